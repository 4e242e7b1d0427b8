"""The snapshot store: an exact-prefix cache of model state, where a conversation's newer
snapshot supersedes its older one.

Pure and synchronous (owned by the snapshot store actor; tested with tables). The
model state is opaque here: the store only keeps it, counts its bytes and hands it
back; copying it is the engine's business, on the MLX thread.

Insert runs in this order, so the byte cap holds at every moment: refuse an entry
larger than the whole budget (it removes nothing); supersede (remove same-bucket,
same-session, same-origin snapshots whose tokens are a strict prefix of the new
ones, and an identical one; a boundary snapshot also removes the session's
completion snapshots that are a strict prefix of it, and those whose prompt but its
last token it starts with and then diverges from); account the new bytes; evict
least-recently-used entries until both caps hold. Lookups walk a radix index per
bucket, so their cost follows the prompt's length, not the number of entries; they
and boundary inserts also scan the session's own completion snapshots (one or two
per conversation; all anonymous callers' in the anonymous session).

Why a boundary supersedes a completion but never the reverse: the idle warm-up
extends a conversation's boundary over the reply just given, so that turn's
completion (prompt + generated tokens) is a strict prefix of the new boundary
whenever the reply re-tokenizes into the tokens generated. When it does not, the
boundary starts with the completion's prompt (but its last token: the generation
prompt's trailing newline may merge with the reply) and diverges inside the reply:
the conversation goes on from the boundary, and the completion could serve only a
prompt carrying the reply as generated, which the re-rendered history never does.
Either way the next prompt starts with the boundary and matches it further (on a
trimmable cache the boundary, trimmed, serves any prompt the completion would, up to
where the two part); keeping both would double what a conversation holds. A
completion never removes a boundary: the next prompt re-renders the reply, so only
the boundary is sure to be a prefix of it.

Sessions: the anonymous session is one session shared by every caller that names
none, so there a boundary may also remove another anonymous caller's completion, but
only one whose whole prompt (but its last token) it repeats: a caller that sent the
same history and got another reply. That caller then prefills its reply once more,
in its idle warm-up (which starts from the prompt instead) or, when its next turn
comes first and the reply re-tokenizes as generated, in that turn. Lookup's
`continues` already lets the next completion of a repeated history supersede such a
sibling, so the anonymous session keeps the rule every session has.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from courier.core.radix_index import PathMatch, RadixIndex

ANONYMOUS_SESSION = ""
EntryId = int


class Origin(Enum):
    BOUNDARY = "boundary"  # the state at the end of a conversation's history, captured during prefill
    COMPLETION = "completion"  # the state after a generation: prompt + generated tokens


@dataclass(frozen=True, slots=True)
class Bucket:
    """State is only ever reused within one bucket: same model, adapter, chat template, media and tenant (an API
    key's: with keys, no caller can reuse, supersede or probe another key's state)."""

    model_id: str
    adapter_id: str = ""
    template_signature: str = ""
    media_digest: str = ""
    tenant: str = ""


@dataclass(slots=True, kw_only=True)
class Snapshot:
    entry_id: EntryId
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    bucket: Bucket
    session: str
    origin: Origin
    created: float
    last_used: float
    # How many of `tokens` were the prompt (the rest was generated); all of them for a boundary snapshot.
    prompt_length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLimits:
    capacity_bytes: int
    max_entries: int
    ttl_s: float
    min_prefix: int

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.max_entries <= 0 or self.ttl_s <= 0 or self.min_prefix < 1:
            raise ValueError(f"snapshot store limits must be positive: {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """`snapshot` with its first `matched` tokens usable (trim the state when `trimmed`), or a miss."""

    snapshot: Snapshot | None
    matched: int
    trimmed: bool = False
    cross_session: bool = False
    # This session's last completion that the prompt continues (it diverges where the reply was re-rendered):
    # the completion snapshot of this request supersedes it.
    continues: EntryId | None = None


MISS = LookupResult(snapshot=None, matched=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertResult:
    accepted: bool
    superseded: int = 0
    freed_bytes: int = 0
    evicted: int = 0
    self_evicted: int = 0


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    inserts: int = 0
    supersedes: int = 0
    replacements: int = 0
    evictions_lru: int = 0
    evictions_ttl: int = 0
    rejections_oversized: int = 0
    self_evictions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """What the store holds and has done, at one moment (a copy: the store's owner hands it out)."""

    entries: int
    nbytes: int
    limits: StoreLimits
    counters: StoreCounters


@dataclass(slots=True)
class _BucketIndex:
    index: RadixIndex[EntryId] = field(default_factory=RadixIndex)


class SnapshotStore:
    def __init__(self, limits: StoreLimits, *, trimmable: bool, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.counters = StoreCounters()
        self._trimmable = trimmable
        self._clock = clock
        self._entries: OrderedDict[EntryId, Snapshot] = OrderedDict()  # least recently used first
        self._buckets: dict[Bucket, _BucketIndex] = {}
        # Completion snapshots per conversation (bucket, session): few each, so a continuation is found cheaply.
        self._completions: dict[tuple[Bucket, str], set[EntryId]] = {}
        self._bytes = 0
        self._ids = itertools.count(1)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> StoreStats:
        return StoreStats(entries=self.entries, nbytes=self.nbytes, limits=self.limits, counters=replace(self.counters))

    def snapshots(self) -> list[Snapshot]:
        return list(self._entries.values())

    def lookup(self, bucket: Bucket, session: str, tokens: Sequence[int]) -> LookupResult:
        """The longest usable prefix of `tokens` held for `bucket`; same-session entries win ties."""
        self.counters.lookups += 1
        self._sweep_expired()
        vector = tuple(tokens)
        indexed = self._buckets.get(bucket)
        if indexed is None or not vector:
            return MISS
        match = indexed.index.match(vector)
        continued = self._continued(bucket, session, vector)
        result = replace(self._best_match(match, session, vector), continues=continued)
        if result.snapshot is None or result.matched < self.limits.min_prefix:
            return MISS
        result.snapshot.last_used = self._clock()
        self._entries.move_to_end(result.snapshot.entry_id)
        self.counters.hits += 1
        self.counters.tokens_reused += result.matched
        return result

    def extended(self, bucket: Bucket, session: str, tokens: Sequence[int]) -> bool:
        """Whether `session` already holds a live snapshot at or beyond `tokens` (a vector that starts with them)."""
        self._sweep_expired()  # an expired snapshot covers nothing: the warm-up it would skip is still worth doing
        indexed = self._buckets.get(bucket)
        vector = tuple(tokens)
        if indexed is None or not vector:
            return False
        match = indexed.index.match(vector)
        if match.shared_length < len(vector):
            return False
        keys = list(match.keys_below_shared) + [
            key for length, keys in match.prefixes if length == len(vector) for key in keys
        ]
        return any(self._entries[key].session == session for key in keys)

    def insert(
        self,
        *,
        bucket: Bucket,
        session: str,
        origin: Origin,
        tokens: Sequence[int],
        state: Any,
        nbytes: int,
        continues: EntryId | None = None,
        prompt_length: int | None = None,
    ) -> InsertResult:
        """`continues`: the entry this snapshot's generation started from; when it is the same conversation's
        (same bucket, session and origin) it is superseded too, even though a reply re-rendered by the chat
        template rarely makes the old vector a strict prefix of the new one."""
        if nbytes > self.limits.capacity_bytes:
            self.counters.rejections_oversized += 1
            return InsertResult(accepted=False)
        vector = tuple(tokens)
        superseded, freed = self._supersede(bucket, session, origin, vector)
        ancestor = self._entries.get(continues) if continues is not None else None
        if ancestor is not None and (ancestor.bucket, ancestor.session, ancestor.origin) == (bucket, session, origin):
            superseded, freed = superseded + 1, freed + ancestor.nbytes
            self.counters.supersedes += 1
            self._remove(ancestor)
        evicted, self_evicted = self._make_room(nbytes, session)
        now = self._clock()
        snapshot = Snapshot(
            entry_id=next(self._ids),
            tokens=vector,
            state=state,
            nbytes=nbytes,
            bucket=bucket,
            session=session,
            origin=origin,
            created=now,
            last_used=now,
            prompt_length=len(vector) if prompt_length is None else prompt_length,
        )
        self._entries[snapshot.entry_id] = snapshot
        if origin is Origin.COMPLETION:
            self._completions.setdefault((bucket, session), set()).add(snapshot.entry_id)
        self._buckets.setdefault(bucket, _BucketIndex()).index.add(vector, snapshot.entry_id)
        self._bytes += nbytes
        self.counters.inserts += 1
        return InsertResult(
            accepted=True, superseded=superseded, freed_bytes=freed, evicted=evicted, self_evicted=self_evicted
        )

    def sweep(self) -> int:
        """Remove expired entries (the periodic tick); lookups also sweep lazily."""
        return self._sweep_expired()

    def reset(self) -> tuple[int, int]:
        """Drop everything; counters are kept. Returns (entries, bytes) freed."""
        freed = (len(self._entries), self._bytes)
        self._entries.clear()
        self._buckets.clear()
        self._completions.clear()
        self._bytes = 0
        return freed

    def _continued(self, bucket: Bucket, session: str, vector: tuple[int, ...]) -> EntryId | None:
        """This conversation's completion whose whole prompt the new prompt starts with: its previous turn."""
        turns = [c for c in self._conversation_completions(bucket, session) if _continues_prompt(vector, c)]
        return max(turns, key=lambda snapshot: snapshot.prompt_length).entry_id if turns else None

    def _conversation_completions(self, bucket: Bucket, session: str) -> list[Snapshot]:
        return [self._entries[key] for key in self._completions.get((bucket, session), ())]

    def _best_match(self, match: PathMatch[EntryId], session: str, tokens: tuple[int, ...]) -> LookupResult:
        # A usable prefix must leave at least one token to feed: the state after the whole prompt has no logits.
        usable = len(tokens) - 1
        own: tuple[int, Snapshot] | None = None
        other: tuple[int, Snapshot] | None = None
        for length, keys in match.prefixes:
            for key in keys:
                snapshot = self._entries[key]
                fits = length <= usable or self._trimmable
                if not fits:
                    continue
                if snapshot.session == session:
                    own = (length, snapshot)
                elif other is None or length > other[0]:
                    other = (length, snapshot)
        best = LookupResult(snapshot=own[1], matched=min(own[0], usable)) if own else MISS
        if other is not None and other[0] > (own[0] if own else 0):
            best = LookupResult(snapshot=other[1], matched=min(other[0], usable), cross_session=True)
        if self._trimmable and match.shared_length > best.matched and match.keys_below_shared:
            diverging = self._diverging(match.keys_below_shared, session)
            shared = min(match.shared_length, usable)
            if shared > best.matched:
                return LookupResult(
                    snapshot=diverging, matched=shared, trimmed=True, cross_session=diverging.session != session
                )
        if best.snapshot is not None and best.matched < len(best.snapshot.tokens):
            return LookupResult(
                snapshot=best.snapshot, matched=best.matched, trimmed=True, cross_session=best.cross_session
            )
        return best

    def _diverging(self, keys: Sequence[EntryId], session: str) -> Snapshot:
        snapshots = [self._entries[key] for key in keys]
        own = [snapshot for snapshot in snapshots if snapshot.session == session]
        return max(own or snapshots, key=lambda snapshot: snapshot.last_used)

    def _supersede(self, bucket: Bucket, session: str, origin: Origin, vector: tuple[int, ...]) -> tuple[int, int]:
        indexed = self._buckets.get(bucket)
        if indexed is None:
            return 0, 0
        superseded = freed = 0
        for length, keys in indexed.index.match(vector).prefixes:
            strict = length < len(vector)
            for key in list(keys):
                snapshot = self._entries[key]
                if snapshot.session != session or not _covers(origin, snapshot.origin, strict=strict):
                    continue
                freed += snapshot.nbytes
                self._remove(snapshot)
                if strict:
                    superseded += 1
                    self.counters.supersedes += 1
                else:
                    self.counters.replacements += 1
        if origin is Origin.BOUNDARY:
            # The turns this boundary carries on past (their completions left above were not prefixes of it).
            for completion in self._conversation_completions(bucket, session):
                if _continues_prompt(vector, completion) and completion.tokens[: len(vector)] != vector:
                    superseded += 1
                    freed += completion.nbytes
                    self.counters.supersedes += 1
                    self._remove(completion)
        return superseded, freed

    def _make_room(self, nbytes: int, session: str) -> tuple[int, int]:
        evicted = self_evicted = 0
        while self._entries and (
            self._bytes + nbytes > self.limits.capacity_bytes or len(self._entries) + 1 > self.limits.max_entries
        ):
            oldest = next(iter(self._entries.values()))
            self._remove(oldest)
            evicted += 1
            self.counters.evictions_lru += 1
            if oldest.session == session:
                self_evicted += 1
                self.counters.self_evictions += 1
        return evicted, self_evicted

    def _sweep_expired(self) -> int:
        deadline = self._clock() - self.limits.ttl_s
        expired = 0
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used > deadline:
                break
            self._remove(oldest)
            expired += 1
        self.counters.evictions_ttl += expired
        return expired

    def _remove(self, snapshot: Snapshot) -> None:
        del self._entries[snapshot.entry_id]
        self._bytes -= snapshot.nbytes
        indexed = self._buckets[snapshot.bucket]
        indexed.index.remove(snapshot.tokens, snapshot.entry_id)
        if snapshot.origin is Origin.COMPLETION:
            conversation = (snapshot.bucket, snapshot.session)
            self._completions[conversation].discard(snapshot.entry_id)
            if not self._completions[conversation]:
                del self._completions[conversation]


def _covers(new: Origin, old: Origin, *, strict: bool) -> bool:
    """Whether a new snapshot of origin `new` makes an old one of origin `old`, whose tokens prefix it, redundant."""
    # A boundary extended over a turn's reply covers that turn's completion; a completion never covers a boundary.
    return new is old or (strict and new is Origin.BOUNDARY and old is Origin.COMPLETION)


def _continues_prompt(vector: tuple[int, ...], completion: Snapshot) -> bool:
    """Whether `vector` starts with the completion's prompt, all but its last token: the generation prompt's trailing
    newline can merge with the start of the reply when the history is re-rendered (byte-level BPE)."""
    kept = completion.prompt_length - 1
    return kept > 0 and vector[:kept] == completion.tokens[:kept]
