"""The key that authenticates a disk-tier directory's snapshot files: created on first use, kept beside them.

A file's SHA-256 digests prove it intact, not that this server wrote it: anyone who
can put a file in the directory can recompute them (another conversation's state
under this one's tokens). So every file carries an HMAC-SHA256 under this key, and a
file whose MAC does not verify is never used. The key is 32 random bytes in
`<directory>/key`, created 0600 through a temporary name (fsynced, renamed into
place) by the first server to open the directory, under the directory's lock. It
travels with the files it signs: files copied from another server's directory, or
the directory restored without its key, are discarded, never trusted. A key file
that is not a regular file of this user, unreadable by others, of the right length,
is not trusted either: a new key replaces it (the files signed with the old one are
then discarded), with a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from contextlib import suppress
from pathlib import Path

from courier.engine.prompt_cache.files import TEMPORARY_SUFFIX

logger = logging.getLogger(__name__)

KEY_NAME = "key"
KEY_BYTES = 32


class UntrustedKey(ValueError):
    """A key file this server did not make for itself."""


def load_or_create_key(directory: Path) -> bytes:
    """The directory's key, created (or replaced, when untrusted) as needed. Call it holding the directory's lock.
    Raises `OSError` when no key can be read or written (the disk tier then stays off)."""
    path = directory / KEY_NAME
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    except UntrustedKey as why:
        logger.warning(
            "prompt cache: %s is not a key this server keeps (%s); a new key replaces it, and the snapshot files "
            "signed with the old one will be discarded",
            path,
            why,
        )
    return _create_key(path)


def _read_key(path: Path) -> bytes:
    _check(os.lstat(path))
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as file:
        _check(os.fstat(descriptor))  # the same file the lstat saw, or one as good
        key = file.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise UntrustedKey(f"{len(key)} bytes")
    return key


def _check(status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise UntrustedKey("not a regular file")
    if status.st_uid != os.geteuid():
        raise UntrustedKey(f"owned by user {status.st_uid}")
    if stat.S_IMODE(status.st_mode) & 0o077:
        raise UntrustedKey(f"mode {stat.S_IMODE(status.st_mode):04o}, readable or writable by others")
    if status.st_size != KEY_BYTES:
        raise UntrustedKey(f"{status.st_size} bytes")


def _create_key(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(key)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    with suppress(OSError):
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return key
