"""Storage faults stay local, on a real SQLite file: a damaged row fails only its own reads; a full disk fails the
write that meets it, nothing acknowledged is lost, and storing resumes once there is room."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest

from courier.storage.records import (
    DamagedRecord,
    Order,
    PageQuery,
    StorageLimits,
    StoredConversation,
)
from courier.storage.sqlite import DATABASE_NAME, SqliteStorage
from tests.support.records import item, response

LIMITS = StorageLimits(max_bytes=10**9, max_entries=10_000, ttl_s=3600.0)
REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120

GOOD_RESPONSE = orjson.dumps(response("resp_bad").response)
GOOD_ITEM = orjson.dumps(item("msg_bad"))


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[SqliteStorage]:
    """resp_bad and resp_ok, resp_child continuing resp_bad; conv_bad holding msg_0, msg_bad, msg_2; conv_ok."""
    store = SqliteStorage(tmp_path, LIMITS)
    store.save_response(response("resp_bad"), ())
    store.save_response(response("resp_ok"), ())
    store.save_response(response("resp_child", previous="resp_bad"), ())
    store.create_conversation(conversation("conv_bad"), [item("msg_0"), item("msg_bad"), item("msg_2")])
    store.create_conversation(conversation("conv_ok"), [item("msg_3")])
    yield store
    store.close()


def conversation(conversation_id: str) -> StoredConversation:
    return StoredConversation(id=conversation_id, created_at=1, metadata={"k": "v"})


def damage(data_dir: Path, sql: str, value: Any, record_id: str) -> None:
    """Change one row behind the server's back, as bit rot or a bad restore would."""
    with closing(sqlite3.connect(data_dir / DATABASE_NAME)) as db, db:
        assert db.execute(sql, (value, record_id)).rowcount == 1


