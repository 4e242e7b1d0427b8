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

Two tiers: with a disk budget (`StoreLimits.disk_capacity_bytes` > 0) an entry lives
in memory, on disk, or both, under one index. Every accepted snapshot is also written
to disk behind the request (write-behind: a restart, even `kill -9`, keeps it), so an
entry the memory tier evicts by LRU usually has its file already and only lets go of
its state; one without a file is spilled (written) instead of dropped. A lookup may
answer with an entry that is only on disk: its owner reads the file back and
`promote`s it. The disk tier evicts least-recently-used files within its own budget;
an entry neither tier holds is gone. The store stays pure: what the disk must do is
queued as `WriteFile` / `DeleteFile` effects that its owner takes (`take_effects`) and
carries out in order, reporting back (`write_done`, `write_failed`, `drop_unreadable`).
A file's bytes are charged before it is written (`disk_footprint`, an upper bound), so
the disk cap holds at every moment too. Supersede removes a conversation's older
entries from both tiers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from courier.core.prefix_divergence import Divergence, DivergenceReport, divergence
from courier.core.radix_index import PathMatch, RadixIndex
from courier.core.snapshot_quantization import KvQuantization
from courier.core.snapshot_rejections import FileRejection

ANONYMOUS_SESSION = ""
EntryId = int
# What a snapshot file may need beyond its arrays and tokens (format header: identity, shapes, layer layout).
DISK_HEADER_ALLOWANCE = 64 * 1024
TOKEN_BYTES = 4


def disk_footprint(nbytes: int, token_count: int) -> int:
    """The bytes a snapshot's file is charged (and may take at most): arrays, tokens and the header allowance."""
    return nbytes + TOKEN_BYTES * token_count + DISK_HEADER_ALLOWANCE


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
    # Tiers: held in memory (state kept, `nbytes` charged there); on disk (file written or being written,
    # `disk_bytes` charged there). While `writing`, the state is kept for the writer even when not in memory.
    in_memory: bool = True
    on_disk: bool = False
    writing: bool = False
    disk_bytes: int = 0
    # Which write is the wanted one: an entry whose file was evicted and that is spilled again is asked to be written
    # twice; only the report of the second write may end its `writing`.
    write_ticket: int = 0

    @property
    def state_held(self) -> bool:
        """Whether the state can be handed out without reading the file back."""
        return self.in_memory or self.writing


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLimits:
    capacity_bytes: int
    max_entries: int
    ttl_s: float
    min_prefix: int
    disk_capacity_bytes: int = 0  # 0: no disk tier
    # How the snapshots it holds store attention KV (None: as computed): reported, never needed by the store.
    quantization: KvQuantization | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.max_entries <= 0 or self.ttl_s <= 0 or self.min_prefix < 1:
            raise ValueError(f"snapshot store limits must be positive: {self}")
        if self.disk_capacity_bytes < 0:
            raise ValueError(f"the disk budget must not be negative: {self.disk_capacity_bytes}")


@dataclass(frozen=True, slots=True)
class WriteFile:
    """Write this entry's state to disk (the state as it was when the write was asked for)."""

    snapshot: Snapshot
    state: Any
    max_bytes: int  # what the disk tier was charged for it: the file may not be larger
    ticket: int  # the entry's write this is (pass it back to `wants_file`, `write_done`, `write_failed`)


@dataclass(frozen=True, slots=True)
class DeleteFile:
    """Delete this entry's file (one not written yet is never written)."""

    entry_id: EntryId


DiskEffect = WriteFile | DeleteFile


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
    # Where the prompt left the closest cached entry, when it missed or left its own conversation's cached history.
    divergence: Divergence | None = None


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
    divergences: int = 0  # lookups that missed, or left their conversation's cached history, at a point found
    # The disk tier (all zero without one).
    disk_hits: int = 0  # lookups answered with an entry read back from disk (counted in `hits` too)
    spills: int = 0  # memory LRU evictions that kept the entry on disk
    restores: int = 0  # entries read back from disk into memory
    evictions_disk: int = 0  # entries the disk tier evicted by LRU while memory did not hold them: gone
    disk_copies_evicted: int = 0  # files the disk tier evicted of entries memory still holds
    disk_write_failures: int = 0
    disk_write_losses: int = 0  # write failures of entries memory no longer held: gone
    disk_unreadable: int = 0  # corrupt, truncated or foreign files found on reading: entry gone, file deleted
    adopted: int = 0  # entries indexed from the files of an earlier run


