"""The admission window through the real server: an idle scheduler lets a lone request whose step is short in at
once, and counts it in `/health` (`scheduler.admission_windows_skipped`). The scheduler's side of it, with a scripted
engine, is tests/actors/test_admission_window.py; the engine's estimate, tests/engine/test_batch_engine.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.support.server import serving


def window_counts(http: httpx.Client) -> tuple[int, int]:
    scheduler = http.get("/health").json()["scheduler"]
    return scheduler["admission_windows_waited"], scheduler["admission_windows_skipped"]


def ask(client: openai.OpenAI, text: str) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_lone_request_whose_step_is_short_goes_in_without_waiting_the_window(
    tiny_llama_dir: Path, cache_dir: Path
) -> None:
    # Without the prompt cache no warm-up runs after a reply, so the second request finds the scheduler idle.
    args = ("--admission-window-ms", "500", "--no-prompt-cache")
    with (
        serving(tiny_llama_dir, cache_dir, "tiny", *args) as server,
        server.openai_client() as client,
        server.http() as http,
    ):
        ask(client, "a first request: the cost model has timed no step yet, and its prior is a long one")
        before = window_counts(http)
        ask(client, "a second request, alone, after the first")  # a tiny model's step: milliseconds
        after = window_counts(http)
    assert before[0] + before[1] == 1  # the first was admitted by an idle scheduler, one way or the other
    assert after == (before[0], before[1] + 1)
