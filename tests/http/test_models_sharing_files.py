"""The same model files declared under two names, through the real server: two models, each with its own disk tier.

`--model a=DIR --model c=DIR` is how an operator serves one set of weights under two names (say, a chat model and
the same weights pooled for embeddings). Each name must keep its own conversations on disk: loaded side by side,
both have a disk tier, and one loaded while the other is not never deletes the other's files (it did, when both
shared one directory and the second's start-up scan took the first's files for a renamed model's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import RunningServer, running_server

WAIT_S = 60.0
SYSTEM = "You help the customers of a shop that sells bicycles. " * 12


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    args = [
        *("--model", f"a={tiny_llama_dir}", "--model", f"c={tiny_llama_dir}"),
        *("--cache-dir", str(tmp_path_factory.mktemp("shared-files-cache"))),
        *("--prompt-cache-snapshot-capacity-bytes", "16MiB"),
    ]
    with running_server(args) as running:
        yield running
        assert running.stop() == 0


def chat(http: httpx.Client, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": 4, "user": "warm-customer"}
    response = http.post("/v1/chat/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def cache_stats(http: httpx.Client, model: str) -> dict[str, Any]:
    figures: dict[str, Any] = http.get("/v1/cache/stats", params={"model": model}).json()
    return figures


def test_two_names_for_one_set_of_files_keep_their_own_conversations_on_disk(server: RunningServer) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    with server.http() as http:
        for question in ("Where is my parcel?", "And the invoice?"):
            messages.append({"role": "user", "content": question})
            reply = chat(http, "a", messages)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        warm_before = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        chat(http, "c", [{"role": "user", "content": "Hi"}])  # loaded beside a: its own directory, not a's
        a_loaded, c_loaded = cache_stats(http, "a"), cache_stats(http, "c")
        assert http.post("/v1/models/a/unload").json()["state"] == "not_loaded"  # a's memory tier goes to disk
        # c loaded again with a gone: its start-up scan sees only its own directory.
        assert http.post("/v1/models/c/unload").json()["state"] == "not_loaded"
        assert http.post("/v1/models/c/load").json()["state"] == "loaded"
        messages.append({"role": "user", "content": "Thanks!"})
        reply = chat(http, "a", messages)
        a_again = cache_stats(http, "a")
    assert warm_before > 0
    # a's whole history but the last reply's tokens came back from its own files, untouched by c.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm_before
    assert a_again["snapshot_disk_hits"] >= 1 and a_again["snapshot_disk_adopted"] >= 1, a_again
    assert c_loaded["snapshot_disk_capacity_bytes"] > 0, c_loaded  # both have a disk tier at once
    assert c_loaded["snapshot_disk_directory"] != a_loaded["snapshot_disk_directory"]
