"""Building blocks the routes' schemas share: nullable values, refused fields, unions, the sampling fields."""

from __future__ import annotations

from typing import Any

from courier.core.template_options import REASONING_EFFORTS, RESERVED

Schema = dict[str, Any]

ERROR = "x-error"  # the sentence a refusal of the value carries (see the package's docstring)
TAG = "x-tag"  # the property that picks a union's branch

STRING: Schema = {"type": "string"}
NAME: Schema = {"type": "string", "minLength": 1}
OBJECT: Schema = {"type": "object"}
BOOLEAN: Schema = {"type": "boolean"}
# Any count of tokens: past it no context holds the request, and a float that large is no integer a reader can use.
MAX_TOKEN_COUNT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1_000_000
# A penalty divides (or multiplies) logits: outside [1/100, 10] it only overflows them or turns the reply to noise.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_STRING = 1024


def nullable(schema: Schema) -> Schema:
    """`schema`, or null: every reader takes a null field as an absent one."""
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if "const" in schema:
        rest = {key: value for key, value in schema.items() if key != "const"}
        return {"enum": [schema["const"], None], **rest}
    for union in ("oneOf", "anyOf"):
        if union in schema:
            return {**schema, union: [*schema[union], {"type": "null"}]}
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return {**schema, "type": [*types, "null"]}


def integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    """An integer (JSON Schema's: 2.0 is one; readers take `int()` of it) within the bounds given."""
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(minimum: float, maximum: float, *, open_low: bool = False) -> Schema:
    low = "exclusiveMinimum" if open_low else "minimum"
    return {"type": "number", low: minimum, "maximum": maximum}


def refused(why: str, *harmless: Any) -> Schema:
    """A field the API defines for what this server cannot do: null, or one of `harmless` (values that ask for
    nothing beyond what it does anyway), is taken; any other value is refused, `why` completing "'<field>' ..."."""
    if not harmless:
        return {"type": "null", ERROR: why}
    return {"enum": [*harmless, None], ERROR: why}


def union(*branches: Schema, tag: str | None = None, error: str | None = None, whole: bool = False) -> Schema:
    """One of `branches`. `tag`: the property that picks the branch; `error`: the wording of a value none takes
    (`whole`: of any failure inside a branch too, every branch reporting at the union)."""
    if whole and error is not None:
        branches = tuple({**branch, ERROR: error} for branch in branches)
    schema: Schema = {"oneOf": list(branches)}
    if tag is not None:
        schema[TAG] = tag
    if error is not None:
        schema[ERROR] = error
    return schema


def variant(kind: str, *required: str, tag: str = "type", **properties: Schema) -> Schema:
    """An object whose `tag` is `kind` (a union's branch), with `required` properties besides the tag."""
    return {
        "type": "object",
        "required": [tag, *required],
        "properties": {tag: {"const": kind}, **properties},
    }


def with_error(schema: Schema, error: str) -> Schema:
    return {**schema, ERROR: error}


# An image part's `detail`: every image reaches the model as its processor takes it, at the most detail it has.
IMAGE_DETAIL = refused(
    "other than 'auto' or 'high' cannot be honoured: an image reaches the model at the resolution its processor takes "
    "(downscale the image to spend fewer tokens on it)",
    "auto",
    "high",
)
TOKENS = nullable(integer(1, MAX_TOKEN_COUNT))
SESSION = nullable(STRING)  # prompt_cache_key, user, safety_identifier
# How long the model stays loaded after the request (Ollama's field): seconds, or a duration such as "5m" (the
# duration's own grammar is `core/served_models/residency.py`'s).
KEEP_ALIVE: Schema = {"type": ["number", "string", "null"]}
MODEL = nullable(STRING)
OPTIONAL_BOOLEAN = nullable(BOOLEAN)
TOP_LOGPROBS = nullable(integer(0, MAX_TOP_LOGPROBS))
STOP = {
    "type": ["string", "array", "null"],
    "items": STRING,
    "maxItems": MAX_STOP_SEQUENCES,
    ERROR: f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings",
}
METADATA = nullable(
    {
        "type": "object",
        "maxProperties": MAX_METADATA_ENTRIES,
        "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
    }
)
LOGIT_BIAS = nullable(
    {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,12}$"},
        "additionalProperties": number(-100, 100),
        ERROR: f"must be an object of token ids (as strings) to numbers in [-100, 100], at most {MAX_LOGIT_BIAS}",
    }
)
REASONING_EFFORT = nullable({"enum": list(REASONING_EFFORTS)})
CHAT_TEMPLATE_KWARGS = nullable(
    {
        "type": "object",
        "maxProperties": MAX_TEMPLATE_KWARGS,
        "propertyNames": {
            "pattern": r"^[^\W\d]\w*$",
            "not": {"enum": sorted(RESERVED)},
            ERROR: f"names must be plain identifiers the renderer does not set itself ({', '.join(sorted(RESERVED))})",
        },
        "additionalProperties": {
            "type": ["string", "number", "boolean", "null"],
            "maxLength": MAX_TEMPLATE_STRING,
        },
    }
)
STREAM_OPTIONS = nullable(
    {
        "type": "object",
        "properties": {
            "include_usage": OPTIONAL_BOOLEAN,
            "include_obfuscation": refused("true is not supported: stream events carry no padding", False),
        },
    }
)
# The sampling fields chat, completions and (as extensions) the Responses API share; `max_tokens` is each route's.
SAMPLING: dict[str, Schema] = {
    "temperature": nullable(number(0, MAX_TEMPERATURE)),
    "top_p": nullable(number(0, 1, open_low=True)),
    "seed": nullable(integer(0, MAX_SEED)),
    "stop": STOP,
    "top_k": nullable(integer(-1, MAX_TOP_K)),  # -1 or 0: off (vLLM's -1 too)
    "min_p": nullable(number(0, 1)),
    "presence_penalty": nullable(number(-2, 2)),
    "frequency_penalty": nullable(number(-2, 2)),
    "repetition_penalty": nullable(number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)),
    "logit_bias": LOGIT_BIAS,
}

# Fields several routes refuse alike.
SERVICE_TIER = refused("other than 'auto' or 'default' cannot be honoured: this server has one tier", "auto", "default")
PROMPT_CACHE_RETENTION = refused(
    "other than 'in_memory' cannot be honoured: the prompt cache lives in memory (--snapshot-ttl sets how long)",
    "in_memory",
)
PROMPT_CACHE_OPTIONS = refused("is not supported; --snapshot-ttl sets how long state is kept")
MODERATION = refused("is not supported: this server runs no moderation model")
IMAGE_OPTIONS = refused("options are not supported: images are read at the size the model's processor takes")
