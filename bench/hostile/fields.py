"""Every body field the validators read, with the JSON types it takes: the wrong-type and numbers cases of the
shapes family, and the sampling family (every sampling field at its edges, each case followed by another client's
ordinary requests)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from bench.hostile.cases import (
    CHAT,
    COMPACT,
    COMPLETIONS,
    CONVERSATIONS,
    DETOKENIZE,
    GOOD_CAPSULE,
    INPUT_TOKENS,
    RESPONSES,
    TOKENIZE,
    Case,
    Expect,
    FollowUp,
    Raw,
    call_items,
    capsule_of,
    chat_base,
    chat_body,
    compact_base,
    post,
    responses_base,
    responses_body,
    tool_turns,
    user,
)

WRONG_VALUES: tuple[object, ...] = (None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1})


def json_type(value: object) -> str:
    """The JSON type of a parsed value, with integers and other numbers told apart."""
    kinds = ((type(None), "null"), (bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "obj")


ANY_TYPE = frozenset({"null", "bool", "int", "float", "str", "list", "obj"})
POSITIVE: tuple[float, float, bool] = (1, float("inf"), True)
TEMPERATURE: tuple[float, float, bool] = (0, 2, False)
TOP_P: tuple[float, float, bool] = (5e-324, 1, False)
SEED: tuple[float, float, bool] = (0, 2**63 - 1, True)
ONE: tuple[float, float, bool] = (1, 1, True)
TOKEN_ID: tuple[float, float, bool] = (0, 49151, True)


@dataclass(frozen=True, slots=True)
class Field:
    """A field of a request body, the JSON types it takes, and the body it sits in (`at`: the path to it)."""

    route: str
    at: tuple[str | int, ...]
    takes: frozenset[str]
    base: Callable[[str], dict[str, Any]]
    numbers: tuple[float, float, bool] | None = None  # (low, high, integers only) for the numbers generator
    follow_up: FollowUp | None = None

    @property
    def name(self) -> str:
        return f"{self.route} {'.'.join(str(step) for step in self.at)}"


# (dotted path, the JSON types it takes, and for a number its range); the body each group of fields sits in.
Spec = tuple[Any, ...]
CHAT_FIELDS: tuple[Spec, ...] = (
    ("model", "null str"), ("messages", "list"), ("max_tokens", "null int", POSITIVE),
    ("max_completion_tokens", "null int", POSITIVE), ("temperature", "null int float", TEMPERATURE),
    ("top_p", "null int float", TOP_P), ("seed", "null int", SEED), ("stop", "null str list"), ("stream", "null bool"),
    ("stream_options", "null obj"), ("logprobs", "null bool"),
)  # fmt: skip
CHAT_MORE_FIELDS: tuple[Spec, ...] = (
    ("n", "null int", ONE), ("tools", "null list"), ("tool_choice", "null str"), ("user", "null str"),
    ("prompt_cache_key", "null str"), ("cache_prompt", "null bool"), ("messages.0", "obj"), ("messages.0.role", "str"),
    ("messages.0.content", "str list"), ("messages.0.name", "any"),
)  # fmt: skip
CHAT_PART_FIELDS: tuple[Spec, ...] = (
    ("messages.0.content.0", "obj"), ("messages.0.content.0.type", "str"), ("messages.0.content.0.text", "str"),
)  # fmt: skip
CHAT_TOOL_FIELDS: tuple[Spec, ...] = (
    ("messages.1.content", "null str list"), ("messages.1.tool_calls", "null list"), ("messages.1.tool_calls.0", "obj"),
    ("messages.1.tool_calls.0.id", "any"), ("messages.1.tool_calls.0.function", "obj"),
    ("messages.1.tool_calls.0.function.name", "str"), ("messages.1.tool_calls.0.function.arguments", "str obj"),
    ("messages.2.tool_call_id", "any"), ("tools.0", "obj"), ("tools.0.type", "str"), ("tools.0.function", "obj"),
    ("tools.0.function.name", "str"), ("tools.0.function.parameters", "null obj"),
)  # fmt: skip
COMPLETIONS_FIELDS: tuple[Spec, ...] = (
    ("model", "null str"), ("prompt", "str list"), ("max_tokens", "null int", POSITIVE),
    ("temperature", "null int float", TEMPERATURE), ("top_p", "null int float", TOP_P), ("seed", "null int", SEED),
    ("stop", "null str list"), ("stream", "null bool"), ("echo", "null bool"), ("suffix", "any"),
    ("best_of", "null int", ONE), ("logprobs", "null int", (0, 5, True)), ("n", "null int", ONE), ("user", "null str"),
)  # fmt: skip
RESPONSES_FIELDS: tuple[Spec, ...] = (
    ("model", "null str"), ("input", "str list", None, FollowUp.CHAIN),
    ("instructions", "null str", None, FollowUp.CHAIN),
    ("max_output_tokens", "null int", POSITIVE), ("temperature", "null int float", TEMPERATURE),
    ("top_p", "null int float", TOP_P), ("top_logprobs", "null int", (0, 20, True)), ("tools", "null list"),
    ("tool_choice", "null str"), ("parallel_tool_calls", "null bool"), ("metadata", "null obj", None, FollowUp.CHAIN),
)  # fmt: skip
RESPONSES_MORE_FIELDS: tuple[Spec, ...] = (
    ("prompt_cache_key", "null str"), ("user", "null str"), ("safety_identifier", "null str"), ("store", "null bool"),
    ("stream", "null bool"), ("previous_response_id", "null str"), ("conversation", "null str obj"),
    ("context_management", "null list"),
)  # fmt: skip
RESPONSES_MANAGED_FIELDS: tuple[Spec, ...] = (
    ("context_management.0", "obj"), ("context_management.0.type", "str"),
    ("context_management.0.compact_threshold", "int", POSITIVE),
)  # fmt: skip
RESPONSES_LAST_FIELDS: tuple[Spec, ...] = (
    ("truncation", "null str"), ("text", "null obj"), ("background", "null bool"), ("n", "null int", ONE),
)  # fmt: skip
RESPONSES_ITEM_FIELDS: tuple[Spec, ...] = (
    ("input.0", "obj", None, FollowUp.CHAIN), ("input.0.type", "str"), ("input.0.role", "str"),
    ("input.0.content", "str list", None, FollowUp.CHAIN), ("input.0.content.0", "obj"),
    ("input.0.content.0.type", "str"), ("input.0.content.0.text", "str"),
)  # fmt: skip
RESPONSES_CALL_FIELDS: tuple[Spec, ...] = (
    ("input.2.call_id", "str", None, FollowUp.CHAIN), ("input.2.name", "str", None, FollowUp.CHAIN),
    ("input.2.arguments", "str", None, FollowUp.CHAIN), ("input.3.call_id", "str", None, FollowUp.CHAIN),
    ("input.3.output", "str list", None, FollowUp.CHAIN), ("tools.0", "obj"), ("tools.0.type", "str"),
    ("tools.0.name", "str"), ("tools.0.parameters", "null obj"),
)  # fmt: skip
COMPACT_FIELDS: tuple[Spec, ...] = (
    ("input", "str list"), ("keep_tokens", "null int", POSITIVE), ("max_output_tokens", "null int", (1, 16384, True)),
    ("instructions", "null str"), ("stream", "null bool"), ("tools", "null list"),
)  # fmt: skip
CONVERSATION_FIELDS: tuple[Spec, ...] = (
    ("metadata", "null obj"), ("items", "null list"), ("items.0", "obj", None, FollowUp.CONVERSATION),
    ("items.0.content", "str list", None, FollowUp.CONVERSATION),
)  # fmt: skip
TOKENIZE_CHAT_FIELDS: tuple[Spec, ...] = (
    ("messages", "null list"), ("add_generation_prompt", "null bool"), ("tools", "null list"), ("messages.0", "obj"),
    ("messages.0.role", "any"), ("messages.0.content", "any"), ("messages.0.content.0", "any"),
    ("messages.0.content.0.text", "any"),
)  # fmt: skip


def fields() -> list[Field]:
    """Every field the validators read, per route, with the JSON types each takes (`any`: ignored unless it has
    the right type, or passed to the chat template as is)."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    responses_tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    capsule = [{"type": "compaction", "encrypted_content": capsule_of(GOOD_CAPSULE)}, user("Go.")]
    managed = [{"type": "compaction", "compact_threshold": 100_000}]
    conversation = {"metadata": {"k": "v"}, "items": [{"type": "message", "role": "user", "content": "Hello."}]}
    completion = {"max_tokens": 2, "temperature": 0}
    tokenize_chat = {"messages": [user([{"type": "text", "text": "Hello."}])], "add_generation_prompt": True}
    groups: list[tuple[str, Callable[[str], dict[str, Any]], tuple[Spec, ...]]] = [
        (CHAT, chat_base, CHAT_FIELDS),
        (CHAT, lambda m: chat_base(m) | {"logprobs": True}, (("top_logprobs", "null int", (0, 20, True)),)),
        (CHAT, chat_base, CHAT_MORE_FIELDS),
        (CHAT, partial(chat_body, messages=[user([{"type": "text", "text": "Hello."}])]), CHAT_PART_FIELDS),
        (CHAT, partial(chat_body, messages=tool_turns("{}"), tools=[tool]), CHAT_TOOL_FIELDS),
        (COMPLETIONS, lambda m: {"model": m, "prompt": "Hello", **completion}, COMPLETIONS_FIELDS),
        (COMPLETIONS, lambda m: {"model": m, "prompt": [1, 2], **completion},
         (("prompt.0", "int str list", TOKEN_ID),)),
        (RESPONSES, responses_base, RESPONSES_FIELDS),
        (RESPONSES, lambda m: responses_base(m) | {"metadata": {"k": "v"}}, (("metadata.k", "str"),)),
        (RESPONSES, responses_base, RESPONSES_MORE_FIELDS),
        (RESPONSES, partial(responses_body, items="Hello.", context_management=managed), RESPONSES_MANAGED_FIELDS),
        (RESPONSES, responses_base, RESPONSES_LAST_FIELDS),
        (RESPONSES, partial(responses_body, items=[user([{"type": "input_text", "text": "Hello."}])]),
         RESPONSES_ITEM_FIELDS),
        (RESPONSES, partial(responses_body, items=call_items(), tools=[responses_tool]), RESPONSES_CALL_FIELDS),
        (RESPONSES, partial(responses_body, items=capsule), (("input.0.encrypted_content", "str"),)),
        (INPUT_TOKENS, responses_base, (("input", "str list"),)),
        (COMPACT, compact_base, COMPACT_FIELDS),
        (CONVERSATIONS, lambda _: conversation, CONVERSATION_FIELDS),
        ("/v1/conversations/{conversation}", lambda _: conversation, (("metadata", "null obj"),)),
        ("/v1/conversations/{conversation}/items", lambda _: conversation, (("items", "list"),)),
        (TOKENIZE, lambda m: {"model": m, "prompt": "Hello"},
         (("prompt", "null str"), ("add_special_tokens", "null bool"), ("model", "null str"))),
        (TOKENIZE, lambda m: {"model": m, **tokenize_chat}, TOKENIZE_CHAT_FIELDS),
        (DETOKENIZE, lambda m: {"model": m, "tokens": [1, 2]}, (("tokens", "list"), ("tokens.0", "int", TOKEN_ID))),
    ]  # fmt: skip
    return [
        Field(route, path_of(at), types_of(takes), base, *rest)
        for route, base, specs in groups
        for at, takes, *rest in specs
    ]


