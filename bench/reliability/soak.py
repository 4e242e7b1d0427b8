"""The soak part: minutes of mixed chat, Responses, conversation and compaction traffic, sampled."""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputItemParam

from bench.harness.clients import sync_client
from bench.harness.report import counts, progress
from bench.harness.servers import Server
from bench.reliability.common import (
    CLIENT_TIMEOUT_S,
    EXPECTED_COMPACT_OUTCOME,
    HTTP_TIMEOUT_S,
    SERVED,
    SNAPSHOT_STATS,
    PartResult,
    Setup,
    T,
    counters_text,
    get_json,
    idle,
    mib,
    rss_kib,
    status_outcome,
    wait_idle,
    words,
)


class StreamIncomplete(Exception):
    """A stream that ended without its terminal event."""


class Tally:
    """Outcomes by (kind, outcome), shared by the soak's client threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.examples: dict[tuple[str, str], str] = {}

    def add(self, kind: str, outcome: str, example: str = "") -> None:
        with self._lock:
            self.counts[(kind, outcome)] += 1
            if example and (kind, outcome) not in self.examples:
                self.examples[(kind, outcome)] = example[:500]

    def attempt(self, kind: str, call: Callable[[], T]) -> T | None:
        """Run one request and tally its outcome: the result, or None when it failed."""
        try:
            value = call()
        except openai.APIStatusError as error:
            self.add(kind, status_outcome(error), str(error))
        except openai.APIConnectionError as error:
            self.add(kind, f"connection error: {type(error).__name__}", str(error))
        except openai.APIError as error:
            self.add(kind, f"stream error {getattr(error, 'code', None)}", str(error))
        except StreamIncomplete as error:
            self.add(kind, "stream incomplete", str(error))
        else:
            self.add(kind, "200")
            return value
        return None


def soak_chat(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random, name: str) -> None:
    """Conversations of six turns, one `user` each, every other turn streamed."""
    conversation = 0
    while time.monotonic() < deadline:
        conversation += 1
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": f"You are {words(rng, 30)}."}]
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": words(rng, rng.randint(10, 40))})
            call = partial(
                stream_chat if turn % 2 else whole_chat, client, messages, rng.randint(16, 48), f"{name}-{conversation}"
            )
            if (text := tally.attempt("chat stream" if turn % 2 else "chat", call)) is None:
                break
            messages.append({"role": "assistant", "content": text})


def whole_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=max_tokens, user=user)
    return reply.choices[0].message.content or ""


def stream_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    parts, finish = [], None
    for chunk in client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=max_tokens, user=user, stream=True
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if finish is None:
        raise StreamIncomplete("stream ended without finish_reason")
    return "".join(parts)


def soak_chain(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    """Responses chained by previous_response_id, six hops a chain."""
    while time.monotonic() < deadline:
        previous: str | None = None
        for _ in range(6):
            if time.monotonic() >= deadline:
                return
            create = partial(
                client.responses.create, model=SERVED, input=words(rng, rng.randint(10, 30)), max_output_tokens=24
            )
            if (response := tally.attempt("responses chain", partial(create, previous_response_id=previous))) is None:
                break
            previous = response.id


def soak_conversation(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    """Responses in a conversation (POST /v1/conversations first), every other turn streamed."""
    while time.monotonic() < deadline:
        if (conversation := tally.attempt("conversation create", client.conversations.create)) is None:
            time.sleep(0.5)
            continue
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            call = partial(
                stream_response if turn % 2 else whole_response,
                client,
                words(rng, rng.randint(10, 30)),
                conversation.id,
            )
            if tally.attempt("conversation turn stream" if turn % 2 else "conversation turn", call) is None:
                break


def whole_response(client: openai.OpenAI, text: str, conversation: str) -> str:
    return str(
        client.responses.create(model=SERVED, input=text, max_output_tokens=24, conversation=conversation).status
    )


def stream_response(client: openai.OpenAI, text: str, conversation: str) -> str:
    terminal = ""
    for event in client.responses.create(
        model=SERVED, input=text, max_output_tokens=24, conversation=conversation, stream=True
    ):
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            terminal = event.type
    if terminal not in ("response.completed", "response.incomplete"):
        raise StreamIncomplete(f"stream ended with {terminal or 'no terminal event'}")
    return terminal


def soak_compact(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    """Explicit compaction of a four-exchange history (random weights never end a summary: 422 is expected)."""
    while time.monotonic() < deadline:
        history: list[ResponseInputItemParam] = []
        for turn in range(4):
            history += [
                {"role": "user", "content": f"Turn {turn}: {words(rng, 60)}"},
                {"role": "assistant", "content": words(rng, 60)},
            ]
        history.append({"role": "user", "content": words(rng, 10)})
        tally.attempt(
            "compact",
            partial(client.responses.compact, model=SERVED, input=history, extra_body={"max_output_tokens": 32}),
        )


def sample(server: Server, t0: float) -> dict[str, Any]:
    """RSS, the snapshot store against its budget, the scheduler, MLX memory and glibc malloc's heap."""
    stats, health = get_json(server, "/v1/cache/stats"), get_json(server, "/health")
    counters, memory, malloc = health["scheduler"], health["memory"], health.get("malloc") or {}
    return {
        **{"t_s": time.monotonic() - t0, "rss_kib": rss_kib(server.pid)},
        **{
            key: stats[key]
            for key in ("snapshot_bytes", "snapshot_capacity_bytes", "snapshot_entries", "snapshot_evictions_lru")
        },
        **{"running": counters["running"], "waiting": counters["waiting"]},
        **{"mlx_active_bytes": memory["active_bytes"], "mlx_cache_bytes": memory["cache_bytes"]},
        **{"malloc_in_use_bytes": malloc.get("in_use_bytes"), "malloc_free_held_bytes": malloc.get("free_held_bytes")},
    }


