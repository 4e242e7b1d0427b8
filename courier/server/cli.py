"""The `courier` command.

The BLAS is chosen before anything imports MLX, so the modules that do are
imported inside `_serve`, after `load_optimized_blas`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from courier import __version__
from courier import settings as settings_module
from courier.cluster import command as cluster_command
from courier.model.catalog import build_catalog
from courier.model.source import ModelSourceError
from courier.platform.blas import load_optimized_blas
from courier.platform.malloc_tuning import pin_malloc_thresholds
from courier.settings.parsers import LOG_LEVELS

logger = logging.getLogger("courier")

EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="courier", description="OpenAI-compatible LLM server for MLX models")
    parser.add_argument("--version", action="version", version=f"courier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API. Every flag can also be set by the environment variable shown.",
    )
    settings_module.add_arguments(serve)
    cluster = commands.add_parser(
        "cluster", help="run replicas behind a front", description="Tools for Courier replicas behind a front."
    )
    cluster_command.add_arguments(cluster)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    arguments = build_parser().parse_args(argv)
    _configure_logging(environ.get("COURIER_LOG_LEVEL", "info"))
    if arguments.command == "cluster":
        return cluster_command.run(arguments, environ, sys.stdout)
    try:
        settings = settings_module.resolve(arguments, environ)
    except settings_module.SettingsError as error:
        logger.error("%s", error)
        return EXIT_USAGE
    logging.getLogger().setLevel(settings.log_level.upper())
    return _serve(settings, environ)


def _serve(settings: settings_module.Settings, environ: Mapping[str, str]) -> int:
    malloc = pin_malloc_thresholds(environ, settings.malloc_tuning)
    logger.info("malloc: %s", malloc.detail)
    try:
        blas = load_optimized_blas(settings.blas, forward_gemv=settings.blas_gemv)
    except OSError as error:
        logger.error("%s", error)
        return EXIT_USAGE
    if blas.optimized:
        logger.info(
            "BLAS: %s %s (%s); kernels %s (%s); gemv: %s",
            blas.library,
            blas.path or "",
            blas.detail,
            blas.kernels or "unknown",
            blas.kernel_choice or "not checked",
            blas.gemv or "not used",
        )
    else:
        logger.warning(
            "BLAS: MLX's reference BLAS (%s); CPU inference will be ~10x slower. "
            "Install OpenBLAS (Debian: apt-get install libopenblas0-pthread) or set COURIER_BLAS to its path",
            blas.detail,
        )
    from courier.platform import cpu_attention  # imports mlx.core: after the BLAS

    attention = cpu_attention.install(settings.cpu_attention)
    logger.info("CPU attention: %s", attention.detail)
    try:
        catalog = build_catalog(
            settings.model, served_model_name=settings.served_model_name, models_dir=settings.models_dir
        )
        catalog.pooling(settings.embedding_pooling)  # a name no model answers to is a usage error, now
    except ModelSourceError as error:
        logger.error("%s", error)
        return EXIT_USAGE

    import anyio

    from courier.server.errors import ServerFailed
    from courier.server.supervisor import Supervisor

    try:
        anyio.run(Supervisor(settings, catalog, blas, environ, cpu_attention=attention).run)
    except ServerFailed as error:
        logger.error("server stopped: %s", error)
        return EXIT_FAILED
    except OSError as error:
        logger.error("cannot serve on %s:%d: %s", settings.host, settings.port, error)
        return EXIT_FAILED
    return 0


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper() if level.lower() in LOG_LEVELS else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def entry_point() -> None:
    sys.exit(main())
