"""The disk tier: at start-up, files an earlier run left are indexed again, oldest first, unless no lookup could use
them; the writer's bound on pending bytes counts only writes still wanted."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from courier.actors.prompt_cache.snapshot_disk import DiskTierConfig, SnapshotDisk
from courier.core.prompt_cache.entries import Bucket, Origin, disk_footprint
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore
from courier.engine.prompt_cache.codec import EncodedState
from courier.engine.prompt_cache.directory import open_directory
from courier.engine.prompt_cache.files import FileTrust, write_snapshot
from courier.engine.prompt_cache.layout import StateLayout
from courier.runtime.mlx_thread import MlxThread

IDENTITY = "c" * 64
NO_LAYERS = StateLayout(layers=(), arrays=())  # the files here hold a state of no layers
SERVED = Bucket(model_id="tiny", template_signature="t")
TOKENS = tuple(range(1, 41))


@pytest.fixture
def mlx() -> Iterator[MlxThread]:
    thread = MlxThread()
    yield thread
    thread.close(timeout=2.0)


def leave_file(
    trust: FileTrust, directory: Path, name: str, bucket: Bucket, tokens: tuple[int, ...], age_s: float
) -> Path:
    path = directory / name
    write_snapshot(
        path,
        trust=trust,
        bucket=bucket,
        session="s",
        origin=Origin.BOUNDARY,
        prompt_length=len(tokens),
        tokens=tokens,
        encoded=EncodedState(layout=[], arrays=[]),
        max_bytes=disk_footprint(0, len(tokens)),
    )
    used = path.stat().st_mtime - age_s
    os.utime(path, (used, used))
    return path


def test_files_another_name_or_template_wrote_are_deleted_and_the_rest_indexed(tmp_path: Path, mlx: MlxThread) -> None:
    first = open_directory(tmp_path, IDENTITY, NO_LAYERS)
    directory = first.path
    first.release()
    older = leave_file(first.trust, directory, "older.snap", SERVED, TOKENS[:30], age_s=20)
    newer = leave_file(first.trust, directory, "newer.snap", SERVED, TOKENS, age_s=10)
    renamed = leave_file(
        first.trust, directory, "renamed.snap", Bucket(model_id="old-name", template_signature="t"), TOKENS, 5
    )
    retemplated = leave_file(
        first.trust, directory, "template.snap", Bucket(model_id="tiny", template_signature="u"), TOKENS, 5
    )
    opened = open_directory(tmp_path, IDENTITY, NO_LAYERS)
    limits = StoreLimits(capacity_bytes=10**6, max_entries=10, ttl_s=60, min_prefix=8, disk_capacity_bytes=10**7)
    store = SnapshotStore(limits, trimmable=True, clock=lambda: 1000.0)
    disk = SnapshotDisk(opened, DiskTierConfig(max_pending_write_bytes=10**6), mlx)
    try:
        assert disk.adopt(store, SERVED) == 2
    finally:
        opened.release()
    assert not renamed.exists() and not retemplated.exists()
    # The newer turn of the conversation superseded the older one: its file goes at the first dispatch.
    (kept,) = store.snapshots()
    assert (kept.tokens, kept.on_disk, kept.in_memory) == (TOKENS, True, False)
    assert abs(kept.last_used - 990) < 2  # used 10 s before now
    assert store.counters.adopted == 2 and store.counters.supersedes == 1
    effects = store.take_effects()
    assert len(effects) == 1 and older.exists() and newer.exists()


def test_a_write_superseded_while_it_waits_leaves_its_room_to_the_next(tmp_path: Path, mlx: MlxThread) -> None:
    """A queued write whose entry a newer turn superseded would only be skipped: it gives up its room in the writer's
    bound, so the newer turn's write is queued instead of refused (a refused spill would lose the conversation)."""
    opened = open_directory(tmp_path, IDENTITY, NO_LAYERS)
    limits = StoreLimits(capacity_bytes=1000, max_entries=10, ttl_s=60, min_prefix=8, disk_capacity_bytes=10**7)
    store = SnapshotStore(limits, trimmable=True, clock=lambda: 1000.0)
    disk = SnapshotDisk(opened, DiskTierConfig(max_pending_write_bytes=150), mlx)
    try:
        for tokens in (TOKENS[:30], TOKENS):  # the writer does not run: both writes wait
            store.insert(bucket=SERVED, session="s", origin=Origin.BOUNDARY, tokens=tokens, state=None, nbytes=100)
            disk.dispatch(store)
    finally:
        opened.release()
    (kept,) = store.snapshots()
    assert (kept.tokens, kept.on_disk, kept.writing) == (TOKENS, True, True)
    assert (disk.io.writes_refused, disk.io.writes_skipped) == (0, 1)
