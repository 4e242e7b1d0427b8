"""bench.multiturn part c: the snapshot store's insert and lookup latency in process, on vectors made beforehand."""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Sequence
from typing import Any

from bench.harness.report import progress, table
from bench.harness.stats import percentile

STORE_PREFIX_TOKENS = 500
STORE_SUFFIX_TOKENS = (50, 1500)
STORE_VOCAB = 49152
STORE_NEXT_TURN_TOKENS = 30
STORE_NEW_CONVERSATION_TOKENS = 200
STORE_MISS_TOKENS = 700
STORE_MIN_PREFIX = 32
STORE_LOOKUP_TARGET_US = 1000.0
LOOKUP_NEXT_TURN = "lookup: next turn (hit, whole entry)"
LOOKUP_SHARED_PREFIX = "lookup: new conversation (hit, shared prefix)"
LOOKUP_MISS = "lookup: unrelated prompt (miss)"
Lookups = dict[str, list[tuple[str, tuple[int, ...], int]]]


def make_store_workload(args: argparse.Namespace) -> tuple[list[tuple[int, ...]], list[str], Lookups]:
    """The vectors, their sessions, and per kind the lookups (session, tokens, least matched; 0: a miss)."""
    rng = random.Random(args.seed)
    vocab = list(range(STORE_VOCAB))  # shared int objects keep the vectors' memory at a pointer per token
    prefix = tuple(rng.choices(vocab, k=STORE_PREFIX_TOKENS))
    low, high = STORE_SUFFIX_TOKENS
    vectors = [prefix + tuple(rng.choices(vocab, k=rng.randint(low, high))) for _ in range(args.store_entries)]
    names = [f"user-{index % args.store_sessions}" for index in range(args.store_entries)]
    next_turns = []
    for _ in range(args.store_lookups):
        index = rng.randrange(args.store_entries)
        tokens = vectors[index] + tuple(rng.choices(vocab, k=STORE_NEXT_TURN_TOKENS))
        next_turns.append((names[index], tokens, len(vectors[index])))
    shared = [
        (f"new-{index}", prefix + tuple(rng.choices(vocab, k=STORE_NEW_CONVERSATION_TOKENS)), STORE_PREFIX_TOKENS)
        for index in range(args.store_lookups)
    ]
    others = [token for token in vocab if token != prefix[0]]
    misses = [
        (f"new-{index}", (rng.choice(others), *rng.choices(vocab, k=STORE_MISS_TOKENS - 1)), 0)
        for index in range(args.store_lookups)
    ]
    return vectors, names, {LOOKUP_NEXT_TURN: next_turns, LOOKUP_SHARED_PREFIX: shared, LOOKUP_MISS: misses}


def latency(operation: str, samples_ns: Sequence[int], unexpected: int) -> dict[str, Any]:
    """`unexpected`: lookups whose outcome was not the kind's (a hit that missed, ...)."""
    micros = [sample / 1000 for sample in samples_ns]
    figures = {"p50_us": percentile(micros, 0.50), "p99_us": percentile(micros, 0.99), "max_us": max(micros)}
    return {"operation": operation, "count": len(micros), **figures, "unexpected": unexpected}


def measure_store(args: argparse.Namespace) -> dict[str, Any]:
    """Inserts one by one, then each kind's lookups, in microseconds; the entries and the seconds to build them."""
    from courier.core.prompt_cache.entries import Bucket, Origin
    from courier.core.prompt_cache.stats import StoreLimits
    from courier.core.prompt_cache.store import SnapshotStore

    progress(f"store: making {args.store_entries} vectors and {args.store_lookups} lookups of each kind")
    vectors, sessions, lookups = make_store_workload(args)
    limits = StoreLimits(
        capacity_bytes=1 << 62, max_entries=2 * args.store_entries, ttl_s=1e9, min_prefix=STORE_MIN_PREFIX
    )
    store = SnapshotStore(limits, trimmable=True, clock=time.monotonic)
    bucket = Bucket("m")
    gc.collect()
    insert_ns: list[int] = []
    build_started = time.perf_counter()
    for session, tokens in zip(sessions, vectors, strict=True):
        started = time.perf_counter_ns()
        store.insert(bucket=bucket, session=session, origin=Origin.COMPLETION, tokens=tokens, state=None, nbytes=1)
        insert_ns.append(time.perf_counter_ns() - started)
    build_s = time.perf_counter() - build_started
    progress(f"store: {store.entries} entries inserted in {build_s:.1f} s; timing lookups")
    operations = [latency(f"insert (store growing to {store.entries})", insert_ns, 0)]
    for kind, queries in lookups.items():
        samples: list[int] = []
        unexpected = 0
        for session, tokens, expected in queries:
            started = time.perf_counter_ns()
            result = store.lookup(bucket, session, tokens)
            samples.append(time.perf_counter_ns() - started)
            # A hit must reach at least its expected length (a new suffix may match a stored token by chance).
            unexpected += result.matched < expected if expected else result.matched != 0
        operations.append(latency(kind, samples, unexpected))
    return {"entries": store.entries, "sessions": args.store_sessions, "build_s": build_s, "operations": operations}


def print_part_c(store: dict[str, Any]) -> None:
    low, high = STORE_SUFFIX_TOKENS
    print(f"### (c) Snapshot store latency, {store['entries']} entries in process\n")
    print(
        f"- vectors: a {STORE_PREFIX_TOKENS}-token shared prefix + {low}-{high} random tokens, "
        f"{store['sessions']} sessions; built in {store['build_s']:.1f} s\n"
    )
    table(
        "operation | count | p50 us | p99 us | max us | unexpected outcomes",
        (
            f"{op['operation']} | {op['count']} | {op['p50_us']:.1f} | {op['p99_us']:.1f} | {op['max_us']:.1f} "
            f"| {op['unexpected']}"
            for op in store["operations"]
        ),
    )
    lookups = [op["p99_us"] for op in store["operations"] if op["operation"].startswith("lookup")]
    worst = max(lookups, default=float("nan"))
    verdict = "meets" if worst < STORE_LOOKUP_TARGET_US else "misses"
    print(f"- worst lookup p99 {worst:.1f} us: {verdict} the target (< {STORE_LOOKUP_TARGET_US:.0f} us)\n")
