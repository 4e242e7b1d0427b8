"""A body checked against its route's schema: one compiled Draft 2020-12 validator per schema (jsonschema-rs), and a
failure told as the API's 400, its `param` the path of what failed (`messages[0].content`).

The validator stops at its first failure. A union's failure is followed into the branch the value meant (its
`x-tag`, else its JSON type and the branch's `const` properties), and within it the failure first in the body's own
order is told. `x-error` words a refusal and says where it is reported (see the package's docstring); any other
failure is worded from the schema itself ("must be an integer from 0 to 20").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jsonschema_rs
import orjson

from courier.http.errors import ApiError
from courier.http.schemas.shared import ERROR, TAG, Schema

Path = tuple[str | int, ...]
_UNIONS = ("oneOf", "anyOf")
_SUBSCHEMA_PAIRS = ("properties", "patternProperties", "oneOf", "anyOf", "allOf", "prefixItems")
_ENTERING_AN_ITEM = frozenset({"properties", "patternProperties", "additionalProperties", "items", "prefixItems"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_validators: dict[int, tuple[Schema, jsonschema_rs.Validator]] = {}


def check(schema: Schema, body: Any) -> None:
    """Refuse `body` (a 400 naming the field) unless `schema` accepts it."""
    validator = _validator(schema)
    if validator.is_valid(body):
        return
    param, message = _refusal(schema, body, _first(validator.iter_errors(body)))
    raise ApiError.invalid(message, param=param or None)


def _first(errors: Iterator[jsonschema_rs.ValidationError]) -> jsonschema_rs.ValidationError:
    """The validator's first failure, unless a key's name is refused where a value under it failed: a name is read
    before its value (`chat_template_kwargs: {"messages": []}` is refused for its name)."""
    found = list(errors)
    first = found[0]
    inside = tuple(first.instance_path)
    for error in found[1:]:
        where = tuple(error.instance_path)
        if error.kind.name == "propertyNames" and len(where) < len(inside) and inside[: len(where)] == where:
            return error
    return first


def _validator(schema: Schema) -> jsonschema_rs.Validator:
    entry = _validators.get(id(schema))
    if entry is None:  # the schema is kept with its validator, so its id is never reused while cached
        entry = _validators[id(schema)] = (schema, jsonschema_rs.Draft202012Validator(schema))
    return entry[1]


def _refusal(root: Schema, body: Any, error: jsonschema_rs.ValidationError) -> tuple[str, str]:
    chain = _chain(root, error)
    node, path = chain[-1]
    keyword = error.kind.name
    if keyword in _UNIONS:
        instance = _at(body, path)
        branch = _branch(node, instance)
        branches: Sequence[Sequence[jsonschema_rs.ValidationError]] = getattr(error.kind, "context", None) or []
        if branch is not None and branch < len(branches) and branches[branch]:
            return _refusal(root, body, min(branches[branch], key=lambda inner: _position(body, inner)))
        return _mismatch(chain, instance)
    reporter = (node, path) if ERROR in node else _capturing(chain)
    if reporter is not None:
        return _param(reporter[1]), f"'{_param(reporter[1])}' {reporter[0][ERROR]}"
    if keyword == "required":
        param = _param((*path, str(getattr(error.kind, "property", ""))))
        return param, f"'{param}' is required"
    if keyword == "propertyNames":  # `node` is the schema of the keys
        key = getattr(getattr(error.kind, "error", None), "instance", "")
        return _param((*path, str(key))), f"'{_param(path)}' keys must be {_described({'type': 'string', **node})}"
    param = _param(path)
    return param, f"'{param}' {_wording(keyword, node, _at(body, path))}"


def _chain(root: Schema, error: jsonschema_rs.ValidationError) -> list[tuple[Schema, Path]]:
    """The schema nodes from the root to the failing keyword's, each with the body's path it applies to."""
    keys, instance_path = list(error.schema_path), tuple(error.instance_path)
    chain: list[tuple[Schema, Path]] = [(root, ())]
    node, consumed, index = root, 0, 0
    while index < len(keys):
        key = str(keys[index])
        paired = key in _SUBSCHEMA_PAIRS and index + 1 < len(keys)
        if paired and isinstance(node.get(key), dict | list):
            node, step = node[key][keys[index + 1]], 2
        elif key in ("additionalProperties", "items", "propertyNames", "not") and isinstance(node.get(key), dict):
            node, step = node[key], 1
        else:
            break
        consumed += key in _ENTERING_AN_ITEM
        chain.append((node, instance_path[:consumed]))
        index += step
    return chain


def _capturing(chain: list[tuple[Schema, Path]]) -> tuple[Schema, Path] | None:
    """The deepest node with an `x-error` above the failure; a union's words only a value none of its branches takes,
    so the unions passed through (whose branch was taken) are skipped."""
    for node, path in reversed(chain[:-1]):
        if ERROR in node and not any(union in node for union in _UNIONS):
            return node, path
    return None


def _mismatch(chain: list[tuple[Schema, Path]], instance: Any) -> tuple[str, str]:
    """A value no branch of the union at the end of `chain` takes: worded by the union's `x-error`, else an
    enclosing one's, else from the branches; told at the union's tag when it has one and the value is an object."""
    node, path = chain[-1]
    tag = node.get(TAG)
    if tag is not None and isinstance(instance, dict):
        param = _param((*path, tag))
        return param, f"'{param}' {node[ERROR] if ERROR in node else _tag_wording(node, tag, instance)}"
    reporter = (node, path) if ERROR in node else _capturing(chain)
    if reporter is not None:
        return _param(reporter[1]), f"'{_param(reporter[1])}' {_filled(reporter[0][ERROR], instance)}"
    return _param(path), f"'{_param(path)}' must be {_described(node)}"


def _filled(wording: str, instance: Any) -> str:
    """An `x-error` with its `{type}` replaced by the refused object's own `type` (what the client asked for)."""
    kind = instance.get("type") if isinstance(instance, dict) else None
    return wording.replace("{type}", _shown(kind))


