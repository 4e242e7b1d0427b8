"""Multi-turn conversations through the real server: each turn reuses the previous turn's state."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.support.polling import attempts
from tests.support.server import RunningServer, running_server

SYSTEM = "You are a careful assistant who answers in full sentences. " * 6  # well past the minimum prefix
TURNS = 5
GENERATION_PROMPT = 3  # "<|im_start|>assistant\n" after the history: only a trimmable (dense) cache can skip it


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def server(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen3_next_dir: Path, cache_dir: Path
) -> Iterator[RunningServer]:
    model = tiny_llama_dir if request.param == "dense" else tiny_qwen3_next_dir
    args = ["--model", str(model), "--cache-dir", str(cache_dir), "--served-model-name", "tiny"]
    with running_server(args) as running:
        yield running
        assert running.stop() == 0


def cache_stats(server: RunningServer) -> dict[str, Any]:
    with server.http() as http:
        stats: dict[str, Any] = http.get("/v1/cache/stats").json()
        return stats


@dataclass(frozen=True, slots=True)
class Turn:
    messages: list[ChatCompletionMessageParam]  # what was sent
    reply: ChatCompletion

    @property
    def prompt(self) -> int:
        assert self.reply.usage is not None
        return self.reply.usage.prompt_tokens

    @property
    def cached(self) -> int:
        assert self.reply.usage is not None and self.reply.usage.prompt_tokens_details is not None
        return self.reply.usage.prompt_tokens_details.cached_tokens or 0


def converse(
    client: openai.OpenAI, user: str, turns: int = TURNS, system: str = SYSTEM, **extra: Any
) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per turn of one conversation."""
    return [(turn.prompt, turn.cached) for turn in conversation(client, user, turns, system, **extra)]


def conversation(
    client: openai.OpenAI, user: str, turns: int = TURNS, system: str = SYSTEM, **extra: Any
) -> list[Turn]:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
    history: list[Turn] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: what comes next in the story?"})
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            user=user,
            extra_body=extra or None,
        )
        history.append(Turn(list(messages), reply))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return history


def warm_up_carries_on_past_the_prompt(server: RunningServer, turn: Turn) -> bool:
    """Whether the history re-rendered through the turn's reply, which the idle warm-up's boundary snapshot holds,
    starts with the turn's prompt but its last token and goes past it: then that boundary supersedes the turn's
    completion snapshot (its prompt and the tokens generated), whether the reply re-tokenized into the tokens
    generated (the completion is a prefix of the history) or not (a random-weight model often generates a run that
    its text re-merges into other tokens; the completion could then never be a prefix of a later prompt).
    """
    replied: list[ChatCompletionMessageParam] = [
        *turn.messages,
        {"role": "assistant", "content": turn.reply.choices[0].message.content or ""},
    ]
    with server.http() as http:
        prompt = http.post("/tokenize", json={"messages": turn.messages}).json()["tokens"]
        history = http.post("/tokenize", json={"messages": replied, "add_generation_prompt": False}).json()["tokens"]
    assert len(prompt) == turn.prompt
    return history[: len(prompt) - 1] == prompt[:-1] and len(history) >= len(prompt)


def test_every_turn_from_the_second_reuses_the_previous_history(server: RunningServer) -> None:
    with server.openai_client() as client:
        before = cache_stats(server)
        turns = conversation(client, "alice")
    after = wait_until_idle(server, queued_at_least=before["snapshot_warmups_queued"] + TURNS)
    usage = [(turn.prompt, turn.cached) for turn in turns]
    assert usage[0][1] == 0
    for (previous_prompt, previous_cached), (prompt, cached) in pairwise(usage):
        assert previous_cached < cached < prompt
        assert cached >= previous_prompt - GENERATION_PROMPT  # the whole previous history came from the cache
    assert after["snapshot_supersedes"] - before["snapshot_supersedes"] >= TURNS - 1
    assert after["snapshot_hits"] - before["snapshot_hits"] >= TURNS - 1  # idle warm-ups look up too
    assert after["tokens_reused"] - before["tokens_reused"] >= sum(cached for _, cached in usage)
    assert after["snapshot_bytes"] <= after["snapshot_capacity_bytes"]
    # Not one entry per turn: only the history through the last reply (the idle warm-up's), which supersedes the
    # history before it and the last turn's completion.
    assert warm_up_carries_on_past_the_prompt(server, turns[-1])
    assert after["snapshot_entries"] - before["snapshot_entries"] == 1


def test_interleaved_conversations_stay_apart_and_stay_warm(server: RunningServer) -> None:
    users = ("bob", "carol", "dan")
    histories: dict[str, list[ChatCompletionMessageParam]] = {
        user: [{"role": "system", "content": SYSTEM}] for user in users
    }
    cached: dict[str, list[int]] = {user: [] for user in users}
    with server.openai_client() as client:
        for turn in range(3):
            for user in users:  # one turn of each conversation in turn
                history = histories[user]
                history.append({"role": "user", "content": f"{user}, turn {turn}: what happens next?"})
                reply = client.chat.completions.create(
                    model="tiny", messages=history, max_tokens=8, temperature=0, user=user
                )
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                cached[user].append(reply.usage.prompt_tokens_details.cached_tokens or 0)
                history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    for user in users:
        assert cached[user][1] > 0 and cached[user][2] > cached[user][1], cached
    assert cache_stats(server)["snapshot_evictions_lru"] == 0


