"""bench.structured's workload: ten JSON schemas, each with the task that asks for it and an instance valid against
it; the throughput part's essay schema and prompts; and the check that a reply parses and validates."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.throughput import TOPICS


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaCase:
    """A schema, the task that asks for it, and one instance valid against it (properties in the schema's order,
    as the grammar writes them)."""

    name: str
    task: str
    schema: dict[str, Any]
    instance: Any


def _object(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    """A closed object: `required` (all its properties unless given) and no others."""
    needed = list(properties) if required is None else list(required)
    return {"type": "object", "properties": properties, "required": needed, "additionalProperties": False}


def _string(max_length: int, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length} | ({"minLength": min_length} if min_length else {})


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _array(items: dict[str, Any], max_items: int, min_items: int | None = None) -> dict[str, Any]:
    bounds = {"minItems": min_items} if min_items is not None else {}
    return {"type": "array", **bounds, "maxItems": max_items, "items": items}


def _pattern(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


BOOLEAN = {"type": "boolean"}
POINT_REF = {"$ref": "#/$defs/point"}
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        name="person",
        task="Invent a person: their name, age and email address.",
        schema=_object(
            {
                "name": _string(40, 1),
                "age": _integer(0, 120),
                "email": _pattern(r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)$"),
            }
        ),
        instance={"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    SchemaCase(
        name="shipping",
        task="Write the shipping label for a parcel sent to a friend in Europe.",
        schema=_object(
            {
                "recipient": _string(40, 1),
                "address": _object(
                    {
                        "street": _string(50, 1),
                        "city": _string(30, 1),
                        "postcode": _pattern(r"^[0-9]{5}$"),
                        "country": _enum("FR", "DE", "ES", "IT", "NL", "PT"),
                    }
                ),
                "express": BOOLEAN,
            }
        ),
        instance={
            "recipient": "Marie Curie",
            "address": {"street": "12 Rue de la Paix", "city": "Paris", "postcode": "75002", "country": "FR"},
            "express": True,
        },
    ),
    SchemaCase(
        name="shopping_list",
        task="Make a shopping list for a pancake breakfast.",
        schema=_object({"items": _array(_object({"item": _string(30, 1), "quantity": _integer(1, 20)}), 5, 1)}),
        instance={"items": [{"item": "flour", "quantity": 1}, {"item": "eggs", "quantity": 6}]},
    ),
    SchemaCase(
        name="sentiment",
        task="Classify the sentiment of this review: 'The soup was cold but the staff were lovely.'",
        schema=_object(
            {
                "sentiment": _enum("positive", "negative", "neutral", "mixed"),
                "confidence_percent": _integer(0, 100),
                "language": {"enum": ["en", "fr", "de", "es"]},
            }
        ),
        instance={"sentiment": "mixed", "confidence_percent": 80, "language": "en"},
    ),
    SchemaCase(
        name="shape",
        task="Describe one geometric shape to draw, and its colour.",
        schema=_object(
            {
                "shape": {
                    "anyOf": [
                        _object({"kind": {"const": "circle"}, "radius": _integer(1, 100)}),
                        _object(
                            {"kind": {"const": "rectangle"}, "width": _integer(1, 100), "height": _integer(1, 100)}
                        ),
                    ]
                },
                "color": _enum("red", "green", "blue", "black"),
            }
        ),
        instance={"shape": {"kind": "rectangle", "width": 40, "height": 25}, "color": "blue"},
    ),
    SchemaCase(
        name="route",
        task="Plan a short route on a grid: where it starts, where it ends, and up to three points on the way.",
        schema={
            "$defs": {"point": _object({"x": _integer(-100, 100), "y": _integer(-100, 100)})},
            **_object({"start": POINT_REF, "end": POINT_REF, "waypoints": _array(POINT_REF, 3)}),
        },
        instance={"start": {"x": 0, "y": 0}, "end": {"x": 10, "y": -4}, "waypoints": [{"x": 5, "y": 2}]},
    ),
    SchemaCase(
        name="article",
        task="Give the title of a blog post about learning to cook, a few tags for it, and whether it is published.",
        schema=_object(
            {"title": _string(60, 3), "tags": _array(_pattern(r"^[a-z]{2,12}$"), 4, 1), "published": BOOLEAN}
        ),
        instance={"title": "Cooking for beginners", "tags": ["cooking", "food"], "published": False},
    ),
    SchemaCase(
        name="event",
        task="Schedule a team meeting next year: what it is, its date, its start time and how many attend.",
        schema=_object(
            {
                "event": _string(40, 1),
                "date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
                "time": _pattern(r"^([01][0-9]|2[0-3]):[0-5][0-9]$"),
                "attendees": _integer(1, 500),
            }
        ),
        instance={"event": "Quarterly planning", "date": "2027-03-14", "time": "09:30", "attendees": 12},
    ),
    SchemaCase(
        name="recipe",
        task="Write a simple recipe: its name, servings, ingredients in grams, and whether it is vegetarian.",
        schema=_object(
            {
                "name": _string(30, 1),
                "servings": _integer(1, 12),
                "ingredients": _array(_object({"name": _string(20, 1), "grams": _integer(1, 1000)}), 4, 2),
                "vegetarian": BOOLEAN,
            }
        ),
        instance={
            "name": "Tomato soup",
            "servings": 4,
            "ingredients": [{"name": "tomatoes", "grams": 800}, {"name": "onion", "grams": 150}],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        name="ticket",
        task="File a support ticket about a printer that does not print.",
        schema=_object(
            {
                "id": _integer(1, 99999),
                "status": {"enum": ["open", "in_progress", "closed"]},
                "assignee": {"anyOf": [_string(20, 1), {"type": "null"}]},
                "priority": _integer(1, 5),
                "note": _string(60),
            },
            required=["id", "status", "assignee"],
        ),
        instance={"id": 4512, "status": "open", "assignee": None, "priority": 2},
    ),
)


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
