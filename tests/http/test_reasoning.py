"""Reasoning split out of the answer, through the real server, on tiny models trained to think in `<think>` tags.

Chat Completions carries it as `reasoning_content` (and its alias `reasoning`) in messages and deltas; the Responses
API as `reasoning` output items with their streamed events; usage counts the tokens it took; stored responses keep
it, and reasoning sent back (a chat message's field, a Responses item) is rendered as the template expects.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from openai.types.chat import ChatCompletionMessageParam

from tests.support import think_model
from tests.support.server import RunningServer, running_server
from tests.support.think_model import ANSWER, QUESTION, REASONING, THINK_END, THINK_START

MODEL = "think-model"  # thinks as Qwen3 does
R1_MODEL = "think-model-r1"  # thinks as DeepSeek-R1 does
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]


class Served:
    def __init__(self, server: RunningServer, model_dir: Path, model: str) -> None:
        self.client = server.openai_client()
        self.http = server.http()
        self.tokenizer = load_tokenizer(model_dir)
        self.model = model

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def rendered(self, messages: list[dict[str, Any]]) -> str:
        """The prompt the server renders for `messages`, as text."""
        tokens = self.http.post("/tokenize", json={"model": self.model, "messages": messages}).json()["tokens"]
        return str(self.http.post("/detokenize", json={"model": self.model, "tokens": tokens}).json()["prompt"])


def _serve(server: RunningServer, model_dir: Path, model: str) -> Iterator[Served]:
    served = Served(server, model_dir, model)
    with served.client, served.http:
        yield served


@pytest.fixture(scope="module")
def think_weights(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Trained once for both flavours: they differ only in their chat template."""
    return think_model.train_think_model(smollm2_dir, tmp_path_factory.mktemp("think-training"))


@pytest.fixture(scope="module")
def think_dirs(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory, think_weights: dict[str, Any]
) -> dict[str, Path]:
    """Both flavours, by the name each is served as."""
    qwen_dir = think_model.build_think_model(smollm2_dir, tmp_path_factory.mktemp("think"), think_weights)
    out_dir = tmp_path_factory.mktemp("think-r1")
    r1_dir = think_model.build_think_model(smollm2_dir, out_dir, think_weights, opens_block=True)
    return {MODEL: qwen_dir, R1_MODEL: r1_dir}


@pytest.fixture(scope="module")
def server(think_dirs: dict[str, Path], cache_dir: Path) -> Iterator[RunningServer]:
    """One server for both flavours, each under its own name."""
    declared = [argument for name, path in think_dirs.items() for argument in ("--model", f"{name}={path}")]
    with running_server([*declared, "--cache-dir", str(cache_dir)]) as running:
        yield running
        assert running.stop() == 0


@pytest.fixture(scope="module")
def qwen(server: RunningServer, think_dirs: dict[str, Path]) -> Iterator[Served]:
    """Thinks as Qwen3 does: the reply opens the block."""
    yield from _serve(server, think_dirs[MODEL], MODEL)


@pytest.fixture(scope="module")
def r1(server: RunningServer, think_dirs: dict[str, Path]) -> Iterator[Served]:
    """Thinks as DeepSeek-R1 does: the generation prompt opens the block, the reply only closes it."""
    yield from _serve(server, think_dirs[R1_MODEL], R1_MODEL)


def _extra(model: Any) -> dict[str, Any]:
    return dict(model.model_extra or {})


def test_chat_splits_the_reasoning_from_the_answer(qwen: Served) -> None:
    reply = qwen.client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert _extra(message)["reasoning_content"] == REASONING
    assert _extra(message)["reasoning"] == REASONING
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    thought = qwen.tokens(f"{THINK_START}\n{REASONING}\n{THINK_END}")
    assert reply.usage.completion_tokens_details.reasoning_tokens == thought
    assert reply.usage.completion_tokens > thought


def test_chat_streams_reasoning_deltas_before_the_answer(qwen: Served) -> None:
    stream = qwen.client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    kinds: list[str] = []
    reasoning: list[str] = []
    content: list[str] = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thought = _extra(delta).get("reasoning_content")
        if thought:
            assert _extra(delta)["reasoning"] == thought
            kinds.append("reasoning")
            reasoning.append(thought)
        if delta.content:
            kinds.append("content")
            content.append(delta.content)
    assert "".join(reasoning) == REASONING
    assert "".join(content) == ANSWER
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # every reasoning delta comes first
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == qwen.tokens(f"{THINK_START}\n{REASONING}\n{THINK_END}")


