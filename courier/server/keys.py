"""The secrets read at start-up: the compaction capsule key, the reasoning seal's key and the API keys.

An unreadable or too-short key file, or a key flag or file that names no key (an
empty file, `--api-key ,`), stops start-up with a message naming the flag: a server
that was told to authenticate must never start without its keys. A server
that listens beyond loopback without API keys says so in the log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from pathlib import Path

from courier.conversation.capsule import CapsuleCodec
from courier.conversation.sealed import KEY_BYTES, ReasoningSeal, derived_key
from courier.http.auth import ApiKeys, keys_in_file, parse_keys
from courier.server.errors import ServerFailed
from courier.settings import Settings

logger = logging.getLogger(__name__)

MIN_COMPACTION_KEY_BYTES = 16
SEAL_KEY_NAME = "reasoning-seal.key"


def load_capsule_codec(settings: Settings) -> CapsuleCodec:
    """Compaction capsules, authenticated with the key in `--compaction-key-file` when one is given."""
    key = None
    if settings.compaction_key_file is not None:
        try:
            key = settings.compaction_key_file.read_bytes().strip()
        except OSError as error:
            raise ServerFailed(f"cannot read --compaction-key-file {settings.compaction_key_file}: {error}") from None
        if len(key) < MIN_COMPACTION_KEY_BYTES:
            raise ServerFailed(
                f"--compaction-key-file {settings.compaction_key_file} holds {len(key)} bytes; "
                f"use at least {MIN_COMPACTION_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`)"
            )
        logger.info(
            "compaction capsules are authenticated (HMAC-SHA256) with the key in %s", settings.compaction_key_file
        )
    return CapsuleCodec(key, settings.max_body_bytes)


def load_reasoning_seal(settings: Settings) -> ReasoningSeal:
    """The key reasoning items are sealed with (`include: ["reasoning.encrypted_content"]`): derived from
    `--compaction-key-file` when one is given (replicas sharing that file accept each other's items), else a random
    key kept in `--data-dir` (created 0600), so sealed items outlive a restart. A data directory that cannot hold
    one leaves a key for this process only, with a warning."""
    if settings.compaction_key_file is not None:
        return ReasoningSeal(derived_key(settings.compaction_key_file.read_bytes().strip()))
    path = settings.data_dir / SEAL_KEY_NAME
    try:
        return ReasoningSeal(_kept_key(path))
    except OSError as error:
        logger.warning(
            "cannot keep the reasoning seal's key in %s (%s): sealed reasoning lasts this process", path, error
        )
        return ReasoningSeal(secrets.token_bytes(KEY_BYTES))


def _kept_key(path: Path) -> bytes:
    """The key in `path`, created (0600, exclusively) when there is none; one that is not a private regular file of
    this user, of the right length, is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    else:
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            key = file.read(KEY_BYTES + 1)
        private = stat.S_ISREG(status.st_mode) and status.st_uid == os.geteuid() and not status.st_mode & 0o077
        if private and len(key) == KEY_BYTES:
            return key
        logger.warning("%s is not a key this server keeps; a new one replaces it", path)
        path.unlink()
    key = secrets.token_bytes(KEY_BYTES)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key)
        file.flush()
        os.fsync(file.fileno())
    return key


def load_api_keys(settings: Settings) -> ApiKeys:
    """`--api-key`, `--api-key-file` and `--admin-api-key`, as the HTTP layer checks them. Each that is given must
    name at least one key: a server told to authenticate that found no key would serve everyone."""
    client_keys = _named(parse_keys(settings.api_key), settings.api_key, "--api-key", "keys, comma-separated")
    if settings.api_key_file is not None:
        try:
            text = settings.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as error:
            raise ServerFailed(f"cannot read --api-key-file {settings.api_key_file}: {error}") from None
        where = f"--api-key-file {settings.api_key_file}"
        client_keys += _named(keys_in_file(text), text, where, "one key per line")
    admin_keys = parse_keys(settings.admin_api_key)
    keys = ApiKeys(client_keys, _named(admin_keys, settings.admin_api_key, "--admin-api-key", "keys, comma-separated"))
    if keys.enabled:
        logger.info("API keys: %d accepted; every route but /health needs one", len(keys))
    elif not is_loopback(settings.host):
        logger.warning(
            "WARNING: listening on %s without API keys: anyone who can reach it may use the model, read stored "
            "responses and share the prompt cache. Set --api-key (or --api-key-file).",
            settings.host,
        )
    return keys


def _named(keys: list[str], given: str | None, where: str, form: str) -> list[str]:
    if given is not None and not keys:
        raise ServerFailed(f"{where} names no key ({form}): refusing to start a server that would serve anyone")
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
