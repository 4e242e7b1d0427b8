"""Table tests of the snapshot store core, with an injected clock."""

from __future__ import annotations

import pytest

from courier.core.prompt_cache.entries import (
    ANONYMOUS_SESSION,
    Bucket,
    DeleteFile,
    DiskEffect,
    Origin,
    Snapshot,
    WriteFile,
    disk_footprint,
)
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore

BUCKET = Bucket(model_id="m")
OTHER_BUCKET = Bucket(model_id="m", template_signature="other")
BASE = tuple(range(100, 140))  # 40 tokens: above the default minimum prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(
    *, capacity: int = 10_000, entries: int = 100, ttl: float = 60.0, min_prefix: int = 8, trimmable: bool = True
) -> tuple[SnapshotStore, Clock]:
    clock = Clock()
    limits = StoreLimits(capacity_bytes=capacity, max_entries=entries, ttl_s=ttl, min_prefix=min_prefix)
    return SnapshotStore(limits, trimmable=trimmable, clock=clock), clock


def put(
    s: SnapshotStore,
    tokens: tuple[int, ...],
    *,
    session: str = "a",
    origin: Origin = Origin.BOUNDARY,
    nbytes: int = 10,
    bucket: Bucket = BUCKET,
) -> bool:
    result = s.insert(bucket=bucket, session=session, origin=origin, tokens=tokens, state=tokens, nbytes=nbytes)
    return result.accepted


def test_a_conversation_chain_collapses_to_its_newest_snapshot() -> None:
    s, _ = store()
    turns = [BASE[:10], BASE[:20], BASE[:30], BASE]
    for turn in turns:
        assert put(s, turn)
    assert [snapshot.tokens for snapshot in s.snapshots()] == [BASE]
    assert s.counters.supersedes == 3
    assert s.counters.evictions_lru == 0
    assert s.nbytes == 10


def test_supersede_touches_only_same_bucket_session_and_origin() -> None:
    s, _ = store()
    put(s, BASE[:20], session="a", origin=Origin.COMPLETION)
    put(s, BASE[:20], session="b", origin=Origin.COMPLETION)
    put(s, BASE[:20], session="a")  # a boundary: identical tokens, so it leaves the completion alone
    put(s, BASE[:20], session="a", origin=Origin.COMPLETION, bucket=OTHER_BUCKET)
    put(s, BASE, session="a", origin=Origin.COMPLETION)
    remaining = {(x.session, x.origin, x.bucket, len(x.tokens)) for x in s.snapshots()}
    assert remaining == {
        ("b", Origin.COMPLETION, BUCKET, 20),
        ("a", Origin.BOUNDARY, BUCKET, 20),
        ("a", Origin.COMPLETION, OTHER_BUCKET, 20),
        ("a", Origin.COMPLETION, BUCKET, 40),
    }
    assert s.counters.supersedes == 1


def test_a_boundary_extended_over_the_reply_supersedes_that_turns_completion() -> None:
    s, _ = store()
    put(s, BASE[:19], nbytes=5)  # the history, captured during prefill
    put(s, BASE[:28], origin=Origin.COMPLETION, nbytes=7)  # its prompt (20 tokens) + 8 generated
    result = s.insert(bucket=BUCKET, session="a", origin=Origin.BOUNDARY, tokens=BASE, state=None, nbytes=10)
    assert (result.superseded, result.freed_bytes, result.evicted) == (2, 12, 0)
    assert [(x.origin, x.tokens) for x in s.snapshots()] == [(Origin.BOUNDARY, BASE)]
    assert (s.counters.supersedes, s.counters.replacements, s.counters.evictions_lru) == (2, 0, 0)
    assert s.nbytes == 10


@pytest.mark.parametrize(
    ("completion", "session", "bucket", "superseded"),
    [
        (BASE[:30], "a", BUCKET, True),  # a strict prefix of the boundary, same conversation
        (BASE[:30], "b", BUCKET, False),  # another session's
        (BASE[:30], "a", OTHER_BUCKET, False),  # another bucket's
        ((*BASE[:30], 7, 7), "a", BUCKET, False),  # diverges inside the reply: not a prefix
        (BASE, "a", BUCKET, False),  # identical: not a strict prefix
        ((*BASE, 7), "a", BUCKET, False),  # longer than the boundary
    ],
)
def test_a_boundary_supersedes_only_its_own_conversations_completion_prefixes(
    completion: tuple[int, ...], session: str, bucket: Bucket, superseded: bool
) -> None:
    s, _ = store()
    put(s, completion, session=session, bucket=bucket, origin=Origin.COMPLETION)
    result = s.insert(bucket=BUCKET, session="a", origin=Origin.BOUNDARY, tokens=BASE, state=None, nbytes=10)
    assert result.superseded == int(superseded)
    survivors = [x.tokens for x in s.snapshots() if x.origin is Origin.COMPLETION]
    assert survivors == ([] if superseded else [completion])
    assert s.counters.evictions_lru == 0


PROMPT = BASE[:20]  # a turn's prompt; its last token is the generation prompt's newline
REPLY = (7, 7, 7)  # the tokens generated


