"""One reply read into its parts: reasoning comes off first, tool calls out of what is left."""

from __future__ import annotations

import json

from courier.core.reasoning import ReasoningFormat
from courier.core.tools.calls import ToolCallFormat
from courier.engine.generation import TokenLogprob, TokensGenerated
from courier.grammar.output_spec import OutputSpec
from courier.http.reply import ReplyAssembler, ReplyParsing

TAGS = ReasoningFormat(start="<think>", end="</think>", start_tokens=(7,), end_tokens=(8,))
TOOLS = ToolCallFormat(start="<tool_call>", end="</tool_call>", parser=lambda text, tools: json.loads(text))
FUNCTIONS = ({"type": "function", "function": {"name": "get_weather"}},)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def event(text: str, logprob: float | None = None) -> TokensGenerated:
    logprobs = (TokenLogprob(token_id=1, token=text, logprob=logprob),) if logprob is not None else ()
    return TokensGenerated(text=text, token_ids=(1,), logprobs=logprobs)


def test_reasoning_then_a_call() -> None:
    reply = ReplyAssembler(ReplyParsing(reasoning=TAGS, tool_format=TOOLS, tools=FUNCTIONS))
    for piece in ["<think>", "I should call ", CALL, "</think>", "\n\n", CALL]:
        reply.feed(event(piece))
    _, calls = reply.finish()
    assert reply.reasoning == f"I should call {CALL}"  # a call written while thinking is thought, not made
    assert reply.content == ""
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"})]
    assert reply.reasoning_tokens == 4


def test_a_reply_cut_in_a_further_call_keeps_the_calls_before_it_and_no_marker() -> None:
    for cut_at in ["\n<", "\n<tool", "\n<tool_call>\n{", "\n<tool_call>\n" + CALL[11:-14]]:
        reply = ReplyAssembler(ReplyParsing(tool_format=TOOLS, tools=FUNCTIONS))
        deltas = [reply.feed(event(piece)) for piece in [CALL, cut_at]]
        rest, calls = reply.finish(cut=True)
        assert [delta.content for delta in [*deltas, rest]] == ["", "", ""], cut_at
        assert reply.content == "" and [call.name for call in calls] == ["get_weather"]


def test_an_answers_logprobs_leave_out_the_reasoning_tokens() -> None:
    reply = ReplyAssembler(ReplyParsing(reasoning=TAGS))
    deltas = [reply.feed(event(text, -0.5)) for text in ["<think>", "hm", "</think>", "Yes"]]
    assert [len(delta.logprobs) for delta in deltas] == [0, 0, 0, 1]
    assert [entry.token for entry in reply.logprobs] == ["Yes"]


def test_without_markers_the_reply_is_all_content() -> None:
    reply = ReplyAssembler(ReplyParsing(output=OutputSpec()))
    reply.feed(event("<think>x</think>y"))
    reply.finish()
    assert (reply.reasoning, reply.content, reply.reasoning_tokens) == ("", "<think>x</think>y", 0)


def test_logprobs_before_the_reply_shows_a_block_wait_to_see_whose_they_are() -> None:
    opened = ReplyAssembler(ReplyParsing(reasoning=TAGS))
    shown = [opened.feed(event(text, -0.5)) for text in ["\n", "<think>", "hm", "</think>", "Yes"]]
    assert [len(delta.logprobs) for delta in shown] == [0, 0, 0, 0, 1]  # the newline opened a block: not the answer's
    plain = ReplyAssembler(ReplyParsing(reasoning=TAGS))
    shown = [plain.feed(event(text, -0.5)) for text in ["\n", "Yes"]]
    assert [len(delta.logprobs) for delta in shown] == [0, 2]  # no block: the held one comes with the answer
    assert [entry.token for entry in plain.logprobs] == ["\n", "Yes"]


def test_logprobs_still_held_when_the_reply_ends_come_with_its_last_delta() -> None:
    """A reply cut while it could still open a block (only `<th` so far): its held text and their logprobs are the
    answer's, and a stream sends both with the finishing delta, as a whole reply lists them."""
    for pieces in (["<th"], ["\n"], ["\n", "<"]):
        reply = ReplyAssembler(ReplyParsing(reasoning=TAGS))
        streamed = [reply.feed(event(text, -0.5)) for text in pieces]
        rest, _ = reply.finish(cut=True)
        assert [len(delta.logprobs) for delta in streamed] == [0] * len(pieces)
        assert [entry.token for entry in rest.logprobs] == pieces == [entry.token for entry in reply.logprobs]
        assert "".join(delta.content for delta in [*streamed, rest]) == "".join(pieces)
