"""The embedded SmolLM2 served end to end by `courier serve` with no --model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.server import running_server

pytestmark = pytest.mark.real_model


def test_default_server_serves_embedded_smollm2_and_traces_a_request(cache_dir: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    with running_server(["--cache-dir", str(cache_dir), "--trace-file", str(trace_file)]) as server:
        with server.openai_client() as client:
            assert [model.id for model in client.models.list().data] == ["SmolLM2-135M-Instruct"]
            answer = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=20,
            )
            streamed = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=20,
                stream=True,
            )
            streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        with server.http() as http:
            health = http.get("/health").json()
            question = [{"role": "user", "content": "What is the capital of France?"}]
            tokenized = http.post("/tokenize", json={"messages": question}).json()
            text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        assert server.stop() == 0
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"
    assert streamed_text == answer.choices[0].message.content
    assert health["status"] == "ok"
    assert health["device"] == "cpu"
    assert health["weight_format"] == "float32 (from 4-bit affine, group size 32)"
    assert health["model_info"]["context_length"] == 8192
    assert "What is the capital of France?<|im_end|>" in text
    log = server.log()
    for step in ("loading embedded SmolLM2-135M-Instruct", "preparing float32 weights", "warming up", "ready: "):
        assert step in log

    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    by_id = {span["context"]["span_id"]: span for span in spans}

    def parent_name(span: dict[str, Any]) -> str | None:
        parent = by_id.get(span["parent_id"]) if span["parent_id"] else None
        return parent["name"] if parent else None

    def named(name: str) -> list[dict[str, Any]]:
        return [span for span in spans if span["name"] == name]

    # Each chat request: HTTP span -> ingress admission -> token counter render and scheduler submit.
    assert [parent_name(span) for span in named("ingress.AdmitGeneration")] == ["POST /v1/chat/completions"] * 2
    assert [parent_name(span) for span in named("scheduler.SubmitGeneration")] == ["ingress.AdmitGeneration"] * 2
    renders = sorted(parent_name(span) or "" for span in named("token_counter.TokenizeChat"))
    assert renders == ["POST /tokenize", "ingress.AdmitGeneration", "ingress.AdmitGeneration"]
    tokenize = named("POST /tokenize")[0]
    assert tokenize["attributes"]["http.response.status_code"] == 200
    for span in spans:
        if span["parent_id"] in by_id:
            assert span["context"]["trace_id"] == by_id[span["parent_id"]]["context"]["trace_id"]
