"""Both response stores, SQLite and PostgreSQL, on real databases: persistence, chains, pagination, budgets, TTL.

Each test runs once per backend (`open_storage` in conftest.py); what only one backend
has is tested in its own module.
"""

from __future__ import annotations

import pytest

from courier.storage.paging import UnknownCursor, page_of
from courier.storage.records import (
    Order,
    PageQuery,
    StorageLimits,
    StorageRefused,
    StoredConversation,
    StoredResponse,
)
from tests.storage.conftest import LIMITS, Clock, OpenStorage, Storage
from tests.support.records import item, response


def test_a_saved_response_survives_reopening(open_storage: OpenStorage) -> None:
    first = open_storage(LIMITS)
    first.save_response(response("resp_1"), ())
    first.close()
    reopened = open_storage(LIMITS)
    assert reopened.load_response("resp_1") == response("resp_1")
    assert reopened.stored_entries == 1
    assert reopened.stored_bytes > 0


def test_a_chain_comes_back_oldest_first_and_names_a_missing_ancestor(storage: Storage) -> None:
    storage.save_response(response("resp_1"), ())
    storage.save_response(response("resp_2", previous="resp_1"), ())
    storage.save_response(response("resp_3", previous="resp_2"), ())
    chain = storage.load_chain("resp_3")
    assert chain is not None
    assert [hop.id for hop in chain.responses] == ["resp_1", "resp_2", "resp_3"]
    assert chain.missing is None
    assert storage.delete_response("resp_1")
    broken = storage.load_chain("resp_3")
    assert broken is not None and broken.missing == "resp_1"
    assert storage.load_chain("resp_unknown") is None


def test_saving_into_a_conversation_appends_its_items_atomically(storage: Storage) -> None:
    empty = storage.stored_bytes
    storage.create_conversation(StoredConversation(id="conv_1", created_at=1, metadata={"k": "v"}), [item("msg_0")])
    storage.save_response(response("resp_1", conversation="conv_1"), [item("msg_1"), item("msg_2")])
    assert [entry["id"] for entry in storage.conversation_items("conv_1") or ()] == ["msg_0", "msg_1", "msg_2"]
    assert storage.delete_response("resp_1") and storage.delete_conversation("conv_1")
    assert storage.stored_bytes == empty  # every byte counted once, and given back


def test_conversation_items_paginate_both_ways(storage: Storage) -> None:
    ids = [f"msg_{index}" for index in range(5)]
    storage.create_conversation(StoredConversation(id="conv_1", created_at=1, metadata={}), [item(i) for i in ids])

    def page(after: str | None, limit: int, order: Order) -> tuple[list[str], bool]:
        listed = storage.list_conversation_items("conv_1", PageQuery(after=after, limit=limit, order=order))
        assert listed is not None
        return [entry["id"] for entry in listed.items], listed.has_more

    assert page(None, 2, Order.ASC) == (ids[:2], True)
    assert page("msg_1", 2, Order.ASC) == (ids[2:4], True)
    assert page("msg_3", 2, Order.ASC) == (ids[4:], False)
    assert page(None, 3, Order.DESC) == (ids[::-1][:3], True)
    assert page("msg_2", 5, Order.DESC) == (["msg_1", "msg_0"], False)
    with pytest.raises(UnknownCursor):
        page("msg_unknown", 2, Order.ASC)
    assert storage.list_conversation_items("conv_x", PageQuery(after=None, limit=1, order=Order.ASC)) is None


def test_input_item_pages_match_the_stored_order() -> None:
    items = [item(f"msg_{index}") for index in range(3)]
    first = page_of(items, PageQuery(after=None, limit=2, order=Order.DESC))
    assert [entry["id"] for entry in first.items] == ["msg_2", "msg_1"] and first.has_more
    rest = page_of(items, PageQuery(after="msg_1", limit=2, order=Order.DESC))
    assert [entry["id"] for entry in rest.items] == ["msg_0"] and not rest.has_more


def test_deleting_items_and_conversations_gives_their_bytes_back(storage: Storage) -> None:
    empty = storage.stored_bytes
    storage.create_conversation(StoredConversation(id="conv_1", created_at=1, metadata={"a": "b"}), [item("msg_0")])
    assert storage.append_conversation_items("conv_1", [item("msg_1", "x" * 1000)])
    with_items = storage.stored_bytes
    assert storage.delete_conversation_item("conv_1", "msg_1") is True
    assert storage.stored_bytes < with_items - 1000
    assert storage.delete_conversation_item("conv_1", "msg_1") is False
    assert storage.delete_conversation_item("conv_x", "msg_1") is None
    assert storage.delete_conversation("conv_1")
    assert storage.stored_bytes == empty
    assert storage.stored_entries == 0
    assert not storage.append_conversation_items("conv_1", [item("msg_2")])


