"""Multi-token decode steps through the real server (the embedded SmolLM2): the same answers as a server started with
`--no-speculation`, several tokens per stream chunk, and the drafts counted in /health, /metrics and the trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.server import READY, RunningServer, running_server

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


def answers(server: RunningServer) -> dict[str, Any]:
    """The same greedy requests: a streamed code copy with logprobs, a completion cut by a stop string, a schema."""
    with server.openai_client() as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=COPY,
            temperature=0,
            max_tokens=COPY_TOKENS,
            stream=True,
            logprobs=True,
        )
        pieces, tokens_per_chunk = [], []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                logprobs = chunk.choices[0].logprobs
                tokens_per_chunk.append(len(logprobs.content or []) if logprobs else 0)
        completion = client.completions.create(
            model=MODEL, prompt=COUNTING, temperature=0, max_tokens=60, stop=[" 13,"]
        )
        structured = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CARD}],
            temperature=0,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "card", "schema": SCHEMA, "strict": True}},
        )
        with server.http() as http:
            health = http.get("/health").json()
            metrics = http.get("/metrics").text
    return {
        "copy": "".join(pieces),
        "tokens_per_chunk": tokens_per_chunk,
        "completion": (completion.choices[0].text, completion.choices[0].finish_reason),
        "structured": structured.choices[0].message.content,
        "health": health,
        "metrics": metrics,
    }


def counter(metrics: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"{name} ")]
    return value


@pytest.mark.usefixtures("smollm2_dir")  # converted before the two servers start at once, so neither converts it
def test_speculation_answers_as_without_it_and_counts_its_drafts(cache_dir: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    # Both load at once (each waits for its own "ready"), then answer one after the other.
    with (
        running_server(["--cache-dir", str(cache_dir), "--trace-file", str(trace_file)], wait_ready=False) as on,
        running_server(["--cache-dir", str(cache_dir), "--no-speculation"], wait_ready=False) as off,
    ):
        for server in (on, off):
            server.wait_for(READY)
        fast = answers(on)
        plain = answers(off)
        assert on.stop() == 0 and off.stop() == 0
    for name in ("copy", "completion", "structured"):
        assert fast[name] == plain[name], name
    assert "def load(path):" in fast["copy"] and fast["completion"][1] == "stop"
    assert max(fast["tokens_per_chunk"]) > 1 and max(plain["tokens_per_chunk"]) == 1
    speculation = fast["health"]["speculation"]
    assert speculation["mode"] == "on" and plain["health"]["speculation"]["mode"] == "off (--no-speculation)"
    assert speculation["accepted_tokens"] > 0 and speculation["tokens_per_step"] > 1
    assert counter(fast["metrics"], "courier_speculative_accepted_tokens_total") == speculation["accepted_tokens"]
    assert counter(plain["metrics"], "courier_speculative_drafted_tokens_total") == 0
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    generations = [span for span in spans if span["name"] == "scheduler.generation"]
    assert len(generations) == 3 and all(span["parent_id"] for span in generations)
    drafted = sum(span["attributes"]["courier.generation.drafted_tokens"] for span in generations)
    accepted = sum(span["attributes"]["courier.generation.accepted_tokens"] for span in generations)
    assert (drafted, accepted) == (speculation["drafted_tokens"], speculation["accepted_tokens"])


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
