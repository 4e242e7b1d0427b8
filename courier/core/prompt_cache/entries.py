"""What the snapshot store holds and answers: an entry (`Snapshot`) under its `Bucket` and session, the results of
a lookup and an insert, and the disk effects (`WriteFile`, `DeleteFile`) its owner carries out.

Pure data (see `snapshot_store.py` for the rules that make and remove entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from courier.core.prompt_cache.divergence import Divergence

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
