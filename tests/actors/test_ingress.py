"""IngressActor over real anyio streams, its neighbours faked: what it sends them, in order, and what it replies.

The token counter, the scheduler and the media fetcher are `FakeNeighbour`s whose
answers every test chooses; a shared journal records, in order, each message a
neighbour took from its inbox, so a test asserts the whole conversation the ingress
held (`["token_counter.TokenizeChat", "scheduler.SubmitGeneration"]`) or that it held
none at all (`[]`). Nothing sleeps: a test waits on a neighbour's arrivals, on a
reply, or on `anyio.wait_all_tasks_blocked()`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.ingress import EVENT_SLACK, IMAGE_ADMISSIONS, IngressActor
from courier.conversation.images import ImageAdmission
from courier.core.failure_codes import FailureCode
from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.engine.generation import (
    FinishReason,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
    VisionInputs,
)
from courier.media.images import FetchedImage
from courier.messages.asking import BUSY, STOPPED
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
from courier.messages.media import FetchImages, FetchMemo, ImageRef, ImagesFetched, MediaFetcherMessage
from courier.messages.scheduler import GenerationQueued, QueueWarmUp, SchedulerMessage, SubmitGeneration
from courier.messages.token_counter import TokenCounterMessage, TokenizeChat, TokenizeResult, TokenizeText
from courier.runtime.actor import ActorStopped, ask
from courier.runtime.message import Message
from courier.status.scheduler_stats import AdmissionStats, SchedulerStats
from tests.support.actors import INBOX, Answer, FakeNeighbour, busy_inbox, run_actor, start_neighbours, stopped_inbox

N = TypeVar("N", bound=Message)

IngressInbox = MemoryObjectSendStream[IngressMessage]
TokenCounterInbox = MemoryObjectSendStream[TokenCounterMessage]

CONTEXT = 64
VOCABULARY = 100
MODEL = "tiny-text-model"
WAIT = 10  # seconds: a test that would hang fails instead
PROMPT = tuple(range(1, 11))  # what the fake token counter renders: 10 tokens
BOUNDARY = 6  # where the fake token counter says the history ends in PROMPT
ROOM = CONTEXT - len(PROMPT)  # what the context leaves for the completion

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "lookup"}}]
CHAT = ChatPrompt(messages=MESSAGES, tools=TOOLS, thinking=False)

IMAGE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}, {"type": "image"}]}
]
FIRST_IMAGE = ImageRef(url="https://images.example/a.png", param="messages[0].content[1]")
SECOND_IMAGE = ImageRef(url="https://images.example/b.png", param="messages[0].content[2]")
IMAGE_CHAT = ChatPrompt(messages=IMAGE_MESSAGES, tools=None, images=(FIRST_IMAGE, SECOND_IMAGE))
FETCHED = (
    FetchedImage(data=b"a-bytes", digest="a" * 64, format="PNG", width=8, height=8),
    FetchedImage(data=b"b-bytes", digest="b" * 64, format="JPEG", width=4, height=2),
)
VISION = VisionInputs(arrays={}, digest="ab" * 32)
OVER_THE_CAP = ChatPrompt(messages=IMAGE_MESSAGES, tools=None, images=(FIRST_IMAGE, SECOND_IMAGE) * 3)  # 6 > 4


# -- the neighbours' answers -------------------------------------------------------------------------------------------


def tokenized(message: TokenCounterMessage) -> TokenizeResult:
    """The token counter renders every prompt as PROMPT (a chat with images comes with its vision inputs)."""
    vision = VISION if isinstance(message, TokenizeChat) and message.images else None
    return TokenizeResult(tokens=PROMPT, history_boundary=BOUNDARY, vision=vision)


def queued(message: SchedulerMessage) -> GenerationQueued | None:
    """The scheduler queues every generation; a warm-up is a tell (no answer)."""
    if isinstance(message, SubmitGeneration):
        return GenerationQueued(request_id=message.request_id, queue_position=0)
    return None


def fetched(message: MediaFetcherMessage) -> ImagesFetched:
    return ImagesFetched(images=FETCHED[: len(message.images)])


def logged(journal: list[str], name: str, answer: Answer[N]) -> Answer[N]:
    """`answer`, recording first in the shared journal that neighbour `name` took the message from its inbox."""

    def record(message: N) -> Any:
        journal.append(f"{name}.{type(message).__name__}")
        return answer(message)

    return record


def held(gate: anyio.Event, answer: Answer[N]) -> Answer[N]:
    """`answer`, held back until `gate` is set (the neighbour reads nothing else meanwhile)."""

    async def hold(message: N) -> Any:
        await gate.wait()
        return answer(message)

    return hold


# -- the rig -----------------------------------------------------------------------------------------------------------


@dataclass
class Rig:
    """The ingress's three neighbours, its stats, and the journal of what the neighbours took from their inboxes."""

    tokenize: Answer[TokenCounterMessage] = tokenized
    submit: Answer[SchedulerMessage] = queued
    fetch: Answer[MediaFetcherMessage] = fetched
    scheduler_stats: SchedulerStats = field(default_factory=lambda: SchedulerStats(max_batch=2, max_queue=2))
    admission_stats: AdmissionStats = field(default_factory=AdmissionStats)
    token_counter_capacity: int = INBOX
    journal: list[str] = field(default_factory=list)
    default_max_tokens: int = 0  # --default-max-tokens (0: what the context leaves)

    def __post_init__(self) -> None:
        self.token_counter = FakeNeighbour[TokenCounterMessage](
            logged(self.journal, "token_counter", self.tokenize), capacity=self.token_counter_capacity
        )
        self.scheduler = FakeNeighbour[SchedulerMessage](logged(self.journal, "scheduler", self.submit))
        self.media = FakeNeighbour[MediaFetcherMessage](logged(self.journal, "media", self.fetch))

    def actor(
        self, *, vision: bool = False, max_images: int = 4, token_counter: TokenCounterInbox | None = None
    ) -> IngressActor:
        images = ImageAdmission(max_images=max_images, model_id=MODEL, fetcher=self.media.send if vision else None)
        return IngressActor(
            self.token_counter.send if token_counter is None else token_counter,
            self.scheduler.send,
            context_length=CONTEXT,
            vocabulary_size=VOCABULARY,
            images=images,
            scheduler_stats=self.scheduler_stats,
            stats=self.admission_stats,
            default_max_tokens=self.default_max_tokens,
        )

    def submitted(self, index: int = 0) -> SubmitGeneration:
        message = self.scheduler.received[index]
        assert isinstance(message, SubmitGeneration)
        return message

    def rendered(self, index: int = 0) -> TokenizeChat:
        message = self.token_counter.received[index]
        assert isinstance(message, TokenizeChat)
        return message

    def fetched(self, index: int = 0) -> FetchImages:
        return self.media.received[index]

    def close_received(self) -> None:
        """Close what the neighbours were handed, as real actors do once they have answered."""
        neighbours: Sequence[FakeNeighbour[Any]] = (self.token_counter, self.scheduler, self.media)
        for neighbour in neighbours:
            for message in neighbour.received:
                for name in ("reply", "events"):
                    stream = getattr(message, name, None)
                    if isinstance(stream, MemoryObjectSendStream):
                        stream.close()
            neighbour.send.close()


