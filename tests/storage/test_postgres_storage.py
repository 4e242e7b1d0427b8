"""What only the PostgreSQL backend has: several writers on one database, budgets in SQL, migrations, outages
(a database down at start-up included), and what PostgreSQL cannot hold.

Each test opens storages on a fresh schema of the session's private cluster; two
`PostgresStorage` instances stand for two replicas (each has its own pool).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import psycopg
import psycopg.errors
import pytest

from courier.storage import postgres_connection, postgres_schema
from courier.storage.postgres import PostgresStorage
from courier.storage.postgres_budget import usage
from courier.storage.postgres_connection import Database, LoginRefused, redacted
from courier.storage.postgres_schema import SCHEMA_VERSION
from courier.storage.records import (
    StorageLimits,
    StorageUnavailable,
    StorageUnreachable,
    StoredConversation,
    StoredResponse,
    UnstorableRecord,
)
from courier.storage.tenant_budget import Usage
from tests.storage.conftest import LIMITS
from tests.support.polling import attempts
from tests.support.ports import free_port
from tests.support.postgres_cluster import PASSWORD, PostgresCluster
from tests.support.records import item, response

WRITERS = 2
TURNS = 40
CHAIN = 200


@pytest.fixture
def url(postgres_cluster: PostgresCluster) -> str:
    return postgres_cluster.fresh_url()


@pytest.fixture
def replicas(url: str) -> Iterator[Callable[[StorageLimits], PostgresStorage]]:
    """Opens one more "replica" of the same database each call."""
    opened: list[PostgresStorage] = []

    def replica(limits: StorageLimits = LIMITS) -> PostgresStorage:
        opened.append(PostgresStorage(url, limits))
        return opened[-1]

    yield replica
    for storage in opened:
        storage.close()


def in_threads(*work: Callable[[], None]) -> None:
    """Run each function on a thread of its own, started together; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(work))

    def run(function: Callable[[], None]) -> None:
        try:
            start.wait()
            function()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(function,)) for function in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def saving(storage: PostgresStorage, name: str, count: int) -> Callable[[], None]:
    def save() -> None:
        for index in range(count):
            storage.save_response(response(f"resp_{name}_{index}"), ())

    return save


