"""The disk tier's key: created 0600 on first use and kept; a key file this server would not have made is replaced."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from courier.engine.prompt_cache.file_key import KEY_BYTES, KEY_NAME, load_or_create_key


def test_the_key_is_created_private_on_first_use_and_kept(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path)
    path = tmp_path / KEY_NAME
    assert len(key) == KEY_BYTES and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(tmp_path) == key
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [KEY_NAME]  # no temporary file left


def readable_by_others(path: Path) -> None:
    path.chmod(0o644)


def shortened(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:16])


def a_link_to_a_key(path: Path) -> None:
    elsewhere = path.parent.parent / "elsewhere-key"
    elsewhere.write_bytes(path.read_bytes())
    elsewhere.chmod(0o600)
    path.unlink()
    path.symlink_to(elsewhere)


def a_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize("change", [readable_by_others, shortened, a_link_to_a_key, a_fifo])
def test_a_key_file_this_server_would_not_have_made_is_replaced(
    tmp_path: Path, change: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "files"
    directory.mkdir()
    old = load_or_create_key(directory)
    path = directory / KEY_NAME
    change(path)
    new = load_or_create_key(directory)
    assert new != old and len(new) == KEY_BYTES
    status = os.lstat(path)
    assert stat.S_ISREG(status.st_mode) and stat.S_IMODE(status.st_mode) == 0o600 and path.read_bytes() == new
    assert "a new key replaces it" in caplog.text


def test_a_key_that_cannot_be_replaced_is_an_error(tmp_path: Path) -> None:
    """A directory where the key belongs: no key, so no disk tier (the server says so and runs memory-only)."""
    (tmp_path / KEY_NAME).mkdir()
    with pytest.raises(OSError):
        load_or_create_key(tmp_path)