def put_turn_completion(s: SnapshotStore) -> None:
    """Turn 1's completion snapshot: PROMPT and the REPLY generated after it (7 bytes)."""
    s.insert(
        bucket=BUCKET,
        session="a",
        origin=Origin.COMPLETION,
        tokens=(*PROMPT, *REPLY),
        state=None,
        nbytes=7,
        prompt_length=len(PROMPT),
    )


@pytest.mark.parametrize(
    ("boundary", "session", "bucket", "superseded"),
    [
        # The history re-rendered through the reply, which did not re-tokenize as generated: the conversation goes on
        # from the boundary, never from the completion.
        ((*PROMPT, 8, 8, 8, 8), "a", BUCKET, True),
        ((*PROMPT[:-1], 9, 8, 8, 8), "a", BUCKET, True),  # the newline merged with the reply's first token
        ((*PROMPT, 7), "a", BUCKET, False),  # a prefix of the completion: the completion goes further
        ((*PROMPT, 8, 8, 8, 8), "b", BUCKET, False),  # another session's conversation
        ((*PROMPT, 8, 8, 8, 8), "a", OTHER_BUCKET, False),  # another bucket's
        (PROMPT[:-1], "a", BUCKET, False),  # the prompt but its last token: does not go past it
        ((*PROMPT[:-2], 9, 9, 9, 9), "a", BUCKET, False),  # leaves the prompt: another conversation
    ],
)
def test_a_boundary_supersedes_the_completion_whose_prompt_it_carries_on_past(
    boundary: tuple[int, ...], session: str, bucket: Bucket, superseded: bool
) -> None:
    s, _ = store()
    put_turn_completion(s)
    result = s.insert(bucket=bucket, session=session, origin=Origin.BOUNDARY, tokens=boundary, state=None, nbytes=10)
    assert (result.superseded, result.freed_bytes) == ((1, 7) if superseded else (0, 0))
    survivors = [x.tokens for x in s.snapshots() if x.origin is Origin.COMPLETION]
    assert survivors == ([] if superseded else [(*PROMPT, *REPLY)])
    assert (s.counters.supersedes, s.counters.replacements, s.counters.evictions_lru) == (int(superseded), 0, 0)
    assert s.nbytes == (10 if superseded else 17)


def test_a_turn_whose_reply_re_tokenized_differently_leaves_one_snapshot_after_the_warm_up() -> None:
    s, _ = store(trimmable=False)
    put(s, PROMPT[:-3], nbytes=5)  # turn 1's history, captured during prefill (before the generation prompt)
    put_turn_completion(s)
    history = (*PROMPT, 77, 3, 4)  # the reply re-rendered as one other token, then the end of the turn
    result = s.insert(bucket=BUCKET, session="a", origin=Origin.BOUNDARY, tokens=history, state=None, nbytes=10)
    assert (result.superseded, result.freed_bytes) == (2, 12)  # the shorter history by prefix, the completion
    assert [(x.origin, x.tokens) for x in s.snapshots()] == [(Origin.BOUNDARY, history)]
    assert s.lookup(BUCKET, "a", (*history, 5, 6)).matched == len(history)  # the next turn extends it


def test_the_anonymous_session_keeps_the_same_rule() -> None:
    """Anonymous callers share one session: a boundary that repeats an anonymous completion's whole prompt and goes
    on elsewhere supersedes it, whoever sent it (see the module docstring: such a caller prefills one reply again)."""
    s, _ = store()
    completion = (*PROMPT, *REPLY)
    s.insert(
        bucket=BUCKET,
        session=ANONYMOUS_SESSION,
        origin=Origin.COMPLETION,
        tokens=completion,
        state=None,
        nbytes=7,
        prompt_length=len(PROMPT),
    )
    put(s, (*PROMPT, 8, 8), session="a")  # a named session never touches it
    assert completion in [x.tokens for x in s.snapshots()]
    put(s, (*PROMPT, 8, 8), session=ANONYMOUS_SESSION)
    assert completion not in [x.tokens for x in s.snapshots()]
    assert s.counters.supersedes == 1


def test_a_completion_never_supersedes_a_boundary() -> None:
    s, _ = store()
    put(s, BASE[:20])  # the history the next turn needs
    (boundary,) = s.snapshots()
    result = s.insert(
        bucket=BUCKET,
        session="a",
        origin=Origin.COMPLETION,
        tokens=BASE,  # extends the boundary
        state=None,
        nbytes=10,
        continues=boundary.entry_id,  # even when named as the entry it continues
        prompt_length=30,
    )
    assert (result.superseded, result.freed_bytes) == (0, 0)
    assert sorted((x.origin.value, len(x.tokens)) for x in s.snapshots()) == [("boundary", 20), ("completion", 40)]
    assert s.counters.supersedes == 0


def test_only_a_strict_extension_supersedes() -> None:
    s, _ = store()
    put(s, BASE[:30])
    put(s, (*BASE[:20], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10))  # diverges: both stay
    assert s.entries == 2
    put(s, BASE[:30])  # identical: replaced, not counted as a supersede
    assert s.entries == 2
    assert (s.counters.supersedes, s.counters.replacements) == (0, 1)


