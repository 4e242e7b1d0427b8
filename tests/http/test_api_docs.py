"""docs/api.md and the request schemas (`courier/http/schemas/`, which validate every body and are /openapi.json's
request bodies) name the same fields: every field a route's schema takes is named in that route's section, and every
field a section's table lists is one its schema takes. Every field, not a sample."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from courier.http.schemas import anthropic, chat, completions, embeddings, responses
from courier.settings import Settings

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MAX_N = Settings().max_n
# (the section's heading, the route, its body's schema)
SECTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("## POST /v1/chat/completions", "/v1/chat/completions", chat.request(MAX_N)),
    ("## POST /v1/completions", "/v1/completions", completions.request(MAX_N)),
    ("## POST /v1/responses", "/v1/responses", responses.REQUEST),
    ("## POST /v1/responses", "/v1/responses/input_tokens", responses.INPUT_TOKENS),
    ("## Compaction", "/v1/responses/compact", responses.COMPACT),
    ("## Conversations", "/v1/conversations", responses.CONVERSATION),
    ("## Conversations", "/v1/conversations/{id}", responses.CONVERSATION_UPDATE),
    ("## Conversations", "/v1/conversations/{id}/items", responses.CONVERSATION_ITEMS),
    ("## Anthropic Messages API", "/v1/messages", anthropic.MESSAGES),
    ("## Anthropic Messages API", "/v1/messages/count_tokens", anthropic.COUNT_TOKENS),
    ("## POST /v1/embeddings", "/v1/embeddings", embeddings.REQUEST),
    ("## Other routes", "/tokenize", chat.TOKENIZE),
    ("## Other routes", "/detokenize", chat.DETOKENIZE),
]
IDS = [route for _, route, _ in SECTIONS]


def section(heading: str) -> str:
    """The text under `heading`, up to the next section of the same level."""
    text = API_DOC.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def code_names(text: str) -> set[str]:
    """Every identifier inside the text's code spans (`{model, input?}` names two)."""
    return {name for span in re.findall(r"`([^`]+)`", text) for name in re.findall(r"[A-Za-z_]\w*", span)}


def tabled_fields(text: str) -> set[str]:
    """The top-level fields a field table's first column names (`stream_options.include_usage` is `stream_options`)."""
    fields: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            for span in re.findall(r"`([^`]+)`", line.split("|")[1]):
                match = re.match(r"[A-Za-z_]\w*", span)
                if match:
                    fields.add(match.group())
    return fields


@pytest.mark.parametrize(("heading", "route", "schema"), SECTIONS, ids=IDS)
def test_every_field_a_schema_takes_is_documented(heading: str, route: str, schema: dict[str, Any]) -> None:
    undocumented = set(schema["properties"]) - code_names(section(heading))
    assert not undocumented, f"{route}: docs/api.md's '{heading}' does not name {sorted(undocumented)}"


@pytest.mark.parametrize(
    ("heading", "schema"),
    [
        ("## POST /v1/chat/completions", chat.request(MAX_N)),
        ("## POST /v1/responses", responses.REQUEST),
        ("## Anthropic Messages API", anthropic.MESSAGES),
    ],
    ids=["chat", "responses", "messages"],
)
def test_every_field_a_table_lists_is_in_its_schema(heading: str, schema: dict[str, Any]) -> None:
    tabled = tabled_fields(section(heading))
    assert tabled, f"no field table under '{heading}'"
    assert tabled - {"anything"} <= set(schema["properties"]), sorted(tabled - set(schema["properties"]))
