"""Compaction through a real server on a tiny random-weight model: every refusal and failure path.

A random-weight model never ends a summary on its own, but the summary's grammar ends it within its budget
(`grammar/summary.py`), so a compaction succeeds here too; its faithful success paths run on SmolLM2
(`tests/test_compaction_real_model.py`). Here a capsule the server would accept is built with the server's key,
and the 400 paths are reached for real.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from courier.conversation.capsule import Capsule, CapsuleCodec, item_digest
from courier.conversation.replay import SUMMARY_HEADER
from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
KEY = b"a-test-key-of-32-random-bytes!!!"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    key_file = tmp_path_factory.mktemp("key") / "compaction.key"
    key_file.write_bytes(KEY)
    with serving(tiny_llama_dir, cache_dir, MODEL, "--compaction-key-file", str(key_file)) as running:
        yield running


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def normalized(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def compaction(encrypted: Any) -> dict[str, Any]:
    return {"type": "compaction", "encrypted_content": encrypted}


def count(http: httpx.Client, items: list[dict[str, Any]]) -> httpx.Response:
    return http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items})


def test_a_capsule_made_with_the_server_key_replays_as_summary_and_retained_items(http: httpx.Client) -> None:
    kept = normalized("user", "The keeper is Ada.")
    capsule = CapsuleCodec(KEY, 10**6).encode(Capsule(summary="Ships logged: Aurora.", retained=(item_digest(kept),)))
    history = [user("An old turn that the summary covers."), user("The keeper is Ada.")]
    replayed = count(http, [*history, compaction(capsule), user("Which ships?")])
    assert replayed.status_code == 200, replayed.text
    by_hand = count(
        http,
        [
            {"type": "message", "role": "assistant", "content": SUMMARY_HEADER + "Ships logged: Aurora."},
            user("The keeper is Ada."),
            user("Which ships?"),
        ],
    )
    assert replayed.json()["input_tokens"] == by_hand.json()["input_tokens"]


def raw(payload: Any) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(payload)).rstrip(b"=").decode()


TAMPERED = [
    ("not base64url", "%%% not base64 %%%"),
    ("not JSON", raw("a string, not an object")[:-2] + "!!"),
    ("version 2", raw({"v": 2, "summary": "s", "retained": []})),
    ("nested capsule", raw({"v": 1, "summary": "s", "retained": [{"type": "compaction", "encrypted_content": "x"}]})),
    ("unsigned", CapsuleCodec(None, 10**6).encode(Capsule(summary="s", retained=()))),
    (
        "another server's",
        CapsuleCodec(b"another-server-key-32-bytes-long", 10**6).encode(Capsule(summary="s", retained=())),
    ),
]


@pytest.mark.parametrize(("case", "encrypted"), TAMPERED, ids=[case for case, _ in TAMPERED])
def test_a_tampered_capsule_is_refused_everywhere(http: httpx.Client, case: str, encrypted: str) -> None:
    for path in ("/v1/responses/input_tokens", "/v1/responses", "/v1/responses/compact"):
        reply = http.post(path, json={"model": MODEL, "input": [user("hi"), compaction(encrypted), user("more")]})
        assert reply.status_code == 400, (case, path, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "input"
        assert "compaction item" in error["message"]


def test_an_altered_capsule_is_refused(http: httpx.Client) -> None:
    signed = CapsuleCodec(KEY, 10**6).encode(Capsule(summary="The keeper is Ada.", retained=()))
    payload = orjson.loads(base64.urlsafe_b64decode(signed + "=" * (-len(signed) % 4)))
    payload["summary"] = "The keeper is Mallory."
    reply = count(http, [compaction(raw(payload)), user("Who is the keeper?")])
    assert reply.status_code == 400
    assert "altered" in reply.json()["error"]["message"]


def long_history(turns: int, words: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for turn in range(turns):
        items.append(user(f"Turn {turn}: " + "the lighthouse log continues " * words))
        items.append({"role": "assistant", "content": f"Noted turn {turn}."})
    items.append(user("Summarize the log."))
    return items


def test_a_summary_that_never_ends_on_its_own_ends_within_max_output_tokens(http: httpx.Client) -> None:
    """Random weights never write the end: the grammar's budget (here 4 characters) ends the summary before the
    cut that used to make this a 422."""
    body = {"model": MODEL, "input": long_history(4, 20), "max_output_tokens": 4, "keep_tokens": 16}
    reply = http.post("/v1/responses/compact", json=body)
    assert reply.status_code == 200, reply.text
    assert 0 < reply.json()["usage"]["output_tokens"] <= 4
    (capsule,) = [item for item in reply.json()["output"] if item["type"] == "compaction"]
    encoded = capsule["encrypted_content"]
    summary = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))["summary"]
    assert summary.startswith("- ") and len(summary) <= 4
    assert http.get("/health").json()["scheduler"]["running"] == 0


def test_the_openai_client_does_not_retry_a_failed_compaction(server: RunningServer) -> None:
    """The same greedy summary would fail alike: a 4xx, which the SDK raises at once, however many retries it has."""
    sent: list[object] = []
    with (
        openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}) as transport,
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=2, http_client=transport) as client,
        pytest.raises(openai.BadRequestError) as raised,
    ):
        client.responses.compact(model=MODEL, input=long_history(12, 60), extra_body={"keep_tokens": 16})  # type: ignore[arg-type]
    assert raised.value.code == "context_length_exceeded"
    assert len(sent) == 1


def test_an_automatic_compaction_that_fails_is_refused_alike(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": long_history(12, 60),  # what it would summarize does not fit one window
        "context_management": [{"type": "compaction", "compact_threshold": 32}],
    }
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_a_history_that_does_not_fit_one_window_is_refused(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": long_history(12, 60), "keep_tokens": 16}  # far over the 2048-token context
    reply = http.post("/v1/responses/compact", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_a_history_that_all_fits_keep_tokens_gets_one_compaction_item(http: httpx.Client) -> None:
    """Codex expects exactly one compaction item back: nothing is summarized and every item is kept."""
    reply = http.post("/v1/responses/compact", json={"model": MODEL, "input": "Just one message."})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [item["type"] for item in output] == ["message", "compaction"]
    assert output[0]["content"][0]["text"] == "Just one message."
    assert reply.json()["usage"]["output_tokens"] == 0


BAD_COMPACT_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"input": "hi", "stream": True}, "stream"),
    ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_x"}, "conversation"),
    ({}, "input"),
    ({"input": "hi", "keep_tokens": 0}, "keep_tokens"),
    ({"input": "hi", "max_output_tokens": 16385}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "teleporter"}]}, "tools[0].type"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPACT_BODIES)
def test_bad_compact_requests_are_400s(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    reply = http.post("/v1/responses/compact", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_automatic_compaction_failing_mid_stream_ends_with_response_failed(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": long_history(12, 60),
        "stream": True,
        "context_management": [{"type": "compaction", "compact_threshold": 32}],
    }
    events = []
    with http.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
    kinds = [event["type"] for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.failed",
    ]
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"


def test_bad_context_management_is_refused(http: httpx.Client) -> None:
    for management, param in (
        ([{"type": "truncation"}], "context_management[0].type"),
        ([{"type": "compaction", "compact_threshold": 0}], "context_management[0].compact_threshold"),
        ("compaction", "context_management"),
    ):
        reply = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "context_management": management})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == param


def test_a_conversation_given_a_replay_appends_only_the_new_turn(http: httpx.Client) -> None:
    conversation = http.post("/v1/conversations", json={}).json()["id"]
    first = {"model": MODEL, "conversation": conversation, "max_output_tokens": 2}
    assert http.post("/v1/responses", json={**first, "input": "The keeper is Ada."}).status_code == 200
    assert http.post("/v1/responses", json={**first, "input": "The Aurora passed."}).status_code == 200
    items = http.get(f"/v1/conversations/{conversation}/items", params={"order": "asc"}).json()["data"]
    assert len(items) == 4
    kept = normalized("user", "The Aurora passed.")
    capsule = CapsuleCodec(KEY, 10**6).encode(Capsule(summary="Ada keeps the log.", retained=(item_digest(kept),)))
    replay = [user("The Aurora passed."), compaction(capsule), user("Who keeps the log?")]
    reply = http.post("/v1/responses", json={**first, "input": replay})
    assert reply.status_code == 200, reply.text
    after = http.get(f"/v1/conversations/{conversation}/items", params={"order": "asc", "limit": 100}).json()["data"]
    # The retained item is already in the conversation: only the capsule, the new message and the answer are added.
    assert [item["type"] for item in after[4:]] == ["compaction", "message", "message"]
    assert after[5]["content"][0]["text"] == "Who keeps the log?"
    # The next turn replays the capsule from the conversation: the summary and the retained turn, not the old ones.
    counted = http.post(
        "/v1/responses/input_tokens", json={"model": MODEL, "conversation": conversation, "input": "And now?"}
    ).json()["input_tokens"]
    by_hand = count(
        http,
        [
            {"type": "message", "role": "assistant", "content": SUMMARY_HEADER + "Ada keeps the log."},
            user("The Aurora passed."),
            user("Who keeps the log?"),
            {"type": "message", "role": "assistant", "content": after[6]["content"][0]["text"]},
            user("And now?"),
        ],
    ).json()["input_tokens"]
    assert counted == by_hand
