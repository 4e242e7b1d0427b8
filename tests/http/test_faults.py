"""No request can stop the server: an actor's unexpected exception fails that request only, end to end.

The model here is the tiny llama with a chat template that divides by zero when the
first message says "boom": the token counter's handler raises what no handler
expects. The request answers 500 `internal_error` in the OpenAI envelope; the fault is
counted in `/metrics` for that actor; the server keeps serving, healthy.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
BOOM = "{% if messages[0]['content'] == 'boom' %}{{ 1 / 0 }}{% endif %}"


@pytest.fixture(scope="module")
def faulty_template_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-boom") / "model"
    shutil.copytree(tiny_llama_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = orjson.loads(config_path.read_bytes())
    config["chat_template"] = BOOM + config["chat_template"]
    config_path.write_bytes(orjson.dumps(config))
    return directory


@pytest.fixture(scope="module")
def server(faulty_template_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(faulty_template_dir, cache_dir, MODEL) as running:
        yield running


def chat(client: httpx.Client, content: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return client.post("/v1/chat/completions", json=body)


def test_an_actor_fault_fails_its_request_only_and_is_counted(server: RunningServer) -> None:
    with server.http() as client:
        for _ in range(3):
            failed = chat(client, "boom")
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "internal_error")
            assert "token counter" in error["message"]
        assert chat(client, "hello").status_code == 200
        assert client.get("/health").json()["status"] == "ok"
        metrics = client.get("/metrics").text
    assert 'courier_request_faults_total{actor="token_counter"} 3.0' in metrics
    assert "ZeroDivisionError" in server.log()  # logged, with its trace id
    assert "trace " in server.log()