@pytest.mark.parametrize(
    "fields",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}],
    ids=["chat_template_kwargs", "reasoning_effort"],
)
def test_thinking_switched_off_answers_without_reasoning(qwen: Served, fields: dict[str, Any]) -> None:
    reply = qwen.client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, extra_body=fields)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert "reasoning_content" not in _extra(message)
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_reply_cut_while_thinking_is_all_reasoning(qwen: Served) -> None:
    reply = qwen.client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    assert REASONING.startswith(_extra(choice.message)["reasoning_content"])
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == 4


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_sent_back_in_a_chat_message_is_rendered(qwen: Served, field: str) -> None:
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER, field: REASONING},
        {"role": "user", "content": QUESTION},
    ]
    rendered = qwen.rendered(history)
    assert f"<|im_start|>assistant\n{THINK_START}\n{REASONING}\n{THINK_END}\n\n{ANSWER}<|im_end|>" in rendered
    reply = qwen.client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=2)  # type: ignore[arg-type]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == qwen.tokens(rendered)


def test_reasoning_that_is_not_text_is_refused(qwen: Served) -> None:
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER, "reasoning": 3}]
    response = qwen.http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].reasoning"


def test_responses_put_reasoning_in_its_own_item(qwen: Served) -> None:
    response = qwen.client.responses.create(model=MODEL, input=QUESTION, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [part.text for part in reasoning.content] == [REASONING]
    assert reasoning.summary == [] and reasoning.encrypted_content is None and reasoning.id.startswith("rs_")
    assert response.output_text == ANSWER
    assert response.usage is not None
    thought = qwen.tokens(f"{THINK_START}\n{REASONING}\n{THINK_END}")
    assert response.usage.output_tokens_details.reasoning_tokens == thought

    stored = qwen.client.responses.retrieve(response.id)
    assert [item.model_dump() for item in stored.output] == [item.model_dump() for item in response.output]


def test_responses_stream_the_reasoning_item_then_the_message(qwen: Served) -> None:
    events = list(qwen.client.responses.create(model=MODEL, input=QUESTION, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * kinds.count("response.reasoning_text.delta"),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert deltas == REASONING
    done = next(event for event in events if event.type == "response.reasoning_text.done")
    assert done.text == REASONING and done.output_index == 0
    added = [event for event in events if event.type == "response.output_item.added"]
    assert [(event.output_index, event.item.type) for event in added] == [(0, "reasoning"), (1, "message")]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [item.type for item in completed.response.output] == ["reasoning", "message"]
    assert completed.response.output_text == ANSWER
    stored = qwen.client.responses.retrieve(completed.response.id)
    assert [item.model_dump() for item in stored.output] == [item.model_dump() for item in completed.response.output]


def test_a_stored_turn_replays_its_reasoning_into_the_next(qwen: Served) -> None:
    first = qwen.client.responses.create(model=MODEL, input=QUESTION, temperature=0)
    chained = qwen.client.responses.input_tokens.count(
        model=MODEL, previous_response_id=first.id, input=[{"role": "user", "content": QUESTION}]
    )
    reasoning_item = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}]}
    explicit = qwen.client.responses.input_tokens.count(
        model=MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            reasoning_item,  # type: ignore[list-item]
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": QUESTION},
        ],
    )
    as_chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        {"role": "user", "content": QUESTION},
    ]
    rendered = qwen.rendered(as_chat)
    assert f"{THINK_START}\n{REASONING}\n{THINK_END}" in rendered
    assert chained.input_tokens == explicit.input_tokens == qwen.tokens(rendered)


