"""A cluster on this machine: a private PostgreSQL, N `courier serve` replicas and an HAProxy front, as child processes.

`courier cluster up` runs one for trying replicas out; the cluster tests and `bench/cluster.py`
run the same one. Start-up, in order: PostgreSQL (replicas need their store to serve chains),
the replicas (all at once, each awaited on `/health`), then the front on a configuration from
`haproxy_config`, awaited until its own health checks see every replica up, so the first request
through the URL is routed with every replica in the ring. Stopping goes the other way, and
drains: the front stops taking connections but finishes those it has, the replicas get SIGTERM
and finish their requests (storing their responses, so PostgreSQL stops last), then the rest.

Every child runs in its own session: a Ctrl-C at the terminal reaches `courier cluster up` only,
which then stops them in that order, instead of reaching PostgreSQL and HAProxy at the moment the
replicas start draining into them.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from courier import settings as settings_module
from courier.cluster.front_process import FrontProcess
from courier.cluster.haproxy_config import FrontOptions, haproxy_config
from courier.cluster.local_postgres import LocalPostgres
from courier.cluster.replica_process import ReplicaProcess, ReplicaStarter, new_interpreter
from courier.cluster.replicas import Replica, default_replica_id

logger = logging.getLogger(__name__)

# The flags the cluster gives each replica itself; passing one through would break routing or the store.
OWN_SERVE_FLAGS = ("host", "port", "replica_id", "storage", "prompt_cache_dir")
# Beyond a replica's own --shutdown-timeout: its last responses' flush and its process exit.
STOP_MARGIN_S = 15.0
CHECK_INTERVAL_S = 1.0
SHORT_TEMP = "/tmp"  # private directories are made in it with mkdtemp
READY_POLL_S = 0.2
STORAGE_VARIABLE = "COURIER_STORAGE"


class ClusterError(RuntimeError):
    """The cluster cannot start as asked; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterPlan:
    replicas: int
    host: str = "127.0.0.1"  # where the front listens
    port: int = 8080  # the front's port; 0 picks a free one
    serve_args: tuple[str, ...] = ()  # more `courier serve` flags for every replica (--model, ...)
    affinity: bool = True  # False: the same front in plain round robin (for comparison)
    start_timeout_s: float = 600.0  # per replica: loading a large model, or converting one, takes minutes

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 64:
            raise ClusterError(f"--replicas is 1 to 64, not {self.replicas}")


def serve_settings(serve_args: Sequence[str], environ: Mapping[str, str]) -> settings_module.Settings:
    """The replicas' settings as `courier serve` would resolve them; `ClusterError` for a flag the cluster sets."""
    parser = argparse.ArgumentParser(prog="courier cluster up ... --", add_help=False, exit_on_error=False)
    settings_module.add_arguments(parser)
    try:
        arguments = parser.parse_args(list(serve_args))
    except argparse.ArgumentError as error:
        raise ClusterError(f"replica flags: {error}") from None
    owned = sorted(f"--{name.replace('_', '-')}" for name in OWN_SERVE_FLAGS if name in vars(arguments))
    if owned:
        raise ClusterError(f"the cluster sets {', '.join(owned)} for each replica itself; leave them out")
    try:
        return settings_module.resolve(arguments, environ)
    except settings_module.SettingsError as error:
        raise ClusterError(str(error)) from None


