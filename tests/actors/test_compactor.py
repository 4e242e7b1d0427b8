"""CompactorActor over real anyio streams, its token counter and ingress played by `FakeNeighbour`s.

The fake token counter answers each `TokenizeChat` with one token per character of the rendered contents, so
every segment's cost is the length of its texts. The fake ingress admits the summary generation with an event
stream filled in advance (or held open by the test, to keep a summary waiting). The capsule codec and the image
rules are the real ones, for a text-only model. Each test asserts what the compactor sends, in order, and what it
answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.actors.compactor import CompactorActor, CompactorLimits
from courier.conversation.capsule import Capsule, CapsuleCodec, CapsuleError, item_digest
from courier.conversation.images import ImageAdmission
from courier.conversation.items import message_item, text_part
from courier.conversation.replay import SUMMARY_HEADER, expand
from courier.conversation.summary_guard import PASS_PENALTIES
from courier.conversation.summary_prompt import SUMMARY_REQUEST
from courier.core.failure_codes import FailureCode
from courier.core.reasoning import ReasoningFormat
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    SamplingParams,
    TokensGenerated,
)
from courier.grammar.summary import summary_chars, summary_constraint
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage, CompactReply
from courier.messages.ingress import AdmitGeneration, Admitted, ChatPrompt, IngressMessage, WarmUpConversation
from courier.messages.media import FetchMemo, ImageRef
from courier.messages.token_counter import (
    MessageNames,
    TokenCounterMessage,
    TokenizeChat,
    TokenizeResult,
    TokenizeText,
)
from courier.runtime.actor import ActorStopped, ask
from courier.runtime.message import ReplyStream
from courier.storage.records import JsonObject
from tests.support.actors import FakeNeighbour, busy_inbox, run_actor, start_neighbours, stopped_inbox
from tests.support.grammar import smollm2_compiler

pytestmark = pytest.mark.anyio

Inbox = MemoryObjectSendStream[CompactorMessage]
Counter = FakeNeighbour[TokenCounterMessage]
Ingress = FakeNeighbour[IngressMessage]

KEY = b"a-test-key-of-32-random-bytes!!!"
UNSIGNED = CapsuleCodec(None, 1_000_000)
SIGNED = CapsuleCodec(KEY, 1_000_000)
TEXT_ONLY = ImageAdmission(max_images=2, model_id="tiny", fetcher=None)
PATIENCE_S = 10  # a bound on every wait, never a sleep
LIMITS = CompactorLimits(context_length=4096, max_output_bytes=1_000_000, timeout_s=30.0)

INSTRUCTIONS = "Be brief."
SESSION = "session-a"
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "log_ship", "parameters": {}}}]
MAX_OUTPUT_TOKENS = 64
PROMPT_TOKENS = 120
SUMMARY_TOKENS = 12
SUMMARY_PIECES = ("  Ada keeps the log; ", "the Aurora passed at dawn.\n")
SUMMARY = "Ada keeps the log; the Aurora passed at dawn."


def user(text: str) -> JsonObject:
    return message_item("user", [text_part("input_text", text)])


def assistant(text: str) -> JsonObject:
    return message_item("assistant", [text_part("output_text", text)])


RULES = message_item("system", [text_part("input_text", "Rules.")])
U1, A1 = user("The keeper is Ada."), assistant("Noted: Ada.")  # segment 0: 18 + 11 = 29 tokens
U2, A2 = user("The Aurora passed at dawn."), assistant("Logged the Aurora.")  # segment 1: 26 + 18 = 44
U3, A3 = user("The Borealis passed at noon."), assistant("Logged the Borealis.")  # segment 2: 28 + 20 = 48
U4 = user("Which ships passed?")  # segment 3: 19
HISTORY = (RULES, U1, A1, U2, A2, U3, A3, U4)
# The latest user segment (19) and segment 2 (48) fit in 80 tokens; segment 1 (44) no longer does.
KEEP_TOKENS = 80
SUMMARIZED_TOKENS = 29 + 44


def rendered_length(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(str(message["content"])) for message in messages)


def count_characters(message: TokenCounterMessage) -> TokenizeResult:
    """The fake token counter: one token per character of the rendered contents."""
    if isinstance(message, TokenizeChat):
        return TokenizeResult(tokens=tuple(range(rendered_length(message.messages))))
    return TokenizeResult(tokens=())


def events_of(*events: GenerationEvent) -> MemoryObjectReceiveStream[GenerationEvent]:
    """A generation's event stream, filled and closed (as the engine leaves it once the generation has ended)."""
    send, receive = anyio.create_memory_object_stream[GenerationEvent](len(events))
    with send:
        for event in events:
            send.send_nowait(event)
    return receive


def finished(reason: FinishReason = FinishReason.STOP, completion_tokens: int = SUMMARY_TOKENS) -> GenerationFinished:
    return GenerationFinished(reason=reason, prompt_tokens=PROMPT_TOKENS, completion_tokens=completion_tokens)


