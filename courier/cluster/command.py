"""`courier cluster`: `haproxy-config` (its flags, and the configuration printed from them) and `up` (`up_command`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO, TypeVar

from courier.cluster import up_command
from courier.cluster.haproxy_config import FrontOptions, haproxy_config
from courier.cluster.replicas import ReplicaError, parse_replicas, with_models
from courier.settings.parsers import parse_api_prefix, parse_bytes, parse_port, parse_positive_float

logger = logging.getLogger("courier.cluster")

_DEFAULTS = FrontOptions()
_T = TypeVar("_T")


def add_arguments(cluster: argparse.ArgumentParser) -> None:
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    config = commands.add_parser(
        "haproxy-config",
        help="print an HAProxy configuration for replicas",
        description="Print an HAProxy (2.6+) configuration that sends each conversation to the replica holding its "
        "prompt cache (among the replicas that serve its model, with --replica-models): response ids' routing tokens, "
        "then a consistent hash of prompt_cache_key, conversation or user "
        "with bounded load; health checks on /health. See docs/deploy.md.",
    )
    config.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="a replica, named by its --replica-id (repeat per replica); HOST:PORT alone is named r<position>",
    )
    config.add_argument(
        "--replica-models",
        action="append",
        default=[],
        metavar="NAME=MODEL[,MODEL...]",
        help="the models replica NAME serves, as requests name them (a name ending in * matches any it begins; "
        "repeat per replica): requests naming one go only to the replicas that serve it; a replica not given "
        "here serves any model",
    )
    config.add_argument("--bind", default=_DEFAULTS.bind, metavar="HOST", help=f"default: {_DEFAULTS.bind}")
    config.add_argument(
        "--port", type=_typed(parse_port), default=_DEFAULTS.port, help=f"the front's port; default: {_DEFAULTS.port}"
    )
    config.add_argument(
        "--max-body-bytes",
        type=_typed(parse_bytes),
        default=_DEFAULTS.max_body_bytes,
        metavar="BYTES",
        help="the replicas' --max-body-bytes: the most of a body the front reads to route it "
        f"(default: Courier's, {_DEFAULTS.max_body_bytes})",
    )
    config.add_argument(
        "--route-body-bytes",
        type=_typed(parse_bytes),
        default=None,
        metavar="BYTES",
        help="how much of a body the front reads for its routing fields (a model, a key, a response id); each "
        "request costs HAProxy ~1 ms of CPU per MiB (default: 2MiB, or the whole body with --replica-models)",
    )
    config.add_argument(
        "--balance-factor",
        type=int,
        default=_DEFAULTS.balance_factor,
        metavar="PERCENT",
        help="hash-balance-factor: no replica takes more than this percentage of the average load; 0 for no bound "
        f"(default: {_DEFAULTS.balance_factor})",
    )
    config.add_argument(
        "--request-timeout",
        type=_typed(parse_positive_float),
        default=_DEFAULTS.request_timeout_s,
        metavar="SECONDS",
        help=f"the replicas' --request-timeout (default: {_DEFAULTS.request_timeout_s:g})",
    )
    config.add_argument(
        "--body-timeout",
        type=_typed(parse_positive_float),
        default=_DEFAULTS.body_timeout_s,
        metavar="SECONDS",
        help=f"the replicas' --body-timeout (default: {_DEFAULTS.body_timeout_s:g})",
    )
    config.add_argument(
        "--api-prefix",
        type=_typed(parse_api_prefix),
        default=_DEFAULTS.api_prefix,
        metavar="PATH",
        help="the replicas' --api-prefix, where their /health is (default: none)",
    )
    config.add_argument(
        "--check-interval",
        type=_typed(parse_positive_float),
        default=_DEFAULTS.check_interval_s,
        metavar="SECONDS",
        help=f"seconds between health checks; two failed mark a replica down (default: {_DEFAULTS.check_interval_s:g})",
    )
    config.add_argument(
        "--stats-socket", type=Path, default=None, metavar="PATH", help="HAProxy's admin socket (default: none)"
    )
    up_command.add_parser(commands)


def run(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    """Carry out `courier cluster COMMAND`; the process's exit code."""
    if arguments.cluster_command == "up":
        return up_command.run(arguments, environ, out)
    refusal = print_haproxy_config(arguments, out)
    if refusal is not None:
        logger.error("%s", refusal)
        return up_command.EXIT_USAGE
    return 0


def print_haproxy_config(arguments: argparse.Namespace, out: TextIO) -> str | None:
    """Print the configuration to `out`; the reason when the flags describe none."""
    try:
        replicas = with_models(parse_replicas(arguments.replica), arguments.replica_models)
        options = FrontOptions(
            bind=arguments.bind,
            port=arguments.port,
            max_body_bytes=arguments.max_body_bytes,
            route_body_bytes=arguments.route_body_bytes,
            balance_factor=arguments.balance_factor,
            request_timeout_s=arguments.request_timeout,
            body_timeout_s=arguments.body_timeout,
            api_prefix=arguments.api_prefix,
            check_interval_s=arguments.check_interval,
            stats_socket=arguments.stats_socket,
        )
    except (ReplicaError, ValueError) as error:
        return str(error)
    out.write(haproxy_config(replicas, options))
    return None


def _typed(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """`parse` for argparse: its ValueError's message becomes the usage error."""

    def typed(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return typed