def test_an_oversized_snapshot_is_refused_and_removes_nothing() -> None:
    s, _ = store(capacity=100)
    put(s, BASE[:20], nbytes=60)
    assert not put(s, BASE, nbytes=101)
    assert [len(x.tokens) for x in s.snapshots()] == [20]
    assert s.counters.rejections_oversized == 1
    assert s.counters.supersedes == 0


def test_supersede_frees_bytes_before_the_capacity_check() -> None:
    s, _ = store(capacity=100)
    put(s, (1,) * 12, session="other", nbytes=15)
    put(s, BASE[:20], nbytes=60)
    assert put(s, BASE, nbytes=80)  # does not fit beside its ancestor, fits instead of it
    assert s.counters.evictions_lru == 0
    assert {len(x.tokens) for x in s.snapshots()} == {12, 40}
    assert s.nbytes == 95


def test_lru_evicts_the_least_recently_used_and_counts_self_evictions() -> None:
    s, clock = store(capacity=30)
    put(s, (1,) * 10, session="x")
    clock.now += 1
    put(s, (2,) * 10, session="y")
    clock.now += 1
    put(s, (3,) * 10, session="z")
    clock.now += 1
    assert s.lookup(BUCKET, "x", (1,) * 10 + (5,)).snapshot is not None  # x is now the most recent
    put(s, (4,) * 10, session="y")
    assert sorted(x.session for x in s.snapshots()) == ["x", "y", "z"]
    assert [x.tokens[0] for x in s.snapshots()] == [3, 1, 4]
    assert (s.counters.evictions_lru, s.counters.self_evictions) == (1, 1)
    assert s.nbytes <= 30


def test_an_eviction_counts_as_ones_own_only_within_ones_bucket() -> None:
    """Another key's caller naming its session alike evicts the entry but not as its own: the counter (in
    /v1/cache/stats) must not tell it that the oldest entry was a session of that name."""
    s, clock = store(entries=1)
    put(s, (1,) * 10, session="alice", bucket=Bucket(model_id="m", tenant="a"))
    clock.now += 1
    assert put(s, (2,) * 10, session="alice", bucket=Bucket(model_id="m", tenant="b"))
    assert (s.counters.evictions_lru, s.counters.self_evictions) == (1, 0)
    clock.now += 1
    assert put(s, (3,) * 10, session="alice", bucket=Bucket(model_id="m", tenant="b"))
    assert (s.counters.evictions_lru, s.counters.self_evictions) == (2, 1)


def test_entry_cap_holds() -> None:
    s, _ = store(entries=2)
    for first in range(5):
        put(s, (first,) * 10, session=str(first))
    assert s.entries == 2
    assert s.counters.evictions_lru == 3


def test_ttl_counts_from_last_use() -> None:
    s, clock = store(ttl=60)
    put(s, BASE[:20])
    clock.now += 50
    assert s.lookup(BUCKET, "a", BASE).matched == 20  # refreshes last use
    clock.now += 50
    assert s.entries == 1
    clock.now += 11
    assert s.sweep() == 1
    assert s.entries == 0
    assert s.counters.evictions_ttl == 1


def test_an_expired_snapshot_no_longer_counts_as_extending_a_prompt() -> None:
    s, clock = store(ttl=60)
    put(s, BASE)
    assert s.extended(BUCKET, "a", BASE[:20])
    clock.now += 61
    assert not s.extended(BUCKET, "a", BASE[:20])
    assert s.entries == 0
    assert s.counters.evictions_ttl == 1


def test_lookup_prefers_the_longest_own_prefix_and_crosses_sessions_only_when_strictly_longer() -> None:
    s, _ = store(trimmable=False)
    put(s, BASE[:20], session="a")
    put(s, BASE[:20], session="b", origin=Origin.COMPLETION)
    own = s.lookup(BUCKET, "a", BASE)
    assert own.snapshot is not None and own.snapshot.session == "a" and not own.cross_session
    put(s, BASE[:30], session="b")
    other = s.lookup(BUCKET, "a", BASE)
    assert other.snapshot is not None and other.snapshot.session == "b" and other.cross_session
    assert other.matched == 30


def test_anonymous_callers_share_one_session() -> None:
    s, _ = store()
    put(s, BASE[:20], session=ANONYMOUS_SESSION)
    put(s, BASE, session=ANONYMOUS_SESSION)
    assert s.entries == 1
    result = s.lookup(BUCKET, ANONYMOUS_SESSION, (*BASE, 1, 2))
    assert result.matched == 40 and not result.cross_session


def test_short_matches_are_misses_and_do_not_refresh() -> None:
    s, _ = store(min_prefix=32)
    put(s, BASE[:20])
    assert s.lookup(BUCKET, "a", BASE).snapshot is None
    assert (s.counters.lookups, s.counters.hits) == (1, 0)


def test_other_buckets_never_match() -> None:
    s, _ = store()
    put(s, BASE[:20], bucket=OTHER_BUCKET)
    assert s.lookup(BUCKET, "a", BASE).snapshot is None


