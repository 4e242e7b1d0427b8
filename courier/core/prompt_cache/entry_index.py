"""Where the snapshot store finds its entries: every entry of both tiers by id, least recently used first; a radix
index of token vectors per bucket, so a lookup's cost follows the prompt's length, not the number of entries; and
each conversation's completion snapshots (one or two per conversation; all anonymous callers' in the anonymous
session), so a continuation is found without a scan.

An index only: which entries are kept, in which tier, and which one a lookup chooses is the store's business
(`store.py`, `matching.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from courier.core.prompt_cache.entries import Bucket, EntryId, Origin, Snapshot
from courier.core.prompt_cache.radix_index import PathMatch, RadixIndex


class EntryIndex:
    def __init__(self) -> None:
        self._entries: OrderedDict[EntryId, Snapshot] = OrderedDict()  # least recently used first, both tiers
        self._buckets: dict[Bucket, RadixIndex[EntryId]] = {}
        # Completion snapshots per conversation (bucket, session): few each, so a continuation is found cheaply.
        self._completions: dict[tuple[Bucket, str], set[EntryId]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def by_id(self) -> Mapping[EntryId, Snapshot]:
        """Every entry by its id, least recently used first."""
        return self._entries

    def snapshots(self) -> list[Snapshot]:
        return list(self._entries.values())

    def get(self, entry_id: EntryId) -> Snapshot | None:
        return self._entries.get(entry_id)

    def oldest(self) -> Snapshot | None:
        """The least recently used entry, None when there is none."""
        return next(iter(self._entries.values()), None)

    def touch(self, entry_id: EntryId) -> None:
        """The entry was just used: last in line for eviction."""
        self._entries.move_to_end(entry_id)

    def add(self, snapshot: Snapshot) -> None:
        self._entries[snapshot.entry_id] = snapshot
        if snapshot.origin is Origin.COMPLETION:
            self._completions.setdefault((snapshot.bucket, snapshot.session), set()).add(snapshot.entry_id)
        self._buckets.setdefault(snapshot.bucket, RadixIndex()).add(snapshot.tokens, snapshot.entry_id)

    def remove(self, snapshot: Snapshot) -> None:
        del self._entries[snapshot.entry_id]
        self._buckets[snapshot.bucket].remove(snapshot.tokens, snapshot.entry_id)
        if snapshot.origin is Origin.COMPLETION:
            conversation = (snapshot.bucket, snapshot.session)
            self._completions[conversation].discard(snapshot.entry_id)
            if not self._completions[conversation]:
                del self._completions[conversation]

    def clear(self) -> None:
        self._entries.clear()
        self._buckets.clear()
        self._completions.clear()

    def match(self, bucket: Bucket, vector: tuple[int, ...]) -> PathMatch[EntryId] | None:
        """The bucket's entries along `vector` (None: the bucket holds nothing)."""
        indexed = self._buckets.get(bucket)
        return indexed.match(vector) if indexed is not None else None

    def conversation_completions(self, bucket: Bucket, session: str) -> list[Snapshot]:
        return [self._entries[key] for key in self._completions.get((bucket, session), ())]
