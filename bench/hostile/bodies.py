"""Request bodies and payload pieces the families share."""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from PIL import Image

from bench.hostile.cases import (
    encode,
)


def chat_body(model: str, messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, **extra}


def responses_body(model: str, items: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "input": items, "max_output_tokens": 2, "temperature": 0, **extra}


def compact_body(model: str, items: list[Any]) -> dict[str, Any]:
    # A summary cut by max_output_tokens is a documented 422 compaction_failed (random weights never end one).
    return {"model": model, "input": items, "max_output_tokens": 8, "keep_tokens": 1}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool_turns(arguments: Any) -> list[dict[str, Any]]:
    """A chat history whose assistant turn calls a tool with `arguments`, answered and thanked for."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return [
        user("Look it up."),
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        user("Thanks."),
    ]


def call_items(arguments: Any = "{}", output: Any = "found") -> list[dict[str, Any]]:
    """A Responses history with a function call and its output (the test model's template wants text beside a
    call)."""
    return [
        user("Look it up."),
        {"role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
        user("Thanks."),
    ]


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_objects(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


HOSTILE_CHARACTERS = ('"', "\\", "\x00", "\x1f", "\u2028", "\ufeff", "\U0001f600", "é", "<", "{", "}", "[", "%")


def random_text(rng: random.Random, longest: int = 12) -> str:
    alphabet = [*HOSTILE_CHARACTERS, "a", "b", "key", " "]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(longest)))


def random_json(rng: random.Random, depth: int) -> Any:
    """A random JSON document up to `depth` levels: keys and strings from an alphabet of characters that need
    escaping, numbers at the edges of what a double holds."""
    if depth <= 0 or rng.random() < 0.3:
        return rng.choice(
            [None, True, False, 0, -1, 2**53 + 1, 1.5e308, -5e-324, random_text(rng), random_text(rng, 40)]
        )
    if rng.random() < 0.5:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {random_text(rng): random_json(rng, depth - 1) for _ in range(rng.randrange(4))}


def base64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def capsule_of(payload: object) -> str:
    return base64url(encode(payload))


GOOD_CAPSULE: dict[str, Any] = {"v": 1, "summary": "Earlier, the user asked about Paris.", "retained": []}


FILLS: dict[str, Any] = {"RGB": (200, 30, 30), "CMYK": (10, 20, 30, 40), "LA": (100, 255)}


def saved_image(image_format: str, size: tuple[int, int] = (1, 1), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, FILLS.get(mode, 0)).save(buffer, format=image_format)
    return buffer.getvalue()


def data_url(raw: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode('ascii')}"


def chat_base(model: str) -> dict[str, Any]:
    return chat_body(model, [user("Hello.")])


def responses_base(model: str) -> dict[str, Any]:
    return responses_body(model, "Hello.")


def compact_base(model: str) -> dict[str, Any]:
    return compact_body(model, [user("Hi."), {"role": "assistant", "content": "Hello."}, user("More.")])
