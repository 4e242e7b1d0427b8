"""StorageActor over a real inbox on a real SQLite database in a temporary directory."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from courier.actors.storage import StorageActor
from courier.core.failure_codes import FailureCode
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.storage import (
    AppendConversationItems,
    CreateConversation,
    DeleteConversation,
    DeleteConversationItem,
    DeleteResponse,
    ListConversationItems,
    LoadChain,
    LoadConversation,
    LoadConversationItem,
    LoadConversationItems,
    LoadResponse,
    SaveResponse,
    StorageMessage,
    UpdateConversation,
)
from courier.runtime.actor import ActorStopped, ask
from courier.runtime.message import ReplyStream
from courier.storage.records import (
    ItemPage,
    JsonObject,
    Order,
    PageQuery,
    StorageLimits,
    StoredConversation,
    StoredResponse,
    UnstorableRecord,
)
from courier.storage.sqlite import DATABASE_NAME, SqliteStorage
from tests.support.actors import run_actor
from tests.support.records import item, response

Outbox = MemoryObjectSendStream[StorageMessage]

LIMITS = StorageLimits(max_bytes=10**9, max_entries=10_000, ttl_s=3600.0)


class Clock:
    """The backend's clock: it stamps `updated_at`, which the TTL sweep compares with the actor's real time."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def backend(tmp_path: Path, limits: StorageLimits = LIMITS, clock: Callable[[], float] = time.time) -> SqliteStorage:
    return SqliteStorage(tmp_path, limits, clock=clock)


def conversation(conversation_id: str, **metadata: str) -> StoredConversation:
    return StoredConversation(id=conversation_id, created_at=1, metadata=metadata)


def ids(items: tuple[JsonObject, ...] | None) -> list[str]:
    assert items is not None
    return [str(entry["id"]) for entry in items]


async def save(outbox: Outbox, stored: StoredResponse, items: tuple[JsonObject, ...] = ()) -> None:
    await call(outbox, lambda reply: SaveResponse(response=stored, conversation_items=items, reply=reply))


async def load(outbox: Outbox, response_id: str) -> StoredResponse | None:
    return await call(outbox, lambda reply: LoadResponse(response_id=response_id, reply=reply))


async def ask_load(outbox: Outbox, response_id: str) -> StoredResponse | RequestFailed | None:
    """The plain ask (no translation of a full or stopped inbox)."""
    reply: StoredResponse | RequestFailed | None = await ask(
        outbox, lambda r: LoadResponse(response_id=response_id, reply=r)
    )
    return reply


async def create(outbox: Outbox, created: StoredConversation, items: tuple[JsonObject, ...] = ()) -> None:
    await call(outbox, lambda reply: CreateConversation(conversation=created, items=items, reply=reply))


async def load_items(outbox: Outbox, conversation_id: str) -> tuple[JsonObject, ...] | None:
    return await call(outbox, lambda reply: LoadConversationItems(conversation_id=conversation_id, reply=reply))


def post(outbox: Outbox, build: Callable[[ReplyStream[Any]], StorageMessage]) -> MemoryObjectReceiveStream[object]:
    """Send a request without waiting for anything (no room, no answer); the answer comes on the returned stream."""
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
    try:
        outbox.send_nowait(build(reply_send))
    except BaseException:
        reply_send.close()
        reply_receive.close()
        raise
    return reply_receive


async def answer(posted: MemoryObjectReceiveStream[object]) -> object:
    with posted:
        return await posted.receive()


def chained(index: int) -> StoredResponse:
    """The `index`th turn of conversation conv_1, each continuing the one before."""
    return response(f"resp_{index}", previous=f"resp_{index - 1}" if index else None, conversation="conv_1")


def save_turn(index: int) -> Callable[[ReplyStream[Any]], SaveResponse]:
    return lambda reply: SaveResponse(response=chained(index), conversation_items=(item(f"msg_{index}"),), reply=reply)


@pytest.mark.anyio
async def test_a_saved_response_loads_back(tmp_path: Path) -> None:
    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await save(outbox, response("resp_1"))
        assert await load(outbox, "resp_1") == response("resp_1")
        assert await load(outbox, "resp_unknown") is None


