"""One server for the Messages API's end-to-end modules: a tiny random-weight llama with a 64K window that ends its
replies within a few tokens (tests/support/agent_model.py), served as MODEL, with an exact alias and `claude-*`,
behind the two keys Claude Code's recorded requests carry, with keep-alives every 20 ms (far below any long prefill:
40K tokens take 0.4 s on an idle machine, so a half-second interval sent none there).

Tests on it must not depend on each other (a test that reads the prompt cache sends a prefix of its own). Modules
that need another model (tools, thinking, images) start their own server under another fixture name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support.agent_model import build_agent_model
from tests.support.agent_recorder import API_KEY, BEARER_KEY, NAMED_MODEL
from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer, serving

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection

MODEL = NAMED_MODEL  # the id Claude Code names with ANTHROPIC_MODEL in the recorded bearer run
ALIAS = "courier-alias"
KEEPALIVE_S = 0.02


@pytest.fixture(scope="package")
def agent_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_model(smollm2_dir, tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="package")
def server(agent_model_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    keys = ("--api-key", f"{API_KEY},{BEARER_KEY}")
    names = f"{MODEL},{ALIAS},claude-*"
    with serving(agent_model_dir, cache_dir, names, *keys, "--stream-keepalive", str(KEEPALIVE_S)) as running:
        yield running


@pytest.fixture(scope="package")
def messages_client(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    """The official Anthropic client (its key sent as x-api-key)."""
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="package")
def keyed_http(server: RunningServer) -> Iterator[httpx.Client]:
    """Plain HTTP with the key, for what the SDK hides (raw events, headers, bodies it would refuse to send)."""
    with httpx.Client(base_url=server.base_url, timeout=120, headers={"x-api-key": API_KEY}) as client:
        yield client