def summary_events() -> MemoryObjectReceiveStream[GenerationEvent]:
    pieces = [TokensGenerated(text=text, token_ids=(index,)) for index, text in enumerate(SUMMARY_PIECES)]
    return events_of(*pieces, finished())


def admitting(
    events: Callable[[AdmitGeneration], MemoryObjectReceiveStream[GenerationEvent]],
) -> Callable[[IngressMessage], Admitted | None]:
    """The fake ingress: admits a generation with `events(message)`; a warm-up (a tell) gets no answer."""

    def answer(message: IngressMessage) -> Admitted | None:
        if not isinstance(message, AdmitGeneration):
            return None
        return Admitted(
            request_id=message.request_id,
            prompt_tokens=PROMPT_TOKENS,
            max_tokens=message.sampling.max_tokens,
            events=events(message),
        )

    return answer


def refusing(failure: RequestFailed) -> Callable[[IngressMessage], RequestFailed | None]:
    return lambda message: failure if isinstance(message, AdmitGeneration) else None


def compactor(
    token_counter: MemoryObjectSendStream[TokenCounterMessage],
    ingress: MemoryObjectSendStream[IngressMessage],
    codec: CapsuleCodec = UNSIGNED,
    limits: CompactorLimits = LIMITS,
    reasoning: ReasoningFormat | None = None,
) -> CompactorActor:
    return CompactorActor(token_counter, ingress, codec, limits, images=TEXT_ONLY, reasoning=reasoning)


def close_neighbours(*neighbours: FakeNeighbour[Any]) -> None:
    """What a real actor does on the way out: its inbox and every reply stream it was handed are closed."""
    for neighbour in neighbours:
        neighbour.send.close()
        for message in neighbour.received:
            reply = getattr(message, "reply", None)
            if isinstance(reply, MemoryObjectSendStream):
                reply.close()


@asynccontextmanager
async def running(actor: CompactorActor, *neighbours: FakeNeighbour[Any]) -> AsyncIterator[Inbox]:
    """The compactor on a fresh inbox with its fake neighbours serving; leaving stops them all. Nothing waits forever:
    a wait that never ends fails the test after `PATIENCE_S`."""
    try:
        with anyio.fail_after(PATIENCE_S):
            async with anyio.create_task_group() as tasks:
                await start_neighbours(tasks, *neighbours)
                async with run_actor(actor) as inbox:
                    yield inbox
                tasks.cancel_scope.cancel()
    finally:
        close_neighbours(*neighbours)


def request(
    reply: ReplyStream[CompactReply],
    context: Sequence[JsonObject] = HISTORY,
    *,
    keep_tokens: int | None = KEEP_TOKENS,
    session: str = SESSION,
    request_items: Sequence[JsonObject] = (),
    memo: FetchMemo | None = None,
) -> CompactHistory:
    return CompactHistory(
        context=context,
        request_items=request_items,
        instructions=INSTRUCTIONS,
        tools=TOOLS,
        keep_tokens=keep_tokens,
        max_output_tokens=MAX_OUTPUT_TOKENS,
        session=session,
        memo=memo,
        reply=reply,
    )


async def compact(
    inbox: Inbox,
    context: Sequence[JsonObject] = HISTORY,
    *,
    keep_tokens: int | None = KEEP_TOKENS,
    session: str = SESSION,
    request_items: Sequence[JsonObject] = (),
    memo: FetchMemo | None = None,
) -> CompactReply:
    def build(reply: ReplyStream[CompactReply]) -> CompactHistory:
        return request(reply, context, keep_tokens=keep_tokens, session=session, request_items=request_items, memo=memo)

    return await ask(inbox, build)


def sent_without_waiting(inbox: Inbox, *, session: str) -> MemoryObjectReceiveStream[CompactReply]:
    """A compaction sent without waiting for its answer; the answer arrives on the returned stream."""
    send, receive = anyio.create_memory_object_stream[CompactReply](1)
    inbox.send_nowait(request(send, session=session))
    return receive


def chat(role: str, text: str) -> JsonObject:
    return {"role": role, "content": text}


def shown(items: Sequence[JsonObject]) -> list[tuple[str, str, str]]:
    """Items without their ids: type, role and text."""
    return [(item["type"], item["role"], item["content"][0]["text"]) for item in items]


def ingress_sessions(ingress: Ingress) -> list[tuple[str, str]]:
    return [(type(message).__name__, message.session) for message in ingress.received]


async def quiet(ingress: Ingress, expected: list[str]) -> None:
    """Once every task is blocked, the ingress has received exactly `expected` (a warm-up would be among them)."""
    await anyio.wait_all_tasks_blocked()
    assert ingress.kinds == expected


# The normal path