def test_cache_prompt_false_skips_lookup_and_insert(server: RunningServer) -> None:
    private = "Dave keeps these notes private and unshared with anyone else at all. " * 4  # no other session has it
    with server.openai_client() as client:
        skipped = converse(client, "dave", turns=2, system=private, cache_prompt=False)
        # Had either turn been stored, the same conversation asked again with caching on would reuse it.
        again = converse(client, "dave", turns=1, system=private)
    assert [cached for _, cached in skipped] == [0, 0]
    assert again[0][1] == 0


def test_reset_frees_everything_and_keeps_counters(server: RunningServer) -> None:
    queued = cache_stats(server)["snapshot_warmups_queued"]
    long_system = "Erin's project notes, kept as one long system prompt for every turn. " * 40  # past a checkpoint
    with server.openai_client() as client:
        converse(client, "erin", turns=1, system=long_system)
    before = wait_until_idle(server, queued_at_least=queued + 1)  # no warm-up may insert during the reset
    with server.http() as http:
        freed = http.post("/v1/cache/reset").json()
        again = http.post("/v1/cache/reset").json()
    after = cache_stats(server)
    # The token counter's renders go too (those long enough to be found again): erin's turn and its warm-up at
    # least, and none are left for a second reset.
    assert freed.pop("forgotten_renders") >= 2 and again["forgotten_renders"] == 0
    assert freed == {
        "cleared": True,
        "freed_bytes": before["snapshot_bytes"],
        "freed_disk_bytes": before["snapshot_disk_bytes"],
        "freed_entries": before["snapshot_entries"],
    }
    assert (after["snapshot_entries"], after["snapshot_bytes"], after["snapshot_disk_bytes"]) == (0, 0, 0)
    assert after["snapshot_inserts"] == before["snapshot_inserts"]


def test_metrics_export_the_cache_and_time_to_first_token(server: RunningServer) -> None:
    queued = cache_stats(server)["snapshot_warmups_queued"]
    with server.openai_client() as client:
        converse(client, "frank", turns=2)
    stats = wait_until_idle(server, queued_at_least=queued + 2)
    with server.http() as http:
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in response.text.splitlines() if not line.startswith("#")
    }
    assert samples["courier_prompt_cache_hits_total"] == stats["snapshot_hits"]
    assert samples["courier_prompt_cache_bytes"] == stats["snapshot_bytes"]
    assert samples['courier_prompt_cache_evictions_total{reason="lru"}'] == stats["snapshot_evictions_lru"]
    assert samples["courier_time_to_first_token_seconds_count"] >= 2
    assert samples['courier_requests_total{outcome="completed"}'] >= 2


def wait_until_idle(server: RunningServer, queued_at_least: int = 0) -> dict[str, Any]:
    """Stats once at least `queued_at_least` warm-ups were queued and every queued one has run or been skipped.

    A reply queues its conversation's warm-up through the ingress, and the scheduler runs it when idle.
    """
    for _ in attempts():
        stats = cache_stats(server)
        finished = stats["snapshot_warmups_run"] + stats["snapshot_warmups_skipped"]
        queued = stats["snapshot_warmups_queued"]
        if queued >= queued_at_least and finished == queued and stats["snapshot_warmups_pending"] == 0:
            return stats
    raise AssertionError(f"the idle warm-ups never finished: {stats}")


def test_idle_warm_up_leaves_only_the_new_message_to_prefill(server: RunningServer) -> None:
    start = wait_until_idle(server)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    uncached: list[int] = []
    with server.openai_client() as client:
        for turn in range(4):
            # Words no other test uses: another session's longer conversation could otherwise already cover this one.
            messages.append({"role": "user", "content": f"Grace asks, round {turn}: and then?"})
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, user="grace"
            )
            done = Turn(list(messages), reply)
            uncached.append(done.prompt - done.cached)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            idle = wait_until_idle(server, queued_at_least=start["snapshot_warmups_queued"] + turn + 1)
            # After each turn's warm-up the conversation holds one snapshot: its history through the reply.
            assert warm_up_carries_on_past_the_prompt(server, done), turn
            assert idle["snapshot_entries"] - start["snapshot_entries"] == 1, turn
    after = cache_stats(server)
    assert after["snapshot_warmups_run"] - start["snapshot_warmups_run"] == 4
    # From the second turn only the new user message (and the generation prompt) is prefilled: the reply was
    # prefilled while the server was idle. The new messages have the same length every turn.
    assert len(set(uncached[1:])) == 1
    assert uncached[1] <= 24
