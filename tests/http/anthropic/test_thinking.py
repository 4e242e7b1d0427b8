"""Thinking on the Messages API, on a tiny model trained to think in `<think>` tags (tests/support/think_model.py).

`thinking` adaptive or enabled turns the template's switch on and the block comes back as a `thinking` block (a
`thinking_delta` stream); no `thinking` (Anthropic's default) or disabled turns it off; `budget_tokens` closes the
block once it has spent them and the answer follows; thinking sent back reaches the template.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.http.anthropic.sse import check_order, read_events
from tests.support import think_model
from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer, serving
from tests.support.think_model import ANSWER, QUESTION, REASONING

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection

MODEL = "think-model"
ASK: Any = [{"role": "user", "content": QUESTION}]


def _build(tokenizer_dir: Path, out_dir: Path) -> Path:
    """The Qwen3-style think model, whether its weights are trained apart (`train_think_model`) or in the build."""
    build: Any = think_model.build_think_model
    train: Any = getattr(think_model, "train_think_model", None)
    if train is None:
        return Path(build(tokenizer_dir, out_dir))
    return Path(build(tokenizer_dir, out_dir, train(tokenizer_dir, out_dir.parent / f"{out_dir.name}-weights")))


@pytest.fixture(scope="module")
def think_server(
    smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    model_dir = _build(smollm2_dir, tmp_path_factory.mktemp("think-anthropic"))
    with serving(model_dir, cache_dir, MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def claude(think_server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=think_server.base_url, api_key="unused", max_retries=0) as client:
        yield client


def create(client: anthropic.Anthropic, **fields: Any) -> Any:
    request: Any = {"model": MODEL, "max_tokens": 60, "messages": ASK, "extra_body": {"temperature": 0}, **fields}
    return client.messages.create(**request)


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}])
def test_thinking_comes_back_as_a_thinking_block(claude: anthropic.Anthropic, thinking: Any) -> None:
    message = create(claude, thinking=thinking, max_tokens=2048)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (REASONING, ANSWER)
    assert message.stop_reason == "end_turn"
    details = message.usage.output_tokens_details
    assert details is not None and 0 < details.thinking_tokens < message.usage.output_tokens


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_without_thinking_the_template_closes_the_block(claude: anthropic.Anthropic, thinking: Any) -> None:
    message = create(claude, **({"thinking": thinking} if thinking else {}))
    assert [(block.type, block.text) for block in message.content] == [("text", ANSWER)]


def test_a_stream_carries_thinking_deltas_first(think_server: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 60, "messages": ASK, "thinking": {"type": "adaptive"}, "stream": True}
    with httpx.stream("POST", f"{think_server.base_url}/v1/messages", json={**body, "temperature": 0}) as response:
        events = check_order(read_events(response))
    blocks = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert blocks == ["thinking", "text"]
    thought = "".join(data["delta"].get("thinking", "") for name, data in events if name == "content_block_delta")
    assert thought == REASONING


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}])
def test_an_omitted_display_returns_the_thinking_block_empty(
    claude: anthropic.Anthropic, think_server: RunningServer, thinking: Any
) -> None:
    """`display: "omitted"`: the block is there (to be sent back), its text is not, in a message or a stream (one
    `signature_delta`, no `thinking_delta`); the thinking is still generated and counted."""
    omitted = {**thinking, "display": "omitted"}
    message = create(claude, thinking=omitted, max_tokens=2048)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("", ANSWER)
    details = message.usage.output_tokens_details
    assert details is not None and details.thinking_tokens > 0
    body = {"model": MODEL, "max_tokens": 2048, "messages": ASK, "thinking": omitted, "stream": True}
    with httpx.stream("POST", f"{think_server.base_url}/v1/messages", json={**body, "temperature": 0}) as response:
        events = check_order(read_events(response))
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert deltas[0] == {"type": "signature_delta", "signature": ""}
    assert all(delta["type"] != "thinking_delta" for delta in deltas)
    assert "".join(delta.get("text", "") for delta in deltas) == ANSWER
    shown = create(claude, thinking={**thinking, "display": "summarized"}, max_tokens=2048)
    assert shown.content[0].thinking == REASONING  # summarized: the whole thinking, no model here summarizes it


def test_the_budget_closes_the_block_and_the_answer_follows(claude: anthropic.Anthropic) -> None:
    """The block's first tokens are `<think>`, a newline and the reasoning's first word: a budget of 3 ends it there."""
    message = create(claude, thinking={"type": "enabled", "budget_tokens": 3})
    thinking, *rest = message.content
    assert thinking.type == "thinking" and REASONING.startswith(thinking.thinking) and thinking.thinking != REASONING
    assert [block.type for block in rest] == ["text"] and rest[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 3},
        extra_body={"temperature": 0},
    ) as stream:
        streamed: Any = stream.get_final_message()
    assert [block.type for block in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == thinking.thinking


def test_a_stop_sequence_inside_the_thinking(claude: anthropic.Anthropic) -> None:
    message = create(claude, thinking={"type": "adaptive"}, stop_sequences=["four"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "four")
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == REASONING.split(" four")[0]


def test_thinking_sent_back_reaches_the_template(claude: anthropic.Anthropic) -> None:
    turn = [{"type": "thinking", "thinking": REASONING, "signature": ""}, {"type": "text", "text": ANSWER}]
    history: Any = [*ASK, {"role": "assistant", "content": turn}, *ASK]
    without = [*ASK, {"role": "assistant", "content": ANSWER}, *ASK]
    count = claude.messages.count_tokens
    assert count(model=MODEL, messages=history).input_tokens > count(model=MODEL, messages=without).input_tokens
    redacted = [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": ANSWER}]
    with_redacted: Any = [*ASK, {"role": "assistant", "content": redacted}, *ASK]
    assert count(model=MODEL, messages=with_redacted).input_tokens == count(model=MODEL, messages=without).input_tokens
