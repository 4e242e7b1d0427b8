"""Property test: under any sequence of inserts, lookups and clock moves, the caps hold, counters reconcile and an
insert removes exactly what it supersedes plus what it evicts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from courier.core.snapshot_store import Bucket, Origin, Snapshot, SnapshotStore, StoreLimits

CAPACITY = 200
MAX_ENTRIES = 6
TTL = 50.0

tokens = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12).map(tuple)
sessions = st.sampled_from(["a", "b", ""])
buckets = st.sampled_from([Bucket("m"), Bucket("m", template_signature="t")])
insert = st.tuples(
    st.just("insert"), tokens, sessions, st.sampled_from(list(Origin)), st.integers(min_value=1, max_value=250), buckets
)
# A conversation's next snapshot: the last inserted vector plus a few tokens (prefix chains are otherwise rare).
extend = st.tuples(
    st.just("extend"),
    st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=4).map(tuple),
    sessions,
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=120),
    buckets,
)
lookup = st.tuples(st.just("lookup"), tokens, sessions)
tick = st.tuples(st.just("tick"), st.floats(min_value=0, max_value=30))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(st.one_of(insert, extend, lookup, tick), max_size=60), trimmable=st.booleans())
def test_byte_cap_holds_and_counters_reconcile(operations: list[tuple[object, ...]], trimmable: bool) -> None:
    clock = Clock()
    limits = StoreLimits(capacity_bytes=CAPACITY, max_entries=MAX_ENTRIES, ttl_s=TTL, min_prefix=1)
    store = SnapshotStore(limits, trimmable=trimmable, clock=clock)
    last: tuple[int, ...] = ()
    for operation in operations:
        match operation:
            case ("insert" | "extend" as kind, vector, session, origin, nbytes, bucket):
                last = last + vector if kind == "extend" else vector  # type: ignore[operator, assignment]
                insert_and_check(store, last, session, origin, nbytes, bucket)  # type: ignore[arg-type]
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
    store: SnapshotStore, vector: tuple[int, ...], session: str, origin: Origin, nbytes: int, bucket: Bucket
) -> None:
    """Supersede removes the conversation's snapshots the new one covers (same origin; for a boundary, also
    completions strictly before it) and never a boundary for a completion; anything else removed was evicted."""

    def covered(snapshot: Snapshot) -> bool:
        conversation = (snapshot.bucket, snapshot.session) == (bucket, session)
        if not conversation or vector[: len(snapshot.tokens)] != snapshot.tokens:
            return False
        strict = len(snapshot.tokens) < len(vector)
        return snapshot.origin is origin or (
            strict and (origin, snapshot.origin) == (Origin.BOUNDARY, Origin.COMPLETION)
        )

    before = store.snapshots()
    result = store.insert(bucket=bucket, session=session, origin=origin, tokens=vector, state=None, nbytes=nbytes)
    remaining = {snapshot.entry_id for snapshot in store.snapshots()}
    removed = [snapshot for snapshot in before if snapshot.entry_id not in remaining]
    if not result.accepted:
        assert not removed
        return
    superseded = [snapshot for snapshot in before if covered(snapshot)]
    assert all(snapshot.entry_id not in remaining for snapshot in superseded)
    assert len(removed) == len(superseded) + result.evicted
    assert result.superseded == sum(len(snapshot.tokens) < len(vector) for snapshot in superseded)
    assert result.freed_bytes == sum(snapshot.nbytes for snapshot in superseded)