@pytest.mark.parametrize("codec", [UNSIGNED, SIGNED], ids=["unsigned", "signed"])
async def test_counts_each_segment_then_summarizes_then_warms_up_the_compacted_context(codec: CapsuleCodec) -> None:
    journal: list[str] = []

    def counted(message: TokenCounterMessage) -> TokenizeResult:
        journal.append(type(message).__name__)
        return count_characters(message)

    def admitted(message: IngressMessage) -> Admitted | None:
        journal.append(type(message).__name__)
        return admitting(lambda _: summary_events())(message)

    counter, ingress = Counter(counted), Ingress(admitted)
    async with running(compactor(counter.send, ingress.send, codec), counter, ingress) as inbox:
        result = await compact(inbox)
        await ingress.wait_for(2)
    assert isinstance(result, CompactionResult)
    assert journal == ["TokenizeChat"] * 4 + ["AdmitGeneration", "WarmUpConversation"]

    # One count per segment of the history (the system message aside), as `/v1/responses/input_tokens` renders it.
    counts = [message for message in counter.received if isinstance(message, TokenizeChat)]
    assert [count.messages for count in counts] == [
        [chat("user", "The keeper is Ada."), chat("assistant", "Noted: Ada.")],
        [chat("user", "The Aurora passed at dawn."), chat("assistant", "Logged the Aurora.")],
        [chat("user", "The Borealis passed at noon."), chat("assistant", "Logged the Borealis.")],
        [chat("user", "Which ships passed?")],
    ]
    assert [(count.add_generation_prompt, count.tools, count.images) for count in counts] == [(False, None, ())] * 4

    # One greedy summary generation of the two oldest segments, without tools or thinking.
    admit, warm_up = ingress.received
    assert isinstance(admit, AdmitGeneration)
    assert admit.prompt == ChatPrompt(
        messages=[
            chat(
                "user",
                "Conversation:\n\nUser: The keeper is Ada.\n\nAssistant: Noted: Ada.\n\n"
                "User: The Aurora passed at dawn.\n\nAssistant: Logged the Aurora.\n\n" + SUMMARY_REQUEST,
            )
        ],
        tools=None,
        thinking=False,
        images=(),
        names=MessageNames.BUILT,
    )
    assert admit.sampling == SamplingParams(max_tokens=MAX_OUTPUT_TOKENS, temperature=0.0)
    assert (admit.session, admit.cache_prompt, admit.fit_to_context) == (SESSION, False, False)
    assert admit.request_id.startswith("compaction_")

    # Then the compacted context is prefilled for the next turn: instructions, summary, retained items.
    assert isinstance(warm_up, WarmUpConversation)
    assert warm_up.session == SESSION
    assert warm_up.tools == TOOLS
    assert warm_up.messages == [
        chat("system", INSTRUCTIONS),
        chat("system", "Rules."),
        chat("assistant", SUMMARY_HEADER + SUMMARY),
        chat("user", "The Borealis passed at noon."),
        chat("assistant", "Logged the Borealis."),
        chat("user", "Which ships passed?"),
    ]


@pytest.mark.parametrize("codec", [UNSIGNED, SIGNED], ids=["unsigned", "signed"])
async def test_the_result_holds_instructions_retained_items_and_a_capsule_that_replays_to_its_context(
    codec: CapsuleCodec,
) -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send, codec), counter, ingress) as inbox:
        result = await compact(inbox)
    assert isinstance(result, CompactionResult)

    head, *kept, capsule_item = result.output
    assert shown([head]) == [("message", "system", INSTRUCTIONS)]
    assert kept == [RULES, U3, A3, U4]  # the retained items as they were sent, ids and all
    assert capsule_item is result.compaction_item
    assert sorted(capsule_item) == ["encrypted_content", "id", "type"]
    assert capsule_item["type"] == "compaction"
    assert capsule_item["id"].startswith("cmp_")
    assert codec.decode(capsule_item["encrypted_content"]) == Capsule(
        summary=SUMMARY, retained=(item_digest(U3), item_digest(A3), item_digest(U4))
    )

    # What the model is shown from here on is what any later turn replaying `output` is shown.
    assert shown(result.context) == [
        ("message", "system", "Rules."),
        ("message", "assistant", SUMMARY_HEADER + SUMMARY),
        ("message", "user", "The Borealis passed at noon."),
        ("message", "assistant", "Logged the Borealis."),
        ("message", "user", "Which ships passed?"),
    ]
    replayed = expand(result.output, codec, INSTRUCTIONS)
    assert shown(replayed) == shown(result.context)
    assert [replayed[0], *replayed[2:]] == [result.context[0], *result.context[2:]]  # all but the summary's fresh id

    assert result.usage == {
        "input_tokens": PROMPT_TOKENS,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": SUMMARY_TOKENS,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": PROMPT_TOKENS + SUMMARY_TOKENS,
    }


async def test_a_signed_capsule_is_refused_by_another_key() -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send, SIGNED), counter, ingress) as inbox:
        result = await compact(inbox)
    assert isinstance(result, CompactionResult)
    other = CapsuleCodec(b"another-server-key-32-bytes-long", 1_000_000)
    with pytest.raises(CapsuleError, match="altered"):
        other.decode(result.compaction_item["encrypted_content"])


