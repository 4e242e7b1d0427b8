"""Shared fixtures: the embedded model converted once, tiny models, a BLAS loaded before MLX, a PostgreSQL cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import openai
import pytest

from courier.platform.blas import load_optimized_blas

# Before anything imports mlx.core: tests then run on the same fast CPU path as the server.
load_optimized_blas()

from courier.platform import cpu_attention  # noqa: E402

cpu_attention.install()  # the attention `courier serve` runs on the CPU

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from courier.cluster.local_postgres import unavailable_reason  # noqa: E402
from courier.model.gguf_convert import ensure_converted  # noqa: E402
from courier.model.progress import Progress  # noqa: E402
from courier.model.source import embedded_gguf_path  # noqa: E402
from courier.runtime.tracing import configure_tracing  # noqa: E402
from tests.support.postgres_cluster import PostgresCluster, private_cluster  # noqa: E402
from tests.support.server import (  # noqa: E402
    FIXED_PREFILL_CHUNKS,
    TINY_MODEL,
    RunningServer,
    error_lines,
    running_server,
)
from tests.support.tiny_embedding_model import build_bert  # noqa: E402
from tests.support.tiny_vision_model import build_tiny_vision_model  # noqa: E402

# What end-to-end modules use to start servers (a `courier serve` subprocess, a local cluster, HAProxy): a test in
# a module that imports one of these is marked `e2e`; one on the shared SmolLM2 server is marked `real_model` too.
_PROCESS_STARTERS = ("tests.support.server", "tests.support.haproxy", "courier.cluster.local_cluster")


def _starts_processes(module: ModuleType | None) -> bool:
    return module is not None and any(
        getattr(value, "__module__", None) in _PROCESS_STARTERS for value in vars(module).values()
    )


# `./dev test` runs the suite on pytest-xdist workers with `--dist loadfile --no-loadscope-reorder`: each module is
# handed to one worker whole (its module-scoped servers start once), in the order of the items. The slowest modules
# are put first, so that no worker is left with a long one at the end. (`--dist loadgroup` would keep every
# real-model test on one worker, but xdist 3.8 cannot name a group under pytest 9: its tests go out one by one.)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(getattr(item, "module", None)) or "tiny_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if "smollm2_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.real_model)
    items.sort(key=_slowest_first)


def _slowest_first(item: pytest.Item) -> int:
    """Real-model tests, then other end-to-end ones, then in-process ones (a stable sort keeps files in order)."""
    if item.get_closest_marker("real_model") is not None:
        return 0
    return 1 if item.get_closest_marker("e2e") is not None else 2


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
    # Imported here, not at the top: mlx-lm takes ~2 s to import, which pytest-xdist's controller would spend before
    # it starts the workers (it loads this file but runs no fixture).
    from tests.support import tiny_models

    return tiny_models.build_llama(smollm2_dir, tmp_path_factory.mktemp("tiny-llama"), quantized=True)


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import tiny_models

    return tiny_models.build_qwen3_next(smollm2_dir, tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def tool_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama trained to call a tool in its template's own format (tests/support/tool_model.py): trained
    once for the session."""
    from tests.support import tool_model

    return tool_model.build_tool_model(smollm2_dir, tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight SmolVLM (needs mlx-vlm, the `vision` extra)."""
    pytest.importorskip("mlx_vlm")
    return build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"))


@pytest.fixture(scope="session")
def tiny_bert_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight BERT embedding model (needs mlx-embeddings, the `embeddings` extra)."""
    pytest.importorskip("mlx_embeddings")
    return build_bert(smollm2_dir, tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A private PostgreSQL cluster for the session (skips the test where PostgreSQL is not installed)."""
    if reason := unavailable_reason():
        pytest.skip(reason)
    with private_cluster() as cluster:
        yield cluster


def _shut_down_cleanly(server: RunningServer) -> None:
    """A shared server's last check, run once every test using it is done (no test has to run last for it)."""
    assert server.stop() == 0
    assert not error_lines(server), "".join(error_lines(server))


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    """The default server on the tiny llama, as TINY_MODEL, started once and shared by every module that needs
    nothing else (each module's `server` fixture returns it). Tests on it must not depend on each other: a test
    that reads the prompt cache sends a prefix of its own, and counters are compared before and after."""
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", TINY_MODEL]
    # Its modules compare greedy replies across requests (streamed and whole, cut by a stop and full, top_k=1 and
    # greedy, the same seed twice).
    with running_server([*args, *FIXED_PREFILL_CHUNKS]) as running:
        yield running
        _shut_down_cleanly(running)


@pytest.fixture(scope="session")
def smollm2_trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared SmolLM2 server writes its spans (a test finds its own by a trace id it sent)."""
    return tmp_path_factory.mktemp("smollm2-trace") / "spans.jsonl"


@pytest.fixture(scope="session")
def smollm2_server(cache_dir: Path, smollm2_trace_file: Path) -> Iterator[RunningServer]:
    """The default server on the embedded SmolLM2 (its default id, SmolLM2-135M-Instruct), shared likewise by the
    real-model modules that need nothing else. Its spans are exported every 100 ms (OpenTelemetry's default is 5 s)."""
    args = ["--cache-dir", str(cache_dir), "--trace-file", str(smollm2_trace_file)]
    with running_server(args, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as running:
        yield running
        _shut_down_cleanly(running)


# A test module that talks to a server defines a module-scoped `server` fixture (its own, or a shared one above);
# these talk to it.
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
