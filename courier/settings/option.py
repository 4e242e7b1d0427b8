"""How a setting is declared: `setting(default, parse, help, ...)` makes a `Settings` field that carries its
option's parser and help in the field's metadata; `options_of` reads them back as one `Option` per field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

ENV_PREFIX = "COURIER_"


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    is_flag: bool = False
    strict: bool = False
    repeated: bool = False  # the flag may be given several times; each value parses to a tuple, all joined

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


@dataclass(frozen=True, slots=True, kw_only=True)
class _OptionMetadata:
    """What a `Settings` field carries besides its name, type and default: how it is parsed and described."""

    parse: Callable[[str], Any]
    help: str
    metavar: str | None
    is_flag: bool
    strict: bool
    repeated: bool


_METADATA_KEY = "courier.option"
_T = TypeVar("_T")


def setting(
    default: _T,
    parse: Callable[[str], _T],
    help: str,
    *,
    metavar: str | None = None,
    flag: bool = False,
    strict: bool = False,
    repeated: bool = False,
) -> _T:
    """Declare a `Settings` field with its option: default, parser, help text, and a metavar or on/off flag.
    `strict`: an environment value that does not parse stops the server instead of leaving the default.
    `repeated`: a tuple setting whose flag may be given several times (`parse` turns one value into a tuple)."""
    metadata = _OptionMetadata(parse=parse, help=help, metavar=metavar, is_flag=flag, strict=strict, repeated=repeated)
    return field(default=default, metadata={_METADATA_KEY: metadata})


def options_of(settings_class: type[Any]) -> tuple[Option, ...]:
    """One `Option` per field of a settings dataclass, in field order, from each field's `setting(...)` metadata."""
    options = []
    for settings_field in fields(settings_class):
        metadata = settings_field.metadata.get(_METADATA_KEY)
        if not isinstance(metadata, _OptionMetadata):
            raise TypeError(
                f"{settings_class.__name__}.{settings_field.name} has no option metadata: "
                "declare it with setting(default, parse, help, ...)"
            )
        options.append(
            Option(
                name=settings_field.name,
                parse=metadata.parse,
                default=settings_field.default,
                help=metadata.help,
                metavar=metadata.metavar,
                is_flag=metadata.is_flag,
                strict=metadata.strict,
                repeated=metadata.repeated,
            )
        )
    return tuple(options)
