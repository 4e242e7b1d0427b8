"""Settings read from the command line and the environment: CLI flag > `COURIER_*` variable > default."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from typing import Any

from courier.settings.option import ENV_PREFIX, Option, options_of
from courier.settings.server import Settings

logger = logging.getLogger("courier.settings")  # warnings name the package, as users know it

OPTIONS: tuple[Option, ...] = options_of(Settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option; help shows each flag's variable and default."""
    for option in OPTIONS:
        default = "unset" if option.default in (None, ()) else option.default
        help_text = f"{option.help} [env {option.env}; default: {default}]"
        if option.is_flag:
            parser.add_argument(
                option.flag,
                dest=option.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=option.name,
                type=_argparse_type(option),
                action="extend" if option.repeated else "store",
                default=argparse.SUPPRESS,
                metavar=option.metavar,
                help=help_text,
            )


def resolve(arguments: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Combine parsed CLI arguments, the environment and the defaults."""
    values: dict[str, Any] = {}
    given = vars(arguments)
    for option in OPTIONS:
        if option.name in given:
            values[option.name] = tuple(given[option.name]) if option.repeated else given[option.name]
        elif option.env in environ:
            values[option.name] = _from_environment(option, environ[option.env])
        else:
            values[option.name] = option.default
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in _KNOWN_VARIABLES)
    for name in unknown:
        logger.warning("ignoring unknown environment variable %s", name)
    return Settings(**values)


_KNOWN_VARIABLES = frozenset(option.env for option in OPTIONS)


class SettingsError(ValueError):
    """A strict setting's environment variable does not parse: the server does not start."""


def _from_environment(option: Option, raw: str) -> Any:
    try:
        return option.parse(raw)
    except ValueError as error:
        if option.strict:  # the value itself is not repeated: it may hold a password
            raise SettingsError(f"{option.env}: {error}") from None
        logger.warning("ignoring %s=%r: %s; using the default %r", option.env, raw, error, option.default)
        return option.default


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parse.__name__ = option.name
    return parse