def measured(url: str) -> tuple[int, int]:
    """The bytes and records really in the tables, to compare with the shared counts."""
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM responses) + (SELECT COALESCE(SUM(nbytes), 0) FROM "
            "conversations) + (SELECT COALESCE(SUM(nbytes), 0) FROM conversation_items), "
            "(SELECT COUNT(*) FROM responses) + (SELECT COUNT(*) FROM conversations)"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def test_two_replicas_appending_to_one_conversation_keep_every_item_in_turns(
    replicas: Callable[[StorageLimits], PostgresStorage], url: str
) -> None:
    first, second = replicas(LIMITS), replicas(LIMITS)
    first.create_conversation(StoredConversation(id="conv_1", created_at=1, metadata={}), [item("start")])

    def writer(storage: PostgresStorage, name: str) -> Callable[[], None]:
        def write() -> None:
            for turn in range(TURNS):
                # A turn is a user message and its answer: the two must stay next to each other.
                assert storage.append_conversation_items("conv_1", [item(f"{name}_q{turn}"), item(f"{name}_a{turn}")])
                if turn % 2:
                    storage.save_response(
                        response(f"resp_{name}_{turn}", conversation="conv_1"), [item(f"{name}_r{turn}")]
                    )

        return write

    in_threads(writer(first, "one"), writer(second, "two"))

    ids = [entry["id"] for entry in second.conversation_items("conv_1") or ()]
    assert ids[0] == "start"
    expected = {"start"} | {f"{name}_{kind}{turn}" for name in ("one", "two") for kind in "qa" for turn in range(TURNS)}
    expected |= {f"{name}_r{turn}" for name in ("one", "two") for turn in range(1, TURNS, 2)}
    assert len(ids) == len(expected) and set(ids) == expected  # none lost, none twice
    for name in ("one", "two"):
        own = [entry for entry in ids if entry.startswith(name)]
        assert own == [f"{name}_{kind}{turn}" for turn in range(TURNS) for kind in ("qar" if turn % 2 else "qa")]
        for turn in range(TURNS):
            question = ids.index(f"{name}_q{turn}")
            assert ids[question + 1] == f"{name}_a{turn}"  # the other writer never got in between
    assert (first.stored_bytes, first.stored_entries) == measured(url)


def test_budgets_hold_for_all_replicas_together(replicas: Callable[[StorageLimits], PostgresStorage], url: str) -> None:
    limits = StorageLimits(max_bytes=10**9, max_entries=3, ttl_s=3600.0)
    first, second = replicas(limits), replicas(limits)
    for index in range(6):
        (first if index % 2 else second).save_response(response(f"resp_{index}"), ())
        time.sleep(0.001)  # the real clock orders the records' updates
    assert first.stored_entries == second.stored_entries == 3
    assert [first.load_response(f"resp_{index}") is not None for index in range(6)] == [False] * 3 + [True] * 3

    in_threads(saving(first, "one", 30), saving(second, "two", 30))
    assert first.stored_entries == 3
    assert (first.stored_bytes, first.stored_entries) == measured(url)


def test_a_byte_budget_is_shared_and_a_record_over_it_is_refused(
    replicas: Callable[[StorageLimits], PostgresStorage], url: str
) -> None:
    one = len(str(response("resp_0")).encode())
    limits = StorageLimits(max_bytes=4 * one, max_entries=100, ttl_s=3600.0)
    first, second = replicas(limits), replicas(limits)
    in_threads(saving(first, "one", 20), saving(second, "two", 20))
    assert 0 < second.stored_bytes <= 4 * one
    assert (first.stored_bytes, first.stored_entries) == measured(url)


def test_a_chain_of_200_is_loaded_in_one_query(
    replicas: Callable[[StorageLimits], PostgresStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = replicas(LIMITS)
    for index in range(CHAIN):
        storage.save_response(response(f"resp_{index}", previous=f"resp_{index - 1}" if index else None), ())
    statements: list[str] = []
    execute = psycopg.Cursor.execute

    def counting(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if str(query).strip():  # the pool's liveness check sends an empty query
            statements.append(str(query))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counting)
    chain = storage.load_chain(f"resp_{CHAIN - 1}")
    monkeypatch.undo()
    assert chain is not None and chain.missing is None
    assert [hop.id for hop in chain.responses] == [f"resp_{index}" for index in range(CHAIN)]
    assert len(statements) == 1 and "WITH RECURSIVE" in statements[0]


def test_replicas_starting_together_apply_the_schema_once(url: str) -> None:
    opened: list[PostgresStorage] = []
    in_threads(*(lambda: opened.append(PostgresStorage(url, LIMITS)) for _ in range(3)))
    for storage in opened:
        storage.close()
    with psycopg.connect(url) as connection:
        versions = connection.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        assert [version for (version,) in versions] == list(range(1, SCHEMA_VERSION + 1))
        assert usage(connection) == (0, 0)
        connection.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
    with pytest.raises(RuntimeError, match=f"schema version {SCHEMA_VERSION + 1}"):
        PostgresStorage(url, LIMITS)


def test_a_stopped_database_is_unreachable_at_once_and_the_same_storage_reaches_it_again(
    replicas: Callable[[StorageLimits], PostgresStorage], postgres_cluster: PostgresCluster
) -> None:
    storage = replicas(LIMITS)
    storage.save_response(response("resp_before"), ())
    with postgres_cluster.stopped():
        started = time.monotonic()
        with pytest.raises(StorageUnreachable, match=r"terminating connection|Connection refused"):
            storage.save_response(response("resp_during"), ())
        with pytest.raises(StorageUnreachable):  # the pool is gone: no wait for one
            storage.load_response("resp_before")
        assert time.monotonic() - started < postgres_connection.ACQUIRE_TIMEOUT_S / 2
        with pytest.raises(StorageUnreachable):
            storage.reach()
    storage.reach()  # the breaker's probe: the same instance connects again
    storage.save_response(response("resp_after"), ())
    assert storage.load_response("resp_before") == response("resp_before")
    assert storage.load_response("resp_during") is None
    assert storage.load_response("resp_after") == response("resp_after")
    assert storage.stored_entries == 2


def test_calls_waiting_for_a_connection_fail_at_once_when_the_database_stops(
    replicas: Callable[[StorageLimits], PostgresStorage], url: str, postgres_cluster: PostgresCluster
) -> None:
    storage = replicas(LIMITS)
    storage.save_response(response("resp_1"), ())
    # What each call returned or raised, and how long it took.
    outcomes: list[tuple[StoredResponse | type[BaseException] | None, float]] = []
    calls = postgres_connection.POOL_MAX_SIZE + 2  # more than the pool holds: some wait for a connection

    def read() -> None:
        started = time.monotonic()
        try:
            outcome: StoredResponse | type[BaseException] | None = storage.load_response("resp_1")
        except StorageUnavailable as error:
            outcome = type(error)
        outcomes.append((outcome, time.monotonic() - started))

    blocker = psycopg.connect(url)  # closed by the database stopping
    blocker.execute("LOCK TABLE responses IN ACCESS EXCLUSIVE MODE")  # the readers hold or wait for connections
    threads = [threading.Thread(target=read) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for _ in attempts(5):
        if postgres_cluster.waiting_on_lock(url, "responses", postgres_connection.POOL_MAX_SIZE):
            break
    else:
        raise AssertionError("the readers never reached the database")
    with postgres_cluster.stopped():
        for thread in threads:
            thread.join(timeout=postgres_connection.ACQUIRE_TIMEOUT_S)
        late = {thread.ident for thread in threads if thread.is_alive()}
        for ident, frame in sys._current_frames().items():  # where a late call waits, should one ever be
            if ident in late:
                sys.stderr.write(f"a call still running:\n{''.join(traceback.format_stack(frame))}")
    blocker.close()
    assert len(outcomes) == calls  # no call still waits
    # A fast stop cuts the sessions one by one: a reader whose session took the lock as the blocker's was cut may
    # be answered before its own is (1-2 calls of 6 in 4 runs of 80 here). Only a reader holding a connection can be:
    # one waiting for a connection gets a dead one or none.
    answered = [outcome for outcome, _ in outcomes if outcome == response("resp_1")]
    assert len(answered) <= postgres_connection.POOL_MAX_SIZE
    failed = [outcome for outcome, _ in outcomes if outcome != response("resp_1")]
    assert failed == [StorageUnreachable] * (calls - len(answered))
    assert max(elapsed for _, elapsed in outcomes) < postgres_connection.ACQUIRE_TIMEOUT_S / 2


def test_a_database_restarted_between_calls_is_reconnected_within_the_next_call(
    replicas: Callable[[StorageLimits], PostgresStorage], postgres_cluster: PostgresCluster
) -> None:
    storage = replicas(LIMITS)
    storage.save_response(response("resp_1"), ())
    with postgres_cluster.stopped():
        pass  # every connection the pool kept is now dead
    assert storage.load_response("resp_1") == response("resp_1")  # no StorageUnreachable, no probe needed


def test_a_database_too_slow_to_answer_is_unavailable_for_that_call_only(
    replicas: Callable[[StorageLimits], PostgresStorage], url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_connection, "STATEMENT_TIMEOUT_MS", 300)
    storage = replicas(LIMITS)
    storage.save_response(response("resp_1"), ())
    with psycopg.connect(url) as blocker:  # holds every table the response needs until it commits
        blocker.execute("LOCK TABLE responses IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="statement timeout"):
            storage.load_response("resp_1")
        assert time.monotonic() - started < 5
    assert storage.load_response("resp_1") == response("resp_1")


def test_an_id_holding_a_nul_character_is_unstorable_and_nothing_else_changes(
    replicas: Callable[[StorageLimits], PostgresStorage],
) -> None:
    storage = replicas(LIMITS)
    storage.create_conversation(StoredConversation(id="conv_1", created_at=1, metadata={}), [item("msg_0")])
    # Text in a record is JSON, which holds a NUL escaped (test_storage_backends.py); an id is text, which cannot.
    with pytest.raises(UnstorableRecord, match=r"an id in it holds a NUL character \(\\u0000\)"):
        storage.save_response(response("resp_1", conversation="conv_1"), [item("msg_\x00")])
    assert storage.load_response("resp_1") is None
    assert [entry["id"] for entry in storage.conversation_items("conv_1") or ()] == ["msg_0"]
    assert storage.load_response("resp_\x00") is None  # an id PostgreSQL could not hold is simply not stored


def test_a_version_1_database_keeps_its_records_and_then_holds_a_nul_character_and_counts_each_tenant(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_schema, "MIGRATIONS", postgres_schema.MIGRATIONS[:1])
    monkeypatch.setattr(postgres_schema, "SCHEMA_VERSION", 1)
    with psycopg.connect(url, autocommit=True) as connection:
        postgres_schema.migrate(connection)  # version 1: records in JSONB, no tenants
        write_as_version_1(connection)
        with pytest.raises(psycopg.errors.UntranslatableCharacter):  # JSONB refuses "\u0000"
            connection.execute("SELECT %s::jsonb", ('{"text": "a\\u0000b"}',))
    monkeypatch.undo()

    storage = PostgresStorage(url, LIMITS)
    assert storage.load_response("resp_1") == response("resp_1", conversation="conv_1")
    assert storage.load_response(f"{TENANT}/resp_2") == response(f"{TENANT}/resp_2")
    assert [entry["id"] for entry in storage.conversation_items("conv_1") or ()] == ["msg_0", "msg_1"]
    # Version 3 counted what each tenant had stored, items with their conversation.
    assert (storage.tenant_usage(""), storage.tenant_usage(TENANT)) == measured_by_tenant(url)
    assert storage.append_conversation_items("conv_1", [item("msg_2", "a\x00b")])
    assert storage.load_conversation_item("conv_1", "msg_2") == item("msg_2", "a\x00b")
    assert (storage.tenant_usage(""), storage.tenant_usage(TENANT)) == measured_by_tenant(url)
    with psycopg.connect(url, autocommit=True) as connection:
        versions = connection.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        assert [version for (version,) in versions] == list(range(1, SCHEMA_VERSION + 1))
        types = connection.execute(
            "SELECT DISTINCT data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND column_name IN ('input_items', 'response', 'metadata', 'item')"
        ).fetchall()
        assert types == [("json",)]
        # A replica of version 1, still running during a rolling upgrade, writes JSONB: PostgreSQL casts it.
        connection.execute(
            "INSERT INTO conversation_items (conversation_id, position, id, item, nbytes) "
            "VALUES ('conv_1', 99, 'msg_old', %s::jsonb, 1)",
            ('{"id": "msg_old", "type": "message"}',),
        )
        # One of version 2 inserts a response by position, without the tenant: the database computes it.
        connection.execute(
            "INSERT INTO responses VALUES (%s, 1, 1, NULL, NULL, '[]', %s, 2)", (f"{TENANT}/resp_old", "{}")
        )
        tenant = connection.execute("SELECT tenant FROM responses WHERE id = %s", (f"{TENANT}/resp_old",))
        assert tenant.fetchone() == (TENANT,)
    storage.close()


TENANT = "a1b2c3d4e5f60718"


def write_as_version_1(connection: psycopg.Connection[Any]) -> None:
    """Records as a Courier of schema version 1 wrote them: the anonymous tenant's conversation and response, and a
    keyed tenant's response; the shared usage row counts them all."""
    stored: list[tuple[StoredResponse, str | None]] = [
        (response("resp_1", conversation="conv_1"), "conv_1"),
        (response(f"{TENANT}/resp_2"), None),
    ]
    metadata = orjson.dumps({"k": "v"}).decode()
    connection.execute(
        "INSERT INTO conversations (id, created_at, updated_at, metadata, nbytes) VALUES ('conv_1', 1, 1, %s, %s)",
        (metadata, len(metadata)),
    )
    for position, item_id in enumerate(("msg_0", "msg_1")):
        blob = orjson.dumps(item(item_id)).decode()
        connection.execute(
            "INSERT INTO conversation_items VALUES ('conv_1', %s, %s, %s, %s)", (position, item_id, blob, len(blob))
        )
    for record, conversation in stored:
        inputs, output = orjson.dumps(list(record.input_items)).decode(), orjson.dumps(record.response).decode()
        connection.execute(
            "INSERT INTO responses VALUES (%s, 1, 1, NULL, %s, %s, %s, %s)",
            (record.id, conversation, inputs, output, len(inputs) + len(output)),
        )
    connection.execute("UPDATE conversations SET next_position = 2")
    connection.execute(
        "UPDATE storage_usage SET bytes = (SELECT SUM(nbytes) FROM responses) + (SELECT SUM(nbytes) FROM "
        "conversations) + (SELECT SUM(nbytes) FROM conversation_items), entries = 3"
    )


def measured_by_tenant(url: str) -> tuple[Usage, Usage]:
    """The anonymous tenant's and TENANT's bytes and records really in the tables."""
    with psycopg.connect(url) as connection:
        anonymous, keyed = Usage(), Usage()
        for record_id, nbytes, entries in connection.execute(
            "SELECT id, nbytes, 1 FROM responses UNION ALL SELECT id, nbytes, 1 FROM conversations "
            "UNION ALL SELECT conversation_id, nbytes, 0 FROM conversation_items"
        ).fetchall():
            (keyed if record_id.startswith(f"{TENANT}/") else anonymous).add(int(nbytes), int(entries))
        return anonymous, keyed


def test_a_database_down_at_start_up_is_reached_and_migrated_by_the_first_call_after(
    postgres_cluster: PostgresCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_connection, "RETRY_INTERVAL_S", 0.0)  # each call tries: none waits for a clock
    url = postgres_cluster.fresh_url()
    wrong_password = url.replace(PASSWORD, "not-the-password")
    with postgres_cluster.stopped():
        storage = PostgresStorage(url, LIMITS)
        misconfigured = PostgresStorage(wrong_password, LIMITS)  # nothing answered to refuse it yet
        assert storage.unreachable is not None and "Connection refused" in storage.unreachable
        assert misconfigured.unreachable is not None
        with pytest.raises(StorageUnavailable, match="Connection refused"):
            storage.save_response(response("resp_1"), ())
        with pytest.raises(StorageUnavailable):
            storage.load_response("resp_1")
    with psycopg.connect(url) as connection:  # nothing was created while it was down
        assert connection.execute("SELECT to_regclass('schema_migrations')").fetchone() == (None,)
    storage.save_response(response("resp_1"), ())  # the same instance: it connected and migrated
    assert storage.load_response("resp_1") == response("resp_1")
    assert storage.stored_entries == 1
    with pytest.raises(StorageUnavailable, match="password authentication failed"):
        misconfigured.load_response("resp_1")  # found out once serving: a 503 for what needs storage, not a crash
    storage.close()
    misconfigured.close()
    with psycopg.connect(url) as connection:
        versions = connection.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        assert [version for (version,) in versions] == list(range(1, SCHEMA_VERSION + 1))


def test_a_misconfigured_database_fails_at_once(url: str) -> None:
    with pytest.raises(LoginRefused, match="password authentication failed"):
        PostgresStorage(url.replace(PASSWORD, "not-the-password"), LIMITS)
    with pytest.raises(LoginRefused, match='database "no_such_database" does not exist'):
        PostgresStorage(url.replace("/postgres?", "/no_such_database?"), LIMITS)
    with pytest.raises(psycopg.ProgrammingError):
        PostgresStorage("postgresql://courier@127.0.0.1:5432/postgres?no_such_parameter=1", LIMITS)


def test_until_the_database_is_reached_a_call_soon_after_a_failed_attempt_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[str] = []
    connect = psycopg.connect

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args[0])
        return connect(*args, **kwargs)

    monkeypatch.setattr(psycopg, "connect", counted)
    now = [0.0]
    prepared: list[object] = []
    database = Database(f"postgresql://courier@127.0.0.1:{free_port()}/postgres", prepared.append, lambda: now[0])
    reason = database.try_open()
    assert reason is not None and "Connection refused" in reason and len(attempts) == 1
    for _ in range(3):
        with pytest.raises(StorageUnreachable, match="Connection refused"), database.connection():
            pass
    assert len(attempts) == 1  # within the interval: no new attempt
    now[0] += postgres_connection.RETRY_INTERVAL_S
    with pytest.raises(StorageUnreachable, match="Connection refused"), database.connection():
        pass
    assert len(attempts) == 2 and not prepared
    with pytest.raises(StorageUnreachable, match="Connection refused"):
        database.reach()  # the breaker's probe tries whenever it is asked to
    assert len(attempts) == 3 and not prepared
    database.close()


def test_the_database_is_named_without_its_password(url: str) -> None:
    shown = redacted(url)
    assert PASSWORD not in shown
    assert shown.startswith("postgresql://courier@127.0.0.1:") and shown.endswith("/postgres")
    storage = PostgresStorage(url, LIMITS)
    assert storage.location == shown
    storage.close()
