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

from tests.http.test_prompt_cache_disk import Conversations, serving, snapshot_files
from tests.support.server import RunningServer

KEY, OTHER_KEY = "conversations-key", "other-tenant-key"
GENERATION_PROMPT = 3  # "<|im_start|>assistant\n": only a trimmable cache can skip it
# Conversation 0 is left alone; the others are given to the hostile files.
CONVERSATIONS = 1
UNTOUCHED = 0


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


def http_of(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


def figures(server: RunningServer) -> dict[str, Any]:
    """/v1/cache/stats once every warm-up has run and the disk has done all it was asked (polled, never slept)."""
    with http_of(server) as http:
        for _ in range(5000):
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


def next_turn(client: openai.OpenAI, conversations: Conversations, index: int) -> tuple[int, int, str]:
    """Conversation `index`'s next turn: (its previous prompt, cached tokens, the reply's text)."""
    messages = conversations.histories[index]
    messages.append({"role": "user", "content": f"Question {len(messages)}: where is my parcel?"})
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, user=f"customer-{index}"
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    previous, conversations.last_prompt[index] = conversations.last_prompt[index], reply.usage.prompt_tokens
    text = reply.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": text})
    return previous, reply.usage.prompt_tokens_details.cached_tokens or 0, text


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
    with serving(model, cache_dir, prompt_cache_dir, "--api-key", f"{KEY},{OTHER_KEY}") as first:
        client = client_of(first)
        for index in range(CONVERSATIONS):
            next_turn(client, conversations, index)
            figures(first)  # its files written before the next conversation's turn
        assert first.stop() == 0
    (directory,) = {path.parent for path in snapshot_files(prompt_cache_dir)}
    adoptable = len(snapshot_files(prompt_cache_dir))
    planted = plant_entries_that_are_not_files(directory, tmp_path_factory.mktemp("elsewhere"))
    # Start-up is bounded (the server's READY line within START_TIMEOUT_S): a scan that opened the FIFO never ends.
    with serving(model, cache_dir, prompt_cache_dir, "--api-key", f"{KEY},{OTHER_KEY}") as server:
        yield Restarted(
            server=server,
            client=client_of(server),
            conversations=conversations,
            directory=directory,
            at_start=figures(server),
            planted=planted,
            adoptable=adoptable,
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
