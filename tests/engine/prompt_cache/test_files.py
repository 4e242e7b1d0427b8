"""Snapshot files on real model states: a round trip gives back the same state (the next token's logits match), and
every way a file can go wrong is refused before anything is built from it."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import pytest
from mlx_lm import load

from courier.core.prompt_cache.entries import Bucket, Origin, disk_footprint
from courier.core.prompt_cache.rejections import FileRejection
from courier.engine.model_state import compact_copy, prefill
from courier.engine.prompt_cache.codec import UndecodableState, decode_state, encode_state
from courier.engine.prompt_cache.directory import DirectoryBusy, open_directory
from courier.engine.prompt_cache.files import (
    FileTrust,
    UnreadableSnapshot,
    read_index_entry,
    read_snapshot,
    write_snapshot,
)
from courier.engine.prompt_cache.layout import measure_layout
from tests.support.snapshot_forgery import CURRENT_VERSION, put_together, take_apart, with_wrapping_keys

IDENTITY = "a" * 64
KEY = b"k" * 32
BUCKET = Bucket(model_id="tiny", template_signature="t", tenant="k")
TOKENS = tuple(range(5, 45))
T = TypeVar("T")
ROOM = 1 << 30  # what a test file's entry was charged, unless the bound is what is tested


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model_and_state(request: pytest.FixtureRequest) -> tuple[Any, list[Any], int]:
    directory = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen3_next_dir")
    model, _ = load(str(directory))[:2]
    state, nbytes = compact_copy(prefill(model, TOKENS))
    return model, state, nbytes


@pytest.fixture(scope="module")
def trust(model_and_state: tuple[Any, list[Any], int]) -> FileTrust:
    """This model's files: its state's layout, measured as the server measures it."""
    return FileTrust(IDENTITY, KEY, measure_layout(model_and_state[0]))


def write(path: Path, state: list[Any], nbytes: int, trust: FileTrust, *, tokens: tuple[int, ...] = TOKENS) -> int:
    return write_snapshot(
        path,
        trust=trust,
        bucket=BUCKET,
        session="s",
        origin=Origin.COMPLETION,
        prompt_length=len(tokens) - 4,
        tokens=tokens,
        encoded=encode_state(state),
        max_bytes=disk_footprint(nbytes, len(tokens)),
    )


def next_logits(model: Any, state: list[Any]) -> mx.array:
    logits: mx.array = model(mx.array([[7]]), cache=state)
    mx.eval(logits)
    return logits


def test_a_state_read_back_continues_exactly_like_the_original(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    model, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    size = write(path, state, nbytes, trust)
    assert size == path.stat().st_size <= disk_footprint(nbytes, len(TOKENS))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    read = read_snapshot(path, trust, disk_footprint(nbytes, len(TOKENS)))
    try:
        assert read.tokens == TOKENS
        assert (read.header.bucket, read.header.session, read.header.origin) == (BUCKET, "s", Origin.COMPLETION)
        assert read.header.nbytes == nbytes
        restored = decode_state(read.header.layout, read.arrays)
    finally:
        read.close()
    assert [type(layer) for layer in restored] == [type(layer) for layer in state]
    original = next_logits(model, compact_copy(state)[0])
    again = next_logits(model, restored)
    assert mx.array_equal(original, again).item()


def flip_byte(at: int) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[at if at >= 0 else len(data) + at] ^= 0x40
        path.write_bytes(bytes(data))

    return change


def truncate(keep: int) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: keep if keep >= 0 else len(data) + keep])

    return change


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (flip_byte(-1), "payload"),  # the last array byte
        (flip_byte(200), "header"),  # inside the JSON header
        (flip_byte(0), "not a Courier snapshot"),  # the magic
        (flip_byte(16), "format"),  # the version
        (truncate(-1), "payload bytes"),
        (truncate(40), "truncated"),
        (truncate(0), "truncated"),
        (lambda path: path.write_bytes(b"\x00" * 4096), "not a Courier snapshot"),
    ],
    ids=["payload-bit", "header-bit", "magic", "version", "last-byte-cut", "cut-in-prefix", "empty", "zeros"],
)
def test_an_altered_or_truncated_file_is_refused(
    model_and_state: tuple[Any, list[Any], int],
    trust: FileTrust,
    tmp_path: Path,
    change: Callable[[Path], None],
    why: str,
) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes, trust)
    change(path)
    with pytest.raises(UnreadableSnapshot, match=why):
        read_snapshot(path, trust, ROOM).close()


def test_a_file_of_another_model_is_refused(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes, trust)
    with pytest.raises(UnreadableSnapshot, match="another model"):
        read_snapshot(path, FileTrust("b" * 64, KEY, trust.layout), ROOM)
    with pytest.raises(UnreadableSnapshot, match="another model"):
        read_index_entry(path, FileTrust("b" * 64, KEY, trust.layout))


def test_a_file_larger_than_its_charge_is_never_written(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    _, state, _ = model_and_state
    path = tmp_path / "x.snap"
    with pytest.raises(ValueError, match="over the"):
        write_snapshot(
            path,
            trust=trust,
            bucket=BUCKET,
            session="s",
            origin=Origin.BOUNDARY,
            prompt_length=len(TOKENS),
            tokens=TOKENS,
            encoded=encode_state(state),
            max_bytes=1000,
        )
    assert list(tmp_path.iterdir()) == []  # no temporary file left either


@pytest.mark.parametrize(
    "layout",
    [
        "not a list",
        [{"class": "Module", "state": {"list": []}}],  # not a cache class
        [{"class": "KVCache", "state": {"array": 99}}],  # an array that is not there
        [{"class": "KVCache", "state": {"eval": "x"}}],  # not a node kind
        [{"state": {"list": []}}],
    ],
)
def test_a_layout_that_is_no_model_state_is_refused(layout: Any) -> None:
    with pytest.raises(UndecodableState):
        decode_state(layout, [])


def test_the_directory_is_private_locked_and_scanned_oldest_first(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    _, state, nbytes = model_and_state
    opened = open_directory(tmp_path / "cache", IDENTITY, trust.layout)
    try:
        assert stat.S_IMODE(opened.path.stat().st_mode) == 0o700
        with pytest.raises(DirectoryBusy):
            open_directory(tmp_path / "cache", IDENTITY, trust.layout)
        old, new = opened.path / "old.snap", opened.path / "new.snap"
        write(old, state, nbytes, opened.trust)
        write(new, state, nbytes, opened.trust, tokens=(*TOKENS, 1, 2))
        os.utime(old, (1_000_000, 1_000_000))
        (opened.path / "junk.snap").write_bytes(b"junk")
        (opened.path / ".half.snap.1.tmp").write_bytes(b"half")
    finally:
        opened.release()
    reopened = open_directory(tmp_path / "cache", IDENTITY, trust.layout)
    try:
        assert [found.path.name for found in reopened.found] == ["old.snap", "new.snap"]
        assert reopened.found[1].tokens == (*TOKENS, 1, 2)
        assert reopened.unreadable == 1
        assert sorted(path.name for path in reopened.path.iterdir()) == ["key", "lock", "new.snap", "old.snap"]
    finally:
        reopened.release()


def test_a_file_larger_than_its_entry_was_charged_is_not_read(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    size = write(path, state, nbytes, trust)
    with pytest.raises(UnreadableSnapshot, match="over the") as refused:
        read_snapshot(path, trust, size - 1)
    assert refused.value.reason is FileRejection.CORRUPT


def bounded(call: Callable[[], T], timeout_s: float = 30.0) -> T:
    """`call()` on a thread of its own, failing the test if it has not returned within `timeout_s` (a FIFO opened
    for reading blocks until a writer comes: for ever)."""
    outcome: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still blocked after {timeout_s} s"
    if errors:
        raise errors[0]
    return outcome[0]


def plant_entries_that_are_not_files(directory: Path, elsewhere: Path, regular: Path) -> list[Path]:
    """A FIFO, a symbolic link to a FIFO, a symbolic link to a valid file and a directory, each named like a snapshot
    file; and a directory named like a temporary file (which cannot be unlinked)."""
    os.mkfifo(directory / "fifo.snap")
    os.mkfifo(elsewhere / "outside-fifo")
    (directory / "to-fifo.snap").symlink_to(elsewhere / "outside-fifo")
    (directory / "to-file.snap").symlink_to(regular)
    (directory / "directory.snap").mkdir()
    (directory / ".directory.snap.1.tmp").mkdir()
    return [directory / name for name in ("fifo.snap", "to-fifo.snap", "to-file.snap", "directory.snap")]


@pytest.mark.parametrize("name", ["fifo.snap", "to-fifo.snap", "to-file.snap", "directory.snap"])
def test_only_a_regular_file_is_opened(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path, name: str
) -> None:
    _, state, nbytes = model_and_state
    (tmp_path / "dir").mkdir()
    (tmp_path / "elsewhere").mkdir()
    regular = tmp_path / "elsewhere" / "valid.snap"
    write(regular, state, nbytes, trust)
    plant_entries_that_are_not_files(tmp_path / "dir", tmp_path / "elsewhere", regular)
    path = tmp_path / "dir" / name
    for read in (partial(read_index_entry, path, trust), partial(read_snapshot, path, trust, ROOM)):
        with pytest.raises(UnreadableSnapshot, match="not a regular file") as refused:
            bounded(read)
        assert refused.value.reason is FileRejection.NOT_A_FILE


def test_entries_that_are_not_regular_files_are_skipped_and_the_rest_scanned(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    """A FIFO would block the scan for ever, a directory failed it and with it the disk tier: each is skipped,
    counted and left alone, and the valid files around them are found."""
    _, state, nbytes = model_and_state
    first = open_directory(tmp_path / "cache", IDENTITY, trust.layout)
    directory = first.path
    first.release()
    write(directory / "a.snap", state, nbytes, first.trust)
    write(directory / "b.snap", state, nbytes, first.trust, tokens=(*TOKENS, 1))
    (directory / "junk.snap").write_bytes(b"junk")
    (tmp_path / "elsewhere").mkdir()
    planted = plant_entries_that_are_not_files(directory, tmp_path / "elsewhere", directory / "a.snap")
    opened = bounded(lambda: open_directory(tmp_path / "cache", IDENTITY, trust.layout))
    try:
        assert sorted(found.path.name for found in opened.found) == ["a.snap", "b.snap"]
        assert opened.rejected == {FileRejection.NOT_A_FILE: 4, FileRejection.CORRUPT: 1}
        assert opened.unreadable == 1
    finally:
        opened.release()
    assert all(os.path.lexists(path) for path in planted)  # skipped, not deleted
    assert not (directory / "junk.snap").exists()
    assert (tmp_path / "elsewhere" / "outside-fifo").exists()


def forge(
    path: Path, *, key: bytes | None = None, version: int = CURRENT_VERSION, tokens: list[int] | None = None
) -> None:
    """`path` put back together by an attacker: its token vector replaced if given, every digest recomputed, MAC'd
    with `key` (a key of the attacker's own when None)."""
    parts = take_apart(path)
    if tokens is not None:
        parts.tokens = tokens
    path.write_bytes(put_together(parts, key=key, version=version))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda path: forge(path, key=KEY), None),  # the forgery helper makes exactly what the server makes
        (lambda path: forge(path, key=KEY, tokens=[*TOKENS[:-1], 99]), None),  # with the key, anything goes
        (lambda path: forge(path, tokens=[*TOKENS[:-1], 99]), FileRejection.UNAUTHENTICATED),  # another's tokens
        (forge, FileRejection.UNAUTHENTICATED),  # the same bytes under another key
        (lambda path: forge(path, version=1), FileRejection.FORMAT),  # the format before the MAC
        (lambda path: forge(path, key=KEY, version=2), None),  # the format before quantized snapshots: still read
        (lambda path: forge(path, key=KEY, version=4), FileRejection.FORMAT),
    ],
    ids=["with-the-key", "tokens-with-the-key", "tokens-recomputed", "another-key", "version-1", "version-2", "v4"],
)
def test_only_a_file_written_under_the_directory_key_is_read(
    model_and_state: tuple[Any, list[Any], int],
    trust: FileTrust,
    tmp_path: Path,
    change: Callable[[Path], None],
    reason: FileRejection | None,
) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes, trust)
    change(path)
    if reason is None:
        read_index_entry(path, trust)
        read_snapshot(path, trust, ROOM).close()
        return
    for read in (partial(read_index_entry, path, trust), partial(read_snapshot, path, trust, ROOM)):
        with pytest.raises(UnreadableSnapshot) as refused:
            read()
        assert refused.value.reason is reason