@pytest.mark.anyio
async def test_a_chain_loads_oldest_first_and_names_a_deleted_ancestor(tmp_path: Path) -> None:
    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await save(outbox, response("resp_1"))
        await save(outbox, response("resp_2", previous="resp_1"))
        chain = await call(outbox, lambda reply: LoadChain(response_id="resp_2", reply=reply))
        assert chain is not None
        assert ([hop.id for hop in chain.responses], chain.missing) == (["resp_1", "resp_2"], None)
        assert await call(outbox, lambda reply: DeleteResponse(response_id="resp_1", reply=reply)) is True
        assert await call(outbox, lambda reply: DeleteResponse(response_id="resp_1", reply=reply)) is False
        broken = await call(outbox, lambda reply: LoadChain(response_id="resp_2", reply=reply))
        assert broken is not None
        assert ([hop.id for hop in broken.responses], broken.missing) == (["resp_2"], "resp_1")
        assert await call(outbox, lambda reply: LoadChain(response_id="resp_unknown", reply=reply)) is None


@pytest.mark.anyio
async def test_a_conversation_is_created_updated_and_deleted(tmp_path: Path) -> None:
    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await create(outbox, conversation("conv_1", topic="maps"))
        loaded = await call(outbox, lambda reply: LoadConversation(conversation_id="conv_1", reply=reply))
        assert loaded == conversation("conv_1", topic="maps")
        updated = await call(
            outbox, lambda reply: UpdateConversation(conversation_id="conv_1", metadata={"topic": "seas"}, reply=reply)
        )
        assert updated == conversation("conv_1", topic="seas")
        assert await call(outbox, lambda reply: DeleteConversation(conversation_id="conv_1", reply=reply)) is True
        assert await call(outbox, lambda reply: LoadConversation(conversation_id="conv_1", reply=reply)) is None
        assert await call(outbox, lambda reply: DeleteConversation(conversation_id="conv_1", reply=reply)) is False


@pytest.mark.anyio
async def test_conversation_items_are_appended_listed_and_loaded(tmp_path: Path) -> None:
    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await create(outbox, conversation("conv_1"), (item("msg_0"),))
        await save(outbox, response("resp_1", conversation="conv_1"), (item("msg_1"),))
        appended = await call(
            outbox, lambda reply: AppendConversationItems(conversation_id="conv_1", items=[item("msg_2")], reply=reply)
        )
        assert appended is True
        assert ids(await load_items(outbox, "conv_1")) == ["msg_0", "msg_1", "msg_2"]
        query = PageQuery(after="msg_0", limit=1, order=Order.ASC)
        page = await call(
            outbox, lambda reply: ListConversationItems(conversation_id="conv_1", page=query, reply=reply)
        )
        assert page is not None
        assert (ids(page.items), page.has_more) == (["msg_1"], True)
        one = await call(
            outbox, lambda reply: LoadConversationItem(conversation_id="conv_1", item_id="msg_2", reply=reply)
        )
        assert one == item("msg_2")
        deleted = await call(
            outbox, lambda reply: DeleteConversationItem(conversation_id="conv_1", item_id="msg_1", reply=reply)
        )
        assert deleted is True
        assert ids(await load_items(outbox, "conv_1")) == ["msg_0", "msg_2"]
        assert await load_items(outbox, "conv_unknown") is None


@pytest.mark.anyio
async def test_writes_sent_together_are_applied_in_arrival_order(tmp_path: Path) -> None:
    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await create(outbox, conversation("conv_1"))
        posted = [post(outbox, save_turn(index)) for index in range(8)]  # nothing awaited in between
        assert [await answer(reply) for reply in posted] == [None] * 8
        assert ids(await load_items(outbox, "conv_1")) == [f"msg_{index}" for index in range(8)]
        chain = await call(outbox, lambda reply: LoadChain(response_id="resp_7", reply=reply))
        assert chain is not None
        assert list(chain.responses) == [chained(index) for index in range(8)]


