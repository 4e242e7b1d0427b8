"""Property test: under any sequence of inserts, lookups and clock moves, the caps hold, counters reconcile and an
insert removes exactly what it supersedes plus what it evicts."""

from __future__ import annotations

from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from courier.core.snapshot_store import Bucket, Origin, Snapshot, SnapshotStore, StoreLimits

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
) -> None:
    """Supersede removes the conversation's snapshots the new one covers (same origin; for a boundary, also
    completions strictly before it, and completions whose prompt but its last token it starts with and that it is no
    prefix of) and never a boundary for a completion; anything else removed was evicted."""

    def covered(snapshot: Snapshot) -> bool:
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

    before = store.snapshots()
    result = store.insert(
        bucket=bucket,
        session=session,
        origin=origin,
        tokens=vector,
        state=None,
        nbytes=nbytes,
        prompt_length=prompt_length,
    )
    remaining = {snapshot.entry_id for snapshot in store.snapshots()}
    removed = [snapshot for snapshot in before if snapshot.entry_id not in remaining]
    if not result.accepted:
        assert not removed
        return
    superseded = [snapshot for snapshot in before if covered(snapshot)]
    assert all(snapshot.entry_id not in remaining for snapshot in superseded)
    assert len(removed) == len(superseded) + result.evicted
    assert result.superseded == sum(snapshot.tokens != vector for snapshot in superseded)  # identical: replaced
    assert result.freed_bytes == sum(snapshot.nbytes for snapshot in superseded)
