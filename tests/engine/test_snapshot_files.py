"""Snapshot files on real model states: a round trip gives back the same state (the next token's logits match), and
every way a file can go wrong is refused before anything is built from it."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load

from courier.core.snapshot_store import Bucket, Origin, disk_footprint
from courier.engine.model_state import compact_copy, prefill
from courier.engine.snapshot_codec import UndecodableState, decode_state, encode_state
from courier.engine.snapshot_directory import DirectoryBusy, open_directory
from courier.engine.snapshot_files import UnreadableSnapshot, read_index_entry, read_snapshot, write_snapshot

IDENTITY = "a" * 64
BUCKET = Bucket(model_id="tiny", template_signature="t", tenant="k")
TOKENS = tuple(range(5, 45))


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model_and_state(request: pytest.FixtureRequest) -> tuple[Any, list[Any], int]:
    directory = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen3_next_dir")
    model, _ = load(str(directory))[:2]
    state, nbytes = compact_copy(prefill(model, TOKENS))
    return model, state, nbytes


def write(path: Path, state: list[Any], nbytes: int, *, tokens: tuple[int, ...] = TOKENS) -> int:
    return write_snapshot(
        path,
        identity=IDENTITY,
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
    model_and_state: tuple[Any, list[Any], int], tmp_path: Path
) -> None:
    model, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    size = write(path, state, nbytes)
    assert size == path.stat().st_size <= disk_footprint(nbytes, len(TOKENS))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    read = read_snapshot(path, IDENTITY)
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
    model_and_state: tuple[Any, list[Any], int], tmp_path: Path, change: Callable[[Path], None], why: str
) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes)
    change(path)
    with pytest.raises(UnreadableSnapshot, match=why):
        read_snapshot(path, IDENTITY).close()


def test_a_file_of_another_model_is_refused(model_and_state: tuple[Any, list[Any], int], tmp_path: Path) -> None:
    _, state, nbytes = model_and_state
    path = tmp_path / "x.snap"
    write(path, state, nbytes)
    with pytest.raises(UnreadableSnapshot, match="another model"):
        read_snapshot(path, "b" * 64)
    with pytest.raises(UnreadableSnapshot, match="another model"):
        read_index_entry(path, "b" * 64)


def test_a_file_larger_than_its_charge_is_never_written(
    model_and_state: tuple[Any, list[Any], int], tmp_path: Path
) -> None:
    _, state, _ = model_and_state
    path = tmp_path / "x.snap"
    with pytest.raises(ValueError, match="over the"):
        write_snapshot(
            path,
            identity=IDENTITY,
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
    model_and_state: tuple[Any, list[Any], int], tmp_path: Path
) -> None:
    _, state, nbytes = model_and_state
    opened = open_directory(tmp_path / "cache", IDENTITY)
    try:
        assert stat.S_IMODE(opened.path.stat().st_mode) == 0o700
        with pytest.raises(DirectoryBusy):
            open_directory(tmp_path / "cache", IDENTITY)
        old, new = opened.path / "old.snap", opened.path / "new.snap"
        write(old, state, nbytes)
        write(new, state, nbytes, tokens=(*TOKENS, 1, 2))
        os.utime(old, (1_000_000, 1_000_000))
        (opened.path / "junk.snap").write_bytes(b"junk")
        (opened.path / ".half.snap.1.tmp").write_bytes(b"half")
    finally:
        opened.release()
    reopened = open_directory(tmp_path / "cache", IDENTITY)
    try:
        assert [found.path.name for found in reopened.found] == ["old.snap", "new.snap"]
        assert reopened.found[1].tokens == (*TOKENS, 1, 2)
        assert reopened.unreadable == 1
        assert sorted(path.name for path in reopened.path.iterdir()) == ["lock", "new.snap", "old.snap"]
    finally:
        reopened.release()
