"""A private PostgreSQL cluster for tests: `courier cluster up`'s own (`LocalPostgres`), without fsync, on a free port.

It needs the server's binaries (Debian: `apt-get install postgresql`; `./dev test`
installs them when it runs as root); without them `unavailable_reason()` says why and the
tests that need a cluster are skipped. As root the cluster belongs to the `postgres` user
(see `courier/cluster/local_postgres.py`). Nothing system-wide is touched: no service is
started, and the cluster lives and dies with its directory. Every test gets its own schema
(`fresh_url`), so tests share one cluster without seeing each other's tables.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import psycopg

from courier.cluster.local_postgres import USER, LocalPostgres
from tests.support.ports import free_port

PASSWORD = "s3cret-test-password"
DATABASE = "postgres"  # tests work in schemas of the maintenance database


class PostgresCluster:
    def __init__(self, server: LocalPostgres) -> None:
        self.server = server
        self._schemas = 0

    def url(self, schema: str | None = None) -> str:
        options = f"?options={quote(f'-csearch_path={schema}')}" if schema else ""
        return f"postgresql://{USER}:{self.server.password}@127.0.0.1:{self.server.port}/{DATABASE}{options}"

    def fresh_url(self) -> str:
        """The URL of a new, empty schema of this cluster's database."""
        self._schemas += 1
        schema = f"test_{self._schemas}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE SCHEMA {schema}")  # a name of ours, never user input
        return self.url(schema)

    def start(self) -> None:
        self.server.start()

    def stop(self, mode: str = "fast") -> None:
        """`fast`: sessions are cut one by one; `immediate`: all at once, as a crash or a lost network does."""
        self.server.stop(mode)

    def waiting_on_lock(self, url: str, table: str, sessions: int) -> bool:
        """Whether at least `sessions` sessions of the database at `url` wait for a lock on `table`."""
        with psycopg.connect(url, autocommit=True) as connection:
            row = connection.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)", (table,)
            ).fetchone()
        return row is not None and int(row[0]) >= sessions

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The database down for the block (connections cut, new ones refused), then up again."""
        self.stop()
        try:
            yield
        finally:
            self.start()


@contextmanager
def private_cluster() -> Iterator[PostgresCluster]:
    """A started cluster, stopped and deleted when the block ends."""
    # Not pytest's tmp_path: as root that is private to root, and the cluster runs as `postgres`.
    directory = Path(tempfile.mkdtemp(prefix="courier-postgres-"))
    try:
        server = LocalPostgres.create(directory, free_port(), password=PASSWORD, durable=False)
        server.start()
        try:
            yield PostgresCluster(server)
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