@pytest.mark.parametrize(
    ("context_length", "retained"),
    [(67 * 16, [RULES, U3, A3, U4]), (67 * 16 - 1, [RULES, U4])],
    ids=["67-tokens-keep-segment-2", "66-tokens-do-not"],
)
async def test_without_keep_tokens_a_sixteenth_of_the_context_is_kept(
    context_length: int, retained: list[JsonObject]
) -> None:
    limits = CompactorLimits(context_length=context_length, max_output_bytes=1_000_000, timeout_s=30.0)
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send, limits=limits), counter, ingress) as inbox:
        result = await compact(inbox, keep_tokens=None)
    assert isinstance(result, CompactionResult)
    assert list(result.output[1:-1]) == retained


async def test_the_default_keep_budget_is_at_most_8192_tokens() -> None:
    limits = CompactorLimits(context_length=1_000_000, max_output_bytes=1_000_000, timeout_s=30.0)
    with stopped_inbox() as outbox:
        assert compactor(outbox, outbox, limits=limits).default_keep_tokens() == 8192


async def test_a_text_only_model_counts_images_as_text_and_leaves_them_to_the_ingress() -> None:
    image = "https://example.com/chart.png"
    pictured = message_item("user", [text_part("input_text", "See this."), {"type": "input_image", "image_url": image}])
    context = (pictured, A1, U4)
    memo = FetchMemo()
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        result = await compact(inbox, context, keep_tokens=1, request_items=(U1, pictured), memo=memo)
    assert isinstance(result, CompactionResult)
    assert [message.images for message in counter.received if isinstance(message, TokenizeChat)] == [(), ()]
    assert memo.fetches == 0
    admit = ingress.received[0]
    assert isinstance(admit, AdmitGeneration)
    assert isinstance(admit.prompt, ChatPrompt)
    assert admit.prompt.images == (ImageRef(url=image, param="input[1].content[1]"),)
    assert admit.memo is memo  # the turn's images are read once for the counts and the summary together


async def test_each_compaction_is_handled_in_named_spans(span_exporter: InMemorySpanExporter) -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        assert isinstance(await compact(inbox), CompactionResult)
    spans = {span.name: span for span in span_exporter.get_finished_spans()}
    assert {"compactor.CompactHistory", "compactor.selection", "compactor.capsule"} <= set(spans)
    attributes = dict(spans["compactor.selection"].attributes or {})
    assert attributes == {
        "courier.compaction.segments": 4,
        "courier.compaction.retained_segments": 2,
        "courier.compaction.keep_tokens": KEEP_TOKENS,
    }


# Refusals: the caller's context is never replaced, and nothing is warmed up


async def test_a_history_that_all_fits_keep_tokens_gets_one_compaction_item_keeping_it_all() -> None:
    """What clients expect of a compaction (Codex: exactly one compaction item back), with nothing summarized."""
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox, keep_tokens=1_000)
    assert isinstance(reply, CompactionResult)
    assert not [message for message in ingress.received if isinstance(message, AdmitGeneration)]  # no summary
    assert [item["type"] for item in reply.output].count("compaction") == 1
    capsule = UNSIGNED.decode(reply.compaction_item["encrypted_content"])
    assert capsule.summary == "" and len(capsule.retained) == len(HISTORY) - 1  # all but the system message
    assert shown(reply.context) == shown(list(HISTORY))  # replayed: the history as it was, no summary message
    assert reply.usage["output_tokens"] == 0
    assert counter.kinds == ["TokenizeChat"] * 4


async def test_a_later_compaction_that_summarizes_nothing_carries_the_earlier_summary_on() -> None:
    """The second compaction of a conversation finds it all fits `keep_tokens`: its capsule keeps the first one's
    summary (no stored or sent item is the summary message replay showed, so retaining it would lose it)."""
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        first = await compact(inbox)
        assert isinstance(first, CompactionResult)
        later = [*first.context, user("And at dusk?")]
        second = await compact(inbox, later, keep_tokens=1_000)
    assert isinstance(second, CompactionResult)
    capsule = UNSIGNED.decode(second.compaction_item["encrypted_content"])
    assert capsule.summary == SUMMARY
    summary_message = next(item for item in first.context if item["role"] == "assistant")
    assert item_digest(summary_message) not in capsule.retained
    assert shown(second.context)[:2] == [
        ("message", "system", "Rules."),
        ("message", "assistant", SUMMARY_HEADER + SUMMARY),
    ]
    # A later turn replays the stored items and the second capsule: the summary is still there.
    stored = [*HISTORY, first.compaction_item, user("And at dusk?"), second.compaction_item]
    assert shown(expand(stored, UNSIGNED, INSTRUCTIONS)) == shown(second.context)


@pytest.mark.parametrize(
    "reasoning", [None, ReasoningFormat(start="<think>", end="</think>", start_tokens=(5,), end_tokens=(6,))]
)
async def test_each_summary_pass_follows_a_grammar_bounded_by_what_it_replaces(
    smollm2_dir: Path, reasoning: ReasoningFormat | None
) -> None:
    """Bullet lines of at most one character per token replaced (and `max_output_tokens`), compiled before the
    pass is admitted; not for a thinking model, whose template may open a block the grammar would not close."""
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    actor = CompactorActor(
        counter.send,
        ingress.send,
        UNSIGNED,
        LIMITS,
        images=TEXT_ONLY,
        reasoning=reasoning,
        grammars=smollm2_compiler(smollm2_dir),
    )
    async with running(actor, counter, ingress) as inbox:
        assert isinstance(await compact(inbox), CompactionResult)
    (admitted,) = [message for message in ingress.received if isinstance(message, AdmitGeneration)]
    constraint = admitted.sampling.constraint
    if reasoning is not None:
        assert constraint is None
        return
    assert constraint is not None and constraint.compiled is not None  # the engine compiles nothing
    assert constraint == summary_constraint(summary_chars(SUMMARIZED_TOKENS, MAX_OUTPUT_TOKENS))


