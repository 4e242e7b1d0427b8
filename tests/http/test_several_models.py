"""Several models in one server, through the real server: each loaded when a request names it, requests waiting on
one load, a load that fails, eviction under a small memory budget while another model streams (the stream
completes), a model loaded again served warm from its prompt cache's disk tier, idle expiry, pins, `keep_alive`
and an operator's load and unload.

Two tiny random-weight models (a dense llama, a hybrid qwen3_next) and one that cannot load. With a 16 MiB
prompt-cache memory tier each is charged 34 and 47 MB: the 60 MiB budget holds one at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import RunningServer, running_server

BUDGET = "60MiB"
# With an 8 MiB memory tier: a and c are charged 25.5 MB each, b about 35 before it loads: a + c fit, a + b do not.
PINNED_BUDGET = "56MiB"
STREAMED_TOKENS = 120
NO_END = {"0": -100, "2": -100}  # the tiny models' end tokens banned: a reply runs to its max_tokens
WAIT_S = 60.0


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory whose weights are missing: it cannot load."""
    directory = tmp_path_factory.mktemp("broken")
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tiny_qwen3_next_dir: Path, broken_dir: Path, cache_dir: Path, trace_file: Path
) -> Iterator[RunningServer]:
    args = [
        *("--model", f"a,alias-a={tiny_llama_dir}", "--model", f"b={tiny_qwen3_next_dir}"),
        *("--model", f"broken={broken_dir}", "--cache-dir", str(cache_dir)),
        *("--prompt-cache-snapshot-capacity-bytes", "16MiB", "--models-memory-bytes", BUDGET),
        *("--trace-file", str(trace_file)),
    ]
    with running_server(args) as running:
        yield running
        assert running.stop() == 0