@dataclass(slots=True)
class DiskIoCounters:
    """What the disk tier's worker has done (kept by the store's owner, which does the I/O)."""

    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    writes_skipped: int = 0  # asked for, but the entry was superseded or evicted before its turn came
    writes_refused: int = 0  # the writer had too many bytes waiting: memory only, counted, never a stall
    write_errors: int = 0  # a full disk, an I/O error
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    read_errors: int = 0  # unreadable, corrupt or vanished files
    restores_refused: int = 0  # every reader busy: answered as a miss
    # Files named like snapshot files not used (at start-up or read back), by reason: deleted, a miss.
    files_rejected: dict[FileRejection, int] = field(default_factory=dict)
    pending: int = 0  # writes and deletes queued or under way, at the moment the figures were read


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """What the store holds and has done, at one moment (a copy: the store's owner hands it out)."""

    entries: int
    nbytes: int
    limits: StoreLimits
    counters: StoreCounters
    memory_entries: int = 0
    disk_entries: int = 0
    disk_nbytes: int = 0
    disk_io: DiskIoCounters = field(default_factory=DiskIoCounters)
    disk_directory: str = ""
    divergences: tuple[DivergenceReport, ...] = ()  # the last few, oldest first (kept by the store's owner)


@dataclass(slots=True)
class _BucketIndex:
    index: RadixIndex[EntryId] = field(default_factory=RadixIndex)


