"""Shared fixtures: the embedded model converted once, tiny models, a BLAS loaded before MLX, a PostgreSQL cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from courier.platform.blas import load_optimized_blas

# Before anything imports mlx.core: tests then run on the same fast CPU path as the server.
load_optimized_blas()

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from courier.cluster.local_postgres import unavailable_reason  # noqa: E402
from courier.model.gguf_convert import ensure_converted  # noqa: E402
from courier.model.progress import Progress  # noqa: E402
from courier.model.source import embedded_gguf_path  # noqa: E402
from courier.runtime.tracing import configure_tracing  # noqa: E402
from tests.support import tiny_models  # noqa: E402
from tests.support.postgres_cluster import PostgresCluster, private_cluster  # noqa: E402
from tests.support.server import RunningServer  # noqa: E402
from tests.support.tiny_vision_model import build_tiny_vision_model  # noqa: E402

_SPANS = InMemorySpanExporter()
# The global tracer provider can be set once per process: this is the test suite's.
configure_tracing({}, None).add_span_processor(SimpleSpanProcessor(_SPANS))


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    """Spans finished in this process during the test (cleared before it)."""
    _SPANS.clear()
    return _SPANS


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("courier-cache")


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir: Path) -> Path:
    """The embedded SmolLM2 GGUF converted to an MLX directory (its tokenizer serves the tiny models too)."""
    return ensure_converted(embedded_gguf_path(), cache_dir, Progress(enabled=False))


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_llama(smollm2_dir, tmp_path_factory.mktemp("tiny-llama"), quantized=True)


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_qwen3_next(smollm2_dir, tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight SmolVLM (needs mlx-vlm, the `vision` extra)."""
    pytest.importorskip("mlx_vlm")
    return build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"))


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A private PostgreSQL cluster for the session (skips the test where PostgreSQL is not installed)."""
    if reason := unavailable_reason():
        pytest.skip(reason)
    with private_cluster() as cluster:
        yield cluster


# A test module that starts a server defines its own module-scoped `server` fixture; these talk to it.
@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    """The official openai client, pointed at the module's server."""
    with server.openai_client() as client:
        yield client


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    """A plain HTTP client for the module's server (routes the openai client has no method for)."""
    with server.http() as http:
        yield http