class LocalCluster:
    """The processes of one plan, their files under `directory`. Use `with`, or `start()` and then `stop()`."""

    def __init__(
        self,
        plan: ClusterPlan,
        directory: Path,
        environ: Mapping[str, str] | None = None,
        starter: ReplicaStarter = new_interpreter,
    ) -> None:
        """`starter` starts each replica's `courier serve` (a fresh interpreter; the tests fork theirs)."""
        self.plan = plan
        self._starter = starter
        self.directory = directory
        environ = dict(os.environ if environ is None else environ)
        environ.pop(STORAGE_VARIABLE, None)
        self.settings = serve_settings(plan.serve_args, environ)
        self._environ = environ
        self.postgres: LocalPostgres | None = None
        self._postgres_directory: Path | None = None
        self._sockets_directory: Path | None = None
        self._hurry = False
        self.replicas: dict[str, ReplicaProcess] = {}
        self.front: FrontProcess | None = None
        self.front_port = plan.port or _free_port()

    @property
    def url(self) -> str:
        """The front's base URL (`/v1` goes after it)."""
        return f"http://{_url_host(self._front_host)}:{self.front_port}{self.settings.api_prefix}"

    @property
    def _front_host(self) -> str:
        """Where a client on this machine reaches the front: its address, or loopback for a wildcard one."""
        return "127.0.0.1" if self.plan.host in ("0.0.0.0", "::") else self.plan.host

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start everything and wait until the front routes to every replica; on failure, stop what started."""
        _check_port_free(self.plan.host, self.front_port)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Sockets need short paths (HAProxy takes 97 characters, PostgreSQL 107; macOS's temporary directory alone is
        # about 50), and as root PostgreSQL's own user must reach its directory, which `directory` (pytest's, say) may
        # not let it: both go in directories of their own under /tmp.
        self._sockets_directory = Path(tempfile.mkdtemp(prefix="courier-", dir=SHORT_TEMP))
        self._postgres_directory = Path(tempfile.mkdtemp(prefix="courier-postgres-", dir=SHORT_TEMP))
        logger.info("cluster: starting PostgreSQL in %s", self._postgres_directory)
        self.postgres = LocalPostgres.create(self._postgres_directory, _free_port())
        self.postgres.start()
        environ = {**self._environ, STORAGE_VARIABLE: self.postgres.url}
        for position in range(1, self.plan.replicas + 1):
            name = default_replica_id(position)
            self.replicas[name] = ReplicaProcess(
                name=name,
                port=_free_port(),
                directory=self.directory / name,
                serve_args=self.plan.serve_args,
                environ=environ,
                api_prefix=self.settings.api_prefix,
                starter=self._starter,
            )
        for replica in self.replicas.values():
            replica.start()
        logger.info("cluster: loading the model in %d replica(s)", len(self.replicas))
        wait_all_ready(list(self.replicas.values()), self.plan.start_timeout_s)
        _check_port_free(self.plan.host, self.front_port)  # again: loading the model may have taken minutes
        self.front = FrontProcess(
            config_text=haproxy_config(self._front_replicas(), self._front_options()),
            port=self.front_port,
            directory=self.directory / "front",
            host=self._front_host,
            stats_socket=self._sockets_directory / "haproxy.sock",
        )
        self.front.start()
        self.front.wait_until_up(set(self.replicas), timeout_s=CHECK_INTERVAL_S * 10 + 10)

    def stop(self) -> None:
        """Drain and stop everything that runs, the front first and PostgreSQL last. Safe to call twice, and each
        step runs even when one before it failed: a child left running, or a directory left behind, is the worse
        outcome."""
        if self.front is not None and self.front.is_running():
            _logged(self.front.soft_stop)
        for replica in self.replicas.values():
            replica.signal(signal.SIGTERM)
        drain_s = self.settings.shutdown_timeout + STOP_MARGIN_S
        for replica in self.replicas.values():
            if replica.pid is not None:
                _logged(partial(replica.wait, drain_s))
        if self.front is not None:
            _logged(self.front.stop)
        if self.postgres is not None:
            postgres = self.postgres
            _logged(lambda: postgres.stop(mode="immediate" if self._hurry else "fast"))
        for directory in (self._postgres_directory, self._sockets_directory):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL every replica and the front: the second Ctrl-C. Only signals, so a signal handler may call it while
        `stop` runs; `stop` then finds them gone and stops PostgreSQL at once (`immediate`)."""
        self._hurry = True
        for replica in self.replicas.values():
            replica.signal(signal.SIGKILL)
        if self.front is not None:
            self.front.kill()

    def front_running(self) -> bool:
        return self.front is not None and self.front.is_running()

    def postgres_running(self) -> bool:
        return self.postgres is not None and self.postgres.is_running()

    @property
    def postgres_log(self) -> Path | None:
        return None if self.postgres is None else self.postgres.log_path

    @property
    def postgres_url(self) -> str:
        """The store's URL with the password left out."""
        return "" if self.postgres is None else self.postgres.redacted_url

    def _front_replicas(self) -> tuple[Replica, ...]:
        return tuple(Replica(name=r.name, host="127.0.0.1", port=r.port) for r in self.replicas.values())

    def _front_options(self) -> FrontOptions:
        return FrontOptions(
            bind=self.plan.host,
            port=self.front_port,
            max_body_bytes=self.settings.max_body_bytes,
            request_timeout_s=self.settings.request_timeout,
            body_timeout_s=self.settings.body_timeout,
            api_prefix=self.settings.api_prefix,
            check_interval_s=CHECK_INTERVAL_S,
            stats_socket=None if self._sockets_directory is None else self._sockets_directory / "haproxy.sock",
            affinity=self.plan.affinity,
        )


def wait_all_ready(replicas: Sequence[ReplicaProcess], timeout_s: float) -> None:
    """Block until every replica answers /health, against one deadline; the first to exit fails it at once."""
    deadline = time.monotonic() + timeout_s
    waiting = list(replicas)
    while waiting:
        for replica in list(waiting):
            if replica.ready_or_raise(deadline):
                waiting.remove(replica)
        if waiting:
            time.sleep(READY_POLL_S)


def _logged(step: Callable[[], object]) -> None:
    try:
        step()
    except Exception:
        logger.exception("cluster: a step of stopping failed; going on with the rest")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ClusterError(f"port {port} is in use on {host}: pick another with --port") from None
            raise ClusterError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
