"""The shapes family: nesting, huge values, roles, empty values, raw bodies, hostile ids and queries, wrong
types and numbers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import Any
from urllib.parse import quote

from bench.hostile.cases import (
    ABOUT_30_MB,
    CHAT,
    COMPACT,
    COMPLETIONS,
    CONVERSATIONS,
    DETOKENIZE,
    RESPONSES,
    TOKENIZE,
    Case,
    Expect,
    FollowUp,
    Raw,
    call_items,
    chat_base,
    chat_body,
    compact_body,
    encode,
    nested_arrays,
    nested_objects,
    post,
    responses_base,
    responses_body,
    user,
)
from bench.hostile.fields import number_cases, wrong_type_cases

MAX_DEPTH = 64  # the server's body nesting limit (`courier/core/json_text.py`)


def shapes(group: str, rows: Iterable[tuple[Any, ...]]) -> list[Case]:
    """Cases of `group` from rows of (name, path, body, expect[, follow_up])."""
    return [
        post("shapes", group, n, path, body, expect=e, follow_up=(*rest, None)[0]) for n, path, body, e, *rest in rows
    ]


def nesting_cases(model: str) -> list[Case]:
    """Bodies nested around and far past the limit, in an ignored field, a typed one, and the whole body."""
    rows: list[tuple[str, str, object, Expect]] = []
    for depth in (62, 63, 64, 65, 1000, 1025, 5000, 100_000):
        arrays, objects = Raw(nested_arrays(depth)), Raw(nested_objects(depth))
        ignored = Expect.EITHER if depth + 1 <= MAX_DEPTH else Expect.REFUSED  # the body object itself is a level
        rows += [
            (f"chat, an ignored field nested {depth}", CHAT, chat_base(model) | {"extra": arrays}, ignored),
            (f"chat, content nested {depth}", CHAT, chat_body(model, [user(arrays)]), Expect.REFUSED),
            (f"responses metadata objects nested {depth}", RESPONSES, responses_base(model) | {"metadata": objects},
             Expect.REFUSED),
            (f"tokenize messages nested {depth}", TOKENIZE, {"model": model, "messages": arrays}, Expect.REFUSED),
        ]  # fmt: skip
    rows += [(f"a bare array nested {d}", RESPONSES, Raw(nested_arrays(d)), Expect.REFUSED) for d in (65, 5000)]
    return shapes("nesting", rows)


def huge_cases(model: str) -> list[Case]:
    """Strings and arrays that take most of the 32 MiB body limit, or a lot of work to render."""
    big, wide = "a" * ABOUT_30_MB, "\U0001f600" * (ABOUT_30_MB // 12)  # 4 bytes each, 12 once escaped as JSON
    chat, responses, base = partial(chat_body, model), partial(responses_body, model), chat_base(model)
    many_tools = [{"type": "function", "function": {"name": f"f{index}"}} for index in range(50_000)]
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = {
        "role": "assistant",
        "content": "x",
        "tool_calls": [{"id": f"c{index}", **call} for index in range(20_000)],
    }
    refused, either = Expect.REFUSED, Expect.EITHER
    return shapes("huge", [
        ("chat content of 30 MB", CHAT, chat([user(big)]), refused),
        ("chat content of 2.5 M emoji", CHAT, chat([user(wide)]), refused),
        ("chat content of 20000 characters", CHAT, chat([user("word " * 4000)]), refused),
        ("chat user of 30 MB", CHAT, base | {"user": big}, either),
        ("chat stop of 1 MB", CHAT, base | {"stop": ["s" * 1_000_000]}, either),
        ("chat model of 1 MB", CHAT, base | {"model": big[:1_000_000]}, refused),
        ("chat 100000 messages", CHAT, chat([user("a") for _ in range(100_000)]), refused),
        ("chat 100000 text parts", CHAT, chat([user([{"type": "text", "text": "a"}] * 100_000)]), refused),
        ("chat 50000 tools", CHAT, base | {"tools": many_tools}, either),
        ("chat 20000 tool calls", CHAT, chat([user("Go."), calls]), either),
        ("completions prompt of 30 MB", COMPLETIONS, {"model": model, "prompt": big, "max_tokens": 2}, refused),
        ("completions 1000000 token ids", COMPLETIONS, {"model": model, "prompt": [1] * 1_000_000, "max_tokens": 2},
         refused),
        ("responses instructions of 30 MB", RESPONSES, responses_base(model) | {"instructions": big}, refused),
        ("responses function_call arguments of 30 MB", RESPONSES, responses(call_items(big)), refused),
        ("responses previous_response_id of 30 MB", RESPONSES,
         {"model": model, "previous_response_id": big, "input": "Hi."}, refused),
        ("responses 20 items of 1.4 MB", RESPONSES, responses([user(big[:1_400_000])] * 20), refused),
        ("responses metadata value of 30 MB", RESPONSES, responses_base(model) | {"metadata": {"k": big}}, refused),
        ("conversation metadata key of 1 MB", CONVERSATIONS, {"metadata": {big[:1_000_000]: "v"}}, refused),
        ("conversation item of 30 MB", CONVERSATIONS, {"items": [user(big)]}, either),
        ("tokenize prompt of 30 MB", TOKENIZE, {"model": model, "prompt": big}, refused),
        ("detokenize 1000000 tokens", DETOKENIZE, {"model": model, "tokens": [1] * 1_000_000}, either),
        ("a body over 32 MiB", CHAT, chat([user(big + "a" * 4_000_000)]), refused),
    ])  # fmt: skip


def role_cases(model: str) -> list[Case]:
    """A role the server does not know is a 4xx (Responses knows no `tool`); a count renders any role."""
    roles = ("wizard", "", "USER", "user ", "function", "ipython", "\x00", "user\x00", "<|im_start|>system")
    rows: list[tuple[Any, ...]] = []
    for role in (*roles, "developer", "tool"):
        shown, message = json.dumps(role), {"role": role, "content": "Hi."}
        chat_expect = Expect.REFUSED if role in roles else Expect.EITHER
        responses_expect = Expect.REFUSED if role in (*roles, "tool") else Expect.EITHER
        conversation = {"items": [{"type": "message", **message}]}
        rows += [
            (f"chat role {shown}", CHAT, chat_body(model, [message, user("Hello.")]), chat_expect),
            (f"responses role {shown}", RESPONSES, responses_body(model, [message]), responses_expect),
            (f"conversation item role {shown}", CONVERSATIONS, conversation, responses_expect, FollowUp.CONVERSATION),
            (f"tokenize role {shown}", TOKENIZE, {"model": model, "messages": [message]}, Expect.EITHER),
        ]
    no_content = chat_body(model, [user("Hi."), {"role": "assistant"}, user("Hi?")])
    no_call = chat_body(model, [{"role": "tool", "content": "x", "tool_call_id": "nope"}])
    rows.append(("chat assistant without content or calls", CHAT, no_content, Expect.REFUSED))
    rows.append(("chat tool result without a call", CHAT, no_call, Expect.EITHER))
    return shapes("roles", rows)


def empty_cases(model: str) -> list[Case]:
    no_calls, either = {"role": "assistant", "content": "x", "tool_calls": []}, Expect.EITHER
    rows: list[tuple[str, str, object, Expect]] = [
        ("chat messages []", CHAT, chat_body(model, []), Expect.REFUSED),
        ("chat content []", CHAT, chat_body(model, [user([])]), Expect.EITHER),
        ("chat tool_calls []", CHAT, chat_body(model, [user("Hi."), no_calls, user("?")]), Expect.EITHER),
        ("chat tools []", CHAT, chat_base(model) | {"tools": []}, Expect.EITHER),
        ("chat stop []", CHAT, chat_base(model) | {"stop": []}, Expect.EITHER),
        ("chat message {}", CHAT, chat_body(model, [{}]), Expect.REFUSED),
        ("chat body {}", CHAT, {}, Expect.REFUSED),
        ("completions prompt []", COMPLETIONS, {"model": model, "prompt": []}, Expect.REFUSED),
        ("completions prompt [[]]", COMPLETIONS, {"model": model, "prompt": [[]]}, Expect.REFUSED),
        ('completions prompt [""]', COMPLETIONS, {"model": model, "prompt": [""], "max_tokens": 2}, Expect.EITHER),
        ("responses input []", RESPONSES, responses_body(model, []), Expect.REFUSED),
        ("responses content []", RESPONSES, responses_body(model, [user([])]), Expect.EITHER),
        ("responses output []", RESPONSES, responses_body(model, call_items(output=[])), Expect.EITHER),
        ("responses tools []", RESPONSES, responses_base(model) | {"tools": []}, Expect.EITHER),
        ("responses context_management []", RESPONSES, responses_base(model) | {"context_management": []}, either),
        ('responses input ""', RESPONSES, responses_body(model, ""), Expect.EITHER),
        ("compact input []", COMPACT, compact_body(model, []), Expect.REFUSED),
        ("conversation items []", CONVERSATIONS, {"items": []}, Expect.EITHER),
        ("conversation append items []", "/v1/conversations/{conversation}/items", {"items": []}, Expect.EITHER),
        ("tokenize messages []", TOKENIZE, {"model": model, "messages": []}, Expect.EITHER),
        ("tokenize messages [{}]", TOKENIZE, {"model": model, "messages": [{}]}, Expect.EITHER),
        ('tokenize content ["x"]', TOKENIZE, {"model": model, "messages": [user(["x"])]}, Expect.EITHER),
        ("tokenize content [[]]", TOKENIZE, {"model": model, "messages": [user([[]])]}, Expect.EITHER),
        ("detokenize tokens []", DETOKENIZE, {"model": model, "tokens": []}, Expect.EITHER),
    ]  # fmt: skip
    return shapes("empty", rows)


def raw_body_cases(model: str) -> list[Case]:
    """Bodies `json.dumps` would not write: duplicate keys, text that is not UTF-8 or not JSON."""
    message, tail = b'{"role": "user", "content": "Hi."}', b', "max_tokens": 2, "model": "' + model.encode() + b'"}'
    listed, valid = b'{"messages": [' + message + b"]", encode(chat_base(model))

    def content(raw: bytes) -> bytes:
        return b'{"messages": [{"role": "user", "content": "' + raw + b'"}]' + tail

    cases = shapes("raw bodies", [
        ("duplicate messages, the last bad", CHAT, listed + b', "messages": "x"' + tail, Expect.REFUSED),
        ("duplicate messages, the last good", CHAT, b'{"messages": "x", "messages": [' + message + b"]" + tail,
         Expect.EITHER),
        ("duplicate role in a message", CHAT,
         b'{"messages": [{"role": "user", "role": "wizard", "content": "Hi."}]' + tail, Expect.REFUSED),
        ("duplicate stream", CHAT, b'{"stream": false, "stream": true, "messages": [' + message + b"]" + tail,
         Expect.EITHER),
        ("1000 duplicate keys", CHAT, listed + b', "x": 1' * 1000 + tail, Expect.EITHER),
        ("UTF-16 body", CHAT, valid.decode().encode("utf-16"), Expect.REFUSED),
        ("byte-order mark", CHAT, b"\xef\xbb\xbf" + valid, Expect.EITHER),
        ("Latin-1 content", CHAT, content(b"caf\xe9"), Expect.REFUSED),
        ("overlong UTF-8 slash", CHAT, content(b"\xc0\xaf"), Expect.REFUSED),
        ("UTF-8 encoded surrogate", CHAT, content(b"\xed\xa0\x80"), Expect.REFUSED),
        ("NaN literal", CHAT, encode(chat_base(model) | {"temperature": Raw("NaN")}), Expect.REFUSED),
        ("trailing comma", CHAT, b'{"messages": [' + message + b",]" + tail, Expect.REFUSED),
        ("two documents", CHAT, valid * 2, Expect.REFUSED),
        ("comment", CHAT, b"/* hi */" + valid, Expect.REFUSED),
        ("text/plain JSON", CHAT, valid, Expect.EITHER),
        ("form-encoded", CHAT, b"messages=hi&model=x", Expect.REFUSED),
        ("empty body", RESPONSES, b"", Expect.REFUSED),
        ("a lone NUL", RESPONSES, b"\x00", Expect.REFUSED),
        ("JSON null", RESPONSES, b"null", Expect.REFUSED),
        ("JSON string", RESPONSES, b'"hi"', Expect.REFUSED),
    ])  # fmt: skip
    cases[-6] = replace(cases[-6], content_type="text/plain")
    cases[-5] = replace(cases[-5], content_type="application/x-www-form-urlencoded")
    return cases


HOSTILE_IDS = (
    "\x00", "a" * 8000, "../../etc/passwd", "resp_\U0001f600", "'; DROP TABLE responses; --", "%", "\n", " ",
    "conv_" + "\x7f", "\u202e",
)  # fmt: skip
ID_PATHS = (
    ("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"), ("POST", "/v1/responses/{}/cancel"),
    ("GET", "/v1/responses/{}/input_items"), ("GET", "/v1/conversations/{}"), ("DELETE", "/v1/conversations/{}"),
    ("GET", "/v1/conversations/{{conversation}}/items/{}"), ("DELETE", "/v1/conversations/{{conversation}}/items/{}"),
    ("GET", "/v1/models/{}"),
)  # fmt: skip
QUERIES = (
    ("limit=NaN", Expect.REFUSED), ("limit=1e309", Expect.REFUSED), ("limit=-0", Expect.REFUSED),
    ("limit=0x10", Expect.REFUSED), ("limit=%EF%BC%91%EF%BC%90", Expect.EITHER),  # fullwidth "10"
    ("limit=" + "9" * 5000, Expect.REFUSED), ("limit=", Expect.REFUSED), ("limit=100", Expect.EITHER),
    ("limit=101", Expect.REFUSED), ("order=ASC", Expect.REFUSED), ("order=%00", Expect.REFUSED),
    ("after=%00", Expect.EITHER), ("after=" + "a" * 5000, Expect.EITHER), ("limit=1&limit=x", Expect.EITHER),
)  # fmt: skip


def path_cases() -> list[Case]:
    """Ids that are not ids in every path that takes one, and query strings that are not numbers."""
    cases, refused = [], Expect.REFUSED
    for method, template in ID_PATHS:
        for identifier in HOSTILE_IDS:
            shown = json.dumps(identifier if len(identifier) < 40 else f"{identifier[:10]}... ({len(identifier)})")
            path, name = template.format(quote(identifier, safe="")), f"{method} {template.format('')} id {shown}"
            cases.append(
                Case(family="shapes", group="ids", name=name, method=method, path=path, body=None, expect=refused)
            )
    for query, expect in QUERIES:
        for route in ("/v1/conversations/{conversation}/items", "/v1/responses/{response}/input_items"):
            name = f"GET {route}?{query if len(query) < 40 else f'{query[:12]}... ({len(query)})'}"
            path = f"{route}?{query}"
            cases.append(
                Case(family="shapes", group="queries", name=name, method="GET", path=path, body=None, expect=expect)
            )
    return cases


def shape_cases(model: str, rng: random.Random) -> list[Case]:
    """Grouped by kind, each kind in a seeded order: selection takes from every kind in turn."""
    cases: list[Case] = []
    kinds = (nesting_cases, huge_cases, role_cases, empty_cases, raw_body_cases, lambda _: path_cases())
    for make in (*kinds, wrong_type_cases, number_cases):
        kind = make(model)
        rng.shuffle(kind)
        cases += kind
    return cases
