"""Conversation items in PostgreSQL: each append takes the conversation's row lock and numbers its items under it.

`conversations.next_position` is the position the conversation's next item gets. An
append reads it `FOR UPDATE`, inserts its items at consecutive positions and moves
it on, all in the caller's transaction, so appends from any number of replicas take
turns on the one row: one append's items never interleave with another's, and no
two items get one position. Positions only order items; a page's cursor is an item's
id. Items are stored as JSON text (the `json` type), and counted in bytes of that text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from psycopg import Connection

from courier.storage.records import JsonObject

# (item id, JSON text, its size in bytes)
ItemRow = tuple[str, str, int]


def append_items(connection: Connection[Any], conversation_id: str, rows: Sequence[ItemRow], now: float) -> int | None:
    """Append `rows` at the conversation's end; the bytes added, or None if the conversation is not stored."""
    locked = connection.execute(
        "SELECT next_position FROM conversations WHERE id = %s FOR UPDATE", (conversation_id,)
    ).fetchone()
    if locked is None:
        return None
    first = int(locked[0])
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO conversation_items (conversation_id, position, id, item, nbytes) "
            "VALUES (%s, %s, %s, %s::json, %s)",
            [(conversation_id, first + offset, *row) for offset, row in enumerate(rows)],
        )
    connection.execute(
        "UPDATE conversations SET next_position = %s, updated_at = %s WHERE id = %s",
        (first + len(rows), now, conversation_id),
    )
    return sum(size for _, _, size in rows)


def item_row(item: JsonObject) -> ItemRow:
    return (str(item["id"]), *json_text(item))


def json_text(value: object) -> tuple[str, int]:
    """`value` as the JSON text sent to a `json` column, and its size in bytes (what the budget counts, as SQLite's)."""
    blob = orjson.dumps(value)
    return blob.decode(), len(blob)
