"""bench.structured's workload: ten JSON schemas (bench/workloads/structured.json), each with the task that asks for
it and an instance valid against it; the throughput part's essay schema and prompts; and the check that a reply
parses and validates."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bench.harness.workloads import json_workload
from bench.throughput import TOPICS


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaCase:
    """A schema, the task that asks for it, and one instance valid against it (properties in the schema's order,
    as the grammar writes them)."""

    name: str
    task: str
    schema: dict[str, Any]
    instance: Any


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A closed object: all its properties required, no others."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _string(max_length: int, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length} | ({"minLength": min_length} if min_length else {})


SCHEMAS: tuple[SchemaCase, ...] = tuple(SchemaCase(**case) for case in json_workload("structured"))


def essay_schema(max_tokens: int) -> dict[str, Any]:
    """The throughput arm's schema: its shortest valid output is longer than `max_tokens` (a section is at least 8
    tokens), so a constrained reply runs to the cap; bounded strings keep the grammar's structure exercised."""
    section = _object({"heading": _string(60), "text": _string(300)})
    return _object(
        {"title": _string(80), "sections": {"type": "array", "minItems": max_tokens // 8 + 1, "items": section}}
    )


def validity_prompt(case: SchemaCase) -> str:
    return f"{case.task}\nAnswer with JSON only, valid against this JSON Schema:\n{json.dumps(case.schema)}"


ESSAY_TASKS = (
    "Write a detailed, multi-paragraph essay about the history of {}, in sections with headings.",
    "Write a long article about {}, in several sections, each with a heading.",
    "Write a detailed guide to {}, in sections with headings and full paragraphs.",
    "Write a long report on {}, split into titled sections.",
)


def essay_prompts(count: int, offset: int) -> list[str]:
    """`count` distinct essay prompts, starting at `offset` (each round and arm takes fresh ones)."""
    prompts = []
    for index in range(offset, offset + count):
        task = ESSAY_TASKS[(index // len(TOPICS)) % len(ESSAY_TASKS)].format(TOPICS[index % len(TOPICS)])
        cycle = index // (len(TOPICS) * len(ESSAY_TASKS))
        prompts.append(task + (f" (Part {cycle + 1}.)" if cycle else ""))
    return prompts


def check_reply(content: str, schema: dict[str, Any]) -> tuple[bool, bool, str | None]:
    """Whether `content` parses as JSON and is valid against `schema` (its own draft), and if not, why."""
    import jsonschema

    try:
        value = json.loads(content)
    except json.JSONDecodeError as error:
        return False, False, f"not JSON: {error}"
    failure = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    if failure is not None:
        where = "/".join(str(part) for part in failure.absolute_path) or "(root)"
        return True, False, f"invalid at {where}: {failure.message}"
    return True, True, None