def _branch(node: Schema, instance: Any) -> int | None:
    """Which branch of a union `instance` meant (None: none)."""
    tag = node.get(TAG)
    for index, branch in enumerate(_branches(node)):
        if not _of_type(branch, instance):
            continue
        if not isinstance(instance, dict):
            return index
        properties, required = branch.get("properties", {}), branch.get("required", ())
        tags = [tag] if tag is not None else [name for name, schema in properties.items() if "const" in schema]
        if all(_tag_admits(properties.get(name, {}), name in required, name, instance) for name in tags):
            return index
    return None


def _tag_admits(schema: Schema, required: bool, name: str, instance: dict[str, Any]) -> bool:
    if name not in instance:
        return not required
    allowed = [schema["const"]] if "const" in schema else schema.get("enum")
    return allowed is None or any(_same(instance[name], value) for value in allowed)


def _same(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


def _branches(node: Schema) -> list[Schema]:
    return list(node.get("oneOf") or node.get("anyOf") or [])


def _types(node: Schema) -> list[str]:
    types = node.get("type")
    if types is None:
        return []
    return [types] if isinstance(types, str) else list(types)


def _of_type(node: Schema, instance: Any) -> bool:
    types = _types(node)
    return not types or any(_is(kind, instance) for kind in types)


def _is(kind: str, value: Any) -> bool:
    if kind in ("integer", "number") and (isinstance(value, bool) or not isinstance(value, int | float)):
        return False
    checks = {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) or (isinstance(value, float) and value.is_integer()),
        "number": True,
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }
    return checks.get(kind, False)