@pytest.mark.parametrize(("trimmable", "matched"), [(True, 25), (False, 0)])
def test_a_diverging_snapshot_is_trimmed_only_when_the_cache_can_be_trimmed(trimmable: bool, matched: int) -> None:
    s, _ = store(trimmable=trimmable)
    put(s, BASE[:25] + (7,) * 10)
    result = s.lookup(BUCKET, "a", BASE)
    assert result.matched == matched
    assert result.trimmed is trimmable


def test_the_whole_prompt_leaves_one_token_to_feed() -> None:
    s, _ = store(trimmable=True)
    put(s, BASE)
    result = s.lookup(BUCKET, "a", BASE)
    assert (result.matched, result.trimmed) == (39, True)
    exact, _ = store(trimmable=False)
    put(exact, BASE)
    assert exact.lookup(BUCKET, "a", BASE).snapshot is None  # a hybrid state cannot be rewound one token


def test_reset_clears_entries_and_keeps_counters() -> None:
    s, _ = store()
    put(s, BASE)
    s.lookup(BUCKET, "a", (*BASE, 1))
    assert s.reset() == (1, 10)
    assert (s.entries, s.nbytes) == (0, 0)
    assert s.counters.hits == 1


@pytest.mark.parametrize("bad", [{"capacity_bytes": 0}, {"max_entries": 0}, {"ttl_s": 0}, {"min_prefix": 0}])
def test_zero_limits_are_refused(bad: dict[str, float]) -> None:
    values: dict[str, float] = {"capacity_bytes": 1, "max_entries": 1, "ttl_s": 1, "min_prefix": 1} | bad
    with pytest.raises(ValueError, match="must be positive"):
        StoreLimits(**values)  # type: ignore[arg-type]


def test_a_snapshot_continuing_an_entry_of_its_conversation_supersedes_it() -> None:
    s, _ = store()
    put(s, (*BASE[:30], 1, 2, 3), origin=Origin.COMPLETION)
    (older,) = s.snapshots()
    diverging = (*BASE[:30], 9, 9, 9, 9)  # the reply re-rendered differently: not a strict extension
    result = s.insert(
        bucket=BUCKET,
        session="a",
        origin=Origin.COMPLETION,
        tokens=diverging,
        state=None,
        nbytes=10,
        continues=older.entry_id,
    )
    assert result.superseded == 1
    assert [x.tokens for x in s.snapshots()] == [diverging]
    other = s.insert(
        bucket=BUCKET,
        session="b",
        origin=Origin.COMPLETION,
        tokens=BASE,
        state=None,
        nbytes=10,
        continues=s.snapshots()[0].entry_id,  # another session's entry is never removed this way
    )
    assert other.superseded == 0
    assert s.entries == 2


def test_lookup_names_the_sessions_completion_that_the_prompt_continues() -> None:
    s, _ = store(trimmable=False)
    put(s, BASE[:20], origin=Origin.BOUNDARY)
    for session, reply in (("a", (5, 5)), ("b", (6, 6))):  # prompt BASE[:30], then a generated reply
        s.insert(
            bucket=BUCKET,
            session=session,
            origin=Origin.COMPLETION,
            tokens=(*BASE[:30], *reply),
            state=None,
            nbytes=10,
            prompt_length=30,
        )
    (completion,) = [x for x in s.snapshots() if x.origin is Origin.COMPLETION and x.session == "a"]
    result = s.lookup(BUCKET, "a", BASE)  # reuses the boundary; continues the completion whose prompt it extends
    assert result.matched == 20
    assert result.continues == completion.entry_id
    assert s.lookup(BUCKET, "a", BASE[:25] + (1,) * 20).continues is None  # does not extend that prompt


def test_extended_tells_whether_the_session_already_holds_the_vector_or_beyond() -> None:
    s, _ = store(trimmable=False)
    put(s, BASE, session="a")
    assert s.extended(BUCKET, "a", BASE[:30])
    assert s.extended(BUCKET, "a", BASE)
    assert not s.extended(BUCKET, "b", BASE[:30])
    assert not s.extended(BUCKET, "a", (*BASE, 1))


def test_the_next_turn_continues_a_completion_even_if_its_last_prompt_token_re_tokenized() -> None:
    s, _ = store(trimmable=False)
    prompt = (*BASE[:30], 198)  # ends with the generation prompt's newline
    s.insert(
        bucket=BUCKET,
        session="a",
        origin=Origin.COMPLETION,
        tokens=(*prompt, 198, 198),
        state=None,
        nbytes=10,
        prompt_length=len(prompt),
    )
    (completion,) = s.snapshots()
    next_turn = (*BASE[:30], 22342, 7, 8, 9)  # "\n" + the reply's newlines re-rendered as one token
    assert s._continued(BUCKET, "a", next_turn) == completion.entry_id


# The disk tier. KEYS[i]: a 10-token vector of its own; each entry holds 10 bytes, so its file is charged FOOTPRINT.
KEYS = [(i,) * 10 for i in range(10)]
FOOTPRINT = disk_footprint(10, 10)


def disk_store(
    *, capacity: int = 30, disk: int = 3 * FOOTPRINT, entries: int = 100, ttl: float = 60.0, trimmable: bool = True
) -> tuple[SnapshotStore, Clock]:
    clock = Clock()
    limits = StoreLimits(
        capacity_bytes=capacity, max_entries=entries, ttl_s=ttl, min_prefix=8, disk_capacity_bytes=disk
    )
    return SnapshotStore(limits, trimmable=trimmable, clock=clock), clock


