"""docs/api.md's table of constraint limits is the code's: every limit in `grammar/constraint.py` is in it, with the
value the code enforces, so the two cannot drift apart. And what the docs say of `oneOf` is what a request gets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from courier.grammar import constraint
from courier.grammar.constraint import ONE_OF_OVERLAPS, GrammarError, json_schema

API_DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PARAM = "response_format.json_schema.schema"


def documented_limits() -> dict[str, int]:
    """The limits table under "**Limits**": its constant column -> the number its value column starts with."""
    text = API_DOCS.read_text(encoding="utf-8")
    start = text.index("**Limits**")
    rows = re.findall(r"^\|(.+)\|\s*$", text[start:].split("\n\n", 2)[1], re.MULTILINE)
    table: dict[str, int] = {}
    for row in rows[2:]:  # the header and its rule
        cells = [cell.strip() for cell in row.split("|")]
        value, constant = re.search(r"\d+", cells[1]), re.fullmatch(r"`([A-Za-z_.]+)`", cells[3])
        assert value is not None and constant is not None, row
        table[constant.group(1)] = int(value.group())
    return table


def enforced_limits() -> dict[str, int]:
    """Every limit the module sets: its `MAX_*` constants and the numeric bounds of its llguidance `LIMITS`."""
    limits = {name: value for name, value in vars(constraint).items() if name.startswith("MAX_")}
    for name in dir(constraint.LIMITS):
        value = getattr(constraint.LIMITS, name)
        if not name.startswith("_") and isinstance(value, int) and not isinstance(value, bool):
            limits[f"LIMITS.{name}"] = value
    return limits


def test_the_docs_table_lists_every_limit_with_the_value_the_code_enforces() -> None:
    enforced = enforced_limits()
    assert {"MAX_SCHEMA_BYTES", "MAX_SCHEMA_DEPTH", "MAX_TOOLS", "LIMITS.max_grammar_size"} <= set(enforced)
    assert documented_limits() == enforced


def test_the_docs_say_what_a_oneof_gets() -> None:
    text = API_DOCS.read_text(encoding="utf-8")
    assert "treated as `anyOf`" not in text
    assert "300 objects told apart by a required `const` property are accepted" in text

    def variant(index: int, discriminated: bool) -> dict[str, object]:
        properties: dict[str, object] = {f"field_{index}": {"type": "integer"}}
        if discriminated:
            properties["kind"] = {"const": f"kind_{index}"}
        return {"type": "object", "properties": properties, "required": ["kind"] if discriminated else []}

    json_schema({"oneOf": [variant(index, True) for index in range(300)]}, name="variants", param=PARAM)
    with pytest.raises(GrammarError) as refused:
        json_schema({"oneOf": [variant(index, False) for index in range(2)]}, name="variants", param=PARAM)
    assert refused.value.param == PARAM
    assert ONE_OF_OVERLAPS in refused.value.message and "coerce_one_of" not in refused.value.message
