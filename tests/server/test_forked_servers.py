"""Test servers forked from a launcher that imported the server once (tests/support/forked_servers.py) behave as a
fresh `courier serve`: the same log, exit codes and signals; and a start the launcher cannot reproduce gets a fresh
interpreter."""

from __future__ import annotations

import os
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
