"""A private PostgreSQL for `courier cluster up`: made in a directory, on one port of loopback, stopped with it.

It needs PostgreSQL's server programs (`initdb`, `pg_ctl`): on PATH (Homebrew puts them there) or
Debian's `/usr/lib/postgresql/N/bin`. Nothing system-wide is touched: no service is started, the
data lives in the given directory, the server listens on 127.0.0.1 only (its socket file inside
the data directory), and its one user has a random password that is never printed. `initdb`
refuses to run as root, so as root the cluster belongs to the `postgres` user (Debian's packages
create it) and its programs run through `runuser`.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

logger = logging.getLogger(__name__)

USER = "courier"
DATABASE = "courier"
START_TIMEOUT_S = 120
OWNER_WHEN_ROOT = "postgres"
_INSTALLED = (
    "/usr/lib/postgresql/*/bin/initdb",
    "/opt/homebrew/opt/postgresql@*/bin/initdb",
    "/usr/local/opt/postgresql@*/bin/initdb",
)


class LocalPostgresError(RuntimeError):
    """No private cluster can be made or run here; the message says why and what to install."""


def find_binaries() -> Path | None:
    """The directory holding `initdb` and `pg_ctl`: on PATH, else the newest of Debian's /usr/lib/postgresql/N/bin
    and Homebrew's keg-only postgresql@N (not linked onto PATH by default)."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    found = [Path(path).parent for pattern in _INSTALLED for path in glob.glob(pattern)]
    return max(found, key=_major_version, default=None)


def _major_version(binaries: Path) -> int:
    version = re.search(r"(\d+)", binaries.parent.name)
    return int(version.group(1)) if version else 0


def unavailable_reason() -> str | None:
    """Why no private cluster can be made here, or None when one can."""
    if find_binaries() is None:
        return (
            "PostgreSQL's server programs are not installed (no initdb): "
            "Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql@16"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(OWNER_WHEN_ROOT)
        except KeyError:
            return "PostgreSQL does not run as root, and there is no `postgres` user to own the cluster"
    return None


@dataclass(slots=True)
class LocalPostgres:
    """One cluster in `directory` (created empty by `create`), serving `port` on loopback once `start`ed."""

    binaries: Path
    directory: Path
    port: int
    password: str = ""
    durable: bool = True

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    @property
    def url(self) -> str:
        """The database's URL, password included: hand it to replicas in their environment, never in argv."""
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def redacted_url(self) -> str:
        return f"postgresql://{USER}:***@127.0.0.1:{self.port}/{DATABASE}"

    @classmethod
    def create(cls, directory: Path, port: int, *, password: str | None = None, durable: bool = True) -> LocalPostgres:
        """A new cluster in `directory` (which must not hold one), its user made; not started. `password`: a random
        one by default; `durable=False` (tests): no fsync, which a cluster that dies with its directory can spare."""
        reason = unavailable_reason()
        binaries = find_binaries()
        if reason is not None or binaries is None:
            raise LocalPostgresError(reason or "PostgreSQL is not installed")
        directory.mkdir(parents=True, exist_ok=True)
        password = password or secrets.token_urlsafe(24)
        cluster = cls(binaries=binaries, directory=directory, port=port, password=password, durable=durable)
        password_file = directory / "initdb-password"
        password_file.write_text(cluster.password + "\n")
        password_file.chmod(0o600)
        if os.geteuid() == 0:
            owner = pwd.getpwnam(OWNER_WHEN_ROOT)
            os.chown(directory, owner.pw_uid, owner.pw_gid)
            os.chown(password_file, owner.pw_uid, owner.pw_gid)
        try:
            cluster._run(
                "initdb",
                "-D",
                str(cluster.data_dir),
                "-U",
                USER,
                f"--pwfile={password_file}",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                *(() if durable else ("--no-sync",)),
            )
        finally:
            password_file.unlink(missing_ok=True)
        return cluster

    def start(self) -> None:
        """Start the server and wait until it accepts connections; the database is made on the first start."""
        settings = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data_dir}"
        if not self.durable:
            settings += " -c fsync=off"
        self._pg_ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(self.log_path), "-o", settings)
        with psycopg.connect(self.url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as connection:
            exists = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
            if exists is None:
                connection.execute(f"CREATE DATABASE {DATABASE}")  # a constant of ours, never user input

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`: open sessions are cut, work committed stays). Stopping a stopped one is a no-op."""
        if (self.data_dir / "postmaster.pid").exists():
            self._pg_ctl("stop", "-w", "-m", mode)

    def is_running(self) -> bool:
        """Whether the server process named in its pid file is alive (cheap enough to ask twice a second)."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        return True

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), *args)

    def _run(self, program: str, *args: str) -> None:
        # Its own session: the server pg_ctl leaves running gets no Ctrl-C meant for `courier cluster up`.
        result = subprocess.run(
            self._command(program, *args), capture_output=True, text=True, check=False, start_new_session=True
        )
        if result.returncode != 0:
            log = self.log_path.read_text()[-4000:] if self.log_path.exists() else ""
            raise LocalPostgresError(f"{program} failed ({result.returncode}): {result.stderr}{result.stdout}\n{log}")

    def _command(self, program: str, *args: str) -> Sequence[str]:
        command = [str(self.binaries / program), *args]
        if os.geteuid() == 0:
            return ["runuser", "-u", OWNER_WHEN_ROOT, "--", *command]
        return command
