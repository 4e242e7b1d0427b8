"""The snapshot store: an exact-prefix cache of model state, where a conversation's newer snapshot supersedes its older
one.

Pure and synchronous (owned by the snapshot store actor; tested with tables). The model state is opaque here: the
store only keeps it, counts its bytes and hands it back; copying it is the engine's business, on the MLX thread.

Insert runs in this order, so the byte cap holds at every moment: refuse an entry larger than the whole budget (it
removes nothing); supersede (remove same-bucket, same-session, same-origin snapshots whose tokens are a strict prefix
of the new ones, and an identical one; a boundary snapshot also removes the session's completion snapshots that are a
strict prefix of it, and those whose prompt but its last token it starts with and then diverges from); account the
new bytes; evict least-recently-used entries until both caps hold. Lookups walk the bucket's radix index, and they
and boundary inserts also read the session's own completion snapshots (`entry_index.py`).

Which entries a lookup chooses and a new one supersedes, and why: `matching.py`.

Two tiers: with a disk budget (`StoreLimits.disk_capacity_bytes` > 0) an entry lives in memory, on disk, or both,
under one index. Every accepted snapshot is also written to disk behind the request (write-behind: a restart, even
`kill -9`, keeps it), so an entry the memory tier evicts by LRU usually has its file already and only lets go of its
state; one without a file is spilled (written) instead of dropped. A lookup may answer with an entry that is only on
disk: its owner reads the file back and `promote`s it. The disk tier evicts least-recently-used files within its own
budget; an entry neither tier holds is gone. The store stays pure: what the disk must do is queued as `WriteFile` /
`DeleteFile` effects that its owner takes (`take_effects`) and carries out in order, reporting back (`write_done`,
`write_failed`, `drop_unreadable`). A file's bytes are charged before it is written (`disk_footprint`, an upper
bound), so the disk cap holds at every moment too. Supersede removes a conversation's older entries from both tiers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from courier.core.prompt_cache.entries import (
    MISS,
    Bucket,
    DeleteFile,
    DiskEffect,
    EntryId,
    InsertResult,
    LookupResult,
    Origin,
    Snapshot,
    WriteFile,
    disk_footprint,
)
from courier.core.prompt_cache.entry_index import EntryIndex
from courier.core.prompt_cache.matching import best_match, continues_prompt, covers, divergence_of
from courier.core.prompt_cache.stats import StoreCounters, StoreLimits, StoreStats


class SnapshotStore:
    def __init__(self, limits: StoreLimits, *, trimmable: bool, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.counters = StoreCounters()
        self._trimmable = trimmable
        self._clock = clock
        self._index = EntryIndex()  # every entry, both tiers
        self._memory: OrderedDict[EntryId, Snapshot] = OrderedDict()  # the memory tier, least recently used first
        self._disk: OrderedDict[EntryId, Snapshot] = OrderedDict()  # the disk tier, least recently used first
        self._bytes = 0
        self._disk_bytes = 0
        self._effects: list[DiskEffect] = []
        self._ids = itertools.count(1)

    @property
    def entries(self) -> int:
        return len(self._index)

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
        return self._index.snapshots()

    def get(self, entry_id: EntryId) -> Snapshot | None:
        return self._index.get(entry_id)

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
        match = self._index.match(bucket, vector) if vector else None
        if match is None:
            return MISS
        continued = self._continued(bucket, session, vector)
        entries = self._index.by_id
        chosen = best_match(entries, match, session, vector, trimmable=self._trimmable)
        result = replace(chosen, continues=continued)
        snapshot = result.snapshot
        missed = snapshot is None or result.matched < self.limits.min_prefix
        diverged = (
            divergence_of(entries, bucket, session, vector, match=match, matched=0 if missed else result.matched)
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
        vector = tuple(tokens)
        match = self._index.match(bucket, vector) if vector else None
        if match is None:
            return False
        if match.shared_length < len(vector):
            return False
        keys = list(match.keys_below_shared) + [
            key for length, keys in match.prefixes if length == len(vector) for key in keys
        ]
        return any(self._index.by_id[key].session == session for key in keys)

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
        ancestor = self._index.get(continues) if continues is not None else None
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
        evicted, self_evicted = self._make_entry_room(bucket, session)
        self._index.add(snapshot)
        self._memory[snapshot.entry_id] = snapshot
        self._bytes += nbytes
        self.counters.inserts += 1
        lost, self_lost = self._fit_memory(bucket, session)
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
        self._make_entry_room(bucket, session)
        self._make_disk_room(footprint)
        self._index.add(snapshot)
        self._disk[snapshot.entry_id] = snapshot
        self._disk_bytes += footprint
        self.counters.adopted += 1
        return snapshot.entry_id

    def promote(self, entry_id: EntryId, state: Any) -> bool:
        """A disk-only entry read back: hold `state` in memory again (evicting others there as an insert does).
        False when the entry is gone or already in memory meanwhile (the state is still good for its reader)."""
        snapshot = self._index.get(entry_id)
        if snapshot is None or snapshot.in_memory:
            return False
        snapshot.state = state
        snapshot.in_memory = True
        self._memory[entry_id] = snapshot
        self._bytes += snapshot.nbytes
        self.counters.restores += 1
        self._fit_memory(snapshot.bucket, snapshot.session)
        return True

    def write_done(self, entry_id: EntryId, ticket: int | None = None) -> None:
        """The file of write `ticket` (default: the latest asked for) is in place."""
        if not self.wants_file(entry_id, ticket):
            return
        snapshot = self._index.by_id[entry_id]
        snapshot.writing = False
        if not snapshot.in_memory:
            snapshot.state = None

    def write_failed(self, entry_id: EntryId, ticket: int | None = None) -> None:
        """The file of write `ticket` (default: the latest) could not be written (disk full, an I/O error, the
        writer busy): the entry stays in memory only, or is gone if memory no longer holds it."""
        if not self.wants_file(entry_id, ticket):
            return
        snapshot = self._index.by_id[entry_id]
        self.counters.disk_write_failures += 1
        self._off_disk(snapshot)
        if not snapshot.in_memory:
            self.counters.disk_write_losses += 1
            self._remove(snapshot)

    def drop_unreadable(self, entry_id: EntryId) -> None:
        """The entry's file is corrupt, truncated or foreign: forget the entry and delete the file."""
        snapshot = self._index.get(entry_id)
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
        snapshot = self._index.get(entry_id)
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
        freed = (len(self._index), self._bytes + self._disk_bytes)
        self._effects.extend(DeleteFile(entry_id) for entry_id in self._disk)
        self._index.clear()
        self._memory.clear()
        self._disk.clear()
        self._bytes = self._disk_bytes = 0
        return freed

    def _touch(self, snapshot: Snapshot) -> None:
        snapshot.last_used = self._clock()
        self._index.touch(snapshot.entry_id)
        for tier in (self._memory, self._disk):
            if snapshot.entry_id in tier:
                tier.move_to_end(snapshot.entry_id)

    def _continued(self, bucket: Bucket, session: str, vector: tuple[int, ...]) -> EntryId | None:
        """This conversation's completion whose whole prompt the new prompt starts with: its previous turn."""
        turns = [c for c in self._index.conversation_completions(bucket, session) if continues_prompt(vector, c)]
        return max(turns, key=lambda snapshot: snapshot.prompt_length).entry_id if turns else None

    def _supersede(self, bucket: Bucket, session: str, origin: Origin, vector: tuple[int, ...]) -> tuple[int, int]:
        match = self._index.match(bucket, vector)
        if match is None:
            return 0, 0
        superseded = freed = 0
        for length, keys in match.prefixes:
            strict = length < len(vector)
            for key in list(keys):
                snapshot = self._index.by_id[key]
                if snapshot.session != session or not covers(origin, snapshot.origin, strict=strict):
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
            for completion in self._index.conversation_completions(bucket, session):
                if continues_prompt(vector, completion) and completion.tokens[: len(vector)] != vector:
                    superseded += 1
                    freed += completion.nbytes
                    self.counters.supersedes += 1
                    self._remove(completion)
        return superseded, freed

    def _make_entry_room(self, bucket: Bucket, session: str) -> tuple[int, int]:
        """Room for one more entry under the entry cap: the least recently used entries go, from both tiers (an
        entry of the inserting conversation, its bucket's and session's, counts as its own eviction)."""
        evicted = self_evicted = 0
        while (oldest := self._index.oldest()) is not None and len(self._index) + 1 > self.limits.max_entries:
            self._remove(oldest)
            evicted += 1
            self.counters.evictions_lru += 1
            if (oldest.bucket, oldest.session) == (bucket, session):
                self_evicted += 1
                self.counters.self_evictions += 1
        return evicted, self_evicted

    def _fit_memory(self, bucket: Bucket, session: str) -> tuple[int, int]:
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
            if (oldest.bucket, oldest.session) == (bucket, session):
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
        while (oldest := self._index.oldest()) is not None:
            if oldest.last_used > deadline:
                break
            self._remove(oldest)
            expired += 1
        self.counters.evictions_ttl += expired
        return expired

    def _remove(self, snapshot: Snapshot) -> None:
        self._index.remove(snapshot)
        if snapshot.in_memory:
            del self._memory[snapshot.entry_id]
            self._bytes -= snapshot.nbytes
            snapshot.in_memory = False
        if snapshot.on_disk:
            self._off_disk(snapshot)
