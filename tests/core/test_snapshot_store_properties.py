"""Property test: under any sequence of inserts, lookups and clock moves, the caps hold and counters reconcile."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from courier.core.snapshot_store import Bucket, Origin, SnapshotStore, StoreLimits

CAPACITY = 200
MAX_ENTRIES = 6
TTL = 50.0

tokens = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12).map(tuple)
insert = st.tuples(
    st.just("insert"),
    tokens,
    st.sampled_from(["a", "b", ""]),
    st.sampled_from(list(Origin)),
    st.integers(min_value=1, max_value=250),
    st.sampled_from([Bucket("m"), Bucket("m", template_signature="t")]),
)
lookup = st.tuples(st.just("lookup"), tokens, st.sampled_from(["a", "b", ""]))
tick = st.tuples(st.just("tick"), st.floats(min_value=0, max_value=30))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(st.one_of(insert, lookup, tick), max_size=60), trimmable=st.booleans())
def test_byte_cap_holds_and_counters_reconcile(operations: list[tuple[object, ...]], trimmable: bool) -> None:
    clock = Clock()
    limits = StoreLimits(capacity_bytes=CAPACITY, max_entries=MAX_ENTRIES, ttl_s=TTL, min_prefix=1)
    store = SnapshotStore(limits, trimmable=trimmable, clock=clock)
    for operation in operations:
        match operation:
            case ("insert", vector, session, origin, nbytes, bucket):
                store.insert(
                    bucket=bucket,  # type: ignore[arg-type]
                    session=session,  # type: ignore[arg-type]
                    origin=origin,  # type: ignore[arg-type]
                    tokens=vector,  # type: ignore[arg-type]
                    state=None,
                    nbytes=nbytes,  # type: ignore[arg-type]
                )
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