async def test_a_summary_not_shorter_than_what_it_replaces_is_retried_once_then_refused() -> None:
    def as_long(_: AdmitGeneration) -> MemoryObjectReceiveStream[GenerationEvent]:
        return events_of(TokensGenerated(text="A long summary.", token_ids=(1,)), finished(completion_tokens=73))

    counter, ingress = Counter(count_characters), Ingress(admitting(as_long))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"] * len(PASS_PENALTIES))
    assert [admit.sampling for admit in admits(ingress)] == GUARDED_PASSES
    assert reply == RequestFailed(
        kind=FailureKind.INVALID_REQUEST,
        message=f"the summary (73 tokens) is not shorter than the history it replaces ({SUMMARIZED_TOKENS} tokens)",
        param="input",
        code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
    )


async def test_a_summary_one_token_shorter_is_accepted() -> None:
    def shorter(_: AdmitGeneration) -> MemoryObjectReceiveStream[GenerationEvent]:
        return events_of(TokensGenerated(text=SUMMARY, token_ids=(1,)), finished(completion_tokens=72))

    counter, ingress = Counter(count_characters), Ingress(admitting(shorter))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
    assert isinstance(reply, CompactionResult)
    assert reply.usage["output_tokens"] == 72


# The guard against degenerate summaries: a loop or a copied-back history gets one retry with a repetition penalty

LOOP_LINE = "Day 4: Belem 14:00, pasteis at 14:00, MAAT museum 14:00.\n\n"  # SmolLM2's, 20 words and marks
GUARDED_PASSES = [
    SamplingParams(max_tokens=MAX_OUTPUT_TOKENS, temperature=0.0, repetition_penalty=penalty)
    for penalty in PASS_PENALTIES
]


def admits(ingress: Ingress) -> list[AdmitGeneration]:
    return [message for message in ingress.received if isinstance(message, AdmitGeneration)]


def looping_events(
    lines: int, reason: FinishReason = FinishReason.LENGTH
) -> MemoryObjectReceiveStream[GenerationEvent]:
    pieces = [TokensGenerated(text=LOOP_LINE, token_ids=(index,)) for index in range(lines)]
    return events_of(*pieces, finished(reason, completion_tokens=lines))


def passes(*streams: Callable[[], MemoryObjectReceiveStream[GenerationEvent]]) -> Callable[[AdmitGeneration], Any]:
    """The fake ingress's events for each summary pass in turn."""
    made = iter(streams)
    return lambda _: next(made)()


@pytest.mark.parametrize(
    "first",
    [lambda: looping_events(12), lambda: looping_events(12, FinishReason.STOP)],
    ids=["a-loop-cut-at-max-output-tokens", "a-loop-that-ended"],
)
async def test_a_looping_summary_is_retried_with_a_repetition_penalty(
    first: Callable[[], MemoryObjectReceiveStream[GenerationEvent]],
) -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(passes(first, summary_events)))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await ingress.wait_for(3)
    assert ingress.kinds == ["AdmitGeneration", "AdmitGeneration", "WarmUpConversation"]
    assert [admit.sampling for admit in admits(ingress)] == GUARDED_PASSES
    first_id, second_id = (admit.request_id for admit in admits(ingress))
    assert first_id != second_id
    assert isinstance(reply, CompactionResult)
    assert reply.context[len(reply.context) - 4]["content"][0]["text"] == SUMMARY_HEADER + SUMMARY
    # The usage counts both passes: the one thrown away was computed too.
    assert reply.usage["input_tokens"] == 2 * PROMPT_TOKENS
    assert reply.usage["output_tokens"] == 12 + SUMMARY_TOKENS


async def test_a_summary_copied_back_whole_is_retried() -> None:
    def echo() -> MemoryObjectReceiveStream[GenerationEvent]:
        return events_of(
            TokensGenerated(text="User: The keeper is Ada.", token_ids=(1,)), finished(completion_tokens=73)
        )

    counter, ingress = Counter(count_characters), Ingress(admitting(passes(echo, summary_events)))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await ingress.wait_for(3)
    assert isinstance(reply, CompactionResult)
    assert [admit.sampling for admit in admits(ingress)] == GUARDED_PASSES
    assert reply.usage["output_tokens"] == 73 + SUMMARY_TOKENS


async def test_a_summary_that_loops_on_every_pass_is_a_422_failure() -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: looping_events(12)))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"] * len(PASS_PENALTIES))
    assert reply == RequestFailed(
        kind=FailureKind.UNUSABLE_OUTPUT,
        message=f"the summary kept repeating itself ({len(PASS_PENALTIES)} passes)",
        code=FailureCode.COMPACTION_FAILED,
    )


