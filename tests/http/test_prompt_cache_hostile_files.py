"""Hostile entries in the prompt cache's disk directory, through the real server, on a dense and a hybrid model.

One server per model writes each conversation's snapshot files and stops; the
files are then tampered with and a second server starts on them, which every test
here shares: each test owns the conversations its hostile files were made from.
Conversations belong to the tenant of one API key; another key's tenant, which no
lookup of theirs can ever match, gives the reply a server without a cache gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.http.test_prompt_cache_disk import Conversations, serving, snapshot_files
from tests.support.polling import attempts
from tests.support.server import FIXED_PREFILL_CHUNKS, RunningServer
from tests.support.snapshot_forgery import put_together, take_apart, with_wrapping_keys

KEY, OTHER_KEY = "conversations-key", "other-tenant-key"
GENERATION_PROMPT = 3  # "<|im_start|>assistant\n": only a trimmable cache can skip it
# Conversation 0 is left alone (and lends its state to a forgery); the others are given to the hostile files.
UNTOUCHED = 0
FORGED = 1  # its file replaced by one holding conversation 0's state under its tokens, every digest recomputed
OLD_FORMAT = 2  # its files rewritten in format 1, which has no MAC
# Their files' keys declared [65536]*4 in 0 bytes and MAC'd with the directory's own key (what a holder of the key
# could write): before the start, and once the server has adopted them.
WRAPPED_BEFORE_START, WRAPPED_AFTER_START = 3, 4
CONVERSATIONS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarted:
    """The second server, on tampered files, and what it said about them at start-up."""

    server: RunningServer
    client: openai.OpenAI
    conversations: Conversations
    directory: Path  # this model's snapshot files
    at_start: dict[str, Any]  # /v1/cache/stats before any request
    planted: list[Path]  # hostile entries that are not regular files
    adoptable: int  # the files left that are this server's own
    forged: list[Path]  # files this server did not write
    old_format: list[Path]
    wrapped: list[Path]  # signed files declaring a shape the model does not have


def http_of(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


def figures(server: RunningServer) -> dict[str, Any]:
    """/v1/cache/stats once every warm-up has run and the disk has done all it was asked (polled, never slept)."""
    with http_of(server) as http:
        for _ in attempts():
            stats: dict[str, Any] = http.get("/v1/cache/stats").json()
            warmups_done = stats["snapshot_warmups_run"] + stats["snapshot_warmups_skipped"]
            if (
                warmups_done == stats["snapshot_warmups_queued"]
                and stats["snapshot_warmups_pending"] == 0
                and stats["snapshot_disk_pending"] == 0
            ):
                return stats
    raise AssertionError(f"the cache never settled: {stats}")


def rejected_metrics(server: RunningServer) -> dict[str, float]:
    """courier_prompt_cache_disk_files_rejected_total by reason, from /metrics."""
    with http_of(server) as http:
        lines = http.get("/metrics").text.splitlines()
    prefix = 'courier_prompt_cache_disk_files_rejected_total{reason="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)
    }


def client_of(server: RunningServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def reply_to(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], index: int) -> tuple[int, int, str]:
    """(prompt tokens, cached tokens, the reply's text) for conversation `index`'s `messages`."""
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, user=f"customer-{index}"
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.usage.prompt_tokens, cached, reply.choices[0].message.content or ""


def next_turn(client: openai.OpenAI, conversations: Conversations, index: int) -> tuple[int, int, str]:
    """Conversation `index`'s next turn: (its previous prompt, cached tokens, the reply's text)."""
    messages = conversations.histories[index]
    messages.append({"role": "user", "content": f"Question {len(messages)}: where is my parcel?"})
    prompt, cached, text = reply_to(client, messages, index)
    previous, conversations.last_prompt[index] = conversations.last_prompt[index], prompt
    messages.append({"role": "assistant", "content": text})
    return previous, cached, text


def cache_less_reply(server: RunningServer, conversations: Conversations, index: int) -> str:
    """What a server without a cache replies to conversation `index`'s next turn: asked by another tenant, whose
    lookups never match this one's snapshots (checked: nothing cached)."""
    history = conversations.histories[index]
    question: ChatCompletionMessageParam = {"role": "user", "content": f"Question {len(history)}: where is my parcel?"}
    messages = [*history, question]
    _, cached, text = reply_to(client_of(server, OTHER_KEY), messages, index)
    assert cached == 0
    return text


