"""The Responses API's tools as agents send them: what the model is offered, and how its calls come back.

- `function` tools are offered as they are.
- `namespace` tools group functions (and custom tools) under a name: each is offered to the model as
  `<namespace>.<name>`, and its calls come back under the names the API defines (`name`, plus `namespace`).
- `custom` tools take free-form text instead of JSON arguments, optionally constrained by a `grammar` (Lark or
  regex syntax, both of which llguidance speaks); their calls come back as `custom_tool_call` items.
- Hosted tools, which OpenAI's servers run (`web_search`, `file_search`, `code_interpreter`, `image_generation`,
  `computer_use_preview`, remote `mcp`, ...), and the built-in client tools whose call items this server does not
  produce (`local_shell`, `shell`, `apply_patch`), are not offered to the model: agents declare them on every
  request whatever the server, and a declared capability is not a requirement. The request's span lists them
  (`courier.tools.not_offered`). A `tool_choice` that forces one of them is refused: that cannot be honoured.

The shapes, and the types taken, are the schema's (`schemas/responses.py`, checked before anything here reads them);
what is left here is a name offered twice, and each tool as the model sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from courier.conversation.ids import new_id
from courier.core.tools.calls import ToolCall
from courier.http.errors import ApiError
from courier.http.schemas.responses import NOT_OFFERED
from courier.storage.records import JsonObject

NAMESPACE_SEPARATOR = "."


@dataclass(frozen=True, slots=True, kw_only=True)
class OfferedTool:
    """One tool as the model sees it (`model_name`), and as the API names it."""

    model_name: str
    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesTools:
    offered: tuple[JsonObject, ...] = ()  # flat function and custom tools, named as the model sees them
    not_offered: tuple[str, ...] = ()  # the tool types left out
    by_model_name: Mapping[str, OfferedTool] = field(default_factory=dict)

    def call_item(self, call: ToolCall) -> JsonObject:
        """A call the model made, as the output item the API defines for its tool."""
        tool = self.by_model_name.get(call.name) or OfferedTool(model_name=call.name, name=call.name)
        item: JsonObject = {"id": new_id("ctc" if tool.custom else "fc"), "type": "", "status": "completed"}
        if tool.custom:
            item.update(type="custom_tool_call", call_id=call.id, name=tool.name, input=call.arguments)
        else:
            item.update(type="function_call", call_id=call.id, name=tool.name, arguments=call.arguments)
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        return item


def qualified(name: str, namespace: str | None) -> str:
    """The name the model knows a tool by."""
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def responses_tools(value: list[Mapping[str, Any]] | None) -> ResponsesTools:
    """`tools`, which the schema has checked, read as above; a name offered twice is a 400 naming the tool."""
    offered: list[JsonObject] = []
    names: dict[str, OfferedTool] = {}
    not_offered: list[str] = []
    for index, tool in enumerate(value or ()):
        param = f"tools[{index}]"
        kind = tool["type"]
        if kind in NOT_OFFERED:
            not_offered.append(kind)
        elif kind == "namespace":
            for position, member in enumerate(tool["tools"]):
                _offer(member, f"{param}.tools[{position}]", tool["name"], offered, names)
        else:
            _offer(tool, param, None, offered, names)
    return ResponsesTools(offered=tuple(offered), not_offered=tuple(not_offered), by_model_name=names)


def _offer(
    tool: Mapping[str, Any],
    param: str,
    namespace: str | None,
    offered: list[JsonObject],
    names: dict[str, OfferedTool],
) -> None:
    name = tool["name"]
    custom = tool["type"] == "custom"
    model_name = qualified(name, namespace)
    if model_name in names:
        raise ApiError.invalid(f"{param}: more than one tool is named {model_name!r}", param=f"{param}.name")
    names[model_name] = OfferedTool(model_name=model_name, name=name, namespace=namespace, custom=custom)
    flat: JsonObject = {"type": tool["type"], "name": model_name}
    for key in ("description",) if custom else ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            flat[key] = tool[key]
    shape = tool.get("format") if custom else None
    if shape is not None and shape["type"] == "grammar":  # absent or {"type": "text"}: any text
        flat["format"] = {"type": "grammar", "syntax": shape["syntax"], "definition": shape["definition"]}
    offered.append(flat)


def forced_tool(choice: str | dict[str, Any] | None, tools: ResponsesTools) -> str | dict[str, Any] | None:
    """`tool_choice` in the terms the output spec reads: a custom or namespaced tool named by the name the model
    knows it by (its namespace may be left out when the name is unique)."""
    if not isinstance(choice, dict):
        return choice
    name = choice["name"]
    model_name = qualified(name, choice.get("namespace") or None)
    if model_name not in tools.by_model_name:
        matches = [tool.model_name for tool in tools.by_model_name.values() if tool.name == name]
        model_name = matches[0] if len(matches) == 1 else model_name
    return {"type": "function", "name": model_name}
