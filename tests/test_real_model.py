"""The embedded SmolLM2 served end to end by `courier serve` with no --model."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from courier.model.device import active_device
from tests.support.server import FIXED_PREFILL_CHUNKS, RunningServer, running_server

pytestmark = pytest.mark.real_model


SYSTEM = "You are a concise geography tutor. Answer in one sentence and name the country. " * 3


def converse(client: openai.OpenAI, turns: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per turn of one multi-turn conversation (its replies are cut short: what the
    cache reuses is the history, whatever the replies say, and each token decoded costs ~90 ms)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    usage: list[tuple[int, int]] = []
    for city in ("Paris", "Rome", "Madrid")[:turns]:
        messages.append({"role": "user", "content": f"Which country is {city} in?"})
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=8, user="geo"
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        usage.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return usage


def test_default_server_serves_embedded_smollm2_and_traces_a_request(cache_dir: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    with running_server(
        ["--cache-dir", str(cache_dir), "--trace-file", str(trace_file), *FIXED_PREFILL_CHUNKS]
    ) as server:
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
            conversation = converse(client, turns=3)
        with server.http() as http:
            health = http.get("/health").json()
            question = [{"role": "user", "content": "What is the capital of France?"}]
            tokenized = http.post("/tokenize", json={"messages": question}).json()
            text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        assert server.stop() == 0
    for (previous_prompt, previous_cached), (prompt, cached) in pairwise(conversation):
        assert previous_cached < cached < prompt
        assert cached >= previous_prompt - 3  # all of the previous history, at most the generation prompt not
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"
    assert streamed_text == answer.choices[0].message.content
    assert health["status"] == "ok"
    assert health["device"] == active_device()  # the server's MLX device is this process's: cpu, cuda or metal
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
    chats = 2 + len(conversation)
    assert [parent_name(span) for span in named("ingress.AdmitGeneration")] == ["POST /v1/chat/completions"] * chats
    assert [parent_name(span) for span in named("scheduler.SubmitGeneration")] == ["ingress.AdmitGeneration"] * chats
    renders = Counter(parent_name(span) for span in named("token_counter.TokenizeChat"))
    assert (renders["POST /tokenize"], renders["ingress.AdmitGeneration"]) == (1, chats)
    assert set(renders) <= {"POST /tokenize", "ingress.AdmitGeneration", "ingress.WarmUpConversation"}
    # The snapshot store's work for a request joins that request's trace, under the scheduler's handling of it;
    # an idle warm-up's joins the trace of the reply that asked for it.
    lookups = Counter(parent_name(span) for span in named("snapshot_store.LookupPrefix"))
    assert lookups["scheduler.SubmitGeneration"] == chats
    assert set(lookups) <= {"scheduler.SubmitGeneration", "ingress.WarmUpConversation"}
    inserts = {parent_name(span) for span in named("snapshot_store.InsertSnapshot")}
    assert "scheduler.SubmitGeneration" in inserts
    assert inserts <= {"scheduler.SubmitGeneration", "ingress.WarmUpConversation"}
    superseding = [
        span for span in named("snapshot_store.InsertSnapshot") if span["attributes"]["courier.snapshot.superseded"]
    ]
    assert superseding  # a later turn's insert shows what it superseded
    tokenize = named("POST /tokenize")[0]
    assert tokenize["attributes"]["http.response.status_code"] == 200
    for span in spans:
        if span["parent_id"] in by_id:
            assert span["context"]["trace_id"] == by_id[span["parent_id"]]["context"]["trace_id"]


def test_responses_stream_and_chain_on_smollm2(smollm2_server: RunningServer) -> None:
    model = "SmolLM2-135M-Instruct"
    instructions = "You are a concise geography tutor. Answer in one short sentence that names the city. " * 2
    with smollm2_server.openai_client() as client:
        with client.responses.stream(
            model=model,
            instructions=instructions,
            input="What is the capital of France?",
            temperature=0,
            max_output_tokens=48,
            prompt_cache_key="geo",
        ) as stream:
            first = stream.get_final_response()
        follow = client.responses.create(
            model=model,
            instructions=instructions,
            previous_response_id=first.id,
            input="And what is the capital of Italy?",
            temperature=0,
            max_output_tokens=48,
            prompt_cache_key="geo",
        )
        stored = client.responses.retrieve(follow.id)
    assert first.status == "completed"
    assert "Paris" in first.output_text
    assert follow.status == "completed" and follow.output_text
    assert stored.output_text == follow.output_text
    assert first.usage is not None and follow.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 3