async def test_a_loop_is_stopped_as_soon_as_it_shows() -> None:
    """The first pass never finishes on its own: the compactor leaves it once its tail loops, which cancels it."""
    held, looping = anyio.create_memory_object_stream[GenerationEvent](64)
    streams = iter([looping, summary_events()])
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: next(streams)))
    with held:
        for index in range(64):
            held.send_nowait(TokensGenerated(text=LOOP_LINE, token_ids=(index,)))
        async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
            reply = await compact(inbox)
            await ingress.wait_for(3)
        with pytest.raises(anyio.BrokenResourceError):  # the compactor closed its end: the generation is cancelled
            held.send_nowait(finished())
    assert isinstance(reply, CompactionResult)
    assert [admit.sampling for admit in admits(ingress)] == GUARDED_PASSES
    stopped_after = reply.usage["output_tokens"] - SUMMARY_TOKENS
    assert stopped_after < 64  # read up to the first look that saw the loop, not to the end of what was sent


async def test_a_history_the_ingress_finds_too_long_does_not_fit_one_window() -> None:
    too_long = RequestFailed(
        kind=FailureKind.INVALID_REQUEST,
        message="the prompt (5000 tokens) exceeds the context (4096 tokens)",
        param="input",
        code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
    )
    counter, ingress = Counter(count_characters), Ingress(refusing(too_long))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert reply == RequestFailed(
        kind=FailureKind.INVALID_REQUEST,
        message="the history to summarize does not fit one context window: "
        "the prompt (5000 tokens) exceeds the context (4096 tokens)",
        param="input",
        code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
    )


async def test_any_other_ingress_refusal_is_passed_on_unchanged() -> None:
    full = RequestFailed(kind=FailureKind.OVERLOADED, message="the queue is full", code=FailureCode.QUEUE_FULL)
    counter, ingress = Counter(count_characters), Ingress(refusing(full))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert reply == full


UNUSABLE_SUMMARIES = [
    (
        (TokensGenerated(text="Ada keeps the", token_ids=(1,)), finished(FinishReason.LENGTH, MAX_OUTPUT_TOKENS)),
        f"the summary was cut at max_output_tokens ({MAX_OUTPUT_TOKENS})",
    ),
    (
        (TokensGenerated(text=" \n\t ", token_ids=(1,)), finished(completion_tokens=1)),
        "the model wrote an empty summary",
    ),
    ((finished(completion_tokens=0),), "the model wrote an empty summary"),
]


@pytest.mark.parametrize(
    ("events", "message"), UNUSABLE_SUMMARIES, ids=["cut-at-max-output-tokens", "whitespace", "no-text"]
)
async def test_an_unusable_summary_is_a_422_failure(events: tuple[GenerationEvent, ...], message: str) -> None:
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: events_of(*events)))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert reply == RequestFailed(kind=FailureKind.UNUSABLE_OUTPUT, message=message, code=FailureCode.COMPACTION_FAILED)


@pytest.mark.parametrize(
    ("failure", "kind"),
    [
        (GenerationFailed(message="the engine failed"), FailureKind.INTERNAL),
        (GenerationFailed(message="the server is stopping", code=FailureCode.SHUTTING_DOWN), FailureKind.UNAVAILABLE),
    ],
    ids=["engine-failure", "shutting-down"],
)
async def test_a_failed_summary_generation_is_passed_on(failure: GenerationFailed, kind: FailureKind) -> None:
    def failing(_: AdmitGeneration) -> MemoryObjectReceiveStream[GenerationEvent]:
        return events_of(TokensGenerated(text="Ada", token_ids=(1,)), failure)

    counter, ingress = Counter(count_characters), Ingress(admitting(failing))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert reply == RequestFailed(kind=kind, message=failure.message, code=failure.code)


async def test_a_summary_past_the_deadline_times_out_and_is_cancelled() -> None:
    held, events = anyio.create_memory_object_stream[GenerationEvent](4)
    limits = CompactorLimits(context_length=4096, max_output_bytes=1_000_000, timeout_s=0.05)
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: events))
    with held:
        async with running(compactor(counter.send, ingress.send, limits=limits), counter, ingress) as inbox:
            reply = await compact(inbox)
            await quiet(ingress, ["AdmitGeneration"])
        with pytest.raises(anyio.BrokenResourceError):  # the compactor closed its end: the generation is cancelled
            held.send_nowait(finished())
    assert reply == RequestFailed(
        kind=FailureKind.TIMEOUT,
        message="the request did not finish within 0.05 s",
        code=FailureCode.DEADLINE_EXCEEDED,
    )