def test_the_byte_budget_evicts_the_least_recently_updated_first(open_storage: OpenStorage, clock: Clock) -> None:
    one = len(str(response("resp_0")).encode())  # roughly one record's JSON size
    store = open_storage(StorageLimits(max_bytes=3 * one, max_entries=100, ttl_s=3600.0))
    for index in range(6):
        clock.now += 1
        store.save_response(response(f"resp_{index}"), ())
        assert store.stored_bytes <= 3 * one
    kept = [f"resp_{index}" for index in range(6) if store.load_response(f"resp_{index}") is not None]
    assert kept and kept == [f"resp_{index}" for index in range(6 - len(kept), 6)]  # the newest survive
    assert "resp_5" in kept


def test_the_entry_budget_holds(open_storage: OpenStorage, clock: Clock) -> None:
    store = open_storage(StorageLimits(max_bytes=10**9, max_entries=2, ttl_s=3600.0))
    for index in range(4):
        clock.now += 1
        store.save_response(response(f"resp_{index}"), ())
    assert store.stored_entries == 2
    assert [store.load_response(f"resp_{index}") is not None for index in range(4)] == [False, False, True, True]


def test_a_record_over_the_whole_budget_is_refused_and_evicts_nothing(open_storage: OpenStorage, clock: Clock) -> None:
    store = open_storage(StorageLimits(max_bytes=2000, max_entries=100, ttl_s=3600.0))
    store.save_response(response("resp_small"), ())
    huge = StoredResponse(
        id="resp_huge",
        created_at=1.0,
        previous_response_id=None,
        conversation_id=None,
        input_items=(item("msg_1", "x" * 5000),),
        response={"id": "resp_huge", "output": []},
    )
    with pytest.raises(StorageRefused):
        store.save_response(huge, ())
    assert store.load_response("resp_small") is not None
    assert store.load_response("resp_huge") is None


def test_ttl_sweep_removes_what_was_not_updated(storage: Storage, clock: Clock) -> None:
    storage.save_response(response("resp_old"), ())
    storage.create_conversation(StoredConversation(id="conv_old", created_at=1, metadata={}), [])
    storage.create_conversation(StoredConversation(id="conv_busy", created_at=1, metadata={}), [])
    clock.now += LIMITS.ttl_s - 10
    storage.append_conversation_items("conv_busy", [item("msg_1")])  # an update renews it
    storage.save_response(response("resp_new"), ())
    clock.now += 20
    assert storage.sweep(clock.now) == 2
    assert storage.load_response("resp_old") is None
    assert storage.load_conversation("conv_old") is None
    assert storage.load_response("resp_new") is not None
    assert storage.load_conversation("conv_busy") is not None


def test_a_response_whose_conversation_was_deleted_is_still_saved(storage: Storage) -> None:
    storage.save_response(response("resp_1", conversation="conv_gone"), [item("msg_1")])
    assert storage.load_response("resp_1") is not None
    assert storage.conversation_items("conv_gone") is None
    assert storage.stored_entries == 1


def test_text_holding_a_nul_character_comes_back_as_it_was_sent(storage: Storage) -> None:
    nul = "before\x00after"
    storage.create_conversation(
        StoredConversation(id="conv_1", created_at=1, metadata={"note": nul}), [item("m0", nul)]
    )
    # Keys out of sorted order, and a key holding a NUL: both come back as sent.
    sent = {"id": "resp_1", "zeta": nul, "output": [item("out_1", nul)], "alpha": {"key\x00": [nul]}}
    stored = StoredResponse(
        id="resp_1",
        created_at=1.0,
        previous_response_id=None,
        conversation_id="conv_1",
        input_items=(item("in_1", nul),),
        response=sent,
    )
    storage.save_response(stored, [item("m1", nul)])
    assert storage.append_conversation_items("conv_1", [item("m2", nul)])
    loaded = storage.load_response("resp_1")
    assert loaded == stored and list(loaded.response) == list(sent)
    chain = storage.load_chain("resp_1")
    assert chain is not None and chain.responses == (stored,)
    assert storage.conversation_items("conv_1") == (item("m0", nul), item("m1", nul), item("m2", nul))
    assert storage.load_conversation_item("conv_1", "m1") == item("m1", nul)
    conversation = storage.update_conversation("conv_1", {"note": nul + "!"})
    assert conversation is not None and conversation.metadata == {"note": nul + "!"}