def path_of(dotted: str) -> tuple[str | int, ...]:
    return tuple(int(step) if step.isdigit() else step for step in dotted.split("."))


def types_of(names: str) -> frozenset[str]:
    return ANY_TYPE if names == "any" else frozenset(names.split())


def with_value(body: dict[str, Any], at: Sequence[str | int], value: object) -> dict[str, Any]:
    """A copy of `body` with the value at path `at` replaced (the containers on the way are copied)."""
    copy: Any = json.loads(json.dumps(body))
    target = copy
    for step in at[:-1]:
        target = target[step]
    target[at[-1]] = value
    return dict(copy)


def wrong_type_cases(model: str) -> list[Case]:
    """Every field, every value of `WRONG_VALUES`: a value of a type the field does not take is a 4xx."""
    cases = []
    for row, value in ((row, value) for row in fields() for value in WRONG_VALUES):
        name, body = f"{row.name} = {json.dumps(value)}", with_value(row.base(model), row.at, value)
        expect = Expect.EITHER if json_type(value) in row.takes else Expect.REFUSED
        cases.append(post("shapes", "wrong type", name, row.route, body, expect=expect, follow_up=row.follow_up))
    return cases


NUMBER_TEXTS = (
    "NaN", "Infinity", "-Infinity", "1e309", "-1e309", "-0", "-0.0", "0", "1e-400", "5e-324", "0.5", "1e2",
    "1.7976931348623157e308", "-1", "2147483648", "9223372036854775807", "9223372036854775808",
    "-9223372036854775809", "18446744073709551615", "18446744073709551616", "1" + "0" * 5000,
)  # fmt: skip


