"""The names a server answers to: `--served-model-name ID[,ALIAS...]`.

The first name is the model's id (what replies and `/v1/models` report first); the others are aliases a request
may send in `model` instead. Agents name models of their own: Claude Code asks for `claude-opus-4-8` (or whatever
its settings say), so an operator maps those names onto the served model. An alias ending in `*` matches every name
that starts with what comes before it (`claude-*`); the other characters, brackets included, match only
themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

WILDCARD = "*"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServedNames:
    names: tuple[str, ...]  # the id first, then the aliases, as given

    @classmethod
    def parse(cls, text: str | None, default: str) -> ServedNames:
        """`"id,alias,claude-*"` -> the names, spaces around each dropped; none given: `default` alone."""
        names = tuple(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
        return cls(names or (default,))

    @property
    def model_id(self) -> str:
        return self.names[0]

    @property
    def listed(self) -> tuple[str, ...]:
        """The names a model list shows: the id and the exact aliases (a pattern names no one model)."""
        return tuple(name for name in self.names if not name.endswith(WILDCARD))

    def matches(self, requested: str) -> bool:
        for name in self.names:
            if name.endswith(WILDCARD) and requested.startswith(name[: -len(WILDCARD)]):
                return True
            if requested == name:
                return True
        return False


def named_by(models: Iterable[T], requested: str, names: Callable[[T], ServedNames]) -> T | None:
    """The model `requested` names among `models`, as a request is routed: an id first, then an exact alias, then a
    pattern, each in declaration order (so `claude-x` is the model with that alias, not the one matching `claude-*`)."""
    ordered = list(models)
    for named in (
        lambda served: served.model_id == requested,
        lambda served: requested in served.listed,
        lambda served: served.matches(requested),
    ):
        for model in ordered:
            if named(names(model)):
                return model
    return None