@pytest.mark.anyio
async def test_a_record_over_the_whole_budget_is_refused_and_the_actor_keeps_serving(tmp_path: Path) -> None:
    limits = StorageLimits(max_bytes=2000, max_entries=100, ttl_s=3600.0)
    huge = StoredResponse(
        id="resp_huge",
        created_at=1.0,
        previous_response_id=None,
        conversation_id=None,
        input_items=(item("msg_1", "x" * 5000),),
        response={"id": "resp_huge", "output": []},
    )
    async with run_actor(StorageActor(backend(tmp_path, limits))) as outbox:
        await save(outbox, response("resp_small"))
        with pytest.raises(Refused) as refused:
            await save(outbox, huge)
        failure = refused.value.failure
        assert (failure.kind, failure.code) == (FailureKind.INVALID_REQUEST, FailureCode.STORAGE_BUDGET_EXCEEDED)
        assert "2000" in failure.message
        assert await load(outbox, "resp_huge") is None
        assert await load(outbox, "resp_small") == response("resp_small")  # nothing was evicted for it
        await save(outbox, response("resp_after"))
        assert await load(outbox, "resp_after") == response("resp_after")


class HoldsNoNul(SqliteStorage):
    """A backend that cannot hold a NUL character in an id, as PostgreSQL cannot."""

    def save_response(self, response: StoredResponse, conversation_items: Sequence[JsonObject]) -> None:
        if "\x00" in response.id:
            raise UnstorableRecord("the record cannot be stored: an id in it holds a NUL character")
        super().save_response(response, conversation_items)


@pytest.mark.anyio
async def test_a_record_the_backend_cannot_hold_is_refused_as_unstorable_and_the_actor_keeps_serving(
    tmp_path: Path,
) -> None:
    async with run_actor(StorageActor(HoldsNoNul(tmp_path, LIMITS))) as outbox:
        with pytest.raises(Refused) as refused:
            await save(outbox, response("resp_\x00"))
        failure = refused.value.failure
        assert (failure.kind, failure.code) == (FailureKind.INVALID_REQUEST, FailureCode.UNSTORABLE_CONTENT)
        assert "NUL character" in failure.message
        await save(outbox, response("resp_after"))
        assert await load(outbox, "resp_after") == response("resp_after")


@pytest.mark.anyio
async def test_an_unknown_cursor_is_refused_on_after_and_the_actor_keeps_serving(tmp_path: Path) -> None:
    def listing(after: str) -> Callable[[ReplyStream[ItemPage | RequestFailed | None]], ListConversationItems]:
        query = PageQuery(after=after, limit=10, order=Order.ASC)
        return lambda reply: ListConversationItems(conversation_id="conv_1", page=query, reply=reply)

    async with run_actor(StorageActor(backend(tmp_path))) as outbox:
        await create(outbox, conversation("conv_1"), (item("msg_0"), item("msg_1"), item("msg_2")))
        with pytest.raises(Refused) as refused:
            await call(outbox, listing("msg_unknown"))
        failure = refused.value.failure
        assert (failure.kind, failure.param, failure.code) == (FailureKind.INVALID_REQUEST, "after", None)
        assert failure.message == "no item with id 'msg_unknown' in this list"
        page = await call(outbox, listing("msg_0"))
        assert page is not None
        assert (ids(page.items), page.has_more) == (["msg_1", "msg_2"], False)


@pytest.mark.anyio
async def test_starting_sweeps_records_past_their_ttl(tmp_path: Path) -> None:
    clock = Clock()
    storage = backend(tmp_path, clock=clock)
    clock.now = time.time() - LIMITS.ttl_s - 600  # last written well over a TTL ago
    storage.save_response(response("resp_old"), ())
    storage.create_conversation(conversation("conv_old"), ())
    clock.now = time.time()
    storage.save_response(response("resp_fresh"), ())
    assert storage.stored_entries == 3  # nothing is swept until the actor starts
    async with run_actor(StorageActor(storage)) as outbox:
        assert await load(outbox, "resp_old") is None
        assert await call(outbox, lambda reply: LoadConversation(conversation_id="conv_old", reply=reply)) is None
        assert await load(outbox, "resp_fresh") == response("resp_fresh")


@pytest.mark.anyio
async def test_a_full_inbox_is_refused_as_overloaded_and_keeps_what_it_queued(tmp_path: Path) -> None:
    storage = backend(tmp_path)
    storage.save_response(response("resp_1"), ())
    async with run_actor(StorageActor(storage), capacity=1) as outbox:
        queued: list[MemoryObjectReceiveStream[object]] = []
        with pytest.raises(anyio.WouldBlock):  # fill it: nothing below yields, so the actor reads nothing
            while True:
                queued.append(post(outbox, lambda reply: LoadResponse(response_id="resp_1", reply=reply)))
        assert outbox.statistics().current_buffer_used == 1
        with pytest.raises(Refused) as refused:
            await load(outbox, "resp_1")
        assert (refused.value.failure.kind, refused.value.failure.code) == (
            FailureKind.UNAVAILABLE,
            FailureCode.OVERLOADED,
        )
        assert [await answer(reply) for reply in queued] == [response("resp_1")] * len(queued)


