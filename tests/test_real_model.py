"""The embedded SmolLM2 served end to end by `courier serve` with no --model."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.support.server import running_server

pytestmark = pytest.mark.real_model


def test_default_server_serves_embedded_smollm2_and_traces_a_request(cache_dir: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    with running_server(["--cache-dir", str(cache_dir), "--trace-file", str(trace_file)]) as server:
        with server.openai_client() as client:
            assert [model.id for model in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        with server.http() as http:
            health = http.get("/health").json()
            question = [{"role": "user", "content": "What is the capital of France?"}]
            tokenized = http.post("/tokenize", json={"messages": question}).json()
            text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        assert server.stop() == 0
    assert health["status"] == "ok"
    assert health["device"] == "cpu"
    assert health["weight_format"] == "float32 (from 4-bit affine, group size 32)"
    assert health["model_info"]["context_length"] == 8192
    assert "What is the capital of France?<|im_end|>" in text
    log = server.log()
    for step in ("loading embedded SmolLM2-135M-Instruct", "preparing float32 weights", "warming up", "ready: "):
        assert step in log

    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    by_name = {span["name"]: span for span in spans}
    request_span = by_name["POST /tokenize"]
    actor_span = by_name["token_counter.TokenizeChat"]
    assert actor_span["context"]["trace_id"] == request_span["context"]["trace_id"]
    assert actor_span["parent_id"] == request_span["context"]["span_id"]
    assert request_span["attributes"]["http.response.status_code"] == 200