def put_key(s: SnapshotStore, clock: Clock, key: int, *, nbytes: int = 10) -> Snapshot:
    """Insert KEYS[key] in a session of its own, a second after the last insert; returns its snapshot."""
    clock.now += 1
    assert put(s, KEYS[key], session=str(key), nbytes=nbytes)
    return s.snapshots()[-1]


def described(effects: list[DiskEffect]) -> list[tuple[str, int, object]]:
    """Effects as (kind, entry id, state written): comparable at a glance."""
    return [
        ("write", effect.snapshot.entry_id, effect.state)
        if isinstance(effect, WriteFile)
        else ("delete", effect.entry_id, None)
        for effect in effects
    ]


def tiers(snapshot: Snapshot) -> tuple[bool, bool, bool]:
    return snapshot.in_memory, snapshot.on_disk, snapshot.writing


def hit(s: SnapshotStore, key: int) -> Snapshot | None:
    return s.lookup(BUCKET, str(key), (*KEYS[key], 99)).snapshot


def test_an_insert_with_a_disk_tier_is_written_behind_and_held_in_both_tiers() -> None:
    s, clock = disk_store()
    x = put_key(s, clock, 1)
    assert described(s.take_effects()) == [("write", x.entry_id, KEYS[1])]
    assert s.take_effects() == []  # taken once
    assert tiers(x) == (True, True, True)
    assert (x.state_held, x.disk_bytes, x.state) == (True, FOOTPRINT, KEYS[1])
    assert (s.nbytes, s.disk_nbytes) == (10, FOOTPRINT)
    stats = s.stats()
    assert (stats.entries, stats.memory_entries, stats.disk_entries, stats.disk_nbytes) == (1, 1, 1, FOOTPRINT)
    assert s.wants_file(x.entry_id)
    s.write_done(x.entry_id)
    assert tiers(x) == (True, True, False)
    assert (x.state_held, x.state) == (True, KEYS[1])  # memory still holds it
    assert not s.wants_file(x.entry_id)
    assert s.take_effects() == []
    assert (s.counters.spills, s.counters.disk_write_failures, s.counters.evictions_lru) == (0, 0, 0)


def test_memory_pressure_spills_the_least_recently_used_entry_to_disk() -> None:
    s, clock = disk_store(capacity=20)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    s.write_done(x.entry_id)
    s.write_done(y.entry_id)
    z = put_key(s, clock, 3)
    assert described(s.take_effects()) == [("write", z.entry_id, KEYS[3])]  # x already has its file
    assert tiers(x) == (False, True, False)
    assert (x.state_held, x.state) == (False, None)
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [x.entry_id, y.entry_id, z.entry_id]
    assert (s.counters.spills, s.counters.evictions_lru, s.counters.evictions_disk) == (1, 0, 0)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (3, 20, 3 * FOOTPRINT)
    stats = s.stats()
    assert (stats.memory_entries, stats.disk_entries) == (2, 3)

    clock.now += 1
    assert hit(s, 1) is x  # answered from disk: the owner reads it back
    assert (x.state_held, s.counters.hits, s.counters.disk_hits) == (False, 0, 0)  # not a hit until it is read
    assert s.promote(x.entry_id, "read back")
    s.count_disk_hit(len(KEYS[1]) - 1)
    assert (s.counters.hits, s.counters.disk_hits, s.counters.tokens_reused) == (1, 1, len(KEYS[1]) - 1)
    assert tiers(x) == (True, True, False)
    assert x.state == "read back"
    assert tiers(y) == (False, True, False)  # now the least recently used in memory: spilled in turn
    assert y.state is None
    assert (s.counters.restores, s.counters.spills, s.counters.evictions_lru) == (1, 2, 0)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (3, 20, 3 * FOOTPRINT)
    assert s.take_effects() == []
    assert not s.promote(x.entry_id, "again")  # already in memory
    assert x.state == "read back"
    assert not s.promote(12345, "gone")  # no such entry
    assert s.counters.restores == 1


def test_an_entry_spilled_while_its_write_is_pending_keeps_its_state_until_the_write_is_done() -> None:
    s, clock = disk_store(capacity=10)
    x = put_key(s, clock, 1)
    y = put_key(s, clock, 2)
    assert described(s.take_effects()) == [("write", x.entry_id, KEYS[1]), ("write", y.entry_id, KEYS[2])]
    assert tiers(x) == (False, True, True)
    assert (x.state_held, x.state) == (True, KEYS[1])  # the writer still needs it
    assert hit(s, 1) is x
    assert (s.counters.hits, s.counters.disk_hits) == (1, 0)  # served from the state still held
    s.write_done(x.entry_id)
    assert tiers(x) == (False, True, False)
    assert (x.state_held, x.state) == (False, None)
    assert hit(s, 1) is x
    assert (s.counters.hits, s.counters.disk_hits) == (1, 0)  # its owner counts it once the file is read