@pytest.mark.anyio
async def test_stopping_closes_the_backend_and_later_asks_raise_actor_stopped(tmp_path: Path) -> None:
    storage = backend(tmp_path)
    async with run_actor(StorageActor(storage)) as outbox:
        await save(outbox, response("resp_1"))
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        storage.load_response("resp_1")
    with pytest.raises(ActorStopped):
        await ask_load(outbox, "resp_1")
    reopened = backend(tmp_path)  # what was acknowledged before the stop was committed
    assert reopened.load_response("resp_1") == response("resp_1")
    reopened.close()


@pytest.mark.anyio
async def test_an_ask_queued_when_the_actor_stops_raises_actor_stopped(tmp_path: Path) -> None:
    storage = backend(tmp_path)
    send, receive = anyio.create_memory_object_stream[StorageMessage](4)
    with send:
        async with anyio.create_task_group() as actors:
            await actors.start(StorageActor(storage).run, receive)
            actors.cancel_scope.cancel()  # the actor stops (as on a server fault) before reading its inbox again
            with anyio.CancelScope(shield=True), anyio.fail_after(5), pytest.raises(ActorStopped) as stopped:
                await ask_load(send, "resp_1")
    assert str(stopped.value) == "the actor stopped before answering"
    with pytest.raises(sqlite3.ProgrammingError):
        storage.load_response("resp_1")  # closed on this way out too


def damage(tmp_path: Path, sql: str, record_id: str) -> None:
    """Overwrite one row's JSON with bytes that do not parse, behind the backend's back (bit rot, a bad restore)."""
    with closing(sqlite3.connect(tmp_path / DATABASE_NAME)) as db, db:
        assert db.execute(sql, (b"{\x00rot", record_id)).rowcount == 1


@pytest.mark.anyio
async def test_a_damaged_record_fails_only_its_own_reads_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = backend(tmp_path)
    storage.save_response(response("resp_bad"), ())
    storage.save_response(response("resp_ok"), ())
    storage.save_response(response("resp_child", previous="resp_bad"), ())
    storage.create_conversation(conversation("conv_1"), (item("msg_0"), item("msg_bad")))
    damage(tmp_path, "UPDATE responses SET response = ? WHERE id = ?", "resp_bad")
    damage(tmp_path, "UPDATE conversation_items SET item = ? WHERE id = ?", "msg_bad")
    actor = StorageActor(storage)
    async with run_actor(actor) as outbox:
        for _ in range(2):
            with pytest.raises(Refused) as refused:
                await load(outbox, "resp_bad")
            failure = refused.value.failure
            assert (failure.kind, failure.code) == (FailureKind.INTERNAL, FailureCode.STORED_RECORD_DAMAGED)
            assert failure.message == "the stored response 'resp_bad' is damaged and cannot be read"
        with pytest.raises(Refused, match="response 'resp_bad'"):
            await call(outbox, lambda reply: LoadChain(response_id="resp_child", reply=reply))
        with pytest.raises(Refused, match="item 'msg_bad' of conversation 'conv_1'"):
            await load_items(outbox, "conv_1")
        item_0 = await call(
            outbox, lambda reply: LoadConversationItem(conversation_id="conv_1", item_id="msg_0", reply=reply)
        )
        assert item_0 == item("msg_0")
        assert await load(outbox, "resp_ok") == response("resp_ok")
        await save(outbox, response("resp_new"))
        assert await load(outbox, "resp_new") == response("resp_new")
    faults = actor.storage_faults
    assert (faults.damaged_records, faults.damaged_reads, faults.unavailable_calls) == (2, 4, 0)
    logged = [record.getMessage() for record in caplog.records if "is damaged" in record.getMessage()]
    assert len(logged) == 2  # once per damaged record, however often it is read
    assert "response 'resp_bad'" in logged[0] and "not valid JSON" in logged[0]
    assert "item 'msg_bad' of conversation 'conv_1'" in logged[1]