RESPONSE_DAMAGE: list[tuple[str, str, Any]] = [
    ("bad JSON", "response", b"{this is not json"),
    ("truncated", "response", GOOD_RESPONSE[: len(GOOD_RESPONSE) // 2]),
    ("not UTF-8", "response", b"\xff\xfe\x00garbage"),
    ("empty", "response", b""),
    ("a list, not an object", "response", b"[]"),
    ("another response's object", "response", orjson.dumps({"id": "resp_other", "output": []})),
    ("output not a list", "response", orjson.dumps({"id": "resp_bad", "output": "text"})),
    ("an output item without an id", "response", orjson.dumps({"id": "resp_bad", "output": [{"type": "message"}]})),
    ("a number, not JSON", "response", 42),
    ("input items truncated", "input_items", orjson.dumps([item("in_resp_bad")])[:-3]),
    ("input items an object", "input_items", orjson.dumps({"id": "x"})),
    ("created_at text", "created_at", "yesterday"),
]


@pytest.mark.parametrize(("case", "column", "value"), RESPONSE_DAMAGE, ids=[case for case, _, _ in RESPONSE_DAMAGE])
def test_a_damaged_response_fails_only_its_own_reads(
    storage: SqliteStorage, tmp_path: Path, case: str, column: str, value: Any
) -> None:
    damage(tmp_path, f"UPDATE responses SET {column} = ? WHERE id = ?", value, "resp_bad")
    with pytest.raises(DamagedRecord) as damaged:
        storage.load_response("resp_bad")
    assert damaged.value.record == "response 'resp_bad'"
    with pytest.raises(DamagedRecord, match="resp_bad"):
        storage.load_chain("resp_child")  # a chain through it cannot be rebuilt
    assert storage.load_response("resp_ok") == response("resp_ok")
    chain = storage.load_chain("resp_ok")
    assert chain is not None and [hop.id for hop in chain.responses] == ["resp_ok"]
    storage.save_response(response("resp_new", previous="resp_ok"), ())
    assert storage.load_response("resp_new") == response("resp_new", previous="resp_ok")
    assert storage.delete_response("resp_bad")  # the way out: the damaged record can still be deleted
    assert storage.load_response("resp_bad") is None


ITEM_DAMAGE: list[tuple[str, Any]] = [
    ("bad JSON", b'{"id": "msg_bad", '),
    ("truncated", GOOD_ITEM[:-1]),
    ("a string, not an object", orjson.dumps("msg_bad")),
    ("another item's id", orjson.dumps(item("msg_other"))),
    ("no type", orjson.dumps({"id": "msg_bad"})),
]


@pytest.mark.parametrize(("case", "value"), ITEM_DAMAGE, ids=[case for case, _ in ITEM_DAMAGE])
def test_a_damaged_conversation_item_fails_only_the_reads_that_reach_it(
    storage: SqliteStorage, tmp_path: Path, case: str, value: Any
) -> None:
    damage(tmp_path, "UPDATE conversation_items SET item = ? WHERE id = ?", value, "msg_bad")
    record = "item 'msg_bad' of conversation 'conv_bad'"
    with pytest.raises(DamagedRecord) as damaged:
        storage.conversation_items("conv_bad")  # the context of the conversation's next turn
    assert damaged.value.record == record
    with pytest.raises(DamagedRecord):
        storage.load_conversation_item("conv_bad", "msg_bad")
    with pytest.raises(DamagedRecord):
        storage.list_conversation_items("conv_bad", PageQuery(after=None, limit=10, order=Order.ASC))
    first = storage.list_conversation_items("conv_bad", PageQuery(after=None, limit=1, order=Order.ASC))
    assert first is not None and [entry["id"] for entry in first.items] == ["msg_0"]
    assert storage.load_conversation_item("conv_bad", "msg_2") == item("msg_2")
    assert storage.load_conversation("conv_bad") == conversation("conv_bad")
    assert storage.conversation_items("conv_ok") == (item("msg_3"),)
    assert storage.delete_conversation_item("conv_bad", "msg_bad") is True
    assert storage.conversation_items("conv_bad") == (item("msg_0"), item("msg_2"))


@pytest.mark.parametrize(
    ("case", "value"),
    [("bad JSON", b"{oops"), ("values not strings", orjson.dumps({"k": 1})), ("a list", b"[]")],
)
def test_a_conversation_with_damaged_metadata_fails_only_its_own_reads(
    storage: SqliteStorage, tmp_path: Path, case: str, value: Any
) -> None:
    damage(tmp_path, "UPDATE conversations SET metadata = ? WHERE id = ?", value, "conv_bad")
    with pytest.raises(DamagedRecord, match="conversation 'conv_bad'"):
        storage.load_conversation("conv_bad")
    assert storage.load_conversation("conv_ok") == conversation("conv_ok")
    assert storage.update_conversation("conv_bad", {"k": "repaired"}) == StoredConversation(
        id="conv_bad", created_at=1, metadata={"k": "repaired"}
    )


def test_a_damaged_record_survives_reopening_and_the_rest_still_opens(storage: SqliteStorage, tmp_path: Path) -> None:
    damage(tmp_path, "UPDATE responses SET response = ? WHERE id = ?", b"\x00\x01", "resp_bad")
    reopened = SqliteStorage(tmp_path, LIMITS)  # start-up reads no record's JSON
    try:
        assert reopened.stored_entries == storage.stored_entries
        with pytest.raises(DamagedRecord):
            reopened.load_response("resp_bad")
        assert reopened.load_response("resp_ok") == response("resp_ok")
    finally:
        reopened.close()


def test_a_full_disk_fails_the_write_that_meets_it_and_storing_resumes_once_there_is_room(tmp_path: Path) -> None:
    """The storage actor in a child process whose files may not grow (RLIMIT_FSIZE), then may again."""
    data_dir = tmp_path / "data"
    child = subprocess.run(
        [sys.executable, "-m", "tests.storage.size_limited", str(data_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    report = orjson.loads(child.stdout)
    refused = {name: (kind, code) for name, kind, code, _ in report["refused"]}
    assert refused == {
        "resp_full": ("unavailable", "storage_unavailable"),
        "msg_full": ("unavailable", "storage_unavailable"),
    }
    assert all("retry later" in message for *_, message in report["refused"])
    assert report["read_while_full"] and report["entries_kept"]
    assert report["unavailable_calls"] == 2
    assert "the database cannot be used" in child.stderr  # logged once for the two failed calls
    assert child.stderr.count("the database cannot be used") == 1

    # Nothing acknowledged is lost, nothing refused was half written.
    reopened = SqliteStorage(data_dir, LIMITS)
    try:
        for response_id in report["acknowledged"]:
            assert reopened.load_response(response_id) == response(response_id)
        assert reopened.load_response("resp_full") is None
        assert reopened.conversation_items("conv_1") == tuple(item(item_id) for item_id in report["appended"])
        assert reopened.stored_entries == len(report["acknowledged"]) + 1
    finally:
        reopened.close()
