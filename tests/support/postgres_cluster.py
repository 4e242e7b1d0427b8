"""A private PostgreSQL cluster for tests: created in a temporary directory on a free port, removed afterwards.

It needs the server's binaries (Debian: `apt-get install postgresql`; `./dev test`
installs them when it runs as root); without them `find_binaries` is None and the
tests that need a cluster are skipped. `initdb` refuses to run as root, so as root the
cluster belongs to the `postgres` user and its commands run through `runuser`. Nothing
system-wide is touched: no service is started, and the cluster lives and dies with
its directory. Every test gets its own schema (`fresh_url`), so tests share one
cluster without seeing each other's tables.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import psycopg

from courier.cluster.local_postgres import find_binaries, unavailable_reason
from tests.support.ports import free_port

USER = "courier"
PASSWORD = "s3cret-test-password"
DATABASE = "postgres"
START_TIMEOUT_S = 60


class PostgresCluster:
    def __init__(self, binaries: Path, directory: Path, port: int) -> None:
        self.binaries = binaries
        self.data_dir = directory / "data"
        self.port = port
        self._log = directory / "server.log"
        self._schemas = 0

    def url(self, schema: str | None = None) -> str:
        options = f"?options={quote(f'-csearch_path={schema}')}" if schema else ""
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{DATABASE}{options}"

    def fresh_url(self) -> str:
        """The URL of a new, empty schema of this cluster's database."""
        self._schemas += 1
        schema = f"test_{self._schemas}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE SCHEMA {schema}")  # a name of ours, never user input
        return self.url(schema)

    def start(self) -> None:
        socket_option = f"-k {self.data_dir}"
        settings = f"-p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off {socket_option}"
        self._pg_ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(self._log), "-o", settings)

    def stop(self) -> None:
        self._pg_ctl("stop", "-w", "-m", "fast")

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The database down for the block (connections cut, new ones refused), then up again."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def initdb(self, password_file: Path) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            USER,
            f"--pwfile={password_file}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), *args)

    def _run(self, program: str, *args: str) -> None:
        command: Sequence[str] = [str(self.binaries / program), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            log = self._log.read_text() if self._log.exists() else ""
            raise RuntimeError(f"{program} failed ({result.returncode}): {result.stderr}{result.stdout}\n{log}")


@contextmanager
def private_cluster() -> Iterator[PostgresCluster]:
    """A started cluster, stopped and deleted when the block ends."""
    binaries = find_binaries()
    assert binaries is not None, unavailable_reason()
    # Not pytest's tmp_path: as root that is private to root, and the cluster runs as `postgres`.
    directory = Path(tempfile.mkdtemp(prefix="courier-postgres-"))
    try:
        password_file = directory / "password"
        password_file.write_text(PASSWORD + "\n")
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(directory, owner.pw_uid, owner.pw_gid)
            os.chown(password_file, owner.pw_uid, owner.pw_gid)
        cluster = PostgresCluster(binaries, directory, free_port())
        cluster.initdb(password_file)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