def test_an_entry_whose_write_failed_is_spilled_again_when_memory_lets_go_of_it() -> None:
    s, clock = disk_store(capacity=20)
    x = put_key(s, clock, 1)
    s.take_effects()
    s.write_failed(x.entry_id)
    assert described(s.take_effects()) == [("delete", x.entry_id, None)]  # whatever part of it was written
    assert tiers(x) == (True, False, False)
    assert (x.state, x.disk_bytes, s.disk_nbytes) == (KEYS[1], 0, 0)
    assert (s.counters.disk_write_failures, s.counters.disk_write_losses) == (1, 0)
    assert not s.wants_file(x.entry_id)
    y = put_key(s, clock, 2)
    z = put_key(s, clock, 3)
    assert described(s.take_effects()) == [
        ("write", y.entry_id, KEYS[2]),
        ("write", x.entry_id, KEYS[1]),  # spilled: written now instead of dropped
        ("write", z.entry_id, KEYS[3]),
    ]
    assert tiers(x) == (False, True, True)
    assert (s.counters.spills, s.counters.evictions_lru) == (1, 0)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (3, 20, 3 * FOOTPRINT)


def test_an_entry_too_big_for_the_disk_is_dropped_when_memory_lets_go_of_it() -> None:
    s, clock = disk_store(capacity=20, disk=FOOTPRINT)
    x = put_key(s, clock, 1, nbytes=11)  # its file would not fit the whole disk budget
    assert s.take_effects() == []
    assert tiers(x) == (True, False, False)
    y = put_key(s, clock, 2, nbytes=9)
    assert described(s.take_effects()) == [("write", y.entry_id, KEYS[2])]
    z = put_key(s, clock, 3, nbytes=9)  # 29 bytes: x goes, and its file cannot be written
    assert described(s.take_effects()) == [("delete", y.entry_id, None), ("write", z.entry_id, KEYS[3])]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id, z.entry_id]
    assert (s.counters.evictions_lru, s.counters.spills, s.counters.disk_copies_evicted) == (1, 0, 1)
    assert tiers(y) == (True, False, False)  # memory keeps it; only its file went
    assert (s.nbytes, s.disk_nbytes) == (18, disk_footprint(9, 10))


def test_disk_pressure_deletes_the_least_recently_used_disk_only_entry() -> None:
    s, clock = disk_store(capacity=10, disk=2 * FOOTPRINT)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    for snapshot in (x, y):
        s.write_done(snapshot.entry_id)
    z = put_key(s, clock, 3)
    assert described(s.take_effects()) == [("delete", x.entry_id, None), ("write", z.entry_id, KEYS[3])]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id, z.entry_id]
    assert (s.counters.evictions_disk, s.counters.disk_copies_evicted, s.counters.spills) == (1, 0, 2)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (2, 10, 2 * FOOTPRINT)
    assert hit(s, 1) is None
    clock.now += 1
    assert hit(s, 2) is y  # a lookup makes y the most recently used on disk too
    w = put_key(s, clock, 4)
    assert described(s.take_effects()) == [("delete", z.entry_id, None), ("write", w.entry_id, KEYS[4])]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id, w.entry_id]
    assert s.counters.evictions_disk == 2


def test_disk_pressure_only_deletes_the_file_of_an_entry_memory_holds() -> None:
    s, clock = disk_store(capacity=30, disk=2 * FOOTPRINT)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    z = put_key(s, clock, 3)
    assert described(s.take_effects()) == [("delete", x.entry_id, None), ("write", z.entry_id, KEYS[3])]
    assert tiers(x) == (True, False, False)
    assert (x.state, x.disk_bytes) == (KEYS[1], 0)
    assert not s.wants_file(x.entry_id)
    s.write_done(x.entry_id)  # the write it no longer wants, reported late: nothing changes
    assert tiers(x) == (True, False, False)
    assert (s.counters.disk_copies_evicted, s.counters.evictions_disk, s.counters.evictions_lru) == (1, 0, 0)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (3, 30, 2 * FOOTPRINT)
    assert hit(s, 1) is x
    assert s.counters.disk_hits == 0
    assert [snapshot.entry_id for snapshot in (y, z) if snapshot.on_disk] == [y.entry_id, z.entry_id]


def test_a_newer_turn_removes_the_older_one_from_disk_before_charging_its_own_file() -> None:
    footprint = disk_footprint(10, len(BASE))
    s, clock = disk_store(capacity=10, disk=2 * footprint)
    put(s, BASE[:20], session="a")
    (older,) = s.snapshots()
    clock.now += 1
    put(s, (1,) * len(BASE), session="b")  # the older turn is spilled: only its file is left
    other = s.snapshots()[-1]
    s.take_effects()
    assert tiers(older) == (False, True, True)
    clock.now += 1
    assert put(s, BASE, session="a")
    newer = s.snapshots()[-1]
    assert described(s.take_effects()) == [("delete", older.entry_id, None), ("write", newer.entry_id, BASE)]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [other.entry_id, newer.entry_id]
    assert tiers(other) == (False, True, True)  # spilled, and its file kept: the older turn's bytes made room
    assert (s.counters.supersedes, s.counters.evictions_disk, s.counters.evictions_lru) == (1, 0, 0)
    assert s.disk_nbytes == 2 * footprint == s.limits.disk_capacity_bytes
    assert not s.wants_file(older.entry_id)