def test_forged_and_old_format_files_are_deleted_and_counted_at_start_up(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    _, state, nbytes = model_and_state
    first = open_directory(tmp_path / "cache", IDENTITY, trust.layout)
    directory = first.path
    first.release()
    for name in ("kept", "forged", "another-key", "old"):
        write(directory / f"{name}.snap", state, nbytes, first.trust)
    write(directory / "another-key.snap", state, nbytes, FileTrust(IDENTITY, b"x" * 32, trust.layout))
    forge(directory / "forged.snap", tokens=[*TOKENS[:-1], 99])
    forge(directory / "old.snap", version=1)
    opened = open_directory(tmp_path / "cache", IDENTITY, trust.layout)
    try:
        assert [found.path.name for found in opened.found] == ["kept.snap"]
        assert opened.rejected == {FileRejection.UNAUTHENTICATED: 2, FileRejection.FORMAT: 1}
        assert opened.unreadable == 3
    finally:
        opened.release()
    assert sorted(path.name for path in directory.glob("*.snap")) == ["kept.snap"]


def test_a_signed_file_whose_state_the_model_could_not_have_is_refused(
    model_and_state: tuple[Any, list[Any], int], trust: FileTrust, tmp_path: Path
) -> None:
    """Keys declared [65536]*4 in 0 bytes, MAC'd with the right key: refused by the layout check, before MLX."""
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes, trust)
    path.write_bytes(put_together(with_wrapping_keys(take_apart(path)), key=KEY))
    for read in (partial(read_index_entry, path, trust), partial(read_snapshot, path, trust, ROOM)):
        with pytest.raises(UnreadableSnapshot, match=r"\[65536, 65536, 65536, 65536\]") as refused:
            read()
        assert refused.value.reason is FileRejection.LAYOUT