async def test_a_summary_the_scheduler_cut_at_the_deadline_is_a_timeout_not_a_summary() -> None:
    limits = CompactorLimits(context_length=4096, max_output_bytes=1_000_000, timeout_s=30.0)
    cut = replace(finished(FinishReason.LENGTH), deadline=True)
    counter = Counter(count_characters)
    ingress = Ingress(admitting(lambda _: events_of(TokensGenerated(text="Half a sum", token_ids=(1,)), cut)))
    async with running(compactor(counter.send, ingress.send, limits=limits), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert reply == RequestFailed(
        kind=FailureKind.TIMEOUT, message="the request did not finish within 30 s", code=FailureCode.DEADLINE_EXCEEDED
    )
    admitted = ingress.received[0]
    assert isinstance(admitted, AdmitGeneration) and admitted.deadline is not None  # the scheduler's to enforce


async def test_an_output_over_the_replay_body_limit_is_refused() -> None:
    limits = CompactorLimits(context_length=4096, max_output_bytes=200, timeout_s=30.0)
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send, limits=limits), counter, ingress) as inbox:
        reply = await compact(inbox)
        await quiet(ingress, ["AdmitGeneration"])
    assert isinstance(reply, RequestFailed)
    assert (reply.kind, reply.param, reply.code) == (FailureKind.INVALID_REQUEST, "keep_tokens", None)
    assert reply.message.startswith("the compacted output (")
    assert reply.message.endswith(" bytes) would not fit the replay body limit")


# A busy or stopped neighbour


@contextmanager
def unavailable(state: str) -> Iterator[MemoryObjectSendStream[Any]]:
    if state == "busy":
        with busy_inbox() as inbox:
            yield inbox
    else:
        with stopped_inbox() as inbox:
            yield inbox


UNAVAILABLE = {"busy": FailureCode.OVERLOADED, "stopped": FailureCode.SHUTTING_DOWN}


@pytest.mark.parametrize("state", ["busy", "stopped"])
async def test_an_unavailable_token_counter_is_refused_as_unavailable(state: str) -> None:
    ingress = Ingress(admitting(lambda _: summary_events()))
    with unavailable(state) as token_counter:
        async with running(compactor(token_counter, ingress.send), ingress) as inbox:
            first = await compact(inbox)
            second = await compact(inbox)  # still serving
            await quiet(ingress, [])
    assert isinstance(first, RequestFailed)
    assert (first.kind, first.code) == (FailureKind.UNAVAILABLE, UNAVAILABLE[state])
    assert second == first


@pytest.mark.parametrize("state", ["busy", "stopped"])
async def test_an_unavailable_ingress_is_refused_as_unavailable(state: str) -> None:
    counter = Counter(count_characters)
    with unavailable(state) as ingress:
        async with running(compactor(counter.send, ingress), counter) as inbox:
            reply = await compact(inbox)
    assert isinstance(reply, RequestFailed)
    assert (reply.kind, reply.code) == (FailureKind.UNAVAILABLE, UNAVAILABLE[state])
    assert counter.kinds == ["TokenizeChat"] * 4  # refused at the summary, after the counts


async def test_the_compactor_keeps_serving_once_a_busy_token_counter_has_room() -> None:
    counter = Counter(count_characters, capacity=1)  # not reading yet, and its one slot taken: busy
    ingress = Ingress(admitting(lambda _: summary_events()))
    filler_reply, filler_answer = anyio.create_memory_object_stream[Any](1)
    with filler_reply, filler_answer:
        counter.send.send_nowait(TokenizeText(text="ahead in the queue", add_special_tokens=False, reply=filler_reply))
        async with running(compactor(counter.send, ingress.send), ingress) as inbox, anyio.create_task_group() as tasks:
            busy = await compact(inbox)
            await start_neighbours(tasks, counter)  # it starts reading: room again
            served = await compact(inbox)
            tasks.cancel_scope.cancel()
        close_neighbours(counter)
    assert isinstance(busy, RequestFailed)
    assert busy.code is FailureCode.OVERLOADED
    assert isinstance(served, CompactionResult)
    assert counter.kinds == ["TokenizeText"] + ["TokenizeChat"] * 4
    assert ingress.kinds == ["AdmitGeneration", "WarmUpConversation"]


# Concurrency and shutdown


async def test_a_second_compaction_completes_while_the_first_summary_is_still_generating() -> None:
    held, slow_events = anyio.create_memory_object_stream[GenerationEvent](4)

    def events(message: AdmitGeneration) -> MemoryObjectReceiveStream[GenerationEvent]:
        return slow_events if message.session == "slow" else summary_events()

    counter, ingress = Counter(count_characters), Ingress(admitting(events))
    with held, anyio.fail_after(PATIENCE_S):
        async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
            with sent_without_waiting(inbox, session="slow") as slow:
                await ingress.wait_for(1)  # the slow one's summary is generating
                fast = await compact(inbox, session="fast")
                assert isinstance(fast, CompactionResult)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(anyio.WouldBlock):
                    slow.receive_nowait()  # still waiting for its summary
                held.send_nowait(TokensGenerated(text="The slow summary.", token_ids=(1,)))
                held.send_nowait(finished())
                late = await slow.receive()
            await ingress.wait_for(4)
    assert isinstance(late, CompactionResult)
    assert UNSIGNED.decode(late.compaction_item["encrypted_content"]).summary == "The slow summary."
    assert UNSIGNED.decode(fast.compaction_item["encrypted_content"]).summary == SUMMARY
    assert ingress_sessions(ingress) == [
        ("AdmitGeneration", "slow"),
        ("AdmitGeneration", "fast"),
        ("WarmUpConversation", "fast"),
        ("WarmUpConversation", "slow"),
    ]