def test_an_unreadable_file_forgets_its_entry() -> None:
    s, clock = disk_store(capacity=10)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    s.write_done(x.entry_id)
    assert hit(s, 1) is x and not x.state_held
    s.drop_unreadable(x.entry_id)
    assert described(s.take_effects()) == [("delete", x.entry_id, None)]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id]
    assert (s.counters.disk_unreadable, s.entries, s.nbytes, s.disk_nbytes) == (1, 1, 10, FOOTPRINT)
    assert not s.promote(x.entry_id, "too late")
    assert hit(s, 1) is None
    s.drop_unreadable(x.entry_id)  # twice: nothing more
    assert s.take_effects() == []
    assert s.counters.disk_unreadable == 1


def test_a_failed_write_of_an_entry_only_on_disk_loses_it() -> None:
    s, clock = disk_store(capacity=10)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    assert tiers(x) == (False, True, True)
    s.write_failed(x.entry_id)
    assert described(s.take_effects()) == [("delete", x.entry_id, None)]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id]
    assert (s.counters.disk_write_failures, s.counters.disk_write_losses) == (1, 1)
    assert (s.entries, s.nbytes, s.disk_nbytes) == (1, 10, FOOTPRINT)
    s.write_failed(x.entry_id)  # reported twice: nothing more
    assert s.take_effects() == []
    assert s.counters.disk_write_failures == 1


def test_reset_deletes_every_file() -> None:
    s, clock = disk_store(capacity=20)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    s.write_failed(y.entry_id)  # y: memory only
    z = put_key(s, clock, 3)  # x: spilled, disk only
    s.take_effects()
    assert [tiers(snapshot)[:2] for snapshot in (x, y, z)] == [(False, True), (True, False), (True, True)]
    assert s.reset() == (3, 20 + 2 * FOOTPRINT)
    assert described(s.take_effects()) == [("delete", x.entry_id, None), ("delete", z.entry_id, None)]
    assert (s.entries, s.nbytes, s.disk_nbytes) == (0, 0, 0)
    stats = s.stats()
    assert (stats.memory_entries, stats.disk_entries, stats.disk_nbytes) == (0, 0, 0)
    assert hit(s, 1) is None


def adopt(s: SnapshotStore, tokens: tuple[int, ...], *, session: str = "a", nbytes: int = 10, age: float) -> int | None:
    return s.adopt(
        bucket=BUCKET,
        session=session,
        origin=Origin.BOUNDARY,
        tokens=tokens,
        nbytes=nbytes,
        prompt_length=len(tokens),
        age_s=age,
    )


def test_adopting_the_files_of_an_earlier_run_rebuilds_the_index_on_disk() -> None:
    s, clock = disk_store()
    first = adopt(s, KEYS[1], session="1", age=30)
    second = adopt(s, KEYS[2], session="2", age=10)
    assert first is not None and second is not None
    assert s.take_effects() == []
    x, y = s.snapshots()
    assert [x.entry_id, y.entry_id] == [first, second]
    assert [tiers(x), tiers(y)] == [(False, True, False)] * 2
    assert (x.state, x.state_held, x.disk_bytes, x.last_used, y.last_used) == (None, False, FOOTPRINT, 970, 990)
    assert (s.counters.adopted, s.counters.inserts, s.entries, s.nbytes, s.disk_nbytes) == (2, 0, 2, 0, 2 * FOOTPRINT)
    assert hit(s, 1) is x
    assert (s.counters.hits, s.counters.disk_hits) == (0, 0)
    assert s.promote(x.entry_id, "read back")
    assert (tiers(x), x.state, s.nbytes) == ((True, True, False), "read back", 10)
    clock.now += 51  # y was last used 61 s ago by this clock (adopted 10 s old): its file goes with it
    assert s.sweep() == 1
    assert described(s.take_effects()) == [("delete", y.entry_id, None)]
    assert s.counters.evictions_ttl == 1


def test_an_adopted_older_turn_is_superseded_by_the_newer_one() -> None:
    s, _ = disk_store()
    older = adopt(s, BASE[:20], age=30)
    newer = adopt(s, BASE, age=10)
    assert older is not None and newer is not None
    assert described(s.take_effects()) == [("delete", older, None)]
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [newer]
    assert (s.counters.adopted, s.counters.supersedes, s.entries) == (2, 1, 1)
    assert s.disk_nbytes == disk_footprint(10, len(BASE))


@pytest.mark.parametrize(
    ("nbytes", "age", "disk"),
    [
        (10, 60.0, 3 * FOOTPRINT),  # as old as the TTL
        (10, 100.0, 3 * FOOTPRINT),
        (11, 1.0, FOOTPRINT),  # its file is over the whole disk budget
        (31, 1.0, 100 * FOOTPRINT),  # over the whole memory budget: it could never be read back
        (10, 1.0, 0),  # no disk tier
    ],
)
def test_an_entry_that_does_not_fit_is_not_adopted(nbytes: int, age: float, disk: int) -> None:
    s, _ = disk_store(disk=disk)
    assert adopt(s, KEYS[1], nbytes=nbytes, age=age) is None
    assert (s.entries, s.disk_nbytes, s.counters.adopted) == (0, 0, 0)
    assert s.take_effects() == []


