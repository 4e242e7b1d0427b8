"""CompactorActor: replaces older history with a model-written summary, keeping verbatim what must stay.

Receives `CompactHistory`. Replays any earlier capsule first, cuts the history
into segments where a cut may fall, counts each through the token counter (the
same render as `/v1/responses/input_tokens`), selects what to keep
(`conversation/selection.py`), asks the ingress for a summary generation (greedy, no
tools, thinking off) like any request, and replies `CompactionResult` with the
capsule, or `RequestFailed`. The summary is bounded by construction: a grammar of at most
`MAX_LINES` bullet lines and a budget of characters proportional to the tokens it replaces
(`grammar/summary.py`), compiled here in a worker thread. A history that all fits
`keep_tokens` gets its one compaction item too, with no summary and every item retained.
A summary that degenerates (its tail loops, or it
is no shorter than the history it replaces; `conversation/summary_guard.py`)
is retried once with a repetition penalty; a loop is stopped as soon as it shows,
so it does not run on to `max_output_tokens`. The failures: 400
`context_length_exceeded` when the history or the summary prompt does not fit or
the summary is not shorter than what it replaces, 422 `compaction_failed` when
the summary is empty, still loops, or is cut by `max_output_tokens` (greedy, so
the same request would fail alike). With a
vision model the counts and the summary carry the images, read through the
media fetcher once per compaction (one `FetchMemo` for all of it). The
caller's context is never replaced on failure. After a success it asks for the
compacted context to be prefilled while the server is idle, so the next turn
starts from cache. Compactions run concurrently (up to `MAX_CONCURRENT`,
`runtime/concurrent_actor.py`), so one long summary does not hold up the others.

Spans: `compactor.CompactHistory` and beneath it
`compactor.selection` (with one `token_counter.TokenizeChat` per counted segment),
one `ingress.AdmitGeneration` per summary pass, and `compactor.capsule`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.capsule import Capsule, CapsuleCodec, item_digest
from courier.conversation.chat_render import chat_messages
from courier.conversation.ids import new_id
from courier.conversation.image_refs import image_refs
from courier.conversation.images import IN_THE_HISTORY, ImageAdmission
from courier.conversation.items import is_instruction, message_item, text_part
from courier.conversation.replay import replay, replayed_summary
from courier.conversation.response_object import usage_object
from courier.conversation.selection import (
    DEFAULT_KEEP_FRACTION,
    MAX_DEFAULT_KEEP_TOKENS,
    Selection,
    segments,
    select,
)
from courier.conversation.summary_guard import PASS_PENALTIES, LoopWatch, Verdict, pass_sampling, verdict
from courier.conversation.summary_prompt import summary_messages
from courier.conversation.warm_up import warm_up_next_turn
from courier.core.failure_codes import FailureCode
from courier.core.reasoning import ReasoningFormat, ReasoningSplitter
from courier.engine.generation import FinishReason, GenerationFinished, RequestId, SamplingParams, TokensGenerated
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import Constraint
from courier.grammar.summary import PARAM as SUMMARY_PARAM
from courier.grammar.summary import summary_chars, summary_constraint
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage, CompactReply
from courier.messages.generation_reader import (
    Cancellation,
    GenerationCancelled,
    ended_without_result,
    generated_events,
)
from courier.messages.ingress import AdmitGeneration, ChatPrompt, IngressMessage
from courier.messages.media import FetchMemo
from courier.messages.token_counter import MessageNames, TokenCounterMessage, TokenizeChat
from courier.runtime.concurrent_actor import ConcurrentActor
from courier.runtime.tracing import tracer
from courier.storage.records import JsonObject

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactorLimits:
    context_length: int
    max_output_bytes: int  # a replay body must fit the server's body limit
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryPass:
    """One summary generation: its text, and how it finished (`LENGTH` too when stopped early in a loop)."""

    text: str
    finished: GenerationFinished
    reasoning_tokens: int = 0  # of its completion tokens, those a reasoning block took (not the summary's length)

    @property
    def summary_tokens(self) -> int:
        return self.finished.completion_tokens - self.reasoning_tokens


class CompactorActor(ConcurrentActor[CompactorMessage]):
    name = "compactor"
    max_concurrent = MAX_CONCURRENT

    def __init__(
        self,
        token_counter: MemoryObjectSendStream[TokenCounterMessage],
        ingress: MemoryObjectSendStream[IngressMessage],
        codec: CapsuleCodec,
        limits: CompactorLimits,
        *,
        images: ImageAdmission,
        reasoning: ReasoningFormat | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        super().__init__()
        self._reasoning = reasoning  # a thinking model's summary is its answer, not its reasoning
        self._grammars = grammars  # the summary's grammar is compiled here, off the MLX thread
        self._token_counter = token_counter
        self._ingress = ingress
        self._codec = codec
        self._limits = limits
        self._images = images

    async def serve(self, message: CompactorMessage) -> CompactReply:
        try:
            return await self._compact(message)
        except Refused as refused:
            return refused.failure

    async def _compact(self, message: CompactHistory) -> CompactionResult:
        instructions = [item for item in message.context if is_instruction(item)]
        history = [item for item in message.context if not is_instruction(item)]
        # Every count and the summary read each image once: the counts render the history many times.
        memo = message.memo or FetchMemo()
        refused = self._images.refusal(
            image_refs(history, message.request_items), generating=False, where=IN_THE_HISTORY
        )
        if refused is not None:
            raise Refused(refused)
        with tracer().start_as_current_span("compactor.selection") as span:
            parts = segments(history)
            costs = [await self._count(part, message.request_items, memo) for part in parts]
            keep_tokens = message.keep_tokens or self.default_keep_tokens()
            if message.summarize_all:
                selection = Selection(retained=(), summarized=tuple(range(len(parts))))
            else:
                selection = select(parts, costs, keep_tokens)
            span.set_attributes(
                {
                    "courier.compaction.segments": len(parts),
                    "courier.compaction.retained_segments": len(selection.retained),
                    "courier.compaction.keep_tokens": keep_tokens,
                }
            )
        summarized = [item for index in selection.summarized for item in parts[index]]
        summarized_tokens = sum(costs[index] for index in selection.summarized)
        retained = [item for index in selection.retained for item in parts[index]]
        if message.summarize_all:
            retained = [item for item in history if item["type"] == "message" and item["role"] == "user"]
        # An earlier capsule's summary, as replay showed it, is no item a later turn sends: it is never retained,
        # but summarized with the rest, or, with nothing else to summarize, carried on as this capsule's summary.
        read = [(item, replayed_summary(item)) for item in retained]
        earlier = [(item, text) for item, text in read if text is not None]
        retained = [item for item, text in read if text is None]
        if summarized:
            summarized = [*(item for item, _ in earlier), *summarized]
            summary, finished = await self._summarize(summarized, summarized_tokens, message, memo)
        else:  # all of it fits `keep_tokens`: the one compaction item keeps every item, and any earlier summary
            summary = "\n".join(text for _, text in earlier if text)
            finished = GenerationFinished(reason=FinishReason.STOP, prompt_tokens=0, completion_tokens=0)
        with tracer().start_as_current_span("compactor.capsule") as span:
            capsule = Capsule(summary=summary, retained=tuple(item_digest(item) for item in retained))
            compaction_item = {
                "id": new_id("cmp"),
                "type": "compaction",
                "encrypted_content": self._codec.encode(capsule),
            }
            head = (
                [message_item("system", [text_part("input_text", message.instructions)])]
                if message.instructions
                else []
            )
            output = (*head, *instructions, *retained, compaction_item)
            size = sum(len(str(item)) for item in output)
            span.set_attributes({"courier.compaction.capsule_bytes": len(compaction_item["encrypted_content"])})
        if size > self._limits.max_output_bytes:
            raise Refused(
                _invalid(f"the compacted output ({size} bytes) would not fit the replay body limit", "keep_tokens")
            )
        # What the model is shown from here on: the capsule just made, replayed as any later turn replays it.
        context = replay(capsule, output[:-1], (), message.instructions)
        # The compacted context (instructions, summary, retained items) prefilled while the server is idle.
        messages = chat_messages(message.instructions, context)
        warm_up_next_turn(self._ingress, message.session, messages, message.tools, message.tenant)
        return CompactionResult(
            output=output, usage=usage_object(finished), compaction_item=compaction_item, context=tuple(context)
        )

    def default_keep_tokens(self) -> int:
        return min(self._limits.context_length // DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS)

    async def _count(self, items: Sequence[JsonObject], request_items: Sequence[JsonObject], memo: FetchMemo) -> int:
        """The tokens `items` render to, images included (a vision model's image tokens depend on the image)."""
        messages = chat_messages(None, items)
        images = await self._images.read(image_refs(items, request_items), memo)
        result = await call(
            self._token_counter,
            lambda reply: TokenizeChat(
                messages=messages,
                tools=None,
                add_generation_prompt=False,
                reply=reply,
                images=images,
                max_tokens=self._limits.context_length,
                names=MessageNames.BUILT,
            ),
        )
        return len(result.tokens)

    async def _summarize(
        self, items: Sequence[JsonObject], history_tokens: int, message: CompactHistory, memo: FetchMemo
    ) -> tuple[str, GenerationFinished]:
        """The summary of `items` (`history_tokens` long) and the usage of every pass it took."""
        # The summarized part's images go with it: a text-only model refuses them at admission, naming the part.
        images = image_refs(items, message.request_items)
        prompt = ChatPrompt(
            messages=summary_messages(items), tools=None, thinking=False, images=images, names=MessageNames.BUILT
        )
        deadline = time.monotonic() + self._limits.timeout_s  # one deadline for every pass
        constraint = await self._summary_grammar(history_tokens, message.max_output_tokens)
        passes: list[SummaryPass] = []
        for attempt in range(len(PASS_PENALTIES)):
            sampling = dataclasses.replace(pass_sampling(message.max_output_tokens, attempt), constraint=constraint)
            done = await self._summary_pass(prompt, sampling, message, memo, deadline)
            passes.append(done)
            judged = verdict(done.text, done.finished.reason, done.summary_tokens, history_tokens)
            if not judged.degenerate:
                break
            logger.info("compaction summary pass %d degenerated (%s)", attempt + 1, judged.value)
        match judged:
            case Verdict.USABLE:
                return done.text.strip(), _spent(passes)
            case Verdict.LOOP:
                raise Refused(_unusable(f"the summary kept repeating itself ({len(passes)} passes)"))
            case Verdict.ECHO:
                raise Refused(
                    _invalid(
                        f"the summary ({done.summary_tokens} tokens) is not shorter than the history "
                        f"it replaces ({history_tokens} tokens)",
                        "input",
                        code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
                    )
                )
            case Verdict.CUT:
                raise Refused(_unusable(f"the summary was cut at max_output_tokens ({message.max_output_tokens})"))
            case Verdict.EMPTY:
                raise Refused(_unusable("the model wrote an empty summary"))

    async def _summary_grammar(self, history_tokens: int, max_tokens: int) -> Constraint | None:
        """The grammar bounding the summary (`grammar/summary.py`), compiled off the MLX thread; None when the model
        cannot serve grammars, or reasons (a template may open a reasoning block the grammar would not let close)."""
        if self._grammars is None or self._reasoning is not None:
            return None
        grammars, constraint = self._grammars, summary_constraint(summary_chars(history_tokens, max_tokens))
        return await anyio.to_thread.run_sync(lambda: grammars.compile(constraint, SUMMARY_PARAM))

    async def _summary_pass(
        self, prompt: ChatPrompt, sampling: SamplingParams, message: CompactHistory, memo: FetchMemo, deadline: float
    ) -> SummaryPass:
        request_id = RequestId(new_id("compaction"))
        try:
            admitted = await call(
                self._ingress,
                lambda reply: AdmitGeneration(
                    request_id=request_id,
                    prompt=prompt,
                    sampling=sampling,
                    reply=reply,
                    session=message.session,
                    cache_prompt=False,
                    memo=memo,
                    tenant=message.tenant,
                    deadline=deadline,
                ),
            )
        except Refused as refused:
            if refused.failure.code is not FailureCode.CONTEXT_LENGTH_EXCEEDED:
                raise
            raise Refused(
                _invalid(
                    f"the history to summarize does not fit one context window: {refused.failure.message}",
                    "input",
                    code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
                )
            ) from None
        # Nobody waits once the asker is gone (a client that disconnected or timed out): stop within a poll.
        abandoned = Cancellation(abandoned=lambda: message.reply.statistics().open_receive_streams == 0)
        texts: list[str] = []
        watch = LoopWatch()
        tokens = 0
        # Thinking is off for the summary; a template that opens a reasoning block anyway has it taken off.
        thinking = ReasoningSplitter(self._reasoning, inside=admitted.opens_in_reasoning) if self._reasoning else None
        try:
            # Closed as soon as this stops reading, which takes the summary out of the batch.
            events = cast(
                AsyncGenerator[TokensGenerated | GenerationFinished],
                generated_events(admitted, max(0.0, deadline - time.monotonic()), abandoned, grace_s=0.0),
            )
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, GenerationFinished) and event.deadline:  # a summary cut short is no summary
                        raise Refused(
                            RequestFailed(
                                kind=FailureKind.TIMEOUT, message="deadline", code=FailureCode.DEADLINE_EXCEEDED
                            )
                        )
                    if not isinstance(event, TokensGenerated):
                        rest = thinking.finish().content if thinking is not None else ""
                        spent = thinking.reasoning_tokens if thinking is not None else 0
                        return SummaryPass(text="".join(texts) + rest, finished=event, reasoning_tokens=spent)
                    count = len(event.token_ids)
                    texts.append(thinking.feed(event.text, count).content if thinking is not None else event.text)
                    tokens += count
                    # A loop would run to max_output_tokens: stop it here (the raw text: one inside a block counts).
                    if watch.add(event.text):
                        cut = GenerationFinished(
                            reason=FinishReason.LENGTH, prompt_tokens=admitted.prompt_tokens, completion_tokens=tokens
                        )
                        return SummaryPass(text="".join(texts), finished=cut)
        except GenerationCancelled:
            raise Refused(
                RequestFailed(kind=FailureKind.UNAVAILABLE, message="cancelled: nobody waits for this compaction")
            ) from None
        except Refused as refused:
            if refused.failure.code is not FailureCode.DEADLINE_EXCEEDED:
                raise
            # The passes share one deadline: name the whole of it, not what was left for this pass.
            whole = f"the request did not finish within {self._limits.timeout_s:g} s"
            raise Refused(dataclasses.replace(refused.failure, message=whole)) from None
        raise Refused(ended_without_result())


def _spent(passes: Sequence[SummaryPass]) -> GenerationFinished:
    """The usage of all the passes together (a degenerate pass was computed too)."""
    return GenerationFinished(
        reason=passes[-1].finished.reason,
        prompt_tokens=sum(done.finished.prompt_tokens for done in passes),
        completion_tokens=sum(done.finished.completion_tokens for done in passes),
        cached_tokens=sum(done.finished.cached_tokens for done in passes),
    )


def _invalid(text: str, param: str, code: FailureCode | None = None) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=text, param=param, code=code)


def _unusable(text: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.UNUSABLE_OUTPUT, message=text, code=FailureCode.COMPACTION_FAILED)