def files_of(directory: Path, index: int) -> list[Path]:
    """Conversation `index`'s snapshot files (of the current format: call before any is rewritten in another)."""
    files = [path for path in directory.glob("*.snap") if path.is_file() and not path.is_symlink()]
    return [path for path in files if take_apart(path).session == f"customer-{index}"]


def plant_forgeries(directory: Path) -> tuple[list[Path], list[Path]]:
    """Conversation FORGED's files replaced by one holding UNTOUCHED's state under FORGED's tokens (digests
    recomputed, MAC'd under a key of the forger's own); OLD_FORMAT's files rewritten as format 1 (no MAC)."""
    donor = take_apart(files_of(directory, UNTOUCHED)[0])
    (victim, *others) = files_of(directory, FORGED)
    parts = take_apart(victim)
    for path in (victim, *others):
        path.unlink()
    parts.header.update({key: donor.header[key] for key in ("nbytes", "layout", "arrays")})
    parts.arrays = donor.arrays
    forged = directory / "forged.snap"
    forged.write_bytes(put_together(parts))
    old_format = files_of(directory, OLD_FORMAT)
    for path in old_format:
        path.write_bytes(put_together(take_apart(path), version=1))
    return [forged], old_format


def wrap_keys(directory: Path, index: int) -> list[Path]:
    """Conversation `index`'s files rewritten with keys of shape [65536]*4 in 0 bytes, MAC'd with the directory's
    key."""
    files = files_of(directory, index)
    key = (directory / "key").read_bytes()
    for path in files:
        path.write_bytes(put_together(with_wrapping_keys(take_apart(path)), key=key))
    return files


def plant_entries_that_are_not_files(directory: Path, elsewhere: Path) -> list[Path]:
    """A FIFO (opening it for reading blocks until a writer comes), a symbolic link to one, and a directory, each
    named like a snapshot file."""
    os.mkfifo(elsewhere / "fifo")
    os.mkfifo(directory / "fifo.snap")
    (directory / "to-fifo.snap").symlink_to(elsewhere / "fifo")
    (directory / "directory.snap").mkdir()
    return [directory / name for name in ("fifo.snap", "to-fifo.snap", "directory.snap")]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def restarted(
    request: pytest.FixtureRequest, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Restarted]:
    model: Path = request.getfixturevalue("tiny_llama_dir" if request.param == "dense" else "tiny_qwen3_next_dir")
    prompt_cache_dir = tmp_path_factory.mktemp("prompt-cache")
    conversations = Conversations(count=CONVERSATIONS)
    with serving(model, cache_dir, prompt_cache_dir, "--api-key", f"{KEY},{OTHER_KEY}", *FIXED_PREFILL_CHUNKS) as first:
        client = client_of(first)
        for index in range(CONVERSATIONS):
            next_turn(client, conversations, index)
            figures(first)  # its files written before the next conversation's turn
        assert first.stop() == 0
    (directory,) = {path.parent for path in snapshot_files(prompt_cache_dir)}
    adoptable = len(files_of(directory, UNTOUCHED)) + len(files_of(directory, WRAPPED_AFTER_START))
    wrapped = wrap_keys(directory, WRAPPED_BEFORE_START)
    forged, old_format = plant_forgeries(directory)
    planted = plant_entries_that_are_not_files(directory, tmp_path_factory.mktemp("elsewhere"))
    # Start-up is bounded (the server's READY line within START_TIMEOUT_S): a scan that opened the FIFO never ends.
    with serving(
        model, cache_dir, prompt_cache_dir, "--api-key", f"{KEY},{OTHER_KEY}", *FIXED_PREFILL_CHUNKS
    ) as server:
        yield Restarted(
            server=server,
            client=client_of(server),
            conversations=conversations,
            directory=directory,
            at_start=figures(server),
            planted=planted,
            adoptable=adoptable,
            forged=forged,
            old_format=old_format,
            wrapped=wrapped,
        )
        assert server.stop() == 0