def number(text: str, integers: bool) -> float | None:
    """`text` parsed as the server parses JSON, when it is a number (an integer, if `integers`)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integers else int | float):
        return None
    return value


def number_cases(model: str) -> list[Case]:
    """Numbers at and past every edge, raw JSON text, in every numeric field."""
    cases = []
    for row in (row for row in fields() if row.numbers is not None):
        low, high, integers = row.numbers or (0, 0, False)
        for text in NUMBER_TEXTS:
            shown, value = text if len(text) < 30 else f"1e{len(text) - 1} written out", number(text, integers)
            expect = Expect.EITHER if value is not None and low <= value <= high else Expect.REFUSED
            body = with_value(row.base(model), row.at, Raw(text))
            cases.append(post("shapes", "numbers", f"{row.name} = {shown}", row.route, body, expect=expect))
    return cases


VOCABULARY = 49152  # the tiny llama's (SmolLM2's tokenizer)
# field -> (low, high, integers, low end open): the ranges docs/api.md gives
SAMPLING_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, False, False), "top_p": (0.0, 1.0, False, True), "top_k": (-1, 1_000_000, True, False),
    "min_p": (0.0, 1.0, False, False), "presence_penalty": (-2.0, 2.0, False, False),
    "frequency_penalty": (-2.0, 2.0, False, False), "repetition_penalty": (0.01, 10.0, False, False),
    "seed": (0, 2**63 - 1, True, False),
}  # fmt: skip
EDGE_TEXTS = (
    "0", "-0.0", "1", "-1", "0.5", "2", "10", str(VOCABULARY - 1), str(VOCABULARY), str(VOCABULARY + 1), "1000000",
    "1000001", "1e-45", "1e-300", "5e-324", "2.2250738585072014e-308", "1.7976931348623157e308",
    "-1.7976931348623157e308", "1e309", "NaN", "Infinity", '"NaN"', '"nan"', '"Infinity"', "9223372036854775807",
    "9223372036854775808",
)  # fmt: skip
SAMPLING_BASES: dict[str, tuple[str, dict[str, object]]] = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1.0}),
    "completions": (COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0}),
    "responses": (RESPONSES, {"input": "Hi", "max_output_tokens": 16, "temperature": 1.0, "store": False}),
}


def sampling_expectation(text: str, field: str) -> Expect:
    """OK where the value lies in the field's documented range (as the server parses JSON), else REFUSED."""
    low, high, integers, open_low = SAMPLING_RANGES[field]
    if (value := number(text, integers)) is None:
        return Expect.REFUSED
    return Expect.OK if (low < value if open_low else low <= value) and value <= high else Expect.REFUSED


def sampling_cases(model: str) -> list[Case]:
    cases = []
    for route, (path, base) in SAMPLING_BASES.items():
        for field, text in ((field, text) for field in SAMPLING_RANGES for text in EDGE_TEXTS):
            body = {"model": model, **base, "temperature": 1.0, field: Raw(text)}
            name, expect = f"{route} {field} = {text}", sampling_expectation(text, field)
            cases.append(
                post("sampling", f"{route} {field}", name, path, body, expect=expect, follow_up=FollowUp.ORDINARY)
            )
    return cases
