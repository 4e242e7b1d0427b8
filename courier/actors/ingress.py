"""IngressActor: admits generation requests before anything is queued.

Receives `AdmitGeneration`; refuses at once (OVERLOADED, `queue_full`) while the
scheduler is at capacity, before any rendering; admits image parts before any fetch
message exists (`conversation/images.py`: the `--max-images` cap, then the model: a
text-only model refuses them, naming itself and the part); has a vision model's
images read by the media fetcher (each URL once per request or per the caller's
memo); asks the token counter to render and count the prompt (with the images: their
placeholders expanded, their pixels prepared), refuses a prompt that with its
requested output would overflow the model's context (400 `context_length_exceeded`),
then asks the scheduler to queue it, with the images' digest for the prompt cache.
Replies `Admitted` with the request's event stream, or `RequestFailed`. A request
with images that passes the early refusals is admitted in a side task (at most
`IMAGE_ADMISSIONS` at once, beyond them refused as overloaded), so a slow image host
holds up only its own request.

Receives `WarmUpConversation` (no reply): renders the history through the last
reply, as the next turn will, and tells the scheduler to prepare it when idle.

Invariant: a refused request leaves nothing queued and no stream open.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import replace

from anyio import BrokenResourceError, ClosedResourceError, WouldBlock, create_memory_object_stream
from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.chat_content import has_images
from courier.conversation.images import ImageAdmission
from courier.core.failure_codes import FailureCode
from courier.core.reasoning import ReasoningFormat
from courier.engine.generation import GenerationEvent, VisionInputs
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.ingress import (
    AdmitGeneration,
    AdmitReply,
    Admitted,
    ChatPrompt,
    IngressMessage,
    Prompt,
    TextPrompt,
    TokenPrompt,
    WarmUpConversation,
)
from courier.messages.media import FetchMemo
from courier.messages.scheduler import QueueWarmUp, SchedulerMessage, SubmitGeneration
from courier.messages.token_counter import MessageNames, TokenCounterMessage, TokenizeChat, TokenizeText
from courier.runtime.actor import Actor
from courier.runtime.concurrent_actor import SideTasks
from courier.status.scheduler_stats import AdmissionStats, SchedulerStats

# Events per request: one per generated token at most, plus the terminal event.
EVENT_SLACK = 2
# Requests with images admitted at once (each fetches, then renders, in its own task).
IMAGE_ADMISSIONS = 8

RenderedPrompt = tuple[tuple[int, ...], int, VisionInputs | None]


class IngressActor(Actor[IngressMessage]):
    name = "ingress"

    def __init__(
        self,
        token_counter: MemoryObjectSendStream[TokenCounterMessage],
        scheduler: MemoryObjectSendStream[SchedulerMessage],
        *,
        context_length: int,
        vocabulary_size: int,
        images: ImageAdmission,
        scheduler_stats: SchedulerStats,
        stats: AdmissionStats,
        reasoning: ReasoningFormat | None = None,
        default_max_tokens: int = 0,
    ) -> None:
        self._default_max_tokens = default_max_tokens  # a reply's limit when its request sets none (0: the room)
        self._token_counter = token_counter
        self._scheduler = scheduler
        self._context_length = context_length
        self._vocabulary_size = vocabulary_size
        self._images = images
        self._scheduler_stats = scheduler_stats  # read only: the scheduler writes it
        self._stats = stats
        self._reasoning = reasoning  # the model's reasoning markers: whether a prompt opens a block is told here
        self._image_admissions: SideTasks[AdmitGeneration] = SideTasks(IMAGE_ADMISSIONS, self.fault)

    async def background(self) -> None:
        await self._image_admissions.run()

    async def handle(self, message: IngressMessage) -> None:
        match message:
            case AdmitGeneration():
                await self._on_admit_generation(message)
            case WarmUpConversation():
                await self._on_warm_up_conversation(message)

    async def _on_admit_generation(self, message: AdmitGeneration) -> None:
        """Refusals that need no render answer at once; a request with images is admitted aside."""
        refused = self._refused_early(message)
        if refused is not None:
            await message.reply.send(refused)
        elif not self._reads_images(message):
            await self._admit_and_reply(message, message.reply)
        elif not await self._image_admissions.start(message, self._admit_and_reply, wait=False):
            busy = f"{IMAGE_ADMISSIONS} requests with images are being fetched; retry shortly"
            await message.reply.send(
                RequestFailed(kind=FailureKind.OVERLOADED, message=busy, code=FailureCode.OVERLOADED)
            )

    def _reads_images(self, message: AdmitGeneration) -> bool:
        prompt = message.prompt
        return self._images.accepts_images and isinstance(prompt, ChatPrompt) and bool(prompt.images)

    async def _on_warm_up_conversation(self, message: WarmUpConversation) -> None:
        """Render the history through the reply, as the next turn will, and queue it for an idle scheduler.

        Not for a history with images: its state belongs to those images' bucket, and preparing it would read
        them again; the turn's completion snapshot already serves the next turn."""
        if has_images(message.messages):
            return
        try:
            result = await call(
                self._token_counter,
                lambda reply: TokenizeChat(
                    messages=message.messages,
                    tools=message.tools,
                    add_generation_prompt=False,
                    max_tokens=self._context_length,
                    reply=reply,
                    reuse_scope=message.tenant,
                    options=message.options,
                    thinking=message.thinking,
                ),
            )
        except Refused:
            return  # a warm-up is an optimisation: dropped, never waited for
        if result.tokens:
            with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
                self._scheduler.send_nowait(
                    QueueWarmUp(session=message.session, tokens=result.tokens, tenant=message.tenant)
                )

    async def _admit_and_reply(
        self, message: AdmitGeneration, reply_stream: MemoryObjectSendStream[AdmitReply]
    ) -> None:
        reply: AdmitReply
        try:
            reply = await self._admit(message)
        except Refused as refused:
            reply = refused.failure
        try:
            await reply_stream.send(reply)
        except (BrokenResourceError, ClosedResourceError):
            # The asker has gone (a client that disconnected while its prompt was rendered): nobody will read the
            # generation's events, so closing them now takes it out of the queue before it generates a token.
            if isinstance(reply, Admitted):
                reply.discard()

    async def _admit(self, message: AdmitGeneration) -> Admitted:
        """Render, check the context, queue (the early refusals have passed)."""
        tokens, boundary, vision = await self._prompt_tokens(message)
        param, limit = _field_names(message.prompt)
        if not tokens:
            raise Refused(_invalid("the prompt is empty", param))
        sampling = message.sampling
        room = self._context_length - len(tokens)
        requested = sampling.max_tokens or min(self._default_max_tokens or room, room)
        max_tokens = min(requested, room) if message.fit_to_context else requested
        if max_tokens <= 0 or len(tokens) + max_tokens > self._context_length:
            raise Refused(_context_exceeded(self._context_length, len(tokens), max_tokens, param, limit))
        sampling = replace(sampling, max_tokens=max_tokens)
        send, receive = create_memory_object_stream[GenerationEvent](message.n * (max_tokens + EVENT_SLACK))
        try:
            await call(
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
                    tenant=message.tenant,
                    n=message.n,
                    deadline=message.deadline,
                ),
            )
        except BaseException:
            send.close()
            receive.close()
            raise
        # A constrained reply (a schema, a forced call) is the grammar's from its first token: no reasoning block.
        constrained = sampling.constraint is not None
        reasoning = self._reasoning if isinstance(message.prompt, ChatPrompt) and not constrained else None
        return Admitted(
            request_id=message.request_id,
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            events=receive,
            opens_in_reasoning=reasoning is not None and reasoning.open_at_end(tokens),
            choices=message.n,
        )

    def _refused_early(self, message: AdmitGeneration) -> RequestFailed | None:
        """Refusals that need no render, for every request alike: a scheduler at capacity, a logit_bias past the
        vocabulary, then image parts."""
        scheduler = self._scheduler_stats
        if scheduler.at_capacity:
            # In a burst, tokenizing every prompt first made each refusal wait for the renders queued ahead of it.
            # The scheduler still has the last word when it queues.
            self._stats.rejected += 1
            full = (
                f"the server is at capacity ({scheduler.max_batch} running, {scheduler.max_queue} waiting); "
                "retry shortly"
            )
            return RequestFailed(kind=FailureKind.OVERLOADED, message=full, code=FailureCode.QUEUE_FULL)
        outside = [token for token, _ in message.sampling.logit_bias if token >= self._vocabulary_size]
        if outside:
            text = f"logit_bias names token {outside[0]}, outside the vocabulary (0..{self._vocabulary_size - 1})"
            return _invalid(text, "logit_bias")
        if isinstance(message.prompt, ChatPrompt):
            return self._images.refusal(message.prompt.images, generating=True)
        return None

    async def _prompt_tokens(self, message: AdmitGeneration) -> RenderedPrompt:
        """The prompt's tokens, where a chat's history ends in them, and its images prepared for the model
        (read first: admission, then fetch, then render)."""
        prompt = message.prompt
        if isinstance(prompt, TokenPrompt):
            out_of_range = [token for token in prompt.tokens if not 0 <= token < self._vocabulary_size]
            if out_of_range:
                raise Refused(_invalid(f"token ids outside the vocabulary (0..{self._vocabulary_size - 1})", "prompt"))
            return prompt.tokens, 0, None
        if isinstance(prompt, TextPrompt):
            text = prompt.text
            result = await call(
                self._token_counter,
                lambda reply: TokenizeText(
                    text=text, add_special_tokens=True, max_tokens=self._context_length, reply=reply
                ),
            )
            return result.tokens, 0, None
        chat = prompt
        if chat.rendered is not None:
            return chat.rendered.tokens, chat.rendered.history_boundary, chat.rendered.vision
        images = await self._images.read(chat.images, message.memo or FetchMemo())
        result = await call(
            self._token_counter,
            lambda reply: TokenizeChat(
                messages=chat.messages,
                tools=chat.tools,
                add_generation_prompt=True,
                reply=reply,
                with_history_boundary=message.cache_prompt,
                thinking=chat.thinking,
                options=chat.options,
                images=images,
                max_tokens=self._context_length,
                names=chat.names,
                reuse_scope=message.tenant if message.cache_prompt else None,
            ),
        )
        return result.tokens, result.history_boundary, result.vision


def _invalid(message: str, param: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=param)


def _field_names(prompt: Prompt) -> tuple[str, str]:
    """What the request's dialect calls its prompt and its token limit: chat's (and the Messages API's) `messages`
    and `max_tokens`, completions' `prompt`, a Responses turn's `input` and `max_output_tokens`."""
    if not isinstance(prompt, ChatPrompt):
        return "prompt", "max_tokens"
    return prompt.names.param, "max_tokens" if prompt.names is MessageNames.REQUEST else "max_output_tokens"


def _context_exceeded(context: int, prompt: int, completion: int, param: str, limit: str) -> RequestFailed:
    message = (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + max(completion, 0)} tokens ({prompt} in the {param}, {max(completion, 0)} for the completion). "
        f"Please reduce the length of the {param} or of {limit}."
    )
    return RequestFailed(
        kind=FailureKind.INVALID_REQUEST, message=message, param=param, code=FailureCode.CONTEXT_LENGTH_EXCEEDED
    )