class SnapshotStore:
    def __init__(self, limits: StoreLimits, *, trimmable: bool, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.counters = StoreCounters()
        self._trimmable = trimmable
        self._clock = clock
        self._entries: OrderedDict[EntryId, Snapshot] = OrderedDict()  # least recently used first, both tiers
        self._memory: OrderedDict[EntryId, Snapshot] = OrderedDict()  # the memory tier, least recently used first
        self._disk: OrderedDict[EntryId, Snapshot] = OrderedDict()  # the disk tier, least recently used first
        self._buckets: dict[Bucket, _BucketIndex] = {}
        # Completion snapshots per conversation (bucket, session): few each, so a continuation is found cheaply.
        self._completions: dict[tuple[Bucket, str], set[EntryId]] = {}
        self._bytes = 0
        self._disk_bytes = 0
        self._effects: list[DiskEffect] = []
        self._ids = itertools.count(1)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes charged to the memory tier."""
        return self._bytes

    @property
    def disk_nbytes(self) -> int:
        """Bytes charged to the disk tier (files written and being written)."""
        return self._disk_bytes

    @property
    def has_disk(self) -> bool:
        return self.limits.disk_capacity_bytes > 0

    def stats(self) -> StoreStats:
        return StoreStats(
            entries=self.entries,
            nbytes=self.nbytes,
            limits=self.limits,
            counters=replace(self.counters),
            memory_entries=len(self._memory),
            disk_entries=len(self._disk),
            disk_nbytes=self._disk_bytes,
        )

    def snapshots(self) -> list[Snapshot]:
        return list(self._entries.values())

    def get(self, entry_id: EntryId) -> Snapshot | None:
        return self._entries.get(entry_id)

    def take_effects(self) -> list[DiskEffect]:
        """What the disk must do, in the order it must be done; taken once."""
        effects, self._effects = self._effects, []
        return effects

    def lookup(
        self, bucket: Bucket, session: str, tokens: Sequence[int], *, find_divergence: bool = True
    ) -> LookupResult:
        """The longest usable prefix of `tokens` held for `bucket`; same-session entries win ties. The snapshot may
        be on disk only (`state_held` False): its owner reads it back, `promote`s it and, if its asker still waits,
        counts the hit (`count_disk_hit`). With `find_divergence` (a turn's lookup; an idle warm-up's is how the
        conversation catches up, not a turn), a miss or a prompt that left its conversation's cached history says
        where (`LookupResult.divergence`)."""
        self.counters.lookups += 1
        self._sweep_expired()
        vector = tuple(tokens)
        indexed = self._buckets.get(bucket)
        if indexed is None or not vector:
            return MISS
        match = indexed.index.match(vector)
        continued = self._continued(bucket, session, vector)
        result = replace(self._best_match(match, session, vector), continues=continued)
        snapshot = result.snapshot
        missed = snapshot is None or result.matched < self.limits.min_prefix
        diverged = (
            self._divergence(bucket, session, vector, match, 0 if missed else result.matched)
            if find_divergence
            else None
        )
        self.counters.divergences += diverged is not None
        if snapshot is None or missed:
            return replace(MISS, divergence=diverged)
        self._touch(snapshot)
        if snapshot.state_held:
            self.counters.hits += 1
            self.counters.tokens_reused += result.matched
        return replace(result, divergence=diverged)

    def count_disk_hit(self, matched: int) -> None:
        """A lookup answered with an entry only on disk got its state read back: now it is a hit (one whose file
        turned out unreadable, or was read too late for its asker's deadline, is not)."""
        self.counters.hits += 1
        self.counters.disk_hits += 1
        self.counters.tokens_reused += matched

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
        evicted, self_evicted = self._make_entry_room(session)
        self._index(snapshot)
        self._memory[snapshot.entry_id] = snapshot
        self._bytes += nbytes
        self.counters.inserts += 1
        lost, self_lost = self._fit_memory(session)
        if self.has_disk:
            self._persist(snapshot)  # write-behind: a restart keeps it; a later eviction only lets go of the state
        return InsertResult(
            accepted=True,
            superseded=superseded,
            freed_bytes=freed,
            evicted=evicted + lost,
            self_evicted=self_evicted + self_lost,
        )

    def adopt(
        self,
        *,
        bucket: Bucket,
        session: str,
        origin: Origin,
        tokens: Sequence[int],
        nbytes: int,
        prompt_length: int,
        age_s: float,
    ) -> EntryId | None:
        """Index an entry whose file an earlier run wrote (on disk only), `age_s` since its last use. Adopt oldest
        first, before serving. None: it does not fit the limits now (its owner deletes the file)."""
        vector = tuple(tokens)
        footprint = disk_footprint(nbytes, len(vector))
        too_big = nbytes > self.limits.capacity_bytes or footprint > self.limits.disk_capacity_bytes
        if too_big or age_s >= self.limits.ttl_s or not vector:
            return None
        self._supersede(bucket, session, origin, vector)  # an older turn's file that a kill left behind
        used = self._clock() - max(0.0, age_s)
        snapshot = Snapshot(
            entry_id=next(self._ids),
            tokens=vector,
            state=None,
            nbytes=nbytes,
            bucket=bucket,
            session=session,
            origin=origin,
            created=used,
            last_used=used,
            prompt_length=prompt_length,
            in_memory=False,
            on_disk=True,
            disk_bytes=footprint,
        )
        self._make_entry_room(session)
        self._make_disk_room(footprint)
        self._index(snapshot)
        self._disk[snapshot.entry_id] = snapshot
        self._disk_bytes += footprint
        self.counters.adopted += 1
        return snapshot.entry_id

    def promote(self, entry_id: EntryId, state: Any) -> bool:
        """A disk-only entry read back: hold `state` in memory again (evicting others there as an insert does).
        False when the entry is gone or already in memory meanwhile (the state is still good for its reader)."""
        snapshot = self._entries.get(entry_id)
        if snapshot is None or snapshot.in_memory:
            return False
        snapshot.state = state
        snapshot.in_memory = True
        self._memory[entry_id] = snapshot
        self._bytes += snapshot.nbytes
        self.counters.restores += 1
        self._fit_memory(snapshot.session)
        return True

    def write_done(self, entry_id: EntryId, ticket: int | None = None) -> None:
        """The file of write `ticket` (default: the latest asked for) is in place."""
        if not self.wants_file(entry_id, ticket):
            return
        snapshot = self._entries[entry_id]
        snapshot.writing = False
        if not snapshot.in_memory:
            snapshot.state = None

    def write_failed(self, entry_id: EntryId, ticket: int | None = None) -> None:
        """The file of write `ticket` (default: the latest) could not be written (disk full, an I/O error, the
        writer busy): the entry stays in memory only, or is gone if memory no longer holds it."""
        if not self.wants_file(entry_id, ticket):
            return
        snapshot = self._entries[entry_id]
        self.counters.disk_write_failures += 1
        self._off_disk(snapshot)
        if not snapshot.in_memory:
            self.counters.disk_write_losses += 1
            self._remove(snapshot)

    def drop_unreadable(self, entry_id: EntryId) -> None:
        """The entry's file is corrupt, truncated or foreign: forget the entry and delete the file."""
        snapshot = self._entries.get(entry_id)
        if snapshot is None:
            return
        self.counters.disk_unreadable += 1
        self._remove(snapshot)

    def flush(self, *, evict: bool = True) -> int:
        """Write every entry memory holds that has no file yet (before a clean stop; or, not `evict`ing, only those
        the disk has room for as it is: an idle writer catching up); returns how many were asked for."""
        if not self.has_disk:
            return 0
        pending = [snapshot for snapshot in self._memory.values() if not snapshot.on_disk]
        # Least recently used first: when the disk cannot hold them all, the newer evict the older (whose writes,
        # no longer wanted by then, are skipped).
        for snapshot in pending:
            footprint = disk_footprint(snapshot.nbytes, len(snapshot.tokens))
            if evict or self._disk_bytes + footprint <= self.limits.disk_capacity_bytes:
                self._persist(snapshot)
        return sum(snapshot.on_disk for snapshot in pending)

    def wants_file(self, entry_id: EntryId, ticket: int | None = None) -> bool:
        """Whether write `ticket` (default: the latest) of this entry is still wanted: the entry may have been
        superseded or evicted since, or its file evicted and asked for again."""
        snapshot = self._entries.get(entry_id)
        if snapshot is None or not snapshot.writing:
            return False
        return ticket is None or ticket == snapshot.write_ticket

    def disk_ages(self) -> list[tuple[EntryId, float]]:
        """Seconds since each entry with a file written was last used (its file's use time, for the next start)."""
        now = self._clock()
        return [(key, now - entry.last_used) for key, entry in self._disk.items() if not entry.writing]

    def sweep(self) -> int:
        """Remove expired entries (the periodic tick); lookups also sweep lazily."""
        return self._sweep_expired()

    def reset(self) -> tuple[int, int]:
        """Drop everything, files included; counters are kept. Returns (entries, bytes) freed, both tiers."""
        freed = (len(self._entries), self._bytes + self._disk_bytes)
        self._effects.extend(DeleteFile(entry_id) for entry_id in self._disk)
        self._entries.clear()
        self._memory.clear()
        self._disk.clear()
        self._buckets.clear()
        self._completions.clear()
        self._bytes = self._disk_bytes = 0
        return freed

    def _touch(self, snapshot: Snapshot) -> None:
        snapshot.last_used = self._clock()
        for tier in (self._entries, self._memory, self._disk):
            if snapshot.entry_id in tier:
                tier.move_to_end(snapshot.entry_id)

    def _index(self, snapshot: Snapshot) -> None:
        self._entries[snapshot.entry_id] = snapshot
        if snapshot.origin is Origin.COMPLETION:
            self._completions.setdefault((snapshot.bucket, snapshot.session), set()).add(snapshot.entry_id)
        self._buckets.setdefault(snapshot.bucket, _BucketIndex()).index.add(snapshot.tokens, snapshot.entry_id)

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
            # As long and held in memory beats one that must be read back from disk (a regenerated prompt).
            in_memory_instead = best.snapshot is not None and not best.snapshot.state_held and diverging.state_held
            if shared > best.matched or (shared == best.matched and in_memory_instead):
                return LookupResult(
                    snapshot=diverging, matched=shared, trimmed=True, cross_session=diverging.session != session
                )
        if best.snapshot is not None and best.matched < len(best.snapshot.tokens):
            return LookupResult(
                snapshot=best.snapshot, matched=best.matched, trimmed=True, cross_session=best.cross_session
            )
        return best

    def _divergence(
        self, bucket: Bucket, session: str, vector: tuple[int, ...], match: PathMatch[EntryId], matched: int
    ) -> Divergence | None:
        """Where `vector` leaves the entry sharing the longest prefix with it (the session's own first), when the
        lookup missed (`matched` 0) or that entry is the session's own: its cached history no longer prefixes the
        prompt. None when every entry sharing that prefix ends there (the prompt only goes on past them), or the
        lookup reused a prefix and what diverges further is another conversation's (a shared system prompt)."""
        index = match.shared_length
        if index == 0 or index >= len(vector):
            return None
        diverging = [self._entries[key] for key in match.keys_below_shared if len(self._entries[key].tokens) > index]
        # The anonymous session is every caller that names none: its entries are no one conversation's history.
        own = [entry for entry in diverging if entry.session == session != ANONYMOUS_SESSION]
        if not diverging or (matched and not own):
            return None
        closest = max(own or diverging, key=lambda entry: entry.last_used)
        return divergence(
            prompt=vector,
            closest=closest.tokens,
            index=index,
            matched=matched,
            session=session,
            tenant=bucket.tenant,
            same_session=bool(own),
        )

    def _diverging(self, keys: Sequence[EntryId], session: str) -> Snapshot:
        snapshots = [self._entries[key] for key in keys]
        own = [snapshot for snapshot in snapshots if snapshot.session == session]
        return max(own or snapshots, key=lambda snapshot: (snapshot.state_held, snapshot.last_used))

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

    def _make_entry_room(self, session: str) -> tuple[int, int]:
        """Room for one more entry under the entry cap: the least recently used entries go, from both tiers."""
        evicted = self_evicted = 0
        while self._entries and len(self._entries) + 1 > self.limits.max_entries:
            oldest = next(iter(self._entries.values()))
            self._remove(oldest)
            evicted += 1
            self.counters.evictions_lru += 1
            if oldest.session == session:
                self_evicted += 1
                self.counters.self_evictions += 1
        return evicted, self_evicted

    def _fit_memory(self, session: str) -> tuple[int, int]:
        """Evict least-recently-used entries from memory until its cap holds (the newest entry, which fits alone,
        is last in line): each keeps its file, is spilled to disk, or, with neither, is gone."""
        lost = self_lost = 0
        while self._bytes > self.limits.capacity_bytes:
            oldest = next(iter(self._memory.values()))
            if self.has_disk and (oldest.on_disk or self._persist(oldest)):
                self._off_memory(oldest)
                self.counters.spills += 1
                continue
            self._remove(oldest)
            lost += 1
            self.counters.evictions_lru += 1
            if oldest.session == session:
                self_lost += 1
                self.counters.self_evictions += 1
        return lost, self_lost

    def _persist(self, snapshot: Snapshot) -> bool:
        """Charge the disk tier for `snapshot`'s file and ask for it to be written; False when it cannot fit."""
        footprint = disk_footprint(snapshot.nbytes, len(snapshot.tokens))
        if footprint > self.limits.disk_capacity_bytes:
            return False
        self._make_disk_room(footprint)
        snapshot.on_disk = snapshot.writing = True
        snapshot.disk_bytes = footprint
        snapshot.write_ticket += 1
        self._disk[snapshot.entry_id] = snapshot
        self._disk_bytes += footprint
        self._effects.append(WriteFile(snapshot, snapshot.state, footprint, snapshot.write_ticket))
        return True

    def _make_disk_room(self, footprint: int) -> None:
        while self._disk and self._disk_bytes + footprint > self.limits.disk_capacity_bytes:
            oldest = next(iter(self._disk.values()))
            if oldest.in_memory:
                self.counters.disk_copies_evicted += 1
                self._off_disk(oldest)
            else:
                self.counters.evictions_disk += 1
                self._remove(oldest)

    def _off_memory(self, snapshot: Snapshot) -> None:
        del self._memory[snapshot.entry_id]
        self._bytes -= snapshot.nbytes
        snapshot.in_memory = False
        if not snapshot.writing:
            snapshot.state = None

    def _off_disk(self, snapshot: Snapshot) -> None:
        del self._disk[snapshot.entry_id]
        self._disk_bytes -= snapshot.disk_bytes
        snapshot.on_disk = snapshot.writing = False
        snapshot.disk_bytes = 0
        self._effects.append(DeleteFile(snapshot.entry_id))

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
        if snapshot.in_memory:
            del self._memory[snapshot.entry_id]
            self._bytes -= snapshot.nbytes
            snapshot.in_memory = False
        if snapshot.on_disk:
            self._off_disk(snapshot)
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
