"""`courier cluster up`: PostgreSQL, N replicas and HAProxy on this machine until Ctrl-C, for trying replicas out.

While it runs, a replica that ends on its own (a crash, a kill) is started again on its own port
with its own name and prompt cache (`restarts.py`), and the front's checks bring it back; if the
front or PostgreSQL ends, everything stops, as the cluster is no longer what was printed. The first
Ctrl-C (or SIGTERM, or SIGHUP), while it starts or runs, drains: the front stops taking connections,
the replicas finish their requests, then PostgreSQL stops and the cluster's temporary directories are
deleted. A second one kills at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TextIO

from courier.cluster.local_cluster import ClusterError, ClusterPlan, LocalCluster
from courier.cluster.restarts import RestartSchedule
from courier.settings.parsers import parse_port

logger = logging.getLogger("courier.cluster")

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_REPLICAS = 2
WATCH_INTERVAL_S = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up",
        help="run PostgreSQL, replicas and HAProxy on this machine",
        description="Start a private PostgreSQL (in a temporary directory), N replicas of the model and an HAProxy "
        "front routing each conversation to one replica; print the URL; stop everything on Ctrl-C. Needs PostgreSQL's "
        "server programs and HAProxy (Debian: apt-get install postgresql haproxy; macOS: brew install postgresql@16 "
        "haproxy). Flags after -- go to every replica's `courier serve`. See docs/deploy.md.",
    )
    up.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS, help=f"default: {DEFAULT_REPLICAS}")
    up.add_argument("--host", default="127.0.0.1", help="where the front listens (default: 127.0.0.1)")
    up.add_argument("--port", type=_port, default=8080, help="the front's port (default: 8080)")
    up.add_argument("--model", default=None, metavar="MODEL", help="as `courier serve --model` (default: its own)")
    up.add_argument(
        "--round-robin", action="store_true", help="a front without affinity, to compare against (default: off)"
    )
    up.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_FLAGS", help="`courier serve` flags")


def run(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    serve_args = list(arguments.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    if arguments.model is not None:
        serve_args = ["--model", arguments.model, *serve_args]
    try:
        plan = ClusterPlan(
            replicas=arguments.replicas,
            host=arguments.host,
            port=arguments.port,
            serve_args=tuple(serve_args),
            affinity=not arguments.round_robin,
        )
        directory = Path(tempfile.mkdtemp(prefix="courier-cluster-"))
        try:
            return _run(LocalCluster(plan, directory, environ), out)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    except ClusterError as error:
        logger.error("%s", error)
        return EXIT_USAGE


class _StopRequested(BaseException):
    """A signal asked the cluster to stop while it was starting (raised out of whatever start-up was doing)."""


class _Signals:
    """SIGINT, SIGTERM and SIGHUP: the first stops the cluster (drained), a second kills it. From before start-up,
    so no signal leaves children running: they are in sessions of their own and get no signal from the terminal."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.received = 0
        self.starting = True

    def on_signal(self, _number: int, _frame: FrameType | None) -> None:
        self.received += 1
        if self.received > 1:
            # Only signals from here (no logging, no waiting): the main flow may be inside either.
            os.write(2, b"courier cluster: stopping now, killing every process of the cluster\n")
            self.cluster.kill()
        elif self.starting:
            raise _StopRequested


def _run(cluster: LocalCluster, out: TextIO) -> int:
    signals = _Signals(cluster)
    previous = {number: signal.signal(number, signals.on_signal) for number in STOP_SIGNALS}
    try:
        try:
            cluster.start()  # on any failure it has already stopped what it started
            signals.starting = False
        except _StopRequested:
            cluster.stop()
            logger.info("cluster: stopped while starting")
            return EXIT_FAILED
        except ClusterError:
            raise  # asked for something it cannot do (a port in use): a usage error
        except Exception as error:
            logger.error("the cluster did not start: %s", error)
            return EXIT_FAILED
        try:
            _print_summary(cluster, out)
            return _watch(cluster, signals)
        finally:
            logger.info("cluster: stopping (the replicas finish their requests first)")
            cluster.stop()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _watch(cluster: LocalCluster, signals: _Signals) -> int:
    """Restart replicas that end, until a signal (0) or the front or PostgreSQL ends (EXIT_FAILED)."""
    schedule = RestartSchedule()
    for name in cluster.replicas:
        schedule.started(name, time.monotonic())
    while not signals.received:
        time.sleep(WATCH_INTERVAL_S)
        if not cluster.front_running():
            log = cluster.front.log_path if cluster.front else None
            logger.error("HAProxy ended (its log: %s); stopping the cluster", log)
            return EXIT_FAILED
        if not cluster.postgres_running():
            logger.error("PostgreSQL ended (its log: %s); stopping the cluster", cluster.postgres_log)
            return EXIT_FAILED
        now = time.monotonic()
        for name, replica in cluster.replicas.items():
            if replica.is_running():
                continue
            if not schedule.waiting(name):
                at = schedule.exited(name, now)
                logger.warning(
                    "replica %s exited with %s; starting it again in %.0f s (its log: %s)",
                    name,
                    replica.exit_code(),
                    at - now,
                    replica.log_path,
                )
            elif schedule.due(name, now):
                schedule.started(name, now)
                try:
                    replica.start()
                except OSError as error:  # its log cannot be opened, no process can be made: try again later
                    logger.error("replica %s could not be started: %s", name, error)
                    schedule.exited(name, now)
    return 0


def _print_summary(cluster: LocalCluster, out: TextIO) -> None:
    lines = [f"Courier cluster: {len(cluster.replicas)} replica(s) behind {cluster.url}/v1"]
    lines += [f"  replica {r.name}: {r.url} (pid {r.pid}, log {r.log_path})" for r in cluster.replicas.values()]
    lines += [
        f"  front: HAProxy, {'round robin' if not cluster.plan.affinity else 'conversation affinity'} "
        f"(config {cluster.front.config_path if cluster.front else None})",
        f"  storage: {cluster.postgres_url} (private; deleted at exit)",
        "Ctrl-C stops everything.",
    ]
    out.write("\n".join(lines) + "\n")
    out.flush()


def _port(text: str) -> int:
    try:
        return parse_port(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