def models(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {model["id"]: model for model in http.get("/v1/models").json()["data"]}


def state(http: httpx.Client, name: str) -> str:
    shown: str = models(http)[name]["status"]["state"]
    return shown


def chat(http: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    return http.post("/v1/chat/completions", json=body, timeout=WAIT_S)


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_models_lists_every_model_with_its_state_and_memory(server: RunningServer) -> None:
    with server.http() as http:
        listed = models(http)
        health = http.get("/health").json()
    assert list(listed) == ["a", "alias-a", "b", "broken"]
    a, b = listed["a"], listed["b"]
    assert a["status"]["state"] == "loaded"  # the default loads at start-up
    assert a["status"]["memory"]["weights"] == "measured" and a["capabilities"]["tool_calling"] == "generic"
    assert b["status"]["state"] == "not_loaded" and b["status"]["memory"]["weights"] == "estimated"
    assert b["status"]["memory"]["weights_bytes"] > 0
    assert listed["alias-a"]["status"] == a["status"]
    assert health["status"] == "ok" and health["models"]["memory_budget_bytes"] == 60 * 1024**2
    assert set(health["models"]["models"]) == {"a", "b", "broken"}


def test_concurrent_requests_for_a_model_wait_on_its_one_load(server: RunningServer) -> None:
    with server.http() as http:
        assert http.post("/v1/models/b/unload").json()["state"] == "not_loaded"
        loads = models(http)["b"]["status"]["loads"]
    answers: list[httpx.Response] = []

    def ask() -> None:
        with server.http() as http:
            answers.append(chat(http, "b"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [answer.status_code for answer in answers] == [200] * 4
    assert {answer.json()["model"] for answer in answers} == {"b"}
    with server.http() as http:
        shown = models(http)["b"]["status"]
    assert shown["loads"] == loads + 1  # one load served all four
    assert shown["state"] == "loaded" and shown["requests_in_flight"] == 0


def test_a_failed_load_is_a_clear_error_and_disturbs_nothing(server: RunningServer) -> None:
    with server.http() as http:
        loaded_before = {name: model["status"]["state"] for name, model in models(http).items()}
        for _ in range(2):
            refused = chat(http, "broken")
            assert refused.status_code == 503
            error = refused.json()["error"]
            assert error["code"] == "model_load_failed" and error["param"] == "model"
            assert "holds no .safetensors weights" in error["message"]
        listed = models(http)
        assert "safetensors" in listed["broken"]["status"]["error"]
        assert {name: model["status"]["state"] for name, model in listed.items()} == loaded_before
        assert chat(http, "nope").json()["error"]["code"] == "model_not_found"


def test_a_stream_completes_while_the_next_model_waits_for_its_memory(server: RunningServer) -> None:
    with server.http() as http:
        assert chat(http, "a").status_code == 200
    streamed: list[str] = []
    finished: dict[str, float] = {}
    first_chunk = threading.Event()

    def stream_a() -> None:
        with server.openai_client() as client:
            chunks = client.chat.completions.create(
                model="a",
                messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=STREAMED_TOKENS,
                logit_bias=NO_END,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in chunks:
                first_chunk.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    streamed.append(chunk.choices[0].finish_reason)
                if chunk.usage is not None:
                    streamed.append(str(chunk.usage.completion_tokens))
        finished["a"] = time.monotonic()

    streaming = threading.Thread(target=stream_a)
    streaming.start()
    assert first_chunk.wait(WAIT_S)
    with server.http() as http:
        answer = chat(http, "b")  # b needs a's memory: it waits for a's stream to end
        finished["b"] = time.monotonic()
        streaming.join()
        assert answer.status_code == 200
        assert streamed == ["length", str(STREAMED_TOKENS)]  # the stream was never cut
        assert finished["a"] <= finished["b"]
        listed = models(http)
    assert (listed["a"]["status"]["state"], listed["b"]["status"]["state"]) == ("not_loaded", "loaded")
    assert listed["a"]["status"]["unloads"] >= 1


def test_a_model_loaded_again_finds_its_conversation_warm_on_disk(server: RunningServer) -> None:
    system = "You help the customers of a shop that sells bicycles. " * 12
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    with server.http() as http:
        for question in ("Where is my parcel?", "And the invoice?"):
            messages.append({"role": "user", "content": question})
            reply = chat(http, "a", messages=messages, user="warm-customer").json()
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        warm_before = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert chat(http, "b").status_code == 200  # a goes to make room: its memory tier is written to disk
        assert state(http, "a") == "not_loaded"
        messages.append({"role": "user", "content": "Thanks!"})
        reply = chat(http, "a", messages=messages, user="warm-customer").json()
        figures = http.get("/v1/cache/stats", params={"model": "a"}).json()
    assert warm_before > 0
    # Its whole history but the last reply's tokens (written by the warm-up after that reply) came from disk.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm_before
    assert figures["snapshot_disk_hits"] >= 1 and figures["snapshot_disk_adopted"] >= 1, figures


def test_an_operator_loads_and_unloads_by_hand(server: RunningServer) -> None:
    with server.http() as http:
        loaded = http.post("/v1/models/alias-a/load").json()
        assert (loaded["id"], loaded["state"]) == ("a", "loaded")
        assert state(http, "a") == "loaded"
        assert http.post("/v1/models/a/unload").json()["state"] == "not_loaded"
        assert state(http, "a") == "not_loaded"
        assert http.post("/v1/models/nope/load").json()["error"]["code"] == "model_not_found"
        stats = http.get("/v1/cache/stats", params={"model": "a"}).json()
    assert stats == {"enabled": True, "model_loaded": False}  # asking for figures never loads a model


def test_traces_show_the_load_the_wait_and_the_unload(server: RunningServer, trace_file: Path) -> None:
    with server.http() as http:
        http.post("/v1/models/b/unload")
        assert chat(http, "b").status_code == 200
    wait_until(lambda: "model_registry.load" in trace_file.read_text(), "a load span written")
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    names = {span["name"] for span in spans}
    assert {"model_registry.load", "model_registry.wait", "model_registry.unload"} <= names
    loads = [span for span in spans if span["name"] == "model_registry.load"]
    requests = {span["context"]["trace_id"] for span in spans if span["name"].startswith("POST")}
    assert any(span["context"]["trace_id"] in requests for span in loads)  # a load joins the request's trace


@pytest.fixture(scope="module")
def pinned(tiny_llama_dir: Path, tiny_qwen3_next_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    """a pinned, b too big beside it, c (another llama) fitting beside it; idle models go after a second."""
    args = [
        *("--model", f"a={tiny_llama_dir}", "--model", f"b={tiny_qwen3_next_dir}", "--model", f"c={tiny_llama_dir}"),
        *("--cache-dir", str(cache_dir), "--pin", "a", "--model-ttl", "1"),
        *("--prompt-cache-snapshot-capacity-bytes", "8MiB", "--models-memory-bytes", PINNED_BUDGET),
    ]
    with running_server(args) as running:
        yield running
        assert running.stop() == 0


def test_a_pinned_model_stays_and_what_cannot_fit_beside_it_is_refused(pinned: RunningServer) -> None:
    with pinned.http() as http:
        refused = chat(http, "b")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_too_large"
        assert "a (loaded, pinned)" in refused.json()["error"]["message"]
        assert models(http)["a"]["status"]["pinned"] is True
        assert chat(http, "a").status_code == 200
        assert chat(http, "c").status_code == 200
        wait_until(lambda: state(http, "c") == "not_loaded", "c unloaded a second after its last request")
        assert state(http, "a") == "loaded"  # pinned: past its TTL, still loaded


def test_keep_alive_keeps_a_model_or_lets_it_go_at_once(pinned: RunningServer) -> None:
    with pinned.http() as http:
        assert chat(http, "c", keep_alive="1h").status_code == 200
        assert models(http)["c"]["status"]["unloads_in_s"] > 3000
        assert chat(http, "c", keep_alive=0).status_code == 200
        wait_until(lambda: state(http, "c") == "not_loaded", "c unloaded as its request ended")
        bad = chat(http, "c", keep_alive="soon")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_metrics_carry_each_models_figures_by_label(server: RunningServer) -> None:
    with server.http() as http:
        for model in ("a", "b"):
            assert chat(http, model).status_code == 200
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples
        }
    for model in ("a", "b"):
        completed = samples[("courier_model_requests_total", (("model", model), ("outcome", "completed")))]
        assert completed >= 1
        assert samples[("courier_model_time_to_first_token_seconds_count", (("model", model),))] >= 1
        assert samples[("courier_model_loads_total", (("model", model),))] >= 1
    states = [(labels, value) for (name, labels), value in samples.items() if name == "courier_model_state"]
    for model in ("a", "b", "broken"):
        assert sum(value for labels, value in states if ("model", model) in labels) == 1  # one state each
    assert samples[("courier_models_memory_budget_bytes", ())] == 60 * 1024**2
