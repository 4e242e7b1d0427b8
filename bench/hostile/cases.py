"""A hostile case (one request and the answer it may get), how one is built and encoded, and the seeded
selection the fuzz bench sends."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

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
    method: str
    path: str  # may hold {conversation}, {item} or {response}: ids of records the runner creates first
    body: bytes | None
    expect: Expect
    follow_up: FollowUp | None = None
    content_type: str = "application/json"
    # The API key the case is sent with: None for the runner's own, "" for none at all.
    credentials: str | None = None


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text spliced into a body as is: what `json.dumps` will not write (NaN, 1e309, 5000 levels)."""

    text: str


LONG_TEXT = 1500
"""Characters past which a text may not fit the tiny model's 2048-token context: such a case may be a 400."""

ABOUT_30_MB = 30_000_000
"""Under the server's default --max-body-bytes (32 MiB): huge, yet read and judged."""


def encode(body: object) -> bytes:
    """`body` as JSON bytes, its `Raw` parts spliced in verbatim (ASCII, lone surrogates escaped as JSON does)."""
    raws: list[str] = []

    def mark(value: object) -> object:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x01raw{len(raws) - 1}\x01"
        if isinstance(value, dict):
            return {key: mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [mark(item) for item in value]
        return value

    text = json.dumps(mark(body))
    for index, raw in enumerate(raws):
        text = text.replace(f'"\\u0001raw{index}\\u0001"', raw, 1)
    return text.encode("utf-8", "surrogatepass")


def post(
    family: str,
    group: str,
    name: str,
    path: str,
    body: object,
    *,
    expect: Expect,
    follow_up: FollowUp | None = None,
    content_type: str = "application/json",
) -> Case:
    """A POST of `body` (encoded unless already bytes)."""
    raw = body if isinstance(body, bytes) else encode(body)
    return Case(
        family=family,
        group=group,
        name=name,
        method="POST",
        path=path,
        body=raw,
        expect=expect,
        follow_up=follow_up,
        content_type=content_type,
    )


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


@dataclass(frozen=True, slots=True)
class Place:
    """Where a payload string goes: `build` makes the body around it."""

    name: str
    path: str
    build: Callable[[str], object]
    longest: int | None = None  # the longest string this place takes (a metadata value: 512); longer is a 400
    follow_up: FollowUp | None = None


def shape_case(
    group: str, name: str, path: str, body: object, expect: Expect, *, follow_up: FollowUp | None = None
) -> Case:
    return post("shapes", group, name, path, body, expect=expect, follow_up=follow_up)