async def test_stopping_with_a_compaction_pending_stops_its_asker_and_cancels_the_summary() -> None:
    held, events = anyio.create_memory_object_stream[GenerationEvent](4)
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: events))
    answers: list[CompactReply | ActorStopped] = []
    answered = anyio.Event()

    async def asker(inbox: Inbox) -> None:
        try:
            answers.append(await compact(inbox))
        except ActorStopped as stopped:
            answers.append(stopped)
        finally:
            answered.set()

    with held, anyio.fail_after(PATIENCE_S):
        try:
            async with anyio.create_task_group() as tasks:
                await start_neighbours(tasks, counter, ingress)
                async with run_actor(compactor(counter.send, ingress.send)) as inbox:
                    tasks.start_soon(asker, inbox)
                    await ingress.wait_for(1)  # its summary is generating
                await answered.wait()
                with pytest.raises(ActorStopped):
                    await compact(inbox)
                await quiet(ingress, ["AdmitGeneration"])
                tasks.cancel_scope.cancel()
        finally:
            close_neighbours(counter, ingress)
        with pytest.raises(anyio.BrokenResourceError):  # the summary's events were closed: it left the batch
            held.send_nowait(finished())
    assert len(answers) == 1
    assert isinstance(answers[0], ActorStopped)


# Retained items that say the same thing


async def test_retained_items_with_the_same_content_are_all_shown() -> None:
    """A retained message repeated word for word (the latest user turn repeating an earlier one) stays twice."""
    again, done = user("Go on."), assistant("Done.")
    last = user("Go on.")
    context = (U1, A1, U2, A2, again, done, last)
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        result = await compact(inbox, context, keep_tokens=30)
    assert isinstance(result, CompactionResult)
    assert list(result.output[1:-1]) == [again, done, last]
    assert shown(result.context)[-3:] == [
        ("message", "user", "Go on."),
        ("message", "assistant", "Done."),
        ("message", "user", "Go on."),
    ]


async def test_a_thinking_models_summary_is_its_answer_without_the_reasoning() -> None:
    markers = ReasoningFormat(start="<think>", end="</think>", start_tokens=(5,), end_tokens=(6,))

    def thinking(_: AdmitGeneration) -> MemoryObjectReceiveStream[GenerationEvent]:
        reasoning = TokensGenerated(text="Summarize the ships.", token_ids=tuple(range(70)))
        pieces = [
            TokensGenerated(text="<think>", token_ids=(1,)),
            reasoning,
            TokensGenerated(text="</think>", token_ids=(2,)),
            TokensGenerated(text="\n\n", token_ids=(3,)),
            TokensGenerated(text=SUMMARY, token_ids=tuple(range(12))),
        ]
        # 85 tokens in all, more than the history's 73: only the 13 after the block are the summary's.
        return events_of(*pieces, finished(completion_tokens=85))

    counter, ingress = Counter(count_characters), Ingress(admitting(thinking))
    async with running(compactor(counter.send, ingress.send, reasoning=markers), counter, ingress) as inbox:
        reply = await compact(inbox)
    assert isinstance(reply, CompactionResult)
    assert UNSIGNED.decode(reply.compaction_item["encrypted_content"]).summary == SUMMARY
    assert ingress.kinds.count("AdmitGeneration") == 1  # judged by its answer's length: no retry


def everything(reply: ReplyStream[CompactReply]) -> CompactHistory:
    return replace(request(reply, keep_tokens=None), summarize_all=True)


async def test_a_compaction_of_everything_summarizes_it_all_and_keeps_only_the_users_messages() -> None:
    """`summarize_all` (Codex's `compaction_trigger`, whose client keeps its user messages and drops the rest): the
    summary covers every item, and the capsule names the user's messages as the items shown after it."""
    counter, ingress = Counter(count_characters), Ingress(admitting(lambda _: summary_events()))
    async with running(compactor(counter.send, ingress.send), counter, ingress) as inbox:
        result = await ask(inbox, everything)
    assert isinstance(result, CompactionResult)
    (admitted,) = [message for message in ingress.received if isinstance(message, AdmitGeneration)]
    assert isinstance(admitted.prompt, ChatPrompt)
    transcript = str(admitted.prompt.messages[0]["content"])
    assert all(text in transcript for text in ("Ada", "Aurora", "Borealis", "Which ships passed?"))
    capsule = UNSIGNED.decode(result.compaction_item["encrypted_content"])
    assert capsule.retained == tuple(item_digest(item) for item in (U1, U2, U3, U4))
    assert shown(result.context) == [
        ("message", "system", "Rules."),
        ("message", "assistant", SUMMARY_HEADER + SUMMARY),
        *shown([U1, U2, U3, U4]),
    ]
