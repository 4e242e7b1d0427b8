"""Tool calling for a model whose chat template knows no tools ("generic" mode, as llama.cpp has).

The tools are described in the system message, in the words of the Hermes / Qwen2.5 templates, and the model is
asked to write each call as `<tool_call>` + a JSON object {"name", "arguments"} + `</tool_call>`: the same
`json_tools` format a native template uses, so the same splitter, parser and call grammar serve both. History the
template cannot render becomes text it can: an assistant message's tool calls join its content in that format, and
tool results become a user message of `<tool_response>` blocks (roles every template accepts; a result's image parts
stay parts inside its block, so a vision template writes their placeholders there). The rendering is a
pure function of the messages, so a conversation's prompt stays an exact prefix of its next turn's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from courier.core.json_text import json_object
from courier.core.tools import custom as custom_tools

START = "<tool_call>"
END = "</tool_call>"

_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def parse_call(text: str, tools: Any = None) -> Any:
    """A generic call's JSON (the signature of mlx-lm's tool parsers)."""
    return json.loads(text.strip())


def needs_rendering(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` as a template without tool support renders them: tools described, calls and results as text."""
    return render_with_sources(messages, tools)[0]


def render_with_sources(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[int | None]]:
    """`render`, and for each rendered message the index of the message it comes from (the first of merged tool
    results; None for a system message added to describe the tools), so a failure can name the client's message."""
    rendered: list[dict[str, Any]] = []
    sources: list[int | None] = []
    merging = False  # the last rendered message gathers tool results
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            block = _response_block(message.get("content"))
            if merging:
                rendered[-1]["content"] = _joined(rendered[-1]["content"], "\n", block)
            else:
                rendered.append({"role": "user", "content": block})
                sources.append(index)
            merging = True
            continue
        merging = False
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            content = _text(message.get("content"))
            rendered.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            rendered.append(dict(message))
        sources.append(index)
    if tools:
        described = _INTRO + "\n".join(json.dumps(dict(tool), ensure_ascii=False) for tool in tools) + _OUTRO
        if rendered and rendered[0].get("role") == "system" and isinstance(rendered[0].get("content"), str):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
        else:
            rendered.insert(0, {"role": "system", "content": described})
            sources.insert(0, None)
    return rendered, sources


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    if call.get(custom_tools.CUSTOM_CALL_KEY):  # a custom tool's raw input, as the model writes it
        return f"{START}\n{custom_tools.call_text(str(function.get('name')), str(function.get('arguments')))}\n{END}"
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        parsed = json_object(arguments)  # within the depth limit, else the string as it came
        arguments = parsed if parsed is not None else arguments
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def _response_block(content: Any) -> str | list[dict[str, Any]]:
    """A tool result as a `<tool_response>` block: text, or parts when the result holds images (a screenshot), so
    the template still writes each image's placeholder inside the block."""
    if not _has_images(content):
        return f"<tool_response>\n{_text(content)}\n</tool_response>"
    return _joined("<tool_response>\n", content, "\n</tool_response>")


def _joined(*contents: Any) -> str | list[dict[str, Any]]:
    """Contents (strings or text and image parts) one after the other: a string while there is no image."""
    if not any(_has_images(content) for content in contents):
        return "".join(_text(content) for content in contents)
    parts: list[dict[str, Any]] = []
    for content in contents:
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part.get("type") == "text" and parts and parts[-1].get("type") == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + part.get("text", "")}
            else:
                parts.append(dict(part))
    return parts


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(part, Mapping) and part.get("type") != "text" for part in content
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return str(content)
