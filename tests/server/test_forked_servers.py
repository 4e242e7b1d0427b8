"""Test servers forked from a launcher that imported the server once (tests/support/forked_servers.py) behave as a
fresh `courier serve`: the same log, exit codes and signals; and a start the launcher cannot reproduce gets a fresh
interpreter."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.forked_servers import DISABLE_VARIABLE, ForkedServer, forkable, forking_allowed, launcher_failure
from tests.support.server import running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="test servers are forked on Linux only")
# The two tests of forked servers themselves; the fallback table below holds with forking off too.
forking_on = pytest.mark.skipif(not forking_allowed(), reason=f"{DISABLE_VARIABLE}=0: every test server starts afresh")

ROOT = Path(__file__).resolve().parents[2]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


@forking_on
def test_a_test_server_is_forked_answers_and_exits_zero_on_sigterm(tiny_llama_dir: Path, cache_dir: Path) -> None:
    with running_server(["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir)]) as server:
        assert isinstance(server.process, ForkedServer), launcher_failure() or "started in a fresh interpreter"
        launcher = forkable([], {}, ROOT)
        assert launcher is not None
        assert parent_of(server.process.pid) == launcher.process.pid
        with server.http() as http:
            assert http.get("/health").json()["status"] == "ok"
        assert server.stop(signal.SIGTERM) == 0
    assert "stopped" in server.log()


@forking_on
def test_a_usage_error_and_a_kill_reach_the_test_as_from_a_fresh_process(tiny_llama_dir: Path) -> None:
    launcher = forkable([], {}, ROOT)
    assert launcher is not None, launcher_failure()
    refused = launcher.start(["--port", "0", "--model", str(ROOT / "no-such-model")], dict(os.environ), ROOT)
    assert refused.wait(timeout=60) == 2
    assert refused.stderr is not None
    with refused.stderr:
        assert "no-such-model" in refused.stderr.read()
    killed = launcher.start(["--port", "0", "--model", str(tiny_llama_dir)], dict(os.environ), ROOT)
    assert killed.stderr is not None
    with killed.stderr:
        with pytest.raises(subprocess.TimeoutExpired):
            killed.wait(timeout=0.01)
        assert killed.poll() is None
        killed.kill()
        assert killed.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("args", "variables"),
    [
        (["--blas", "none"], {}),  # the launcher chose the BLAS before it imported MLX
        ([], {"COURIER_BLAS": "none"}),
        ([], {"HF_HUB_OFFLINE": "1"}),  # huggingface_hub reads it as it is imported
    ],
    ids=["blas-flag", "blas-variable", "library-variable"],
)
def test_a_start_that_reads_what_the_launcher_already_read_gets_a_fresh_interpreter(
    args: list[str], variables: dict[str, str]
) -> None:
    assert forkable(["--port", "0", *args], variables, ROOT) is None


@forking_on
def test_a_server_forked_after_its_tokenizer_changed_loads_the_new_one(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The launcher loads each model directory's tokenizer once and its children reuse it
    (tests/support/shared_tokenizers.py): a directory whose tokenizer files changed is loaded again."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    body = {"model": "tiny", "input": "Hello"}
    args = ["--model", f"tiny={model}", "--cache-dir", str(tmp_path / "cache")]
    with running_server(args) as server, server.http() as http:
        before = http.post("/v1/responses/input_tokens", json=body).json()["input_tokens"]
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "A preamble the template now renders first. " + config["chat_template"]
    config_path.write_text(json.dumps(config))
    with running_server(args) as server, server.http() as http:
        assert isinstance(server.process, ForkedServer), launcher_failure() or "started in a fresh interpreter"
        after = http.post("/v1/responses/input_tokens", json=body).json()["input_tokens"]
    assert after > before
