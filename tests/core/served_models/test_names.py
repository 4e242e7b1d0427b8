"""`--served-model-name ID,ALIAS,...`: the id, the aliases, and patterns ending in `*`."""

from __future__ import annotations

import pytest

from courier.core.served_models.names import ServedNames, named_by


def test_no_names_is_the_default_alone() -> None:
    names = ServedNames.parse(None, "SmolLM2")
    assert (names.model_id, names.listed) == ("SmolLM2", ("SmolLM2",))


def test_the_first_name_is_the_id_and_patterns_are_not_listed() -> None:
    names = ServedNames.parse(" qwen , claude-opus-4-8[1m],claude-*,qwen", "default")
    assert names.model_id == "qwen"
    assert names.names == ("qwen", "claude-opus-4-8[1m]", "claude-*")  # spaces dropped, repeats once
    assert names.listed == ("qwen", "claude-opus-4-8[1m]")


@pytest.mark.parametrize(
    ("requested", "served"),
    [
        ("qwen", True),
        ("claude-opus-4-8[1m]", True),
        ("claude-haiku-4-5-20251001", True),  # the pattern
        ("claude-", True),
        ("claude", False),
        ("qwen2", False),
        ("claude-opus-4-8[1]", True),  # brackets are no character class: the pattern matches it as a prefix
        ("gpt-4o", False),
    ],
)
def test_a_request_names_the_id_an_alias_or_a_name_a_pattern_begins(requested: str, served: bool) -> None:
    assert ServedNames.parse("qwen,claude-opus-4-8[1m],claude-*", "x").matches(requested) is served


def test_brackets_match_only_themselves_without_a_pattern() -> None:
    names = ServedNames.parse("qwen,claude-opus-4-8[1m]", "x")
    assert names.matches("claude-opus-4-8[1m]")
    assert not names.matches("claude-opus-4-81m")
    assert not names.matches("claude-opus-4-8")


def test_a_name_is_routed_to_an_id_then_an_exact_alias_then_a_pattern() -> None:
    """`GET /v1/models/{id}` and a request naming `{id}` find the same model: with `a,claude-*` declared before
    `claude-x`, `claude-x` is the model with that exact alias, not the first whose pattern matches."""
    models = [ServedNames(("a", "claude-*")), ServedNames(("claude-x",)), ServedNames(("b", "claude-y"))]
    assert named_by(models, "claude-x", lambda names: names) is models[1]
    assert named_by(models, "claude-y", lambda names: names) is models[2]
    assert named_by(models, "claude-z", lambda names: names) is models[0]
    assert named_by(models, "gpt-4o", lambda names: names) is None
