"""IngressActor: admits generation requests before anything is queued.

Receives `AdmitGeneration`; refuses at once (OVERLOADED) while the scheduler is
at capacity, before any rendering; admits image parts before any fetch message
exists (the `--max-images` cap, then the model: a text-only model refuses them,
naming itself and the part); has a vision model's images fetched (the media
fetcher, each URL once per request or per the caller's memo); asks the token
counter to render and count the prompt (with the images: their placeholders
expanded, their pixels prepared), refuses a prompt that with its requested
output would overflow the model's context (400 `context_length_exceeded`), then
asks the scheduler to queue it, with the images' digest for the prompt cache.
Replies `Admitted` with the request's event stream, or `RequestFailed` (invalid
input, or OVERLOADED when the scheduler's queue is full). Invariant: a
refused request leaves nothing queued and no stream open.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from dataclasses import replace

import anyio
from anyio import BrokenResourceError, ClosedResourceError, WouldBlock, create_memory_object_stream
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.chat_content import has_images
from courier.media.images import FetchedImage
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.generation import GenerationEvent
from courier.messages.ingress import (
    AdmitGeneration,
    AdmitReply,
    Admitted,
    ChatPrompt,
    IngressMessage,
    TextPrompt,
    TokenPrompt,
    WarmUpConversation,
)
from courier.messages.media import (
    FetchImages,
    FetchMemo,
    FetchReply,
    ImageRef,
    ImagesFetched,
    MediaFetcherMessage,
    VisionInputs,
    over_image_cap,
)
from courier.messages.scheduler import GenerationQueued, QueueWarmUp, SchedulerMessage, SubmitGeneration, SubmitReply
from courier.messages.token_counter import (
    TokenCounterMessage,
    TokenizeChat,
    TokenizeReply,
    TokenizeResult,
    TokenizeText,
)
from courier.runtime.actor import Actor, ActorBusy, ActorStopped, ask
from courier.status.scheduler_stats import SchedulerStats

# Events per request: one per generated token at most, plus the terminal event.
EVENT_SLACK = 2
# Requests with images admitted at once (each fetches, then renders, in its own task).
IMAGE_ADMISSIONS = 8


class IngressActor(Actor[IngressMessage]):
    name = "ingress"

    def __init__(
        self,
        token_counter: MemoryObjectSendStream[TokenCounterMessage],
        scheduler: MemoryObjectSendStream[SchedulerMessage],
        *,
        context_length: int,
        vocabulary_size: int,
        model_id: str,
        max_images: int,
        scheduler_stats: SchedulerStats,
        media_fetcher: MemoryObjectSendStream[MediaFetcherMessage] | None = None,
    ) -> None:
        self._token_counter = token_counter
        self._media_fetcher = media_fetcher  # None: the model accepts text only
        self._scheduler = scheduler
        self._context_length = context_length
        self._vocabulary_size = vocabulary_size
        self._model_id = model_id
        self._max_images = max_images
        self._stats = scheduler_stats
        self._image_slots = anyio.Semaphore(IMAGE_ADMISSIONS)
        self._tasks: TaskGroup | None = None
        self._tasks_ready = anyio.Event()

    async def background(self) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            self._tasks_ready.set()
            await anyio.sleep_forever()

    async def handle(self, message: IngressMessage) -> None:
        match message:
            case AdmitGeneration() if self._fetches_images(message):
                await self._admit_aside(message)
            case AdmitGeneration():
                await self._on_admit_generation(message, message.reply)
            case WarmUpConversation():
                await self._on_warm_up_conversation(message)

    def _fetches_images(self, message: AdmitGeneration) -> bool:
        return (
            self._media_fetcher is not None and isinstance(message.prompt, ChatPrompt) and bool(message.prompt.images)
        )

    async def _admit_aside(self, message: AdmitGeneration) -> None:
        """A request with images is admitted in its own task: a slow image host must not hold up the requests
        behind it. At most `IMAGE_ADMISSIONS` at once; beyond them the request is refused as overloaded."""
        reply = message.reply.clone()  # the actor closes the original when `handle` returns
        try:
            self._image_slots.acquire_nowait()
        except WouldBlock:
            with reply:
                busy = f"{IMAGE_ADMISSIONS} requests with images are being fetched; retry shortly"
                await reply.send(RequestFailed(kind=FailureKind.OVERLOADED, message=busy))
            return
        await self._tasks_ready.wait()
        assert self._tasks is not None
        self._tasks.start_soon(self._admit_then_release, message, reply)

    async def _admit_then_release(self, message: AdmitGeneration, reply: MemoryObjectSendStream[AdmitReply]) -> None:
        with reply:
            try:
                await self._on_admit_generation(message, reply)
            finally:
                self._image_slots.release()

    async def _on_warm_up_conversation(self, message: WarmUpConversation) -> None:
        """Render the history through the reply, as the next turn will, and queue it for an idle scheduler.

        Not for a history with images: its state belongs to those images' bucket, and preparing it would read
        them again; the turn's completion snapshot already serves the next turn."""
        if has_images(message.messages):
            return
        try:
            result: TokenizeReply = await ask(
                self._token_counter,
                lambda reply: TokenizeChat(
                    messages=message.messages, tools=message.tools, add_generation_prompt=False, reply=reply
                ),
            )
        except (ActorBusy, ActorStopped):
            return  # a warm-up is an optimisation: dropped, never waited for
        if isinstance(result, TokenizeResult) and result.tokens:
            with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
                self._scheduler.send_nowait(QueueWarmUp(session=message.session, tokens=result.tokens))

    async def _on_admit_generation(
        self, message: AdmitGeneration, reply_stream: MemoryObjectSendStream[AdmitReply]
    ) -> None:
        try:
            reply = await self._admit(message)
        except ActorBusy:
            reply = RequestFailed(kind=FailureKind.OVERLOADED, message="the server is busy; retry shortly")
        except ActorStopped:
            reply = RequestFailed(kind=FailureKind.UNAVAILABLE, message="the server is shutting down")
        with suppress(BrokenResourceError, ClosedResourceError):
            await reply_stream.send(reply)

    async def _admit(self, message: AdmitGeneration) -> Admitted | RequestFailed:
        refused = self._refused_early(message)
        if refused is not None:
            return refused
        rendered = await self._prompt_tokens(message)
        if isinstance(rendered, RequestFailed):
            return rendered
        tokens, boundary, vision = rendered
        param = "messages" if isinstance(message.prompt, ChatPrompt) else "prompt"
        if not tokens:
            return _invalid("the prompt is empty", param)
        sampling = message.sampling
        room = self._context_length - len(tokens)
        requested = sampling.max_tokens or room
        max_tokens = min(requested, room) if message.fit_to_context else requested
        if max_tokens <= 0 or len(tokens) + max_tokens > self._context_length:
            return _context_exceeded(self._context_length, len(tokens), max_tokens, param)
        sampling = replace(sampling, max_tokens=max_tokens)
        send, receive = create_memory_object_stream[GenerationEvent](max_tokens + EVENT_SLACK)
        try:
            queued: SubmitReply = await ask(
                self._scheduler,
                lambda reply: SubmitGeneration(
                    request_id=message.request_id,
                    prompt_tokens=tokens,
                    sampling=sampling,
                    events=send,
                    reply=reply,
                    session=message.session,
                    boundary=boundary,
                    cache_prompt=message.cache_prompt,
                    vision=vision,
                ),
            )
        except BaseException:
            send.close()
            receive.close()
            raise
        if not isinstance(queued, GenerationQueued):
            send.close()
            receive.close()
            return queued
        return Admitted(request_id=message.request_id, prompt_tokens=len(tokens), max_tokens=max_tokens, events=receive)

    def _refused_early(self, message: AdmitGeneration) -> RequestFailed | None:
        """Refusals that need no render: a scheduler at capacity, then image parts."""
        stats = self._stats
        if stats.running + stats.waiting >= stats.max_batch + stats.max_queue:
            # In a burst, tokenizing every prompt first made each refusal wait for the renders queued ahead of it.
            # The scheduler still has the last word when it queues.
            stats.rejected += 1
            full = f"the server is at capacity ({stats.max_batch} running, {stats.max_queue} waiting); retry shortly"
            return RequestFailed(kind=FailureKind.OVERLOADED, message=full, code="queue_full")
        if isinstance(message.prompt, ChatPrompt) and message.prompt.images:
            return self._refused_images(message.prompt.images)
        return None

    def _refused_images(self, images: Sequence[ImageRef]) -> RequestFailed | None:
        """Image admission, before any fetch exists: the count cap, then the model."""
        over = over_image_cap(images, self._max_images)
        if over is not None or self._media_fetcher is not None:
            return over
        first = images[0].param
        message = (
            f"The model '{self._model_id}' accepts text only, and {first} is an image; send text, or serve a vision "
            "model"
        )
        return RequestFailed(
            kind=FailureKind.INVALID_REQUEST, message=message, param=first, code="model_not_multimodal"
        )

    async def _fetch_images(self, message: AdmitGeneration) -> tuple[FetchedImage, ...] | RequestFailed:
        """An admitted request's images, read by the media fetcher (none for a prompt without them)."""
        prompt = message.prompt
        if not isinstance(prompt, ChatPrompt) or not prompt.images or self._media_fetcher is None:
            return ()
        refs, memo = prompt.images, message.memo or FetchMemo()
        fetched: FetchReply = await ask(
            self._media_fetcher, lambda reply: FetchImages(images=refs, memo=memo, reply=reply)
        )
        return fetched.images if isinstance(fetched, ImagesFetched) else fetched

    async def _prompt_tokens(
        self, message: AdmitGeneration
    ) -> tuple[tuple[int, ...], int, VisionInputs | None] | RequestFailed:
        """The prompt's tokens, where a chat's history ends in them, and its images prepared for the model
        (fetched first: admission, then fetch, then render)."""
        prompt = message.prompt
        if isinstance(prompt, TokenPrompt):
            out_of_range = [token for token in prompt.tokens if not 0 <= token < self._vocabulary_size]
            if out_of_range:
                return _invalid(f"token ids outside the vocabulary (0..{self._vocabulary_size - 1})", "prompt")
            return prompt.tokens, 0, None
        if isinstance(prompt, TextPrompt):
            text = prompt.text
            result: TokenizeReply = await ask(
                self._token_counter, lambda reply: TokenizeText(text=text, add_special_tokens=True, reply=reply)
            )
        else:
            chat = prompt
            images = await self._fetch_images(message)
            if isinstance(images, RequestFailed):
                return images
            result = await ask(
                self._token_counter,
                lambda reply: TokenizeChat(
                    messages=chat.messages,
                    tools=chat.tools,
                    add_generation_prompt=True,
                    reply=reply,
                    with_history_boundary=message.cache_prompt,
                    thinking=chat.thinking,
                    images=images,
                ),
            )
        if not isinstance(result, TokenizeResult):
            return result
        return result.tokens, result.history_boundary, result.vision


def _invalid(message: str, param: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=param)


def _context_exceeded(context: int, prompt: int, completion: int, param: str) -> RequestFailed:
    message = (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + max(completion, 0)} tokens ({prompt} in the {param}, {max(completion, 0)} for the completion). "
        "Please reduce the length of the input or of max_tokens."
    )
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=param, code="context_length_exceeded")
