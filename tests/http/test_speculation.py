"""Multi-token decode steps through the real server (the embedded SmolLM2): the same answers as a server started with
`--no-speculation`, several tokens per stream chunk, and the drafts counted in /health, /metrics and the trace."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.polling import attempts
from tests.support.server import RunningServer, running_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
SOURCE = """import json


def load(path):
    with open(path) as handle:
        return json.load(handle)


def save(path, data):
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
"""
COPY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": f"Return this code unchanged:\n```python\n{SOURCE}```"}
]
# The code's first lines (`def load(path):` and its `with open(...)` line): enough for drafts to land and for the
# two servers' tokens to be compared. Each token decoded costs far more than one prefilled: no more than that.
COPY_TOKENS = 24
COUNTING = "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
CARD = "Name: Ada Lovelace\nCity: London\nBorn: 1815\nReturn her name, city and year of birth as JSON."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "born": {"type": "integer"}},
    "required": ["name", "city", "born"],
    "additionalProperties": False,
}


# The shared server has served other tests, whose prompts may share a cached prefix with these: each request is
# prefilled whole on both servers, so the comparison is not of a cached prefix's restore against a whole prefill.
WHOLE = {"cache_prompt": False}


def answers(server: RunningServer, trace_id: str) -> dict[str, Any]:
    """The same greedy requests: a streamed code copy with logprobs, a completion cut by a stop string, a schema. Each
    is sent in the trace `trace_id`, and /health and /metrics are read before and after them."""
    traced = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    with server.openai_client() as client, server.http() as http:
        health_before = http.get("/health").json()
        stream = client.chat.completions.create(
            model=MODEL,
            messages=COPY,
            temperature=0,
            max_tokens=COPY_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            extra_headers=traced,
            extra_body=WHOLE,
        )
        pieces, tokens_per_chunk, completion_tokens = [], [], 0
        for chunk in stream:
            if chunk.usage is not None:
                completion_tokens += chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                logprobs = chunk.choices[0].logprobs
                tokens_per_chunk.append(len(logprobs.content or []) if logprobs else 0)
        completion = client.completions.create(
            model=MODEL,
            prompt=COUNTING,
            temperature=0,
            max_tokens=60,
            stop=[" 13,"],
            extra_headers=traced,
            extra_body=WHOLE,
        )
        structured = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CARD}],
            temperature=0,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "card", "schema": SCHEMA, "strict": True}},
            extra_headers=traced,
            extra_body=WHOLE,
        )
        health = http.get("/health").json()
        metrics = http.get("/metrics").text
    assert completion.usage is not None and structured.usage is not None
    completion_tokens += completion.usage.completion_tokens + structured.usage.completion_tokens
    return {
        "copy": "".join(pieces),
        "tokens_per_chunk": tokens_per_chunk,
        "completion": (completion.choices[0].text, completion.choices[0].finish_reason),
        "structured": structured.choices[0].message.content,
        "completion_tokens": completion_tokens,
        "health_before": health_before,
        "health": health,
        "metrics": metrics,
    }


def generation_spans(trace_file: Path, trace_id: str, expected: int) -> list[dict[str, Any]]:
    """The server's `scheduler.generation` spans in the trace `trace_id`, once `expected` of them are exported."""
    found: list[dict[str, Any]] = []
    for _ in attempts(deadline_s=30):
        spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
        found = [
            span
            for span in spans
            if span["name"] == "scheduler.generation" and span["context"]["trace_id"] == f"0x{trace_id}"
        ]
        if len(found) >= expected:
            return found
    raise AssertionError(f"{len(found)} of {expected} generation spans of trace {trace_id} exported")


def counter(metrics: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"{name} ")]
    return value


def test_speculation_answers_as_without_it_and_counts_its_drafts(
    smollm2_server: RunningServer, smollm2_trace_file: Path, cache_dir: Path
) -> None:
    # The session's shared SmolLM2 server speculates (the default); one started with --no-speculation answers too. The
    # shared server has answered other tests: its counters are compared before and after, its spans are this test's
    # trace's.
    trace_id = secrets.token_hex(16)
    fast = answers(smollm2_server, trace_id)
    with running_server(["--cache-dir", str(cache_dir), "--no-speculation"]) as off:
        plain = answers(off, secrets.token_hex(16))
        assert off.stop() == 0
    for name in ("copy", "completion", "structured"):
        assert fast[name] == plain[name], name
    assert "def load(path):" in fast["copy"] and fast["completion"][1] == "stop"
    assert max(fast["tokens_per_chunk"]) > 1 and max(plain["tokens_per_chunk"]) == 1
    speculation, before = fast["health"]["speculation"], fast["health_before"]["speculation"]
    assert speculation["mode"] == "on" and plain["health"]["speculation"]["mode"] == "off (--no-speculation)"
    accepted = speculation["accepted_tokens"] - before["accepted_tokens"]
    drafted = speculation["drafted_tokens"] - before["drafted_tokens"]
    assert accepted > 0
    # More than one token per decode step, over this test's requests (the first token of each comes from its prefill).
    steps = speculation["decode_steps"] - before["decode_steps"]
    assert 0 < steps < fast["completion_tokens"] - 3, (steps, fast["completion_tokens"])
    assert plain["health"]["speculation"]["decode_steps"] >= plain["completion_tokens"] - 3
    assert counter(fast["metrics"], "courier_speculative_accepted_tokens_total") == speculation["accepted_tokens"]
    assert counter(plain["metrics"], "courier_speculative_drafted_tokens_total") == 0
    generations = generation_spans(smollm2_trace_file, trace_id, expected=3)
    assert len(generations) == 3 and all(span["parent_id"] for span in generations)
    traced_drafted = sum(span["attributes"]["courier.generation.drafted_tokens"] for span in generations)
    traced_accepted = sum(span["attributes"]["courier.generation.accepted_tokens"] for span in generations)
    assert (traced_drafted, traced_accepted) == (drafted, accepted)


def test_a_model_whose_cache_cannot_take_positions_back_does_not_speculate(
    tiny_qwen3_next_dir: Path, cache_dir: Path
) -> None:
    with running_server(["--model", str(tiny_qwen3_next_dir), "--cache-dir", str(cache_dir)]) as server:
        with server.openai_client() as client:
            reply = client.completions.create(model=tiny_qwen3_next_dir.name, prompt="one two one two", max_tokens=8)
        with server.http() as http:
            speculation = http.get("/health").json()["speculation"]
        assert server.stop() == 0
    assert reply.choices[0].text is not None
    assert speculation["mode"].startswith("off (the model's cache cannot take positions back")
    assert speculation["drafted_tokens"] == 0 and speculation["decode_steps"] > 0
