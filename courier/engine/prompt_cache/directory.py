"""The disk tier's directory: private, held by one server at a time, and what an earlier run left in it.

`DIR/<model identity>/` (0700) holds one model's snapshot files (0600) and the key
that authenticates them (`snapshot_key`). A lock file (`flock`, released by the
kernel however the process ends, `kill -9` included) keeps a second server from
sharing the directory: it would count and delete files the first one owns. Opening
it reads every file's header (never a payload):
unreadable, foreign or half-written files are deleted and counted; anything else
named like a snapshot file (a directory, a FIFO, a symbolic link) is skipped and
counted, never opened for reading, and no one entry can fail the scan. The rest
come back oldest first, with their token vectors, for the store to index again.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.prompt_cache.rejections import FileRejection
from courier.engine.prompt_cache.file_key import load_or_create_key
from courier.engine.prompt_cache.files import (
    SUFFIX,
    TEMPORARY_SUFFIX,
    FileTrust,
    SnapshotHeader,
    UnreadableSnapshot,
    read_index_entry,
)
from courier.engine.prompt_cache.layout import StateLayout

LOCK_NAME = "lock"


class DirectoryBusy(OSError):
    """Another process holds the directory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FoundFile:
    path: Path
    header: SnapshotHeader
    tokens: tuple[int, ...]
    age_s: float  # since it was last written or used
    size: int  # bytes on disk


@dataclass(slots=True, kw_only=True)
class SnapshotDirectory:
    path: Path
    trust: FileTrust  # the identity, the key of the MAC and the state layout every file here must have
    found: list[FoundFile]  # oldest first
    rejected: Counter[FileRejection]  # entries not used, by reason: deleted, but those that are not regular files

    @property
    def unreadable(self) -> int:
        """Files that failed their checks (deleted)."""
        return sum(count for reason, count in self.rejected.items() if reason is not FileRejection.NOT_A_FILE)

    _lock: int = field(repr=False)

    def release(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def open_directory(
    root: Path, identity: str, layout: StateLayout, quantization: KvQuantization | None = None
) -> SnapshotDirectory:
    """Create (0700), lock, key and scan `root/<identity>` for files of the served model (`layout`: its state's as
    stored, `quantization`: how its attention KV is stored). Raises `DirectoryBusy` or `OSError`."""
    directory = root / identity[:32]
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    lock = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise DirectoryBusy(f"{directory} is in use by another Courier process") from None
    try:
        trust = FileTrust(identity, load_or_create_key(directory), layout, quantization)
        found, rejected = _scan(directory, trust)
    except BaseException:
        os.close(lock)
        raise
    return SnapshotDirectory(path=directory, trust=trust, found=found, rejected=rejected, _lock=lock)


def _scan(directory: Path, trust: FileTrust) -> tuple[list[FoundFile], Counter[FileRejection]]:
    """The readable files oldest first, and the entries not used, by reason."""
    found: list[FoundFile] = []
    rejected: Counter[FileRejection] = Counter()
    now = time.time()
    for path in directory.iterdir():
        if path.name.endswith(TEMPORARY_SUFFIX):
            _remove(path)  # a write a crash cut short
            continue
        if not path.name.endswith(SUFFIX):
            continue
        try:
            header, tokens, status = read_index_entry(path, trust)
        except UnreadableSnapshot as error:
            rejected[error.reason] += 1
            if error.reason is not FileRejection.NOT_A_FILE:
                _remove(path)
            continue
        except OSError:  # unreadable for a reason of its own (EIO): one file never fails the scan
            rejected[FileRejection.CORRUPT] += 1
            _remove(path)
            continue
        age_s = max(0.0, now - status.st_mtime)
        found.append(FoundFile(path=path, header=header, tokens=tokens, age_s=age_s, size=status.st_size))
    found.sort(key=lambda item: -item.age_s)
    return found, rejected


def _remove(path: Path) -> None:
    """Delete a file this directory no longer wants; one that cannot be deleted (a directory) stays."""
    with suppress(OSError):
        path.unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system holding `path` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_bavail * stats.f_frsize