@dataclass
class Ingress:
    """A running ingress's inbox, and the streams of what it admitted (closed when the test ends)."""

    inbox: IngressInbox
    admitted: list[Admitted] = field(default_factory=list)

    async def admit(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 8,
        request_id: str = "req-1",
        session: str = "alice",
        cache_prompt: bool = True,
        memo: FetchMemo | None = None,
        fit_to_context: bool = False,
    ) -> AdmitReply:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.5, seed=7)
        reply: AdmitReply = await ask(
            self.inbox,
            lambda reply: AdmitGeneration(
                request_id=RequestId(request_id),
                prompt=prompt,
                sampling=sampling,
                session=session,
                cache_prompt=cache_prompt,
                memo=memo,
                fit_to_context=fit_to_context,
                reply=reply,
            ),
        )
        if isinstance(reply, Admitted):
            self.admitted.append(reply)
        return reply

    def close(self) -> None:
        for admitted in self.admitted:
            admitted.events.close()


@asynccontextmanager
async def neighbours(rig: Rig) -> AsyncIterator[None]:
    """The rig's neighbours serving (and every wait in the test bounded by WAIT)."""
    with anyio.fail_after(WAIT):
        try:
            async with anyio.create_task_group() as tasks:
                await start_neighbours(tasks, rig.token_counter, rig.scheduler, rig.media)
                yield
                tasks.cancel_scope.cancel()
        finally:
            rig.close_received()