def test_flush_writes_only_the_entries_without_a_file() -> None:
    s, clock = disk_store()
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    s.take_effects()
    s.write_done(y.entry_id)
    s.write_failed(x.entry_id)
    s.take_effects()
    assert s.flush() == 1
    assert described(s.take_effects()) == [("write", x.entry_id, KEYS[1])]
    assert tiers(x) == (True, True, True)
    assert (s.disk_nbytes, s.counters.spills) == (2 * FOOTPRINT, 0)
    assert s.flush() == 0  # x's write is under way
    assert s.take_effects() == []


def test_flush_keeps_the_most_recently_used_entries_when_the_disk_cannot_hold_all() -> None:
    s, clock = disk_store(disk=FOOTPRINT)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)  # y's file replaced x's
    s.take_effects()
    s.write_failed(y.entry_id)  # neither has a file now
    s.take_effects()
    s.flush()
    assert tiers(y)[1] and not tiers(x)[1]  # y, the most recently used, should be the one on disk


def test_without_a_disk_tier_no_effects_are_queued() -> None:
    s, clock = disk_store(capacity=20, disk=0)
    x, y = put_key(s, clock, 1), put_key(s, clock, 2)
    z = put_key(s, clock, 3)  # x is dropped, not spilled
    assert [snapshot.entry_id for snapshot in s.snapshots()] == [y.entry_id, z.entry_id]
    assert tiers(z) == (True, False, False)
    assert hit(s, 2) is y
    s.write_done(y.entry_id)
    s.write_failed(y.entry_id)
    assert s.flush() == 0
    assert not s.promote(x.entry_id, "gone")
    assert adopt(s, KEYS[4], age=1) is None
    s.drop_unreadable(y.entry_id)
    clock.now += 100
    s.sweep()
    put_key(s, clock, 5)
    s.reset()
    assert s.take_effects() == []
    counters = s.counters
    assert (counters.evictions_lru, counters.spills, counters.disk_hits, counters.disk_write_failures) == (1, 0, 0, 0)
    assert (counters.disk_unreadable, counters.evictions_ttl, counters.evictions_disk) == (1, 1, 0)
    assert s.stats().disk_entries == s.stats().disk_nbytes == 0


def test_an_entry_asked_to_be_written_twice_keeps_its_file_when_the_owner_carries_out_the_effects_in_order() -> None:
    s, clock = disk_store(capacity=30, disk=2 * FOOTPRINT)  # memory holds three entries, the disk two files
    x, y, z, w = (put_key(s, clock, key) for key in (1, 2, 3, 4))
    effects = s.take_effects()
    assert described(effects) == [
        ("write", x.entry_id, KEYS[1]),
        ("write", y.entry_id, KEYS[2]),
        ("delete", x.entry_id, None),  # x's file makes room for z's; memory still holds x
        ("write", z.entry_id, KEYS[3]),
        ("delete", y.entry_id, None),
        ("write", x.entry_id, KEYS[1]),  # then memory lets go of x: it is written again
        ("delete", z.entry_id, None),
        ("write", w.entry_id, KEYS[4]),
    ]
    files = set()
    for effect in effects:  # the owner's part, in order: a write no longer wanted is skipped
        if isinstance(effect, DeleteFile):
            files.discard(effect.entry_id)
        elif s.wants_file(effect.snapshot.entry_id, effect.ticket):
            files.add(effect.snapshot.entry_id)
            s.write_done(effect.snapshot.entry_id, effect.ticket)
    assert s.take_effects() == []
    on_disk = {snapshot.entry_id for snapshot in s.snapshots() if snapshot.on_disk}
    assert on_disk == {x.entry_id, w.entry_id}
    assert on_disk <= files  # x's first write, reported done, ended its second before it was carried out


def test_a_prompt_two_entries_serve_equally_is_served_from_the_one_in_memory() -> None:
    """A regenerated prompt: its boundary is only on disk, the completion that extends past it is in memory."""
    s, clock = disk_store(capacity=25, disk=10 * FOOTPRINT)
    boundary = (*BASE[:20],)
    s.insert(bucket=BUCKET, session="a", origin=Origin.BOUNDARY, tokens=boundary, state="boundary", nbytes=10)
    first = s.snapshots()[0]
    put_key(s, clock, 1)
    put_key(s, clock, 2)  # the boundary leaves memory for disk
    s.write_done(first.entry_id)
    completion = (*BASE[:21], 7, 7)
    s.insert(
        bucket=BUCKET,
        session="a",
        origin=Origin.COMPLETION,
        tokens=completion,
        state="done",
        nbytes=5,
        prompt_length=21,
    )
    (kept,) = [snapshot for snapshot in s.snapshots() if snapshot.tokens == boundary]
    assert not kept.state_held
    result = s.lookup(BUCKET, "a", BASE[:21])
    assert result.snapshot is not None and result.snapshot.tokens == completion
    assert (result.matched, result.trimmed, s.counters.disk_hits) == (20, True, 0)