def _position(body: Any, error: jsonschema_rs.ValidationError) -> tuple[int, ...]:
    """Where a failure is in the body, in the body's own order (a missing property after those present)."""
    position: list[int] = []
    value = body
    for step in error.instance_path:
        if isinstance(value, dict):
            keys = list(value)
            position.append(keys.index(step) if step in keys else len(keys))
            value = value.get(str(step))
        elif isinstance(value, list) and isinstance(step, int):
            position.append(step)
            value = value[step] if step < len(value) else None
    if isinstance(value, dict) and error.kind.name == "required":
        position.append(len(value))
    return tuple(position)


def _at(body: Any, path: Path) -> Any:
    value = body
    for step in path:
        value = value[step]
    return value


def _param(path: Path) -> str:
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


def _wording(keyword: str, node: Schema, value: Any) -> str:
    if keyword in ("enum", "const"):
        return f"must be {_described(node)}, not {_shown(value)}"
    if keyword == "maxProperties":
        return f"holds at most {node['maxProperties']} entries"
    if keyword == "minProperties":
        return f"must hold at least {node['minProperties']} entries"
    if keyword in ("not", "false", "additionalProperties"):
        return "is not accepted"
    if keyword in _BOUNDS and "number" in _types(node) and "maximum" in node:  # a number, out of its interval
        return "must be " + _range("number", node).removeprefix("a number ")
    return f"must be {_described(node)}"


def _tag_wording(node: Schema, tag: str, instance: dict[str, Any]) -> str:
    values: list[str] = []
    for branch in _branches(node):
        schema = branch.get("properties", {}).get(tag, {})
        for value in [schema["const"]] if "const" in schema else schema.get("enum", []):
            if value is not None and _plain(value) not in values:
                values.append(_plain(value))
    found = f", not {_shown(instance[tag])}" if tag in instance else ""
    return f"must be one of {', '.join(values)}{found}"


def _described(node: Schema) -> str:
    """What `node` accepts, as a phrase ("an integer from 0 to 20", "a string or a list of at most 4 items")."""
    if "enum" in node:
        return "one of " + ", ".join(_plain(value) for value in node["enum"] if value is not None)
    if "const" in node:
        return _shown(node["const"])
    if any(union in node for union in _UNIONS):
        phrases = [_described(branch) for branch in _branches(node) if _types(branch) != ["null"]]
        return " or ".join(dict.fromkeys(phrases)) or "a valid value"
    phrases = [_described_type(kind, node) for kind in _types(node) if kind != "null"]
    return " or ".join(phrases) or "a valid value"


def _described_type(kind: str, node: Schema) -> str:
    if kind in ("integer", "number"):
        return _range(kind, node)
    if kind == "string":
        phrase = "a non-empty string" if node.get("minLength") == 1 else "a string"
        if "maxLength" in node:
            phrase += f" of at most {node['maxLength']} characters"
        return phrase + (f" matching {node['pattern']}" if "pattern" in node else "")
    if kind == "array":
        phrase = "a non-empty list" if node.get("minItems") == 1 else "a list"
        return phrase + (f" of at most {node['maxItems']} items" if "maxItems" in node else "")
    if kind == "object":
        return "an object" + (f" of at most {node['maxProperties']} entries" if "maxProperties" in node else "")
    return {"boolean": "a boolean"}.get(kind, kind)


def _range(kind: str, node: Schema) -> str:
    noun = "an integer" if kind == "integer" else "a number"
    low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum")
    if kind == "integer" and low is not None and high is not None:
        return f"{noun} from {_plain(low)} to {_plain(high)}"
    if kind == "integer" and low == 1:
        return "a positive integer"
    if low is not None and high is not None:
        opening = "(" if "exclusiveMinimum" in node else "["
        return f"{noun} in {opening}{_plain(low)}, {_plain(high)}]"
    if low is not None:
        return f"{noun} of at least {_plain(low)}"
    return f"{noun} of at most {_plain(high)}" if high is not None else noun


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else _shown(value)


def _shown(value: Any) -> str:
    text = orjson.dumps(value).decode() if _jsonable(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except TypeError:
        return False
    return True