@asynccontextmanager
async def serving(
    rig: Rig, *, vision: bool = False, max_images: int = 4, token_counter: TokenCounterInbox | None = None
) -> AsyncIterator[Ingress]:
    """The ingress running between the rig's neighbours; leaving stops it (its inbox closed), then them."""
    async with (
        neighbours(rig),
        run_actor(rig.actor(vision=vision, max_images=max_images, token_counter=token_counter)) as inbox,
    ):
        ingress = Ingress(inbox)
        try:
            yield ingress
        finally:
            ingress.close()


def failure(reply: AdmitReply) -> RequestFailed:
    assert isinstance(reply, RequestFailed), reply
    return reply


def admitted(reply: AdmitReply) -> Admitted:
    assert isinstance(reply, Admitted), reply
    return reply


# -- 1. the normal path ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_chat_is_rendered_then_queued_with_what_the_context_leaves() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(CHAT, max_tokens=0, session="alice", cache_prompt=True))
    assert rig.journal == ["token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
    chat = rig.rendered()
    assert (chat.messages, chat.tools, chat.thinking, chat.images) == (MESSAGES, TOOLS, False, ())
    assert (chat.add_generation_prompt, chat.with_history_boundary) == (True, True)
    submit = rig.submitted()
    assert (submit.request_id, submit.prompt_tokens, submit.boundary) == ("req-1", PROMPT, BOUNDARY)
    assert (submit.session, submit.cache_prompt, submit.vision) == ("alice", True, None)
    assert submit.sampling == SamplingParams(max_tokens=ROOM, temperature=0.5, seed=7)
    assert (reply.request_id, reply.prompt_tokens, reply.max_tokens) == ("req-1", len(PROMPT), ROOM)


@pytest.mark.anyio
async def test_without_cache_prompt_no_history_boundary_is_asked_for() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        admitted(await ingress.admit(CHAT, max_tokens=5, session="bob", cache_prompt=False))
    assert rig.rendered().with_history_boundary is False
    submit = rig.submitted()
    assert (submit.session, submit.cache_prompt, submit.sampling.max_tokens) == ("bob", False, 5)


@pytest.mark.anyio
async def test_a_chat_already_rendered_is_queued_without_another_render() -> None:
    """A Responses turn counted against its threshold hands over its count's tokens."""
    rendered = TokenizeResult(tokens=tuple(range(20, 32)), history_boundary=9, vision=VISION)
    rig = Rig()
    async with serving(rig, vision=True) as ingress:
        prompt = replace(IMAGE_CHAT, rendered=rendered)
        reply = admitted(await ingress.admit(prompt, max_tokens=4))
        too_long = failure(await ingress.admit(prompt, max_tokens=CONTEXT))  # the context check still applies
        over_the_cap = failure(await ingress.admit(replace(OVER_THE_CAP, rendered=rendered)))  # so does the image cap
    assert rig.journal == ["scheduler.SubmitGeneration"]  # nothing rendered, nothing fetched again
    submit = rig.submitted()
    assert (submit.prompt_tokens, submit.boundary, submit.vision) == (rendered.tokens, 9, VISION)
    assert reply.prompt_tokens == len(rendered.tokens)
    assert too_long.code == FailureCode.CONTEXT_LENGTH_EXCEEDED
    assert "are accepted (--max-images)" in over_the_cap.message


@pytest.mark.anyio
async def test_the_scheduler_side_events_arrive_on_the_admitted_stream() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(CHAT, max_tokens=5))
        events = rig.submitted().events
        assert events.statistics().max_buffer_size == 5 + EVENT_SLACK
        token = TokensGenerated(text="Paris", token_ids=(42,))
        finished = GenerationFinished(reason=FinishReason.STOP, prompt_tokens=len(PROMPT), completion_tokens=1)
        await events.send(token)
        await events.send(finished)
        events.close()  # the scheduler closes the stream at the end
        assert [event async for event in reply.events] == [token, finished]


