"""CompactorActor: replaces older history with a model-written summary, keeping verbatim what must stay.

Receives `CompactHistory`. Replays any earlier capsule first, cuts the history
into segments where a cut may fall, counts each through the token counter (the
same render as `/v1/responses/input_tokens`), selects what to keep
(`conversation/selection.py`), asks the ingress for one summary generation (greedy, no
tools, thinking off) like any request, and replies `CompactionResult` with the
capsule, or `RequestFailed`: 400 `context_length_exceeded` when the history or
the summary prompt does not fit or the summary is not shorter than what it
replaces, 502 when the summary is empty or cut by `max_output_tokens`. With a
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
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

import anyio
from anyio import BrokenResourceError, ClosedResourceError, WouldBlock
from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.capsule import Capsule, CapsuleCodec, CapsuleError, item_digest
from courier.conversation.chat_render import chat_messages
from courier.conversation.image_refs import image_refs
from courier.conversation.items import is_instruction, message_item, new_id, text_part
from courier.conversation.replay import expand
from courier.conversation.selection import DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS, segments, select
from courier.conversation.summary_prompt import summary_messages
from courier.media.images import FetchedImage
from courier.messages.base import FailureKind, RequestFailed, RequestId
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage, CompactReply
from courier.messages.generation import FinishReason, GenerationFinished, SamplingParams, TokensGenerated
from courier.messages.ingress import (
    AdmitGeneration,
    AdmitReply,
    Admitted,
    ChatPrompt,
    IngressMessage,
    WarmUpConversation,
)
from courier.messages.media import FetchImages, FetchMemo, FetchReply, ImageRef, MediaFetcherMessage, over_image_cap
from courier.messages.token_counter import TokenCounterMessage, TokenizeChat, TokenizeReply, TokenizeResult
from courier.runtime.actor import ActorBusy, ActorStopped, ask
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
    max_images: int = 16  # --max-images, checked over the whole history before any image is read


class _Refused(Exception):
    def __init__(self, failure: RequestFailed) -> None:
        super().__init__(failure.message)
        self.failure = failure


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
        media_fetcher: MemoryObjectSendStream[MediaFetcherMessage] | None = None,
    ) -> None:
        super().__init__()
        self._token_counter = token_counter
        self._media_fetcher = media_fetcher  # None: the model accepts text only
        self._ingress = ingress
        self._codec = codec
        self._limits = limits

    async def serve(self, message: CompactorMessage) -> CompactReply:
        try:
            return await self._compact(message)
        except _Refused as refused:
            return refused.failure
        except (ActorBusy, ActorStopped):
            return RequestFailed(kind=FailureKind.UNAVAILABLE, message="the server is busy or shutting down")

    async def _compact(self, message: CompactHistory) -> CompactionResult:
        try:
            items = expand(message.items, self._codec, message.instructions)
        except CapsuleError as error:
            raise _Refused(_invalid(f"compaction item: {error}", "input")) from None
        instructions = [item for item in items if is_instruction(item)]
        history = [item for item in items if not is_instruction(item)]
        # Every count and the summary read each image once: the counts render the history many times.
        memo = message.memo or FetchMemo()
        self._admit_images(image_refs(history, message.items))
        with tracer().start_as_current_span("compactor.selection") as span:
            parts = segments(history)
            costs = [await self._count(part, message.items, memo) for part in parts]
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
            raise _Refused(_invalid("nothing to compact: the whole history is kept verbatim", "input"))
        summarized_tokens = sum(costs[index] for index in selection.summarized)
        retained = [item for index in selection.retained for item in parts[index]]
        summary, finished = await self._summarize(summarized, message, memo)
        if finished.completion_tokens >= summarized_tokens:
            raise _Refused(
                _invalid(
                    f"the summary ({finished.completion_tokens} tokens) is not shorter than the history it replaces "
                    f"({summarized_tokens} tokens)",
                    "input",
                    code="context_length_exceeded",
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
            raise _Refused(
                _invalid(f"the compacted output ({size} bytes) would not fit the replay body limit", "keep_tokens")
            )
        self._warm_up(message, output)
        usage = {
            "input_tokens": finished.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finished.cached_tokens},
            "output_tokens": finished.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        }
        return CompactionResult(output=output, usage=usage, compaction_item=compaction_item)

    def default_keep_tokens(self) -> int:
        return min(self._limits.context_length // DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS)

    async def _count(self, items: Sequence[JsonObject], request_items: Sequence[JsonObject], memo: FetchMemo) -> int:
        """The tokens `items` render to, images included (a vision model's image tokens depend on the image)."""
        messages = chat_messages(None, items)
        images = await self._images(image_refs(items, request_items), memo)
        result: TokenizeReply = await ask(
            self._token_counter,
            lambda reply: TokenizeChat(
                messages=messages, tools=None, add_generation_prompt=False, reply=reply, images=images
            ),
        )
        if not isinstance(result, TokenizeResult):
            raise _Refused(result)
        return len(result.tokens)

    def _admit_images(self, refs: Sequence[ImageRef]) -> None:
        """The image cap over the whole history, before its counts read any image (a vision model only)."""
        over = over_image_cap(refs, self._limits.max_images, "in the history")
        if self._media_fetcher is not None and over is not None:
            raise _Refused(over)

    async def _images(self, refs: Sequence[ImageRef], memo: FetchMemo) -> tuple[FetchedImage, ...]:
        """A vision model's images for a count, each read once per compaction (none for a text-only model)."""
        if not refs or self._media_fetcher is None:
            return ()
        fetched: FetchReply = await ask(
            self._media_fetcher, lambda reply: FetchImages(images=refs, memo=memo, reply=reply)
        )
        if isinstance(fetched, RequestFailed):
            raise _Refused(fetched)
        return fetched.images

    async def _summarize(
        self, items: Sequence[JsonObject], message: CompactHistory, memo: FetchMemo
    ) -> tuple[str, GenerationFinished]:
        # The summarized part's images go with it: a text-only model refuses them at admission, naming the part.
        images = image_refs(items, message.items)
        prompt = ChatPrompt(messages=summary_messages(items), tools=None, thinking=False, images=images)
        sampling = SamplingParams(max_tokens=message.max_output_tokens, temperature=0.0)
        request_id = RequestId(new_id("compaction"))
        admitted: AdmitReply = await ask(
            self._ingress,
            lambda reply: AdmitGeneration(
                request_id=request_id,
                prompt=prompt,
                sampling=sampling,
                reply=reply,
                session=message.session,
                cache_prompt=False,
                memo=memo,
            ),
        )
        if not isinstance(admitted, Admitted):
            if admitted.code == "context_length_exceeded":
                raise _Refused(
                    _invalid(
                        f"the history to summarize does not fit one context window: {admitted.message}",
                        "input",
                        code="context_length_exceeded",
                    )
                )
            raise _Refused(admitted)
        texts, finished = await self._collect(admitted)
        summary = "".join(texts).strip()
        if finished.reason is FinishReason.LENGTH:
            raise _Refused(_upstream(f"the summary was cut at max_output_tokens ({message.max_output_tokens})"))
        if not summary:
            raise _Refused(_upstream("the model wrote an empty summary"))
        return summary, finished

    async def _collect(self, admitted: Admitted) -> tuple[list[str], GenerationFinished]:
        texts: list[str] = []
        deadline = time.monotonic() + self._limits.timeout_s
        with admitted.events as events:
            while True:
                event = None
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    try:
                        event = await events.receive()
                    except anyio.EndOfStream:
                        raise _Refused(_upstream("the summary generation ended without a result")) from None
                if event is None:
                    raise _Refused(
                        RequestFailed(
                            kind=FailureKind.INTERNAL, message="the summary timed out", code="deadline_exceeded"
                        )
                    )
                if isinstance(event, TokensGenerated):
                    texts.append(event.text)
                elif isinstance(event, GenerationFinished):
                    return texts, event
                else:
                    raise _Refused(
                        RequestFailed(kind=FailureKind.INTERNAL, message=event.message, code="generation_failed")
                    )

    def _warm_up(self, message: CompactHistory, output: Sequence[JsonObject]) -> None:
        """The compacted context (instructions, summary, retained items) prefilled while the server is idle."""
        try:
            replayed = expand(output, self._codec, message.instructions)
        except CapsuleError:
            return
        warm_up = WarmUpConversation(
            session=message.session, messages=chat_messages(message.instructions, replayed), tools=message.tools
        )
        with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
            self._ingress.send_nowait(warm_up)


def _invalid(text: str, param: str, code: str | None = None) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=text, param=param, code=code)


def _upstream(text: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.UPSTREAM, message=text, code="compaction_failed")
