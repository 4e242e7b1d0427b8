"""One Responses turn over real streams to fake actors: its history is loaded, replayed and rendered once.

The capsule in a stored conversation is decoded once per turn (a counting codec
proves it), and that one render is what the threshold count, the admission and the
next turn's warm-up all carry. After an automatic compaction the turn is admitted
from the context the compactor replayed, so its fresh capsule is never decoded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import pytest

from courier.conversation.capsule import Capsule, CapsuleCodec, item_digest
from courier.conversation.chat_render import chat_messages
from courier.conversation.ids import replica_of
from courier.conversation.images import ImageAdmission
from courier.conversation.record import record
from courier.conversation.replay import SUMMARY_HEADER, expand
from courier.conversation.response_object import finished_outcome
from courier.conversation.turn import TurnServices, admit_turn, compact, plan_turn
from courier.engine.generation import FinishReason, GenerationEvent, GenerationFinished, RequestId
from courier.http.responses.request import parse_responses_request
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage
from courier.messages.ingress import AdmitGeneration, Admitted, ChatPrompt, IngressMessage, WarmUpConversation
from courier.messages.storage import LoadConversationItems, SaveResponse, StorageMessage
from courier.messages.token_counter import TokenCounterMessage, TokenizeChat, TokenizeResult
from tests.support.actors import FakeNeighbour, Reply, start_neighbours

CONTEXT = 4096


class CountingCodec(CapsuleCodec):
    def __init__(self) -> None:
        super().__init__(None, 1 << 20)
        self.decoded = 0

    def decode(self, text: Any) -> Capsule:
        self.decoded += 1
        return super().decode(text)


def message(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": f"msg_{role}_{text}", "type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def admitted(request_id: RequestId) -> Admitted:
    send, receive = anyio.create_memory_object_stream[GenerationEvent](4)
    with send:
        send.send_nowait(GenerationFinished(reason=FinishReason.STOP, prompt_tokens=9, completion_tokens=1))
    return Admitted(request_id=request_id, prompt_tokens=9, max_tokens=1, events=receive)


@dataclass
class Fakes:
    stored: list[dict[str, Any]]
    storage: FakeNeighbour[StorageMessage]
    token_counter: FakeNeighbour[TokenCounterMessage]
    compactor: FakeNeighbour[CompactorMessage]
    ingress: FakeNeighbour[IngressMessage]
    codec: CountingCodec
    services: TurnServices
    compaction: CompactionResult | None = None  # what the compactor fake answers


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    codec = CountingCodec()
    kept = message("user", "kept")
    capsule = codec.encode(Capsule(summary="They met.", retained=(item_digest(kept),)))
    stored = [
        message("user", "old question"),
        message("assistant", "old answer"),
        kept,
        {"id": "cmp_1", "type": "compaction", "encrypted_content": capsule},
        message("assistant", "after the capsule"),
    ]

    def store(request: StorageMessage) -> Any:
        return tuple(stored) if isinstance(request, LoadConversationItems) else Reply(None)

    def ingress(request: IngressMessage) -> Any:
        return admitted(request.request_id) if isinstance(request, AdmitGeneration) else None

    def compactor(request: CompactorMessage) -> CompactionResult | None:
        return harness.compaction

    storage: FakeNeighbour[StorageMessage] = FakeNeighbour(store)
    token_counter: FakeNeighbour[TokenCounterMessage] = FakeNeighbour(lambda _: TokenizeResult(tokens=(1,) * 100))
    compactor_fake: FakeNeighbour[CompactorMessage] = FakeNeighbour(compactor)
    ingress_fake: FakeNeighbour[IngressMessage] = FakeNeighbour(ingress)
    services = TurnServices(
        storage=storage.send,
        token_counter=token_counter.send,
        compactor=compactor_fake.send,
        ingress=ingress_fake.send,
        images=ImageAdmission(max_images=4, model_id="tiny", fetcher=None),
        capsules=codec,
        model_id="tiny",
        context_length=CONTEXT,
        warm_up=True,
    )
    harness = Fakes(
        stored=stored,
        storage=storage,
        token_counter=token_counter,
        compactor=compactor_fake,
        ingress=ingress_fake,
        codec=codec,
        services=services,
    )
    async with anyio.create_task_group() as tasks:
        await start_neighbours(tasks, storage, token_counter, compactor_fake, ingress_fake)
        yield harness
        tasks.cancel_scope.cancel()


def request(threshold: int) -> Any:
    return parse_responses_request(
        {
            "model": "tiny",
            "conversation": "conv_1",
            "input": "And now?",
            "instructions": "Be brief.",
            "context_management": [{"type": "compaction", "compact_threshold": threshold}],
        }
    )


@pytest.mark.anyio
async def test_a_turn_decodes_its_capsule_once_and_reuses_the_render(fakes: Fakes) -> None:
    parsed = request(threshold=1000)  # the fake counts 100 tokens: no compaction due
    plan = await plan_turn(fakes.services, parsed)
    turn = await admit_turn(fakes.services, plan)
    turn.admitted.events.close()  # the generation is not read here
    outcome = finished_outcome(_finished(), [message("assistant", "Done.")])
    recorded = await record(fakes.services, turn.draft, outcome, turn.rendered)

    await fakes.ingress.wait_for(2)  # the warm-up is a tell
    assert fakes.codec.decoded == 1
    assert fakes.storage.kinds == ["LoadConversationItems", "SaveResponse"]
    assert fakes.token_counter.kinds == ["TokenizeChat"]  # the threshold count
    assert fakes.ingress.kinds == ["AdmitGeneration", "WarmUpConversation"]
    count = fakes.token_counter.received[0]
    admission, warm_up = fakes.ingress.received
    assert isinstance(count, TokenizeChat) and isinstance(admission, AdmitGeneration)
    assert isinstance(warm_up, WarmUpConversation)
    history = [*fakes.stored, *parsed.input_items]
    expected = chat_messages("Be brief.", expand(history, CapsuleCodec(None, 1 << 20), "Be brief."))
    assert count.messages == expected
    assert count.with_history_boundary  # tokenized as admission would: admission takes these tokens as they are
    prompt = admission.prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.messages is count.messages  # one render, carried twice
    assert prompt.rendered == TokenizeResult(tokens=(1,) * 100)
    assert list(warm_up.messages) == [*expected, {"role": "assistant", "content": "Done."}]
    assert [m["content"] for m in expected[:3]] == ["Be brief.", SUMMARY_HEADER + "They met.", "kept"]
    assert recorded.failure is None
    assert recorded.response["status"] == "completed"
    saved = fakes.storage.received[1]
    assert isinstance(saved, SaveResponse) and saved.response.id == turn.draft.id


@pytest.mark.anyio
async def test_a_compacted_turn_is_admitted_from_the_context_the_compactor_replayed(fakes: Fakes) -> None:
    parsed = request(threshold=10)  # 100 counted tokens: compaction due
    plan = await plan_turn(fakes.services, parsed)
    assert plan.compaction_due
    replayed_context = (message("assistant", SUMMARY_HEADER + "All of it."), message("user", "And now?"))
    item = {"id": "cmp_2", "type": "compaction", "encrypted_content": "opaque: never decoded"}
    fakes.compaction = CompactionResult(
        output=(message("user", "And now?"), item), usage={}, compaction_item=item, context=replayed_context
    )
    compaction = await compact(fakes.services, plan)
    turn = await admit_turn(fakes.services, plan, compaction, compaction_id="cmp_stream")
    turn.admitted.events.close()

    assert fakes.codec.decoded == 1  # the stored capsule, once; the compactor's own never
    sent = fakes.compactor.received[0]
    assert isinstance(sent, CompactHistory)
    assert list(sent.context) == list(plan.rendered.shown)  # replayed already: the compactor decodes nothing
    assert list(sent.request_items) == list(parsed.input_items)
    admission = fakes.ingress.received[0]
    assert isinstance(admission, AdmitGeneration) and admission.fit_to_context
    prompt = admission.prompt
    assert isinstance(prompt, ChatPrompt) and prompt.rendered is None  # the compacted context is rendered anew
    assert prompt.messages == chat_messages("Be brief.", replayed_context)
    assert turn.compaction_item is not None and turn.compaction_item["id"] == "cmp_stream"


def _finished() -> GenerationFinished:
    return GenerationFinished(reason=FinishReason.STOP, prompt_tokens=9, completion_tokens=1)


@pytest.mark.anyio
async def test_a_replica_s_turn_mints_a_response_id_carrying_its_token(fakes: Fakes) -> None:
    plain = await plan_turn(fakes.services, request(threshold=1000))
    routed = await plan_turn(replace(fakes.services, replica_id="r2"), request(threshold=1000))
    assert replica_of(plain.draft.id) is None and plain.draft.id.startswith("resp_")
    assert replica_of(routed.draft.id) == "r2" and routed.draft.id.startswith("resp_r2.")