@pytest.mark.anyio
async def test_a_text_prompt_is_tokenized_with_special_tokens_and_no_boundary() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(TextPrompt(text="Once upon a time"), max_tokens=4))
    assert rig.journal == ["token_counter.TokenizeText", "scheduler.SubmitGeneration"]
    text = rig.token_counter.received[0]
    assert isinstance(text, TokenizeText)
    assert (text.text, text.add_special_tokens) == ("Once upon a time", True)
    submit = rig.submitted()
    # The fake answers a boundary for every render: a text prompt has no history, so none is passed on.
    assert (submit.prompt_tokens, submit.boundary, submit.sampling.max_tokens) == (PROMPT, 0, 4)
    assert (reply.prompt_tokens, reply.max_tokens) == (len(PROMPT), 4)


@pytest.mark.anyio
async def test_a_token_prompt_goes_straight_to_the_scheduler() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(TokenPrompt(tokens=(0, 5, VOCABULARY - 1)), max_tokens=0))
    assert rig.journal == ["scheduler.SubmitGeneration"]
    submit = rig.submitted()
    assert (submit.prompt_tokens, submit.boundary, submit.sampling.max_tokens) == ((0, 5, 99), 0, CONTEXT - 3)
    assert (reply.prompt_tokens, reply.max_tokens) == (3, CONTEXT - 3)


@pytest.mark.parametrize("bad", [VOCABULARY, -1])
@pytest.mark.anyio
async def test_token_ids_outside_the_vocabulary_are_refused(bad: int) -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        refused = failure(await ingress.admit(TokenPrompt(tokens=(1, bad, 2))))
    assert (refused.kind, refused.param) == (FailureKind.INVALID_REQUEST, "prompt")
    assert refused.message == f"token ids outside the vocabulary (0..{VOCABULARY - 1})"
    assert rig.journal == []


# -- 2. refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_prompt_whose_max_tokens_overflow_the_context_is_refused() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        refused = failure(await ingress.admit(CHAT, max_tokens=ROOM + 1))
    assert (refused.kind, refused.code, refused.param) == (
        FailureKind.INVALID_REQUEST,
        FailureCode.CONTEXT_LENGTH_EXCEEDED,
        "messages",
    )
    assert refused.message.startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + 1} tokens "
        f"({len(PROMPT)} in the messages, {ROOM + 1} for the completion)."
    )
    assert rig.journal == ["token_counter.TokenizeChat"]  # nothing queued


@pytest.mark.anyio
async def test_a_prompt_and_max_tokens_filling_the_context_exactly_are_admitted() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(CHAT, max_tokens=ROOM))
    assert reply.max_tokens == ROOM
    assert rig.submitted().sampling.max_tokens == ROOM


@pytest.mark.anyio
async def test_a_prompt_filling_the_context_leaves_no_room_even_for_a_default_max_tokens() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        refused = failure(await ingress.admit(TokenPrompt(tokens=(1,) * CONTEXT), max_tokens=0))
    assert (refused.code, refused.param) == (FailureCode.CONTEXT_LENGTH_EXCEEDED, "prompt")
    assert f"({CONTEXT} in the prompt, 0 for the completion)" in refused.message
    assert rig.journal == []


@pytest.mark.anyio
async def test_fit_to_context_caps_max_tokens_instead_of_refusing() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(CHAT, max_tokens=1000, fit_to_context=True))
    assert reply.max_tokens == ROOM
    assert rig.submitted().sampling.max_tokens == ROOM
    assert rig.submitted().events.statistics().max_buffer_size == ROOM + EVENT_SLACK


@pytest.mark.anyio
async def test_fit_to_context_keeps_a_max_tokens_that_fits() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        reply = admitted(await ingress.admit(CHAT, max_tokens=3, fit_to_context=True))
    assert reply.max_tokens == 3


@pytest.mark.anyio
async def test_an_empty_render_is_refused_before_the_scheduler() -> None:
    rig = Rig(tokenize=lambda message: TokenizeResult(tokens=()))
    async with serving(rig) as ingress:
        refused = failure(await ingress.admit(CHAT))
    assert refused == RequestFailed(kind=FailureKind.INVALID_REQUEST, message="the prompt is empty", param="messages")
    assert rig.journal == ["token_counter.TokenizeChat"]


