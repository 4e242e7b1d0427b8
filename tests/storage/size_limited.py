"""A child process for `test_storage_faults.py`: the storage actor on a file system that runs out of room.

`RLIMIT_FSIZE` caps the size of any file this process writes, which is what a full
disk looks like to SQLite (the write past it fails with EFBIG, SIGXFSZ ignored). It
is a limit of the whole process, hence a child of its own. Run as
`python -m tests.storage.size_limited DATA_DIR`; prints one JSON object: what was
acknowledged, what was refused and how, and the actor's fault counters.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson

from courier.actors.storage import StorageActor
from courier.messages.asking import Refused, call
from courier.messages.storage import AppendConversationItems, CreateConversation, LoadResponse, SaveResponse
from courier.storage.records import StorageLimits, StoredConversation, StoredResponse
from courier.storage.sqlite import DATABASE_NAME, SqliteStorage
from tests.support.actors import run_actor
from tests.support.records import item, response

LIMITS = StorageLimits(max_bytes=10**9, max_entries=10_000, ttl_s=3600.0)


async def scenario(data_dir: Path) -> dict[str, Any]:
    storage = SqliteStorage(data_dir, LIMITS)
    actor = StorageActor(storage)
    report: dict[str, Any] = {"acknowledged": [], "appended": [], "refused": []}

    async with run_actor(actor) as outbox:

        async def save(stored: StoredResponse) -> None:
            await call(outbox, lambda reply: SaveResponse(response=stored, reply=reply))

        async def append(item_id: str) -> None:
            items = [item(item_id)]
            await call(
                outbox, lambda reply: AppendConversationItems(conversation_id="conv_1", items=items, reply=reply)
            )

        async def attempt(name: str, write: Any) -> None:
            try:
                await write
            except Refused as refused:
                failure = refused.failure
                report["refused"].append([name, failure.kind.value, failure.code, failure.message])

        conversation = StoredConversation(id="conv_1", created_at=1, metadata={})
        await call(outbox, lambda reply: CreateConversation(conversation=conversation, items=[], reply=reply))
        for index in range(3):
            await save(response(f"resp_{index}"))
            report["acknowledged"].append(f"resp_{index}")
            await append(f"msg_{index}")
            report["appended"].append(f"msg_{index}")
        entries = storage.stored_entries

        # Every write appends to the write-ahead log: capped at its present size, the next one has no room.
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        wal = data_dir / f"{DATABASE_NAME}-wal"
        resource.setrlimit(resource.RLIMIT_FSIZE, (wal.stat().st_size, hard))
        await attempt("resp_full", save(response("resp_full")))
        await attempt("msg_full", append("msg_full"))
        loaded = await call(outbox, lambda reply: LoadResponse(response_id="resp_0", reply=reply))
        report["read_while_full"] = loaded == response("resp_0")
        report["entries_kept"] = storage.stored_entries == entries

        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the disk has room again
        await save(response("resp_after"))
        report["acknowledged"].append("resp_after")
        await append("msg_after")
        report["appended"].append("msg_after")
        report["unavailable_calls"] = actor.storage_faults.unavailable_calls
    return report


def main() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    report = anyio.run(scenario, Path(sys.argv[1]))
    sys.stdout.write(orjson.dumps(report).decode() + "\n")


if __name__ == "__main__":
    main()