def soak_traffic(server: Server, args: argparse.Namespace) -> tuple[Tally, list[dict[str, Any]], float]:
    """Five client threads until the deadline, a sampler every --sample-every seconds."""
    tally, samples, stop = Tally(), [], threading.Event()
    t0 = time.monotonic()
    deadline = t0 + args.soak_seconds

    def sampler() -> None:
        while True:
            try:
                samples.append(sample(server, t0))
            except (httpx.HTTPError, KeyError, ValueError) as error:
                progress(f"soak: sample failed: {error}")
            if stop.wait(args.sample_every):
                return

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    client = sync_client(server.base_url, CLIENT_TIMEOUT_S)
    workers: list[Callable[[], None]] = [
        partial(soak_chat, client, tally, deadline, random.Random(args.seed), "soak-chat-a"),
        partial(soak_chat, client, tally, deadline, random.Random(args.seed + 1), "soak-chat-b"),
        partial(soak_chain, client, tally, deadline, random.Random(args.seed + 2)),
        partial(soak_conversation, client, tally, deadline, random.Random(args.seed + 3)),
        partial(soak_compact, client, tally, deadline, random.Random(args.seed + 4)),
    ]
    threads = [threading.Thread(target=worker, daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.soak_seconds + args.hang_bound)
    clients_done = time.monotonic() - t0
    stop.set()
    watcher.join(HTTP_TIMEOUT_S)
    client.close()
    if hung := sum(thread.is_alive() for thread in threads):
        tally.add("soak", "client thread still running", f"{hung} threads")
    return tally, samples, clients_done


def is_expected(kind: str, outcome: str) -> bool:
    return outcome == "200" or (kind == "compact" and outcome == EXPECTED_COMPACT_OUTCOME)


def run_soak(setup: Setup) -> PartResult:
    args = setup.args
    flags = ["--prompt-cache-snapshot-capacity-bytes", args.soak_snapshot_capacity]
    flags += ["--mlx-cache-limit", args.soak_mlx_cache_limit] if args.soak_mlx_cache_limit is not None else []
    result, courier = setup.part("soak", f"bench.reliability --parts soak --soak-seconds {args.soak_seconds:g}", flags)
    with courier as server:
        progress(f"soak: {args.soak_seconds:g} s of mixed traffic")
        tally, samples, clients_s = soak_traffic(server, args)
        first, after, idle_s = wait_idle(server)
        stats, rss_end = get_json(server, "/v1/cache/stats"), rss_kib(server.pid)
        exit_code = server.stop(signal.SIGTERM)
    tallied = {f"{k} / {o}": (k, o, n) for (k, o), n in tally.counts.items()}
    failures = {name: n for name, (k, o, n) in tallied.items() if not is_expected(k, o) and o[:1] != "4"}
    client_4xx = {name: n for name, (k, o, n) in tallied.items() if o[:1] == "4" and not is_expected(k, o)}
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.counts.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    capacity = max((s["snapshot_capacity_bytes"] for s in samples), default=0)
    max_bytes = max((s["snapshot_bytes"] for s in samples), default=0)
    over = [s for s in samples if s["snapshot_bytes"] > s["snapshot_capacity_bytes"]]
    minute = min(samples, key=lambda s: abs(s["t_s"] - 60.0)) if samples else None
    rss_values = [s["rss_kib"] for s in samples if s["rss_kib"] is not None]
    growth = rss_end - minute["rss_kib"] if rss_end is not None and minute and minute["rss_kib"] is not None else None
    result.row("duration (s) / samples", f"{args.soak_seconds:g} (clients done at {clients_s:.1f}) / {len(samples)}")
    for kind, outcomes in by_kind.items():
        result.row(f"outcomes: {kind}", counts(outcomes))
    result.row("requests in all", sum(tally.counts.values()))
    result.row("snapshot bytes max / budget", f"{max_bytes} / {capacity} ({len(over)} samples over)")
    result.row(
        "snapshot entries / LRU evictions at end", f"{stats['snapshot_entries']} / {stats['snapshot_evictions_lru']}"
    )
    result.row("snapshot stats at end", ", ".join(f"{key}={stats[key]}" for key in SNAPSHOT_STATS))
    result.row(
        "max running / waiting sampled",
        " / ".join(str(max((s[key] for s in samples), default=0)) for key in ("running", "waiting")),
    )
    first_rss, minute_rss = rss_values[0] if rss_values else None, minute["rss_kib"] if minute else None
    rss = (first_rss, minute_rss, max(rss_values, default=None), rss_end)
    result.row("RSS first sample / ~60 s / max / end (MiB)", " / ".join(mib(value) for value in rss))
    result.row("RSS growth ~60 s -> end (MiB)", mib(growth))
    if samples and minute is not None:

        def mebibytes(key: str, chosen: Sequence[dict[str, Any]]) -> str:
            return " / ".join(f"{s[key] / 2**20:.1f}" for s in chosen)

        top = max(samples, key=lambda s: s["mlx_cache_bytes"])
        result.row(
            "MLX cache of freed buffers first / ~60 s / max / last (MiB)",
            mebibytes("mlx_cache_bytes", (samples[0], minute, top, samples[-1])),
        )
        result.row(
            "MLX arrays first / ~60 s / last (MiB)", mebibytes("mlx_active_bytes", (samples[0], minute, samples[-1]))
        )
        for label, key in (("in use", "malloc_in_use_bytes"), ("freed but held", "malloc_free_held_bytes")):
            if all(s[key] is not None for s in (samples[0], minute, samples[-1])):
                result.row(
                    f"malloc {label} first / ~60 s / last (MiB)", mebibytes(key, (samples[0], minute, samples[-1]))
                )
    result.row(
        "/health after clients stopped", f"{counters_text(first)}; idle: {counters_text(after)} ({idle_s:.1f} s)"
    )
    result.row("exit code after SIGTERM", exit_code)
    result.check("no failures (5xx, stream/connection errors)", not failures, counts(failures))
    result.check("no 4xx answers (but 422 compaction_failed)", not client_4xx, counts(client_4xx))
    result.check(
        "snapshot bytes never over the budget (sampled)",
        not over and max_bytes <= capacity,
        f"max {max_bytes} of {capacity}",
    )
    evictions = stats["snapshot_evictions_lru"]
    result.check("the budget made the store evict", evictions > 0, f"{evictions} LRU evictions")
    result.check("running == waiting == 0 once clients stop", idle(first), counters_text(first))
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    examples = {f"{k} / {o}": text for (k, o), text in tally.examples.items()}
    result.data = {"samples": samples, "examples": examples, "cache_stats_end": stats}
    return result
