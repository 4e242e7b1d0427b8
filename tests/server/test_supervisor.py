"""Start-up failures and shutdown of a real `courier serve` process."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

from tests.support.server import run_to_exit, running_server

OFFLINE = {"HF_HUB_OFFLINE": "1"}
# Greedy on the tiny model this runs the full 2000 tokens (checked): sampling could end it early at an
# end-of-sequence token, and a stream that finishes by itself would not be in flight when the signal lands.
GO_ON_FOREVER = {
    "messages": [{"role": "user", "content": "Go on forever."}],
    "max_tokens": 2000,
    "temperature": 0,
    "stream": True,
}


def test_sigterm_drains_and_exits_zero(tiny_qwen3_next_dir: Path, cache_dir: Path) -> None:
    with running_server(["--model", str(tiny_qwen3_next_dir), "--cache-dir", str(cache_dir)]) as server:
        with server.http() as http:
            assert http.get("/health").json()["model_info"]["prompt_cache_trimmable"] is False
        assert server.stop(signal.SIGTERM) == 0
    assert "draining" in server.log()
    assert "stopped" in server.log()


def test_sigint_while_loading_exits_promptly(tiny_llama_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir)]
    with running_server(args, wait_ready=False) as server:  # returns once the server is listening
        assert server.stop(signal.SIGINT, timeout=30) == 0
    assert "received SIGINT: shutting down" in server.log()


def test_unknown_model_is_a_usage_error() -> None:
    result = run_to_exit(["--model", "/no/such/dir"])
    assert result.returncode == 2
    assert "not an existing directory" in result.stderr


def test_model_that_fails_to_load_exits_nonzero_with_the_reason(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    result = run_to_exit(["--model", str(tmp_path), "--cache-dir", str(cache_dir)])
    assert result.returncode == 1
    assert "cannot load model" in result.stderr


def test_port_in_use_is_reported(tiny_llama_dir: Path, cache_dir: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        result = run_to_exit(["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--port", str(port)])
    finally:
        holder.close()
    assert result.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}" in result.stderr


def test_hub_model_without_network_fails_with_the_reason(cache_dir: Path) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE as it is imported: this start gets a fresh interpreter.
    result = run_to_exit(["--model", "mlx-community/no-such-model-4bit", "--cache-dir", str(cache_dir)], env=OFFLINE)
    assert result.returncode == 1
    assert "cannot load model from mlx-community/no-such-model-4bit" in result.stderr


def test_a_gguf_that_cannot_be_converted_exits_nonzero_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    result = run_to_exit(["--model", str(broken), "--cache-dir", str(tmp_path / "cache")])
    assert result.returncode == 1
    assert "cannot convert" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_with_a_stream_in_flight_ends_it_with_an_error_and_exits(tiny_llama_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--shutdown-timeout", "1"]
    with running_server(args) as server, server.http() as http:
        body = GO_ON_FOREVER
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)  # ends: the server must not leave the client hanging
        assert server.wait_exit(timeout=30) == 0
    assert rest, "the stream ended without any further event"
    assert "shutting down" in rest[-1]
    assert '"code":"shutting_down"' in rest[-1]  # retry elsewhere, not a model fault
    assert rest[-1] != "data: [DONE]"


def test_a_second_signal_stops_at_once_without_an_exception_group(tiny_llama_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir)]
    with running_server(args) as server, server.http() as http:
        body = GO_ON_FOREVER
        with http.stream("POST", "/v1/chat/completions", json=body) as response:  # keeps the drain waiting
            next(line for line in response.iter_lines() if line.startswith("data:"))
            server.process.send_signal(signal.SIGTERM)
            server.wait_for(re.compile("draining"))
            server.process.send_signal(signal.SIGTERM)
            # Forced: it must stop well before the 30 s drain deadline (its exit status is not the point).
            server.wait_exit(timeout=20)
    # Without the guard, Hypercorn cancelled mid-shutdown crashed the task group with an exception group.
    assert "Exception Group" not in server.log()