def test_entries_that_are_not_regular_files_neither_hang_nor_turn_the_disk_tier_off(restarted: Restarted) -> None:
    at_start = restarted.at_start
    assert at_start["snapshot_disk_directory"] == str(restarted.directory)  # the disk tier is on
    assert at_start["snapshot_disk_adopted"] == restarted.adoptable, at_start
    assert at_start["snapshot_disk_files_rejected"]["not_a_file"] == len(restarted.planted)
    assert all(os.path.lexists(path) for path in restarted.planted)  # skipped, left alone
    assert "3 entries that are not regular files skipped" in restarted.server.log()
    assert rejected_metrics(restarted.server)["not_a_file"] == len(restarted.planted)
    previous, cached, _ = next_turn(restarted.client, restarted.conversations, UNTOUCHED)
    assert cached >= previous - GENERATION_PROMPT  # its adopted file served it


def test_a_file_this_server_did_not_write_is_a_miss_deleted_and_counted(restarted: Restarted) -> None:
    """Another conversation's state under this one's tokens, every digest recomputed: without the directory's key
    its MAC cannot verify. The turn is served as a server without a cache serves it."""
    at_start = restarted.at_start
    rejected = at_start["snapshot_disk_files_rejected"]
    assert rejected["unauthenticated"] == len(restarted.forged), at_start
    assert rejected["format"] == len(restarted.old_format) > 0, at_start
    assert not any(path.exists() for path in (*restarted.forged, *restarted.old_format))
    metrics = rejected_metrics(restarted.server)
    assert (metrics["unauthenticated"], metrics["format"]) == (len(restarted.forged), len(restarted.old_format))
    for index in (FORGED, OLD_FORMAT):
        expected = cache_less_reply(restarted.server, restarted.conversations, index)
        _, cached, text = next_turn(restarted.client, restarted.conversations, index)
        assert (cached, text) == (0, expected)


def test_a_declared_shape_the_model_does_not_have_is_a_miss_not_a_500(restarted: Restarted) -> None:
    """The header's sizes add up (numpy's int64 product of [65536]*4 is 0) and the MAC verifies; the shape is checked
    against the model's layout with Python integers, at start-up and again when a file is read back."""
    at_start = restarted.at_start
    assert at_start["snapshot_disk_files_rejected"]["layout"] == len(restarted.wrapped) > 0, at_start
    assert not any(path.exists() for path in restarted.wrapped)
    rejected = len(restarted.forged) + len(restarted.old_format) + len(restarted.wrapped)
    assert at_start["snapshot_disk_unreadable"] == rejected
    # Adopted at start-up, then rewritten under the server: found when its state is read back for the next turn.
    # The files are listed once the server is idle: the turns of the test before leave warm-ups whose snapshots
    # supersede older ones, and a file deleted between the listing and its reading was a FileNotFoundError here.
    figures(restarted.server)
    replaced = wrap_keys(restarted.directory, WRAPPED_AFTER_START)
    assert replaced
    for index in (WRAPPED_BEFORE_START, WRAPPED_AFTER_START):
        expected = cache_less_reply(restarted.server, restarted.conversations, index)
        _, cached, text = next_turn(restarted.client, restarted.conversations, index)  # a 500 raises here
        assert (cached, text) == (0, expected)
    after = figures(restarted.server)
    assert after["snapshot_disk_files_rejected"]["layout"] == len(restarted.wrapped) + 1, after
    assert rejected_metrics(restarted.server)["layout"] == len(restarted.wrapped) + 1
    assert not any(path.exists() for path in replaced)
