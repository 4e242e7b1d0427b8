"""bench.speculative's four greedy workloads (texts: bench/workloads/speculative.toml): (a) code edit, (b) quote,
(c) free chat, (d) json extraction, each request a single user message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.harness.workloads import workload

# Extraction schemas bound their strings and lists, as real ones do (the longest value in these texts: 52 characters).
MAX_STRING = 80
MAX_ITEMS = 4
TEXTS = workload("speculative")
SOURCE_FILE: str = TEXTS["source_file"]
EDITS: tuple[str, ...] = tuple(TEXTS["edits"])
DOCUMENT: str = TEXTS["document"]
QUOTE_TOPICS: tuple[str, ...] = tuple(TEXTS["quote_topics"])
CHAT_PROMPTS: tuple[str, ...] = tuple(TEXTS["chat_prompts"])


def code_prompt(index: int) -> str:
    edit = EDITS[index % len(EDITS)]
    return (
        f"Here is a file:\n\n```python\n{SOURCE_FILE}```\n\nRewrite this file with {edit}. "
        "Keep everything else the same."
    )


def quote_prompt(index: int) -> str:
    topic = QUOTE_TOPICS[index % len(QUOTE_TOPICS)]
    return f"Document:\n\n{DOCUMENT}\nQuote the paragraph about {topic} from this document exactly, word for word."


def chat_prompt(index: int) -> str:
    return CHAT_PROMPTS[index % len(CHAT_PROMPTS)]


def closed_object(fields: dict[str, Any]) -> dict[str, Any]:
    """A strict object schema: every field required, no others; a field is a JSON type name (a string bounded to
    MAX_STRING), or a table of them: a list of 1 to MAX_ITEMS such objects."""

    def schema(kind: str | dict[str, Any]) -> dict[str, Any]:
        if isinstance(kind, dict):
            return {"type": "array", "minItems": 1, "maxItems": MAX_ITEMS, "items": closed_object(kind)}
        return {"type": kind, "maxLength": MAX_STRING} if kind == "string" else {"type": kind}

    properties = {name: schema(kind) for name, kind in fields.items()}
    return {"type": "object", "properties": properties, "required": list(fields), "additionalProperties": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtractionCase:
    """A text holding values, and a schema whose fields echo them."""

    name: str
    text: str
    schema: dict[str, Any]

    def prompt(self) -> str:
        keys = []
        for key, value in self.schema["properties"].items():
            items = value.get("items", {}).get("properties")
            keys.append(f"{key} (a list of objects with {', '.join(items)})" if items else key)
        return (
            f"{self.text}\n\nExtract the details above as a JSON object with the keys {', '.join(keys)}. "
            "Copy the values exactly as written. Answer with the JSON object only."
        )


EXTRACTION_CASES = tuple(
    ExtractionCase(name=case["name"], text=case["text"], schema=closed_object(case["fields"]))
    for case in TEXTS["extraction_cases"]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    key: str
    title: str
    max_tokens: int
    source: str  # what a reply may copy (its lines count as verbatim); empty when nothing is there to copy


WORKLOADS = {
    "a": Workload(key="a", title="code edit", max_tokens=448, source=SOURCE_FILE),
    "b": Workload(key="b", title="quote", max_tokens=192, source=DOCUMENT),
    "c": Workload(key="c", title="free chat", max_tokens=160, source=""),
    "d": Workload(key="d", title="json extraction", max_tokens=224, source=""),
}
SINGLE_WORKLOADS = ("a", "b", "c")
PROMPTS = {"a": code_prompt, "b": quote_prompt, "c": chat_prompt}


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One chat request: a single user message, and the schema a constrained arm sends with it."""

    label: str
    prompt: str
    schema: dict[str, Any] | None = None
    schema_name: str = ""


def requests_for(key: str, count: int, start: int = 0) -> list[Request]:
    """`count` requests of a workload, the `start`-th first (each index takes the next change, topic or case)."""
    found: list[Request] = []
    for index in range(start, start + count):
        if key in PROMPTS:
            found.append(Request(label=f"({key}) #{index}", prompt=PROMPTS[key](index)))
        else:
            case = EXTRACTION_CASES[index % len(EXTRACTION_CASES)]
            prompt, schema = case.prompt(), case.schema
            found.append(Request(label=f"({key}) #{index}", prompt=prompt, schema=schema, schema_name=case.name))
    return found


def verbatim_share(reply: str, source: str) -> float | None:
    """The share of the reply's non-blank lines that stand, stripped, as lines of `source` (None: nothing to copy)."""
    if not source:
        return None
    known = {line.strip() for line in source.splitlines() if line.strip()}
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return sum(1 for line in lines if line in known) / len(lines) if lines else 0.0
