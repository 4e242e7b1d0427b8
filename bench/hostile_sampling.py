"""The fuzz bench's `sampling` family: every sampling field at its edges, on chat, completions and Responses, each
case followed by another client's ordinary requests (`FollowUp.ORDINARY`)."""

from __future__ import annotations

import orjson

from bench.hostile import Case, Expect, FollowUp, Raw, encode

VOCABULARY = 49152  # the tiny llama's (SmolLM2's tokenizer)


# field -> (low, high, integers, low end open): the ranges docs/api.md gives
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, False, False),
    "top_p": (0.0, 1.0, False, True),
    "top_k": (-1, 1_000_000, True, False),
    "min_p": (0.0, 1.0, False, False),
    "presence_penalty": (-2.0, 2.0, False, False),
    "frequency_penalty": (-2.0, 2.0, False, False),
    "repetition_penalty": (0.01, 10.0, False, False),
    "seed": (0, 2**63 - 1, True, False),
}

EDGE_TEXTS = (
    "0",
    "-0.0",
    "1",
    "-1",
    "0.5",
    "2",
    "10",
    str(VOCABULARY - 1),
    str(VOCABULARY),
    str(VOCABULARY + 1),
    "1000000",
    "1000001",
    "1e-45",
    "1e-300",
    "5e-324",
    "2.2250738585072014e-308",
    "1.7976931348623157e308",
    "-1.7976931348623157e308",
    "1e309",
    "NaN",
    "Infinity",
    '"NaN"',
    '"nan"',
    '"Infinity"',
    "9223372036854775807",
    "9223372036854775808",
)

ROUTES = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/responses", "responses"))


def expectation(text: str, field: str) -> Expect:
    """OK where the value lies in the field's documented range (as the server parses JSON), else REFUSED."""
    low, high, integers, open_low = RANGES[field]
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return Expect.REFUSED
    if isinstance(value, bool) or not isinstance(value, int | float):
        return Expect.REFUSED
    if integers and not isinstance(value, int):
        return Expect.REFUSED
    inside = low < value <= high if open_low else low <= value <= high
    return Expect.OK if inside else Expect.REFUSED


def base(model: str, route: str) -> dict[str, object]:
    if route == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1.0}
    if route == "completions":
        return {"model": model, "prompt": "Hi", "max_tokens": 4, "temperature": 1.0}
    return {"model": model, "input": "Hi", "max_output_tokens": 16, "temperature": 1.0, "store": False}


def sampling_cases(model: str) -> list[Case]:
    cases = []
    for path, route in ROUTES:
        for field in RANGES:
            for text in EDGE_TEXTS:
                body = {**base(model, route), field: Raw(text)}
                cases.append(
                    Case(
                        family="sampling",
                        group=f"{route} {field}",
                        name=f"{route} {field} = {text}",
                        method="POST",
                        path=path,
                        body=encode(body),
                        expect=expectation(text, field),
                        follow_up=FollowUp.ORDINARY,
                    )
                )
    return cases
