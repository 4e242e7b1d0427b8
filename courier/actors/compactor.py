"""CompactorActor: replaces older history with a model-written summary, keeping verbatim what must stay.

Receives `CompactHistory`. Replays any earlier capsule first, cuts the history
into segments where a cut may fall, counts each through the token counter (the
same render as `/v1/responses/input_tokens`), selects what to keep
(`conversation/selection.py`), asks the ingress for one summary generation (greedy, no
tools, thinking off) like any request, and replies `CompactionResult` with the
capsule, or `RequestFailed`: 400 `context_length_exceeded` when the history or
the summary prompt does not fit or the summary is not shorter than what it
replaces, 422 `compaction_failed` when the summary is empty or cut by
`max_output_tokens` (greedy, so a retry would fail alike). With a
vision model the counts and the summary carry the images, read through the
media fetcher once per compaction (one `FetchMemo` for all of it). The
caller's context is never replaced on failure. After a success it asks for the
compacted context to be prefilled while the server is idle, so the next turn
starts from cache. Compactions run concurrently (up to `MAX_CONCURRENT`,
`runtime/concurrent_actor.py`), so one long summary does not hold up the others.

Spans: `compactor.CompactHistory` and beneath it `compactor.selection` (with one
`token_counter.TokenizeChat` per counted segment), the summary's
`ingress.AdmitGeneration`, and `compactor.capsule`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.capsule import Capsule, CapsuleCodec, item_digest
from courier.conversation.chat_render import chat_messages
from courier.conversation.image_refs import image_refs
from courier.conversation.images import IN_THE_HISTORY, ImageAdmission
from courier.conversation.items import is_instruction, message_item, new_id, text_part
from courier.conversation.replay import replay
from courier.conversation.response_object import usage_object
from courier.conversation.selection import DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS, segments, select
from courier.conversation.summary_prompt import summary_messages
from courier.conversation.warm_up import warm_up_next_turn
from courier.core.failure_codes import FailureCode
from courier.engine.generation import FinishReason, GenerationFinished, RequestId, SamplingParams
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage, CompactReply
from courier.messages.generation_reader import Cancellation, GenerationCancelled, collect
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
    ) -> None:
        super().__init__()
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
            selection = select(parts, costs, keep_tokens)
            span.set_attributes(
                {
                    "courier.compaction.segments": len(parts),
                    "courier.compaction.retained_segments": len(selection.retained),
                    "courier.compaction.keep_tokens": keep_tokens,
                }
            )
        summarized = [item for index in selection.summarized for item in parts[index]]
        if not summarized:
            raise Refused(_invalid("nothing to compact: the whole history is kept verbatim", "input"))
        summarized_tokens = sum(costs[index] for index in selection.summarized)
        retained = [item for index in selection.retained for item in parts[index]]
        summary, finished = await self._summarize(summarized, message, memo)
        if finished.completion_tokens >= summarized_tokens:
            raise Refused(
                _invalid(
                    f"the summary ({finished.completion_tokens} tokens) is not shorter than the history it replaces "
                    f"({summarized_tokens} tokens)",
                    "input",
                    code=FailureCode.CONTEXT_LENGTH_EXCEEDED,
                )
            )
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
        self, items: Sequence[JsonObject], message: CompactHistory, memo: FetchMemo
    ) -> tuple[str, GenerationFinished]:
        # The summarized part's images go with it: a text-only model refuses them at admission, naming the part.
        images = image_refs(items, message.request_items)
        prompt = ChatPrompt(
            messages=summary_messages(items), tools=None, thinking=False, images=images, names=MessageNames.BUILT
        )
        sampling = SamplingParams(max_tokens=message.max_output_tokens, temperature=0.0)
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
        try:
            collected = await collect(admitted, self._limits.timeout_s, abandoned)
        except GenerationCancelled:
            raise Refused(
                RequestFailed(kind=FailureKind.UNAVAILABLE, message="cancelled: nobody waits for this compaction")
            ) from None
        summary = collected.text.strip()
        if collected.finished.reason is FinishReason.LENGTH:
            raise Refused(_unusable(f"the summary was cut at max_output_tokens ({message.max_output_tokens})"))
        if not summary:
            raise Refused(_unusable("the model wrote an empty summary"))
        return summary, collected.finished


def _invalid(text: str, param: str, code: FailureCode | None = None) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=text, param=param, code=code)


def _unusable(text: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.UNUSABLE_OUTPUT, message=text, code=FailureCode.COMPACTION_FAILED)