@pytest.mark.anyio
async def test_a_scheduler_at_capacity_refuses_at_once_before_any_render() -> None:
    full = SchedulerStats(max_batch=2, max_queue=3, running=2, waiting=3)
    rig = Rig(scheduler_stats=full)
    async with serving(rig) as ingress:
        first = failure(await ingress.admit(CHAT))
        second = failure(await ingress.admit(TextPrompt(text="hello")))
    assert first == second
    assert (first.kind, first.code) == (FailureKind.OVERLOADED, FailureCode.QUEUE_FULL)
    assert "(2 running, 3 waiting)" in first.message
    assert rig.journal == []
    assert rig.admission_stats.rejected == 2
    assert full == SchedulerStats(max_batch=2, max_queue=3, running=2, waiting=3)  # the scheduler's: untouched


@pytest.mark.anyio
async def test_capacity_is_read_live_each_request() -> None:
    stats = SchedulerStats(max_batch=1, max_queue=1, running=1, waiting=1)
    rig = Rig(scheduler_stats=stats)
    async with serving(rig) as ingress:
        assert failure(await ingress.admit(CHAT)).code == FailureCode.QUEUE_FULL
        stats.waiting = 0  # the scheduler took one from its queue
        admitted(await ingress.admit(CHAT, request_id="req-2"))
    assert rig.journal == ["token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
    assert rig.admission_stats.rejected == 1


@pytest.mark.anyio
async def test_images_for_a_text_only_model_are_refused_naming_the_first_part() -> None:
    rig = Rig()
    async with serving(rig, vision=False) as ingress:
        refused = failure(await ingress.admit(IMAGE_CHAT))
    assert (refused.kind, refused.code, refused.param) == (
        FailureKind.INVALID_REQUEST,
        FailureCode.MODEL_NOT_MULTIMODAL,
        FIRST_IMAGE.param,
    )
    assert f"'{MODEL}' accepts text only, and {FIRST_IMAGE.param} is an image" in refused.message
    assert rig.journal == []
    assert rig.admission_stats.rejected == 0


@pytest.mark.parametrize("vision", [True, False], ids=["vision-model", "text-model"])
@pytest.mark.anyio
async def test_too_many_images_are_refused_naming_the_first_over_the_cap(vision: bool) -> None:
    third = ImageRef(url="https://images.example/c.png", param="messages[2].content[0]")
    prompt = ChatPrompt(messages=IMAGE_MESSAGES, tools=None, images=(FIRST_IMAGE, SECOND_IMAGE, third))
    rig = Rig()
    async with serving(rig, vision=vision, max_images=2) as ingress:
        refused = failure(await ingress.admit(prompt))
    assert (refused.kind, refused.code, refused.param) == (FailureKind.INVALID_REQUEST, None, third.param)
    assert refused.message == "3 images in one request; at most 2 are accepted (--max-images)"
    assert rig.journal == []  # nothing fetched, nothing rendered


@pytest.mark.anyio
async def test_a_scheduler_refusal_is_the_reply_and_closes_the_event_stream() -> None:
    full = RequestFailed(kind=FailureKind.OVERLOADED, message="batch and queue full", code=FailureCode.QUEUE_FULL)
    rig = Rig(submit=lambda message: full)
    async with serving(rig) as ingress:
        refused = failure(await ingress.admit(CHAT))
    assert refused == full
    assert rig.journal == ["token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
    with pytest.raises(anyio.ClosedResourceError):
        rig.submitted().events.send_nowait(TokensGenerated(text="x", token_ids=(1,)))


@pytest.mark.anyio
async def test_a_token_counter_failure_is_the_reply() -> None:
    broken = RequestFailed(kind=FailureKind.INVALID_REQUEST, message="template error", param="messages")
    rig = Rig(tokenize=lambda message: broken)
    async with serving(rig) as ingress:
        assert await ingress.admit(CHAT) == broken
    assert rig.journal == ["token_counter.TokenizeChat"]


# -- 3. a busy or stopped neighbour ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_busy_token_counter_is_refused_as_overloaded_and_the_ingress_serves_on() -> None:
    rig = Rig()
    with busy_inbox() as busy:
        async with serving(rig, token_counter=busy) as ingress:
            refused = failure(await ingress.admit(CHAT))
            after = admitted(await ingress.admit(TokenPrompt(tokens=(1, 2)), request_id="req-2"))
    assert refused == BUSY
    assert (refused.kind, refused.code) == (FailureKind.UNAVAILABLE, FailureCode.OVERLOADED)
    assert after.request_id == "req-2"
    assert rig.journal == ["scheduler.SubmitGeneration"]


@pytest.mark.anyio
async def test_a_stopped_token_counter_is_refused_as_shutting_down_and_the_ingress_serves_on() -> None:
    rig = Rig()
    with stopped_inbox() as stopped:
        async with serving(rig, token_counter=stopped) as ingress:
            refused = failure(await ingress.admit(TextPrompt(text="hello")))
            after = admitted(await ingress.admit(TokenPrompt(tokens=(1, 2)), request_id="req-2"))
    assert refused == STOPPED
    assert (refused.kind, refused.code) == (FailureKind.UNAVAILABLE, FailureCode.SHUTTING_DOWN)
    assert after.request_id == "req-2"
    assert rig.journal == ["scheduler.SubmitGeneration"]


@pytest.mark.anyio
async def test_a_token_counter_free_again_renders_the_next_request() -> None:
    """Busy (its one inbox slot taken by someone else's message), then free: the next chat is admitted in full."""
    rig = Rig(token_counter_capacity=1)
    other_send, other_receive = anyio.create_memory_object_stream[Any](1)
    with other_receive:
        rig.token_counter.send.send_nowait(TokenizeText(text="someone else", add_special_tokens=True, reply=other_send))
        async with run_actor(rig.actor()) as inbox:
            ingress = Ingress(inbox)
            assert await ingress.admit(CHAT) == BUSY
            async with neighbours(rig):  # the token counter reads its inbox again
                admitted(await ingress.admit(CHAT, request_id="req-2"))
                ingress.close()
    assert rig.journal == ["token_counter.TokenizeText", "token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
    assert rig.submitted().request_id == "req-2"


# -- 4. images with a vision model -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_images_are_fetched_then_rendered_then_queued() -> None:
    rig = Rig()
    memo = FetchMemo()
    async with serving(rig, vision=True) as ingress:
        reply = admitted(await ingress.admit(IMAGE_CHAT, memo=memo, max_tokens=4))
    assert rig.journal == ["media.FetchImages", "token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
    fetch = rig.fetched()
    assert list(fetch.images) == [FIRST_IMAGE, SECOND_IMAGE]
    assert fetch.memo is memo  # the caller's: each URL read once across its work
    chat = rig.rendered()
    assert (chat.messages, chat.images, chat.add_generation_prompt) == (IMAGE_MESSAGES, FETCHED, True)
    submit = rig.submitted()
    assert submit.vision is VISION
    assert (submit.prompt_tokens, submit.sampling.max_tokens) == (PROMPT, 4)
    assert (reply.prompt_tokens, reply.max_tokens) == (len(PROMPT), 4)


@pytest.mark.anyio
async def test_without_a_memo_each_request_fetches_with_a_fresh_one() -> None:
    rig = Rig()
    async with serving(rig, vision=True) as ingress:
        admitted(await ingress.admit(IMAGE_CHAT))
        admitted(await ingress.admit(IMAGE_CHAT, request_id="req-2"))
    first, second = rig.fetched(0).memo, rig.fetched(1).memo
    assert first == second == FetchMemo()
    assert first is not second


@pytest.mark.anyio
async def test_a_failed_fetch_is_the_reply_and_nothing_is_rendered() -> None:
    unreadable = RequestFailed(kind=FailureKind.INVALID_REQUEST, message="HTTP 404", param=SECOND_IMAGE.param)
    rig = Rig(fetch=lambda message: unreadable)
    async with serving(rig, vision=True) as ingress:
        assert await ingress.admit(IMAGE_CHAT) == unreadable
    assert rig.journal == ["media.FetchImages"]


@pytest.mark.anyio
async def test_image_admissions_beyond_the_limit_are_refused_while_text_goes_through() -> None:
    gate = anyio.Event()
    rig = Rig(fetch=held(gate, fetched))
    replies: list[AdmitReply] = []
    async with serving(rig, vision=True) as ingress:

        async def admit_images(number: int) -> None:
            replies.append(await ingress.admit(IMAGE_CHAT, request_id=f"img-{number}"))

        async with anyio.create_task_group() as tasks:
            for number in range(IMAGE_ADMISSIONS):
                tasks.start_soon(admit_images, number)
            await rig.media.wait_for(1)
            await anyio.wait_all_tasks_blocked()  # every admission waits on the held fetch

            extra = failure(await ingress.admit(IMAGE_CHAT, request_id="img-extra"))
            assert extra == RequestFailed(
                kind=FailureKind.OVERLOADED,
                message=f"{IMAGE_ADMISSIONS} requests with images are being fetched; retry shortly",
                code=FailureCode.OVERLOADED,
            )
            # With every slot taken, an image request is still refused for what it is, at once.
            over = failure(await ingress.admit(OVER_THE_CAP, request_id="img-over-cap"))
            assert (over.kind, over.code) == (FailureKind.INVALID_REQUEST, None)
            assert "are accepted (--max-images)" in over.message
            text = admitted(await ingress.admit(CHAT, request_id="text"))
            assert text.request_id == "text"
            assert replies == []  # the image admissions still wait on their fetches
            assert rig.journal == ["media.FetchImages", "token_counter.TokenizeChat", "scheduler.SubmitGeneration"]
            gate.set()

        assert sorted(admitted(reply).request_id for reply in replies) == [f"img-{n}" for n in range(IMAGE_ADMISSIONS)]
        # Their slots are free again.
        admitted(await ingress.admit(IMAGE_CHAT, request_id="img-later"))
    assert len(rig.media.received) == IMAGE_ADMISSIONS + 1
    assert len(rig.scheduler.received) == IMAGE_ADMISSIONS + 2


# -- 5. warm-ups -------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_warm_up_renders_the_history_and_tells_the_scheduler() -> None:
    rig = Rig()
    async with serving(rig) as ingress:
        await ingress.inbox.send(WarmUpConversation(session="alice", messages=MESSAGES, tools=TOOLS))
        await rig.scheduler.wait_for(1)
    assert rig.journal == ["token_counter.TokenizeChat", "scheduler.QueueWarmUp"]
    chat = rig.rendered()
    assert (chat.messages, chat.tools, chat.images) == (MESSAGES, TOOLS, ())
    assert (chat.add_generation_prompt, chat.with_history_boundary) == (False, False)
    warm_up = rig.scheduler.received[0]
    assert isinstance(warm_up, QueueWarmUp)
    assert (warm_up.session, warm_up.tokens) == ("alice", PROMPT)
    assert (chat.options, chat.thinking) == (NO_OPTIONS, True)


@pytest.mark.anyio
async def test_a_warm_up_renders_with_the_requests_template_options() -> None:
    """The history renders as the next turn's prompt will: an effort a template writes into its system message
    (gpt-oss's), or thinking switched off, rendered otherwise, and every warm-up would miss from the first lines."""
    rig = Rig()
    effort = TemplateOptions(reasoning_effort="high", effort_param="output_config.effort", effort_advisory=True)
    async with serving(rig) as ingress:
        await ingress.inbox.send(
            WarmUpConversation(session="alice", messages=MESSAGES, tools=None, options=effort, thinking=False)
        )
        await rig.scheduler.wait_for(1)
    assert (rig.rendered().options, rig.rendered().thinking) == (effort, False)


async def warm_up_then_admit(ingress: Ingress, messages: list[dict[str, Any]]) -> None:
    """Send a warm-up, then admit a token prompt: once admitted, the warm-up (handled first) is done."""
    await ingress.inbox.send(WarmUpConversation(session="alice", messages=messages, tools=None))
    admitted(await ingress.admit(TokenPrompt(tokens=(1, 2, 3))))


@pytest.mark.anyio
async def test_a_warm_up_of_a_history_with_images_sends_nothing() -> None:
    rig = Rig()
    async with serving(rig, vision=True) as ingress:
        await warm_up_then_admit(ingress, IMAGE_MESSAGES)
    assert rig.journal == ["scheduler.SubmitGeneration"]


@pytest.mark.anyio
async def test_a_warm_up_with_a_busy_token_counter_is_dropped_quietly() -> None:
    rig = Rig()
    with busy_inbox() as busy:
        async with serving(rig, token_counter=busy) as ingress:
            await warm_up_then_admit(ingress, MESSAGES)
    assert rig.journal == ["scheduler.SubmitGeneration"]


@pytest.mark.anyio
async def test_a_warm_up_rendering_nothing_tells_the_scheduler_nothing() -> None:
    rig = Rig(tokenize=lambda message: TokenizeResult(tokens=()))
    async with serving(rig) as ingress:
        await warm_up_then_admit(ingress, MESSAGES)
    assert rig.journal == ["token_counter.TokenizeChat", "scheduler.SubmitGeneration"]


# -- 6. shutdown -------------------------------------------------------------------------------------------------------


async def admit_expecting_stop(inbox: IngressInbox, prompt: Prompt, outcomes: list[AdmitReply | str]) -> None:
    """Admit `prompt`; record the reply, or "stopped" when the ingress stopped before answering."""
    try:
        outcomes.append(await Ingress(inbox).admit(prompt))
    except ActorStopped:
        outcomes.append("stopped")


@pytest.mark.anyio
async def test_an_image_admission_pending_at_shutdown_ends_in_actor_stopped() -> None:
    rig = Rig(fetch=held(anyio.Event(), fetched))  # never answers
    outcomes: list[AdmitReply | str] = []
    async with neighbours(rig), anyio.create_task_group() as tasks:
        async with run_actor(rig.actor(vision=True)) as inbox:
            tasks.start_soon(admit_expecting_stop, inbox, IMAGE_CHAT, outcomes)
            await rig.media.wait_for(1)
        # Left run_actor: the inbox is closed and the actor has stopped, its side task cancelled.
        assert outcomes == ["stopped"]
        with pytest.raises(ActorStopped):
            await Ingress(inbox).admit(CHAT)
    assert rig.journal == ["media.FetchImages"]


@pytest.mark.anyio
async def test_an_admission_pending_when_the_inbox_closes_fails_when_its_neighbour_stops() -> None:
    rig = Rig(tokenize=held(anyio.Event(), tokenized))  # never answers
    outcomes: list[AdmitReply | str] = []
    async with neighbours(rig), anyio.create_task_group() as tasks:
        async with run_actor(rig.actor()) as inbox:
            tasks.start_soon(admit_expecting_stop, inbox, CHAT, outcomes)
            await rig.token_counter.wait_for(1)
            inbox.close()  # the server stops the ingress
            with pytest.raises(ActorStopped):
                await Ingress(inbox).admit(CHAT, request_id="too-late")
            await anyio.wait_all_tasks_blocked()
            assert outcomes == []  # still waiting on the token counter
            # The token counter stops without answering: a real actor closes the reply of a message it never handled.
            rig.token_counter.received[0].reply.close()
        assert outcomes == [STOPPED]
    assert rig.journal == ["token_counter.TokenizeChat"]


@pytest.mark.anyio
async def test_a_generation_whose_asker_left_during_its_render_is_discarded_before_it_runs() -> None:
    """A client that disconnects while its prompt renders: the admitted generation's events are closed at once,
    which takes it out of the scheduler's queue before it generates a token."""
    gate = anyio.Event()
    rig = Rig(tokenize=held(gate, tokenized))
    async with serving(rig) as ingress:
        async with anyio.create_task_group() as asker:
            asker.start_soon(ingress.admit, TextPrompt(text="Hello"))
            await rig.token_counter.wait_for(1)
            asker.cancel_scope.cancel()  # the asker gives up while its prompt renders
        gate.set()
        await rig.scheduler.wait_for(1)
        events = rig.submitted().events
        while events.statistics().open_receive_streams:
            await anyio.wait_all_tasks_blocked()
    assert rig.journal == ["token_counter.TokenizeText", "scheduler.SubmitGeneration"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("default", "requested", "expected"),
    [(0, 0, ROOM), (20, 0, 20), (ROOM + 100, 0, ROOM), (20, 8, 8), (20, ROOM, ROOM)],
)
async def test_a_request_without_a_limit_gets_the_default_cap_or_the_room_left(
    default: int, requested: int, expected: int
) -> None:
    """`--default-max-tokens` bounds a reply whose request sets no limit, never beyond what the context leaves; a
    request's own limit is its own."""
    rig = Rig(default_max_tokens=default)
    async with serving(rig) as ingress:
        reply = await ingress.admit(TextPrompt(text="Hello"), max_tokens=requested)
    assert isinstance(reply, Admitted) and reply.max_tokens == expected
    assert rig.submitted().sampling.max_tokens == expected
