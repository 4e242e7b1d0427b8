"""Custom tools (OpenAI's free-form tools): calls whose input is plain text, not JSON arguments.

In a `json_tools` format (the generic one, Hermes, Qwen) a custom call is written between the same markers as a
function call, its header the JSON `{"name": ...}` alone on the first line and its input, verbatim, on the lines
after it:

    <tool_call>
    {"name": "apply_patch"}
    *** Begin Patch
    ...
    </tool_call>

so text a model would find hard to escape (a patch, a program) needs no escaping, and a grammar (Lark or regex,
`grammar/constraint.py`) can constrain the input itself. The newline before the end marker belongs to the format,
not the input. The model is told so in the tool's description (`described`); history renders a custom call back the
same way (`call_text`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

# Marks a chat template tool call that is a custom tool's (its `arguments` are the raw input).
CUSTOM_CALL_KEY = "custom_input"


def header(name: str) -> str:
    return json.dumps({"name": name}, ensure_ascii=False)


def call_text(name: str, text: str) -> str:
    """The body of a custom call between the format's markers, without the newlines around it."""
    return f"{header(name)}\n{text}"


def described(tool: Mapping[str, Any]) -> str:
    """A custom tool's description for the model: its own, then how to call it, then its grammar if it has one."""
    name = str(tool.get("name"))
    how = (
        f"This tool takes free-form text, not JSON arguments: write its call with {header(name)} alone on the first "
        "line inside the tool call, then the text itself, verbatim, on the lines after it."
    )
    shape = tool.get("format")
    if isinstance(shape, Mapping) and shape.get("type") == "grammar":
        how += f"\nThe text must match this {shape.get('syntax')} grammar:\n{shape.get('definition')}"
    own = tool.get("description")
    return f"{own}\n\n{how}" if isinstance(own, str) and own else how


def parse_call(text: str, names: Collection[str]) -> tuple[str, str] | None:
    """(name, input) when `text`, the raw text between the markers, is a call to one of the custom tools `names`;
    None for anything else (a function call, or text that is no call)."""
    body = text.lstrip()
    try:
        parsed, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or set(parsed) != {"name"} or parsed["name"] not in names:
        return None
    rest = body[end:]
    rest = rest.removeprefix("\n")
    return str(parsed["name"]), rest.removesuffix("\n")