def test_a_reasoning_summary_stands_in_for_missing_content(qwen: Served) -> None:
    with_content = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}]}
    with_summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": REASONING}]}
    counts = [
        qwen.client.responses.input_tokens.count(
            model=MODEL,
            input=[{"role": "user", "content": QUESTION}, item, {"role": "assistant", "content": ANSWER}],  # type: ignore[list-item]
        ).input_tokens
        for item in (with_content, with_summary)
    ]
    assert counts[0] == counts[1]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}, "input[1].encrypted_content"),
        ({"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}, "input[1].content"),
        ({"type": "reasoning", "summary": "thought"}, "input[1].summary"),
    ],
)
def test_reasoning_items_this_server_cannot_read_are_refused(qwen: Served, item: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": [{"role": "user", "content": QUESTION}, item]}
    response = qwen.http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_prompt_that_opens_the_block_starts_the_reply_in_it(r1: Served) -> None:
    assert r1.rendered([{"role": "user", "content": QUESTION}]).endswith(f"assistant\n{THINK_START}\n")
    reply = r1.client.chat.completions.create(model=R1_MODEL, messages=ASK, temperature=0)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert _extra(message)["reasoning_content"] == REASONING
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == r1.tokens(f"{REASONING}\n{THINK_END}")

    response = r1.client.responses.create(model=R1_MODEL, input=QUESTION, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == ANSWER


def test_a_constrained_reply_is_content_even_where_the_prompt_opens_the_block(r1: Served) -> None:
    """The grammar writes JSON from the first token, so no block is written, and none is split off."""
    reply = r1.client.chat.completions.create(
        model=R1_MODEL, messages=ASK, temperature=0, max_tokens=8, response_format={"type": "json_object"}
    )
    message = reply.choices[0].message
    assert message.content is not None and message.content.startswith("{")
    assert "reasoning_content" not in _extra(message)
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_the_model_shows_its_reasoning_markers(qwen: Served) -> None:
    model = qwen.http.get(f"/v1/models/{MODEL}").json()
    assert model["capabilities"]["reasoning"] == [THINK_START, THINK_END]


def test_an_unknown_item_type_is_still_refused(qwen: Served) -> None:
    """A reasoning item among others is taken; an item type nobody knows is still a 400 naming it."""
    body = {"model": MODEL, "input": [{"role": "user", "content": QUESTION}, {"type": "mystery"}]}
    response = qwen.http.post("/v1/responses", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[1].type"


def test_a_reasoning_summary_is_served_as_summary_parts(qwen: Served) -> None:
    """`reasoning.summary` (Codex asks for "auto"): the reasoning item carries a `summary_text` part, the reasoning
    itself (nothing here is hidden, so nothing is condensed), and the stream has its summary events too."""
    response = qwen.client.responses.create(model=MODEL, input=QUESTION, temperature=0, reasoning={"summary": "auto"})
    reasoning = response.output[0]
    assert reasoning.type == "reasoning"
    assert [(part.type, part.text) for part in reasoning.summary] == [("summary_text", REASONING)]
    assert reasoning.content is not None and reasoning.content[0].text == REASONING
    assert response.reasoning is not None and response.reasoning.summary == "auto"
    events = list(
        qwen.client.responses.create(
            model=MODEL, input=QUESTION, temperature=0, reasoning={"summary": "detailed"}, stream=True
        )
    )
    summary_events = [event.type for event in events if "summary" in event.type]
    assert summary_events[0] == "response.reasoning_summary_part.added"
    assert summary_events[-2:] == ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_summary_text.delta")
    assert deltas == REASONING


def test_sealed_reasoning_round_trips_without_storage(qwen: Served) -> None:
    """`include: ["reasoning.encrypted_content"]` with `store: false`: the reasoning item comes sealed, and sent back
    as Codex sends it (its summary and seal, no content) it reaches the model as the reasoning it was."""
    first = qwen.client.responses.create(
        model=MODEL,
        input=QUESTION,
        temperature=0,
        store=False,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.encrypted_content is not None and reasoning.encrypted_content.startswith("crs1.")
    with pytest.raises(openai.NotFoundError):
        qwen.client.responses.retrieve(first.id)
    as_codex_sends = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    in_clear = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}]}

    def history(item: dict[str, Any]) -> list[Any]:
        return [{"role": "user", "content": QUESTION}, item, {"role": "assistant", "content": ANSWER}, *ASK]

    counts = [
        qwen.client.responses.input_tokens.count(model=MODEL, input=history(item)).input_tokens
        for item in (as_codex_sends, in_clear)
    ]
    assert counts[0] == counts[1]
    after = qwen.client.responses.create(
        model=MODEL,
        input=history(as_codex_sends),
        temperature=0,  # sampled, the trained reply can wander past its end (seen in CI)
        store=False,
        include=["reasoning.encrypted_content"],
    )
    assert after.status == "completed"


def test_a_streamed_sealed_reasoning_item_is_the_same_in_its_done_event_and_the_response(qwen: Served) -> None:
    """Each seal takes a fresh nonce: the item is sealed once, so `.done` and `response.completed` carry one item."""
    stream = qwen.client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, store=False, include=["reasoning.encrypted_content"], stream=True
    )
    with stream:
        events = list(stream)
    done = [
        event.item for event in events if event.type == "response.output_item.done" and event.item.type == "reasoning"
    ]
    completed = events[-1]
    assert completed.type == "response.completed" and len(done) == 1
    final = next(item for item in completed.response.output if item.type == "reasoning")
    assert done[0].encrypted_content is not None and done[0].encrypted_content == final.encrypted_content


def test_a_sealed_reasoning_item_altered_is_refused(qwen: Served) -> None:
    first = qwen.client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, store=False, include=["reasoning.encrypted_content"]
    )
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content is not None
    sealed = reasoning.encrypted_content
    middle = len(sealed) // 2
    altered = sealed[:middle] + ("A" if sealed[middle] != "A" else "B") + sealed[middle + 1 :]
    item: dict[str, Any] = {"type": "reasoning", "summary": [], "encrypted_content": altered}
    body = {"model": MODEL, "input": [{"role": "user", "content": QUESTION}, item], "store": False}
    response = qwen.http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("input[1].encrypted_content", "invalid_encrypted_content")
