"""Property test: under any sequence of inserts, lookups and clock moves, the caps hold, counters reconcile and an
insert removes exactly what it supersedes plus what it evicts. With a disk tier, the test also plays the owner (writes
done, failed or reported late; disk hits read back or found unreadable; flushes, sweeps, resets): both tiers' caps
hold, every entry is in one of them, the files the effects leave are exactly the on-disk entries'."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from courier.core.prompt_cache.entries import (
    DISK_HEADER_ALLOWANCE,
    Bucket,
    DeleteFile,
    DiskEffect,
    EntryId,
    Origin,
    Snapshot,
    WriteFile,
    disk_footprint,
)
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore

BUCKET = Bucket("m")
CAPACITY = 200
MAX_ENTRIES = 6
TTL = 50.0

tokens = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12).map(tuple)
suffix = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=4).map(tuple)
sessions = st.sampled_from(["a", "b", ""])
buckets = st.sampled_from([Bucket("m"), Bucket("m", template_signature="t")])
generated = st.integers(min_value=0, max_value=4)  # a completion's tokens after its prompt (capped to leave one)
insert = st.tuples(
    st.just("insert"),
    tokens,
    sessions,
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=250),
    buckets,
    generated,
)
# A conversation's next snapshot: the last inserted vector plus a few tokens (prefix chains are otherwise rare).
extend = st.tuples(
    st.just("extend"),
    suffix,
    sessions,
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=120),
    buckets,
    generated,
)
# The last vector cut back by a few tokens and continued otherwise: a reply re-rendered differently, a sibling reply.
branch = st.tuples(
    st.just("branch"),
    suffix,
    sessions,
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=120),
    buckets,
    st.tuples(generated, st.integers(min_value=1, max_value=4)),
)
lookup = st.tuples(st.just("lookup"), tokens, sessions)
tick = st.tuples(st.just("tick"), st.floats(min_value=0, max_value=30))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(st.one_of(insert, extend, branch, lookup, tick), max_size=60), trimmable=st.booleans())
def test_byte_cap_holds_and_counters_reconcile(operations: list[tuple[object, ...]], trimmable: bool) -> None:
    clock = Clock()
    limits = StoreLimits(capacity_bytes=CAPACITY, max_entries=MAX_ENTRIES, ttl_s=TTL, min_prefix=1)
    store = SnapshotStore(limits, trimmable=trimmable, clock=clock)
    last: tuple[int, ...] = ()
    for operation in operations:
        match operation:
            case ("insert" | "extend" | "branch" as kind, vector, session, origin, nbytes, bucket, extra):
                generated, cut = cast(tuple[int, int], extra) if kind == "branch" else (cast(int, extra), 0)
                kept = last[: max(len(last) - cut, 0)]  # a branch cuts back a few tokens first
                last = kept + vector if kind != "insert" else vector  # type: ignore[operator, assignment]
                prompt_length = max(len(last) - generated, 1) if origin is Origin.COMPLETION else len(last)
                insert_and_check(store, last, session, origin, nbytes, bucket, prompt_length)  # type: ignore[arg-type]
            case ("lookup", vector, session):
                result = store.lookup(Bucket("m"), session, vector)  # type: ignore[arg-type]
                if result.snapshot is not None:
                    assert 1 <= result.matched < len(vector)  # type: ignore[arg-type]
                    assert result.snapshot.tokens[: result.matched] == vector[: result.matched]  # type: ignore[index]
            case ("tick", seconds):
                clock.now += seconds  # type: ignore[operator]
        snapshots = store.snapshots()
        assert store.nbytes <= CAPACITY
        assert store.entries <= MAX_ENTRIES
        assert store.nbytes == sum(snapshot.nbytes for snapshot in snapshots)
        counters = store.counters
        removed = counters.supersedes + counters.replacements + counters.evictions_lru + counters.evictions_ttl
        assert counters.inserts - removed == store.entries
        assert counters.hits <= counters.lookups


def insert_and_check(
    store: SnapshotStore,
    vector: tuple[int, ...],
    session: str,
    origin: Origin,
    nbytes: int,
    bucket: Bucket,
    prompt_length: int,
    *,
    state: object = None,
) -> None:
    """Supersede removes the conversation's snapshots the new one covers (same origin; for a boundary, also
    completions strictly before it, and completions whose prompt but its last token it starts with and that it is no
    prefix of) and never a boundary for a completion; anything else removed was evicted (from memory or the entry
    cap, counted in the result; or, with a disk tier, a file-only entry the disk made room by)."""
    before = store.snapshots()
    disk_evictions = store.counters.evictions_disk
    result = store.insert(
        bucket=bucket,
        session=session,
        origin=origin,
        tokens=vector,
        state=state,
        nbytes=nbytes,
        prompt_length=prompt_length,
    )
    remaining = {snapshot.entry_id for snapshot in store.snapshots()}
    removed = [snapshot for snapshot in before if snapshot.entry_id not in remaining]
    if not result.accepted:
        assert not removed
        return
    superseded = [snapshot for snapshot in before if covered(snapshot, vector, session, origin, bucket)]
    assert all(snapshot.entry_id not in remaining for snapshot in superseded)
    disk_evicted = store.counters.evictions_disk - disk_evictions
    assert len(removed) == len(superseded) + result.evicted + disk_evicted
    assert result.superseded == sum(snapshot.tokens != vector for snapshot in superseded)  # identical: replaced
    assert result.freed_bytes == sum(snapshot.nbytes for snapshot in superseded)


def covered(snapshot: Snapshot, vector: tuple[int, ...], session: str, origin: Origin, bucket: Bucket) -> bool:
    """Whether a new snapshot (`vector`, `session`, `origin`, `bucket`) supersedes or replaces `snapshot`."""
    if (snapshot.bucket, snapshot.session) != (bucket, session):
        return False
    if vector[: len(snapshot.tokens)] == snapshot.tokens:  # a prefix of the new vector, or identical
        strict = len(snapshot.tokens) < len(vector)
        return snapshot.origin is origin or (
            strict and (origin, snapshot.origin) == (Origin.BOUNDARY, Origin.COMPLETION)
        )
    kept = snapshot.prompt_length - 1  # a turn the boundary carries on past, elsewhere than its reply
    return (
        (origin, snapshot.origin) == (Origin.BOUNDARY, Origin.COMPLETION)
        and kept > 0
        and vector[:kept] == snapshot.tokens[:kept]
        and snapshot.tokens[: len(vector)] != vector
    )


# The disk tier: its budget holds a few entries' files (each charged DISK_HEADER_ALLOWANCE and more), or one small
# one, so that some files never fit and their entries can only be dropped.
disk_capacities = st.sampled_from([DISK_HEADER_ALLOWANCE + 150, 3 * DISK_HEADER_ALLOWANCE + 600])
# A file an earlier run left behind, `age` seconds since its last use (some older than the TTL).
adopt = st.tuples(
    tokens,
    sessions,
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=250),
    buckets,
    st.floats(min_value=0, max_value=70),
    generated,
)
# A lookup that continues the last inserted vector, or one inserted earlier (in its own session and bucket): they
# hit, often an entry only on disk.
revisit = st.tuples(st.just("revisit"), suffix, sessions)
recall = st.tuples(st.just("recall"), st.integers(min_value=0, max_value=59), suffix)
# The owner's other calls (a reset rarely).
maintain = st.tuples(
    st.just("maintain"), st.sampled_from(["flush", "flush", "sweep", "sweep", "settle", "settle", "settle", "reset"])
)
outcomes = st.sampled_from(["done", "failed", "later"])
reads = st.sampled_from(["promote", "promote", "unreadable", "later"])


class Owner:
    """Plays the store's owner: carries out its effects in order (tracking which files exist), reports each write
    done, failed or later, and reads entries answered from disk back (or finds them unreadable)."""

    def __init__(self, store: SnapshotStore, data: st.DataObject) -> None:
        self.store = store
        self.data = data
        self.files: set[EntryId] = set()  # written, being written, or adopted; not deleted since
        self.asked: set[EntryId] = set()  # every entry a file was ever asked for or adopted
        self.writes: list[tuple[EntryId, int]] = []  # written, not reported yet: (entry, ticket)
        self.reads: list[EntryId] = []  # being read back

    def carry_out(self, effects: list[DiskEffect] | None = None) -> None:
        """Carry out `effects` (already taken), then whatever else the store asks until it asks nothing."""
        effects = self.store.take_effects() if effects is None else effects
        while effects:
            written = []
            for effect in effects:
                if isinstance(effect, WriteFile):
                    entry_id = effect.snapshot.entry_id
                    assert entry_id not in self.files  # never asked twice without a delete between
                    assert effect.state is not None  # the writer is handed the state
                    self.files.add(entry_id)
                    self.asked.add(entry_id)
                    written.append((entry_id, effect.ticket))
                else:
                    assert effect.entry_id in self.asked  # only an entry that had been on disk
                    assert effect.entry_id in self.files  # and whose file was not deleted already
                    self.files.remove(effect.entry_id)
            for entry_id, ticket in written:
                self.report_write(entry_id, ticket, self.data.draw(outcomes))
            effects = self.store.take_effects()

    def report_write(self, entry_id: EntryId, ticket: int, outcome: str) -> None:
        if outcome == "later":
            self.writes.append((entry_id, ticket))
            return
        snapshot = self.store.get(entry_id)
        held_before = snapshot is not None and snapshot.in_memory
        flags = (snapshot.in_memory, snapshot.on_disk, snapshot.writing) if snapshot is not None else None
        wanted = self.store.wants_file(entry_id, ticket)
        (self.store.write_done if outcome == "done" else self.store.write_failed)(entry_id, ticket)
        if wanted and outcome == "failed" and not held_before:
            assert self.store.get(entry_id) is None  # only the file held it: gone
        if not wanted and snapshot is not None:  # an older write's report (or a gone entry's) changes nothing
            assert self.store.get(entry_id) is snapshot
            assert (snapshot.in_memory, snapshot.on_disk, snapshot.writing) == flags

    def read_back(self, snapshot: Snapshot, choice: str, matched: int = 1) -> None:
        entry_id = snapshot.entry_id
        if choice == "later":
            self.reads.append(entry_id)
        elif choice == "unreadable":
            self.store.drop_unreadable(entry_id)
            assert self.store.get(entry_id) is None
        else:
            current = self.store.get(entry_id)
            expected = current is not None and not current.in_memory
            assert self.store.promote(entry_id, ("read", entry_id)) == expected
            if expected:
                assert snapshot.in_memory and snapshot.state == ("read", entry_id)
            hits = (self.store.counters.hits, self.store.counters.disk_hits)
            self.store.count_disk_hit(matched)
            assert (self.store.counters.hits, self.store.counters.disk_hits) == (hits[0] + 1, hits[1] + 1)

    def settle(self) -> None:
        writes, self.writes = self.writes, []
        for entry_id, ticket in writes:
            self.report_write(entry_id, ticket, self.data.draw(st.sampled_from(["done", "failed"])))
        reads, self.reads = self.reads, []
        for entry_id in reads:
            snapshot = self.store.get(entry_id)
            if snapshot is not None:
                self.read_back(snapshot, self.data.draw(st.sampled_from(["promote", "unreadable"])))
            else:
                assert not self.store.promote(entry_id, ("read", entry_id))  # gone meanwhile


@settings(max_examples=300, deadline=None)
@given(
    adopted=st.lists(adopt, max_size=6),
    operations=st.lists(
        st.one_of(insert, extend, branch, lookup, revisit, recall, tick, maintain), min_size=8, max_size=60
    ),
    trimmable=st.booleans(),
    disk_capacity=disk_capacities,
    data=st.data(),
)
def test_both_tiers_hold_their_caps_and_counters_reconcile_with_the_owner_playing_the_disk(
    adopted: list[tuple[tuple[int, ...], str, Origin, int, Bucket, float, int]],
    operations: list[tuple[object, ...]],
    trimmable: bool,
    disk_capacity: int,
    data: st.DataObject,
) -> None:
    clock = Clock()
    limits = StoreLimits(
        capacity_bytes=CAPACITY, max_entries=MAX_ENTRIES, ttl_s=TTL, min_prefix=1, disk_capacity_bytes=disk_capacity
    )
    store = SnapshotStore(limits, trimmable=trimmable, clock=clock)
    owner = Owner(store, data)
    reset_dropped = 0
    for found in sorted(adopted, key=lambda found: -found[5]):  # oldest first
        adopt_and_check(store, owner, clock.now, found)
        check_tiers(store, owner, disk_capacity, reset_dropped)
    last: tuple[int, ...] = ()
    inserted: list[tuple[tuple[int, ...], str, Bucket]] = []
    for operation in operations:
        match operation:
            case ("insert" | "extend" | "branch" as kind, vector, session, origin, nbytes, bucket, extra):
                generated, cut = cast(tuple[int, int], extra) if kind == "branch" else (cast(int, extra), 0)
                kept = last[: max(len(last) - cut, 0)]
                last = kept + vector if kind != "insert" else vector  # type: ignore[operator, assignment]
                prompt_length = max(len(last) - generated, 1) if origin is Origin.COMPLETION else len(last)
                inserted.append((last, session, bucket))  # type: ignore[arg-type]
                insert_and_check(
                    store,
                    last,
                    session,  # type: ignore[arg-type]
                    origin,  # type: ignore[arg-type]
                    nbytes,  # type: ignore[arg-type]
                    bucket,  # type: ignore[arg-type]
                    prompt_length,
                    state=("state", last),
                )
            case ("lookup", vector, session):
                lookup_and_read(store, owner, cast(tuple[int, ...], vector), cast(str, session))
            case ("revisit", more, session):
                lookup_and_read(store, owner, last + cast(tuple[int, ...], more), cast(str, session))
            case ("recall", index, more) if inserted:
                vector, session, bucket = inserted[cast(int, index) % len(inserted)]
                lookup_and_read(store, owner, vector + cast(tuple[int, ...], more), session, bucket)
            case ("tick", seconds):
                clock.now += seconds  # type: ignore[operator]
            case ("maintain", "flush"):
                without_file = {snapshot.entry_id for snapshot in store.snapshots() if not snapshot.on_disk}
                flushed = store.flush()
                effects = store.take_effects()
                asked = [effect.snapshot.entry_id for effect in effects if isinstance(effect, WriteFile)]
                written = [entry_id for entry_id in set(asked) if (entry := store.get(entry_id)) and entry.on_disk]
                assert flushed == len(written) and set(asked) <= without_file  # the older may have made room
                owner.carry_out(effects)
            case ("maintain", "sweep"):
                store.sweep()
            case ("maintain", "settle"):
                owner.settle()
            case ("maintain", "reset"):
                expected = (store.entries, store.nbytes + store.disk_nbytes)
                on_disk = [snapshot.entry_id for snapshot in store.snapshots() if snapshot.on_disk]
                assert store.reset() == expected
                reset_dropped += expected[0]
                effects = store.take_effects()
                deleted = [effect.entry_id for effect in effects if isinstance(effect, DeleteFile)]
                assert sorted(deleted) == sorted(on_disk) and len(effects) == len(on_disk)
                owner.carry_out(effects)
        owner.carry_out()
        check_tiers(store, owner, disk_capacity, reset_dropped)


def adopt_and_check(
    store: SnapshotStore,
    owner: Owner,
    now: float,
    found: tuple[tuple[int, ...], str, Origin, int, Bucket, float, int],
) -> None:
    """An adopted file supersedes what it covers, as an insert does; it fits both budgets and the TTL or is refused."""
    vector, session, origin, nbytes, bucket, age, generated = found
    prompt_length = max(len(vector) - generated, 1) if origin is Origin.COMPLETION else len(vector)
    before = store.snapshots()
    counters = replace(store.counters)
    entry_id = store.adopt(
        bucket=bucket,
        session=session,
        origin=origin,
        tokens=vector,
        nbytes=nbytes,
        prompt_length=prompt_length,
        age_s=age,
    )
    footprint = disk_footprint(nbytes, len(vector))
    fits = nbytes <= CAPACITY and footprint <= store.limits.disk_capacity_bytes and age < TTL
    assert (entry_id is not None) == fits
    remaining = {snapshot.entry_id for snapshot in store.snapshots()}
    removed = [snapshot for snapshot in before if snapshot.entry_id not in remaining]
    if entry_id is None:
        assert not removed
        assert not store.take_effects()
        return
    owner.files.add(entry_id)  # the earlier run's file
    owner.asked.add(entry_id)
    snapshot = store.get(entry_id)
    assert snapshot is not None
    assert (snapshot.in_memory, snapshot.on_disk, snapshot.writing, snapshot.state) == (False, True, False, None)
    assert snapshot.last_used == now - age
    superseded = [snapshot for snapshot in before if covered(snapshot, vector, session, origin, bucket)]
    assert all(snapshot.entry_id not in remaining for snapshot in superseded)
    evicted = (store.counters.evictions_lru - counters.evictions_lru) + (
        store.counters.evictions_disk - counters.evictions_disk
    )
    assert len(removed) == len(superseded) + evicted
    owner.carry_out()


def lookup_and_read(
    store: SnapshotStore, owner: Owner, vector: tuple[int, ...], session: str, bucket: Bucket = BUCKET
) -> None:
    disk_hits = store.counters.disk_hits
    result = store.lookup(bucket, session, vector)
    snapshot = result.snapshot
    if snapshot is None:
        assert store.counters.disk_hits == disk_hits
        return
    assert 1 <= result.matched < len(vector)
    assert snapshot.tokens[: result.matched] == vector[: result.matched]
    assert store.counters.disk_hits == disk_hits  # a disk hit counts once its file is read back
    if not snapshot.state_held:
        assert snapshot.on_disk and snapshot.state is None
        owner.read_back(snapshot, owner.data.draw(reads), result.matched)


def check_tiers(store: SnapshotStore, owner: Owner, disk_capacity: int, reset_dropped: int) -> None:
    snapshots = store.snapshots()
    memory = [snapshot for snapshot in snapshots if snapshot.in_memory]
    disk = [snapshot for snapshot in snapshots if snapshot.on_disk]
    assert store.nbytes == sum(snapshot.nbytes for snapshot in memory) <= CAPACITY
    assert store.disk_nbytes == sum(snapshot.disk_bytes for snapshot in disk) <= disk_capacity
    assert store.entries == len(snapshots) <= MAX_ENTRIES
    stats = store.stats()
    assert (stats.memory_entries, stats.disk_entries, stats.disk_nbytes) == (len(memory), len(disk), store.disk_nbytes)
    for snapshot in snapshots:
        assert snapshot.in_memory or snapshot.on_disk  # an entry neither tier holds is gone
        assert snapshot.disk_bytes == (disk_footprint(snapshot.nbytes, len(snapshot.tokens)) if snapshot.on_disk else 0)
        assert snapshot.on_disk or not snapshot.writing
        assert snapshot.state_held == (snapshot.in_memory or snapshot.writing)
        assert (snapshot.state is not None) == snapshot.state_held  # kept exactly while someone needs it
        assert store.wants_file(snapshot.entry_id) == snapshot.writing
    assert owner.files == {snapshot.entry_id for snapshot in disk}  # every file on disk is an entry's, and no more
    counters = store.counters
    removed = (
        counters.supersedes
        + counters.replacements
        + counters.evictions_lru
        + counters.evictions_ttl
        + counters.evictions_disk
        + counters.disk_write_losses
        + counters.disk_unreadable
    )
    assert counters.inserts + counters.adopted - removed == store.entries + reset_dropped
    assert counters.hits <= counters.lookups
    assert counters.disk_hits <= counters.hits
