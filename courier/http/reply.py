"""One generated reply, event by event, as the parts a client sees: reasoning, content and tool calls.

The reasoning block comes off first (`core/reasoning.py`: markers are only looked for where the reply begins), then
tool calls are taken out of what is left (`core/tools/calls.py`: text between call markers is held until the call
closes). Chat Completions and the Responses API both read generations through this, streamed or whole. A call to
one of the request's custom tools (Responses) is read as its free-form input (`core/tools/custom.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from courier.core.reasoning import ReasoningFormat, ReasoningSplitter
from courier.core.tools import custom as custom_tools
from courier.core.tools.calls import ToolCall, ToolCallFormat, ToolCallSplitter, parse_tool_calls
from courier.engine.generation import GenerationFinished, TokenLogprob, TokensGenerated
from courier.grammar.output_spec import OutputSpec
from courier.messages.asking import Refused
from courier.messages.generation_reader import Cancellation, ended_without_result, generated_events
from courier.messages.ingress import Admitted
from courier.status.service_state import ServiceState


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    """What one event (or the end of the generation) adds that a client may see now."""

    reasoning: str
    content: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the answer's tokens (a reasoning token's are not reported)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyParsing:
    """How to read a reply: the model's reasoning markers (None: it has none) and whether the prompt opened a
    reasoning block, its tool-call format (None: the request offered no tools), the tools, and the output spec
    that says how many calls to keep."""

    reasoning: ReasoningFormat | None = None
    opens_in_reasoning: bool = False
    tool_format: ToolCallFormat | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    output: OutputSpec = field(default_factory=OutputSpec)


class ReplyAssembler:
    def __init__(self, parsing: ReplyParsing) -> None:
        self._parsing = parsing
        markers = parsing.reasoning
        self._thinking = ReasoningSplitter(markers, inside=parsing.opens_in_reasoning) if markers else None
        tool_format = parsing.tool_format if parsing.tools else None
        self._tool_format = tool_format
        self._calls = ToolCallSplitter(tool_format.start, tool_format.end) if tool_format else None
        self._raw_calls: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._reasoned = False  # the last piece was (partly) reasoning
        self._undecided_logprobs: list[TokenLogprob] = []  # before the reply shows whether it opens a block
        self.logprobs: list[TokenLogprob] = []

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def reasoning_tokens(self) -> int:
        return self._thinking.reasoning_tokens if self._thinking is not None else 0

    def feed(self, event: TokensGenerated) -> ReplyDelta:
        delta = self._split(event.text, len(event.token_ids), finishing=False)
        if self._reasoned or not event.logprobs:
            return delta
        if self._thinking is not None and self._thinking.undecided:
            self._undecided_logprobs.extend(event.logprobs)  # the answer's only if no block opens
            return delta
        logprobs = (*self._undecided_logprobs, *event.logprobs)
        self._undecided_logprobs = []
        self.logprobs.extend(logprobs)
        return ReplyDelta(delta.reasoning, delta.content, logprobs)

    @property
    def reasoning_closed(self) -> bool:
        """The reply had a reasoning block, and it ended (the answer, or a call, came after it)."""
        return self._thinking is not None and bool(self.reasoning) and not self._thinking.in_reasoning

    def finish(self, *, cut: bool = False) -> tuple[ReplyDelta, list[ToolCall]]:
        """Text still held back (with the logprobs of its tokens), and the complete tool calls (as many as the
        request keeps). `cut`: the token limit ended the reply; a call it cut, its start marker included, is dropped,
        never turned into content."""
        delta = self._split("", 0, finishing=True, cut=cut)
        held = tuple(self._undecided_logprobs)  # no block opened after all: they were the answer's
        self._undecided_logprobs = []
        self.logprobs.extend(held)
        return ReplyDelta(delta.reasoning, delta.content, held), self._parsing.output.kept_calls(self._parsed_calls())

    def _parsed_calls(self) -> list[ToolCall]:
        customs = {str(tool["name"]) for tool in self._parsing.output.functions if tool.get("type") == "custom"}
        if not customs or self._tool_format is None:
            return parse_tool_calls(self._raw_calls, self._tool_format, self._parsing.tools)
        calls: list[ToolCall] = []
        for raw in self._raw_calls:
            custom = custom_tools.parse_call(raw, customs)
            if custom is None:
                calls += parse_tool_calls([raw], self._tool_format, self._parsing.tools)
            else:
                calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=custom[0], arguments=custom[1]))
        return calls

    def _split(self, text: str, tokens: int, *, finishing: bool, cut: bool = False) -> ReplyDelta:
        reasoning = ""
        if self._thinking is not None:
            split = self._thinking.finish() if finishing else self._thinking.feed(text, tokens)
            reasoning, text, self._reasoned = split.reasoning, split.content, split.reasoned
            if self._reasoned:
                self._undecided_logprobs = []  # they were the block's opening
        if self._calls is not None:
            calls = self._calls.feed(text)
            content, raw = calls.content, list(calls.calls)
            if finishing:
                rest = self._calls.finish(cut=cut)
                content, raw = content + rest.content, raw + list(rest.calls)
            self._raw_calls.extend(raw)
            text = content
        self._reasoning.append(reasoning)
        self._content.append(text)
        return ReplyDelta(reasoning, text)


def reply_parsing(
    state: ServiceState,
    admitted: Admitted,
    tools: Sequence[Mapping[str, Any]] | None,
    output: OutputSpec,
) -> ReplyParsing:
    """How to read the reply of `admitted`: the served model's markers and formats, the request's tools."""
    return ReplyParsing(
        reasoning=state.reasoning,
        opens_in_reasoning=admitted.opens_in_reasoning,
        tool_format=state.tool_format,
        tools=tools,
        output=output,
    )


async def assemble(
    admitted: Admitted,
    timeout_s: float,
    replies: Sequence[ReplyAssembler],
    cancellation: Cancellation | None = None,
) -> list[GenerationFinished]:
    """Feed a whole generation into `replies` (one per sample, by `choice`); each sample's finish, in order.
    Failures raise as `generated_events` raises them."""
    finishes: dict[int, GenerationFinished] = {}
    async for event in generated_events(admitted, timeout_s, cancellation):
        if isinstance(event, TokensGenerated):
            replies[event.choice].feed(event)
        else:
            finishes[event.choice] = event
    if len(finishes) < len(replies):
        raise Refused(ended_without_result())
    return [finishes[choice] for choice in range(len(replies))]
