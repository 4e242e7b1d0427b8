"""SnapshotStoreActor over a real inbox: its store is observed only through the messages it answers and its spans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.actors.prompt_cache.snapshot_store import DIVERGENCES_KEPT, SnapshotStoreActor
from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.entries import Bucket, Origin
from courier.core.prompt_cache.stats import StoreLimits, StoreStats
from courier.core.prompt_cache.store import SnapshotStore
from courier.messages.asking import Refused, call
from courier.messages.base import RequestFailed
from courier.messages.snapshot_store import (
    InsertSnapshot,
    LookupPrefix,
    LookupReply,
    PrefixFound,
    PrefixMissed,
    ReadSnapshotStats,
    ResetSnapshots,
    SnapshotStoreMessage,
)
from courier.runtime import trace_attributes
from courier.runtime.actor import ActorBusy, ActorStopped, ask
from courier.runtime.faults import FaultCounter
from tests.support.actors import run_actor

Outbox = MemoryObjectSendStream[SnapshotStoreMessage]

LIMITS = StoreLimits(capacity_bytes=1000, max_entries=16, ttl_s=60.0, min_prefix=4)
BUCKET = Bucket(model_id="m")
IMAGE_BUCKET = Bucket(model_id="m", media_digest="sha256:image")
TENANT_BUCKET = Bucket(model_id="m", tenant="key-a")
BASE = tuple(range(100, 140))  # 40 tokens


class State:
    """An opaque model state: the store only keeps it and hands the same object back."""

    def __init__(self, name: str) -> None:
        self.name = name


def actor() -> SnapshotStoreActor:
    """A fresh store on a frozen clock (nothing expires during a test), owned by its actor from here on."""
    return SnapshotStoreActor(SnapshotStore(LIMITS, trimmable=True, clock=lambda: 1000.0))


def insert(
    outbox: Outbox,
    tokens: tuple[int, ...],
    *,
    session: str = "a",
    nbytes: int = 100,
    state: object = None,
    bucket: Bucket = BUCKET,
) -> None:
    """A tell, sent the way the scheduler sends it: at once, without waiting for room."""
    outbox.send_nowait(
        InsertSnapshot(
            bucket=bucket, session=session, origin=Origin.BOUNDARY, tokens=tokens, state=state, nbytes=nbytes
        )
    )


async def lookup(
    outbox: Outbox,
    tokens: tuple[int, ...],
    *,
    session: str = "a",
    bucket: Bucket = BUCKET,
    check_extended: bool = False,
) -> LookupReply:
    reply: LookupReply = await ask(
        outbox,
        lambda r: LookupPrefix(bucket=bucket, session=session, tokens=tokens, reply=r, check_extended=check_extended),
    )
    return reply


async def ask_stats(outbox: Outbox) -> StoreStats | RequestFailed:
    """The plain ask (no translation of a full or stopped inbox)."""
    reply: StoreStats | RequestFailed = await ask(outbox, lambda r: ReadSnapshotStats(reply=r))
    return reply


async def stats(outbox: Outbox) -> StoreStats:
    return await call(outbox, lambda reply: ReadSnapshotStats(reply=reply))


def span_attributes(exporter: InMemorySpanExporter, name: str) -> list[Mapping[str, object]]:
    """The attributes of each finished span called `name`, oldest first."""
    return [dict(span.attributes or {}) for span in exporter.get_finished_spans() if span.name == name]


@pytest.mark.anyio
async def test_an_inserted_snapshot_serves_a_longer_prompt() -> None:
    state = State("history")
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], state=state)
        found = await lookup(outbox, BASE)
    assert isinstance(found, PrefixFound)
    assert found.state is state
    assert (found.length, found.matched, found.trimmed, found.continues) == (20, 20, False, None)


@pytest.mark.anyio
async def test_a_lookup_in_another_bucket_misses() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], state=State("text only"))
        assert await lookup(outbox, BASE, bucket=IMAGE_BUCKET) == PrefixMissed(extended=False)
        assert isinstance(await lookup(outbox, BASE), PrefixFound)  # the same prompt in its own bucket hits


@pytest.mark.anyio
async def test_stats_count_what_was_inserted_and_looked_up() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], session="a", nbytes=100)
        insert(outbox, BASE[:10], session="b", nbytes=50, bucket=IMAGE_BUCKET)
        await lookup(outbox, BASE, session="a")  # a hit on 20 tokens
        await lookup(outbox, (1, 2, 3, 4, 5), session="a")  # a miss
        figures = await stats(outbox)
    assert (figures.entries, figures.nbytes, figures.limits) == (2, 150, LIMITS)
    counters = figures.counters
    assert (counters.inserts, counters.lookups, counters.hits, counters.tokens_reused) == (2, 2, 1, 20)
    assert (counters.supersedes, counters.evictions_lru, counters.rejections_oversized) == (0, 0, 0)


@pytest.mark.anyio
async def test_stats_are_a_copy_that_later_changes_leave_alone() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], nbytes=100)
        before = await stats(outbox)
        insert(outbox, BASE[:10], session="b", nbytes=50)
        await lookup(outbox, BASE)
        after = await stats(outbox)
    assert (before.entries, before.nbytes, before.counters.inserts, before.counters.lookups) == (1, 100, 1, 0)
    assert (after.entries, after.nbytes, after.counters.inserts, after.counters.lookups) == (2, 150, 2, 1)
    assert before.counters is not after.counters


@pytest.mark.anyio
async def test_a_newer_snapshot_of_the_session_supersedes_the_older(span_exporter: InMemorySpanExporter) -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], nbytes=100)
        insert(outbox, BASE, nbytes=150)  # the same conversation, one turn on
        figures = await stats(outbox)
    assert (figures.entries, figures.nbytes, figures.counters.supersedes) == (1, 150, 1)
    first, second = span_attributes(span_exporter, "snapshot_store.InsertSnapshot")
    assert (first[trace_attributes.SNAPSHOT_ACCEPTED], first[trace_attributes.SNAPSHOT_SUPERSEDED]) == (True, 0)
    assert second[trace_attributes.SNAPSHOT_ACCEPTED] is True
    assert second[trace_attributes.SNAPSHOT_SUPERSEDED] == 1
    assert second[trace_attributes.SNAPSHOT_FREED_BYTES] == 100
    assert second[trace_attributes.SNAPSHOT_EVICTED] == 0


@pytest.mark.anyio
async def test_the_lookup_span_carries_the_matched_tokens(span_exporter: InMemorySpanExporter) -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20])
        await lookup(outbox, BASE)
        await lookup(outbox, BASE, bucket=IMAGE_BUCKET)
    lookups = span_attributes(span_exporter, "snapshot_store.LookupPrefix")
    assert [attributes[trace_attributes.SNAPSHOT_MATCHED] for attributes in lookups] == [20, 0]


@pytest.mark.anyio
async def test_check_extended_misses_when_the_session_already_holds_a_longer_snapshot() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE, session="a")
        assert await lookup(outbox, BASE[:20], session="a", check_extended=True) == PrefixMissed(extended=True)
        # Asked without the check, the same prompt is served from the longer snapshot, trimmed.
        plain = await lookup(outbox, BASE[:20], session="a")
        assert isinstance(plain, PrefixFound)
        assert (plain.length, plain.matched, plain.trimmed) == (40, 19, True)


@pytest.mark.anyio
async def test_check_extended_does_not_count_another_sessions_snapshot() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE, session="a")
        reply = await lookup(outbox, BASE[:20], session="b", check_extended=True)
    assert isinstance(reply, PrefixFound)
    assert (reply.length, reply.matched, reply.trimmed) == (40, 19, True)


@pytest.mark.anyio
async def test_a_snapshot_larger_than_the_whole_budget_is_refused(span_exporter: InMemorySpanExporter) -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], nbytes=100)
        insert(outbox, BASE, nbytes=LIMITS.capacity_bytes + 1)
        figures = await stats(outbox)
        kept = await lookup(outbox, BASE)
    assert (figures.entries, figures.nbytes, figures.counters.inserts) == (1, 100, 1)
    assert figures.counters.rejections_oversized == 1
    assert isinstance(kept, PrefixFound) and kept.length == 20  # the refused one removed nothing
    refused = span_attributes(span_exporter, "snapshot_store.InsertSnapshot")[-1]
    assert refused[trace_attributes.SNAPSHOT_ACCEPTED] is False
    assert refused[trace_attributes.SNAPSHOT_SUPERSEDED] == 0


@pytest.mark.anyio
async def test_reset_answers_what_it_freed_and_empties_the_store() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE[:20], session="a", nbytes=100)
        insert(outbox, BASE[:10], session="b", nbytes=50)
        freed = await call(outbox, lambda reply: ResetSnapshots(reply=reply))
        figures = await stats(outbox)
        missed = await lookup(outbox, BASE)
    assert freed == (2, 150, 0)  # no disk tier: no disk bytes
    assert (figures.entries, figures.nbytes) == (0, 0)
    assert figures.counters.inserts == 2  # counters survive a reset
    assert missed == PrefixMissed()


@pytest.mark.anyio
async def test_a_full_inbox_refuses_asks_at_once_and_keeps_what_it_queued() -> None:
    async with run_actor(actor(), capacity=1) as outbox:
        queued = 0
        with pytest.raises(anyio.WouldBlock):  # fill it: nothing below yields, so the actor reads nothing
            while True:
                insert(outbox, BASE[: 10 + queued], session=f"s{queued}", nbytes=10)
                queued += 1
        assert outbox.statistics().current_buffer_used == 1
        with pytest.raises(ActorBusy):
            await ask_stats(outbox)
        with pytest.raises(Refused) as refused:
            await call(outbox, lambda reply: ReadSnapshotStats(reply=reply))
        assert refused.value.failure.code is FailureCode.OVERLOADED
        # Waiting for room (not asking) gets through once the actor has drained its inbox.
        reply_send, reply_receive = anyio.create_memory_object_stream[StoreStats | RequestFailed](1)
        with reply_receive:
            await outbox.send(ReadSnapshotStats(reply=reply_send))
            figures = await reply_receive.receive()
    assert isinstance(figures, StoreStats)
    assert (figures.counters.inserts, figures.entries, figures.nbytes) == (queued, queued, 10 * queued)


@pytest.mark.anyio
async def test_an_ask_after_the_actor_stopped_raises_actor_stopped() -> None:
    async with run_actor(actor()) as outbox:
        assert (await stats(outbox)).entries == 0
    with pytest.raises(ActorStopped):
        await ask_stats(outbox)
    with pytest.raises(Refused) as refused:
        await stats(outbox)
    assert refused.value.failure.code is FailureCode.SHUTTING_DOWN


@pytest.mark.anyio
async def test_an_ask_queued_when_the_actor_stops_raises_actor_stopped() -> None:
    send, receive = anyio.create_memory_object_stream[SnapshotStoreMessage](4)
    with send:
        async with anyio.create_task_group() as actors:
            await actors.start(actor().run, receive)
            actors.cancel_scope.cancel()  # the actor stops (as on a server fault) before reading its inbox again
            insert(send, BASE)
            assert send.statistics().current_buffer_used == 1  # queued, not handed to the stopping actor
            with anyio.CancelScope(shield=True), anyio.fail_after(5), pytest.raises(ActorStopped) as stopped:
                await ask_stats(send)  # the deadline only turns a regression (a hang) into a failure
    assert str(stopped.value) == "the actor stopped before answering"
    assert send.statistics().open_receive_streams == 0


@pytest.mark.anyio
async def test_a_lookup_whose_asker_stopped_waiting_is_no_fault() -> None:
    faults = FaultCounter()
    async with run_actor(actor(), faults=faults) as outbox:
        insert(outbox, BASE)
        gone_send, gone_receive = anyio.create_memory_object_stream[LookupReply](1)
        gone_receive.close()  # the scheduler gave up on it (its lookup deadline passed)
        outbox.send_nowait(LookupPrefix(bucket=BUCKET, session="a", tokens=(*BASE, 1), reply=gone_send))
        found = await lookup(outbox, (*BASE, 2))  # the store goes on answering
        assert isinstance(found, PrefixFound)
    assert faults.by_actor() == {}


def letters(tokens: Sequence[int]) -> str:
    """A stand-in tokenizer: token n is the letter chr(n)."""
    return "".join(chr(token) for token in tokens)


@pytest.mark.anyio
async def test_a_miss_says_where_the_prompt_left_the_closest_entry(span_exporter: InMemorySpanExporter) -> None:
    """As text, on the lookup's span and in the stats, newest last (the route shows each key its own)."""
    cached = tuple(ord(c) for c in "x-billing: v=c40;\nYou are an agent. Be brief.")
    prompt = tuple(ord(c) for c in "x-billing: v=1c0;\nYou are an agent. Be brief. Hi")
    store = SnapshotStore(LIMITS, trimmable=False, clock=lambda: 1000.0)
    async with run_actor(SnapshotStoreActor(store, decode=letters)) as outbox:
        insert(outbox, cached, bucket=TENANT_BUCKET)
        assert await lookup(outbox, prompt, bucket=TENANT_BUCKET) == PrefixMissed()
        assert isinstance(await lookup(outbox, (*cached, 1), bucket=TENANT_BUCKET), PrefixFound)  # a hit: none
        figures = await stats(outbox)
    assert figures.counters.divergences == 1
    (found,) = figures.divergences
    assert (found.session, found.tenant, found.prompt_tokens, found.matched_tokens) == ("a", "key-a", len(prompt), 0)
    assert (found.diverged_at, found.closest_tokens, found.same_session) == (13, len(cached), True)
    assert (found.before, found.prompt[:5], found.cached[:5]) == ("x-billing: v=", "1c0;\n", "c40;\n")
    first, _ = span_attributes(span_exporter, "snapshot_store.LookupPrefix")
    assert first[trace_attributes.SNAPSHOT_DIVERGED_AT] == 13
    assert first[trace_attributes.SNAPSHOT_CLOSEST_TOKENS] == len(cached)
    assert first[trace_attributes.SNAPSHOT_CLOSEST_SAME_SESSION] is True
    assert first[trace_attributes.SNAPSHOT_DIVERGENCE_BEFORE] == "x-billing: v="
    assert first[trace_attributes.SNAPSHOT_DIVERGENCE_PROMPT] == found.prompt
    assert first[trace_attributes.SNAPSHOT_DIVERGENCE_CACHED] == found.cached


@pytest.mark.anyio
async def test_only_the_last_divergences_are_kept() -> None:
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE)
        for n in range(DIVERGENCES_KEPT + 3):
            await lookup(outbox, (*BASE[:5], n, *BASE[6:]))
        figures = await stats(outbox)
    assert figures.counters.divergences == DIVERGENCES_KEPT + 3
    assert len(figures.divergences) == DIVERGENCES_KEPT
    assert figures.divergences[-1].prompt.split()[0] == str(DIVERGENCES_KEPT + 2)  # the newest last


@pytest.mark.anyio
async def test_an_idle_warm_ups_lookup_reports_no_divergence() -> None:
    """A warm-up (asking `check_extended`) is how a conversation catches up with a reply re-tokenized otherwise than
    it was generated: no turn missed."""
    async with run_actor(actor()) as outbox:
        insert(outbox, BASE)
        await lookup(outbox, (*BASE[:20], 7, *BASE[21:]), check_extended=True)
        figures = await stats(outbox)
    assert (figures.counters.divergences, figures.divergences) == (0, ())
