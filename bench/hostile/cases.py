"""A hostile case (one request and the answer it may get), the bodies and payload pieces the families build cases
from, and the seeded selection the fuzz bench sends."""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from PIL import Image

LONG_TEXT = 1500  # characters past which a text may not fit the tiny model's 2048-token context: it may be a 400
ABOUT_30_MB = 30_000_000  # under the server's default --max-body-bytes (32 MiB): huge, yet read and judged
HOSTILE_CHARACTERS = ('"', "\\", "\x00", "\x1f", "\u2028", "\ufeff", "\U0001f600", "é", "<", "{", "}", "[", "%")
FILLS: dict[str, Any] = {"RGB": (200, 30, 30), "CMYK": (10, 20, 30, 40), "LA": (100, 255)}
GOOD_CAPSULE: dict[str, Any] = {"v": 1, "summary": "Earlier, the user asked about Paris.", "retained": []}
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
COMPACT, INPUT_TOKENS, CONVERSATIONS = "/v1/responses/compact", "/v1/responses/input_tokens", "/v1/conversations"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"


class Expect(StrEnum):
    OK = "2xx"
    REFUSED = "4xx"
    EITHER = "2xx or 4xx"


class FollowUp(StrEnum):
    """What the runner sends after a 2xx, so that stored hostile input is also replayed and read back."""

    CHAIN = "a next turn by previous_response_id, and the stored response read back"
    CONVERSATION = "a Responses turn in the conversation, and its items read back"
    ORDINARY = "another client's ordinary requests: default sampling, and an unseeded temperature draw"


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    family: str
    group: str  # what the case varies (a payload, a field): selection keeps every group it can
    name: str  # "<place>: <payload>"
    path: str  # may hold {conversation}, {item} or {response}: ids of records the runner creates first
    body: bytes | None
    expect: Expect
    method: str = "POST"
    follow_up: FollowUp | None = None
    content_type: str = "application/json"
    credentials: str | None = None  # the API key it is sent with: None for the runner's own, "" for none at all


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text spliced into a body as is: what `json.dumps` will not write (NaN, 1e309, 5000 levels)."""

    text: str


def encode(body: object) -> bytes:
    """`body` as JSON bytes, its `Raw` parts spliced in verbatim (ASCII, lone surrogates escaped as JSON does)."""
    raws: list[str] = []

    def mark(value: object) -> object:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x01raw{len(raws) - 1}\x01"
        if isinstance(value, dict):
            return {key: mark(item) for key, item in value.items()}
        return [mark(item) for item in value] if isinstance(value, list) else value

    text = json.dumps(mark(body))
    for index, raw in enumerate(raws):
        text = text.replace(f'"\\u0001raw{index}\\u0001"', raw, 1)
    return text.encode("utf-8", "surrogatepass")


def post(family: str, group: str, name: str, path: str, body: object, *, expect: Expect, follow_up: Any = None) -> Case:
    """A POST of `body` (encoded unless already bytes)."""
    raw = body if isinstance(body, bytes) else encode(body)
    return Case(family=family, group=group, name=name, path=path, body=raw, expect=expect, follow_up=follow_up)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a payload string goes: `build` makes the body around it."""

    name: str
    path: str
    build: Callable[[str], object]
    longest: int | None = None  # the longest string this place takes (a metadata value: 512); longer is a 400
    follow_up: FollowUp | None = None


def at_place(family: str, group: str, place: Place, value: str, expect: Expect) -> Case:
    """`value` (named `group`) put where `place` takes it."""
    name, body = f"{place.name}: {group}", place.build(value)
    return post(family, group, name, place.path, body, expect=expect, follow_up=place.follow_up)


def shuffled(places: Sequence[Place], rng: random.Random, first: int) -> list[Place]:
    """The first `first` places as they are, then the others in a seeded order."""
    return [*places[:first], *rng.sample(places[first:], len(places) - first)]


def select(cases: Sequence[Case], limit: int, rng: random.Random) -> list[Case]:
    """At most `limit` cases, taken round-robin across groups (in a seeded order), each group in its own order:
    a small limit still tries every group it can, and a group's first cases (its primary places) first."""
    groups: dict[str, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.group, []).append(case)
    order = list(groups)
    rng.shuffle(order)
    chosen: list[Case] = []
    depth = 0
    while len(chosen) < limit and any(depth < len(groups[group]) for group in order):
        chosen.extend(groups[group][depth] for group in order if depth < len(groups[group]))
        depth += 1
    return chosen[:limit]


def family_rng(seed: int, family: str) -> random.Random:
    return random.Random(f"{seed}:{family}")


def chat_body(model: str, messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, **extra}


def responses_body(model: str, items: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "input": items, "max_output_tokens": 2, "temperature": 0, **extra}


def compact_body(model: str, items: list[Any]) -> dict[str, Any]:
    # A summary cut by max_output_tokens is a documented 422 compaction_failed (random weights never end one).
    return {"model": model, "input": items, "max_output_tokens": 8, "keep_tokens": 1}


def chat_base(model: str) -> dict[str, Any]:
    return chat_body(model, [user("Hello.")])


def responses_base(model: str) -> dict[str, Any]:
    return responses_body(model, "Hello.")


def compact_base(model: str) -> dict[str, Any]:
    return compact_body(model, [user("Hi."), {"role": "assistant", "content": "Hello."}, user("More.")])


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool_turns(arguments: Any) -> list[dict[str, Any]]:
    """A chat history whose assistant turn calls a tool with `arguments`, answered and thanked for."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    assistant = {"role": "assistant", "content": "Looking.", "tool_calls": [call]}
    return [
        user("Look it up."),
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        user("Thanks."),
    ]


def call_items(arguments: Any = "{}", output: Any = "found") -> list[dict[str, Any]]:
    """A Responses history with a function call and its output (the test model's template wants text beside it)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": arguments}
    result = {"type": "function_call_output", "call_id": "call_1", "output": output}
    return [user("Look it up."), {"role": "assistant", "content": "Looking."}, call, result, user("Thanks.")]


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_objects(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def random_text(rng: random.Random, longest: int = 12) -> str:
    alphabet = [*HOSTILE_CHARACTERS, "a", "b", "key", " "]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(longest)))


def random_json(rng: random.Random, depth: int) -> Any:
    """A random JSON document up to `depth` levels: keys and strings from an alphabet of characters that need
    escaping, numbers at the edges of what a double holds."""
    if depth <= 0 or rng.random() < 0.3:
        leaves = [None, True, False, 0, -1, 2**53 + 1, 1.5e308, -5e-324, random_text(rng), random_text(rng, 40)]
        return rng.choice(leaves)
    if rng.random() < 0.5:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {random_text(rng): random_json(rng, depth - 1) for _ in range(rng.randrange(4))}


def base64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def capsule_of(payload: object) -> str:
    return base64url(encode(payload))


def saved_image(image_format: str, size: tuple[int, int] = (1, 1), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, FILLS.get(mode, 0)).save(buffer, format=image_format)
    return buffer.getvalue()


def data_url(raw: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode('ascii')}"
