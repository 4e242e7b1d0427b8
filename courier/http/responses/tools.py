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
- Any other type is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from courier.conversation.ids import new_id
from courier.core.tools.calls import ToolCall
from courier.http.errors import ApiError
from courier.storage.records import JsonObject

# Tools that OpenAI's servers run, or built-in client tools with call items of their own.
NOT_OFFERED = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
        "local_shell",
        "shell",
        "apply_patch",
    }
)
CUSTOM_SYNTAXES = ("lark", "regex")
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


def responses_tools(value: Any) -> ResponsesTools:
    """`tools` read as above; each refusal a 400 naming the tool."""
    if value is None:
        return ResponsesTools()
    if not isinstance(value, list):
        raise ApiError.invalid("'tools' must be a list", param="tools")
    offered: list[JsonObject] = []
    names: dict[str, OfferedTool] = {}
    not_offered: list[str] = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        kind = _kind(tool, param)
        if kind in NOT_OFFERED:
            not_offered.append(kind)
        elif kind == "namespace":
            namespace = _name(tool, param)
            members = tool.get("tools")
            if not isinstance(members, list) or not members:
                raise ApiError.invalid(f"{param}.tools must be a non-empty list of tools", param=f"{param}.tools")
            for position, member in enumerate(members):
                where = f"{param}.tools[{position}]"
                if _kind(member, where) not in ("function", "custom"):
                    message = f"{where}: a namespace holds 'function' and 'custom' tools, not {member.get('type')!r}"
                    raise ApiError.invalid(message, param=f"{where}.type")
                _offer(member, where, namespace, offered, names)
        elif kind in ("function", "custom"):
            _offer(tool, param, None, offered, names)
        else:
            message = (
                f"{param}: tools of type {kind!r} are not supported; 'function', 'custom' and 'namespace' tools are "
                f"offered to the model, and hosted tools ({', '.join(sorted(NOT_OFFERED))}) are left out"
            )
            raise ApiError.invalid(message, param=f"{param}.type")
    return ResponsesTools(offered=tuple(offered), not_offered=tuple(not_offered), by_model_name=names)


def _offer(
    tool: Mapping[str, Any],
    param: str,
    namespace: str | None,
    offered: list[JsonObject],
    names: dict[str, OfferedTool],
) -> None:
    name = _name(tool, param)
    custom = tool.get("type") == "custom"
    model_name = qualified(name, namespace)
    if model_name in names:
        raise ApiError.invalid(f"{param}: more than one tool is named {model_name!r}", param=f"{param}.name")
    names[model_name] = OfferedTool(model_name=model_name, name=name, namespace=namespace, custom=custom)
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError.invalid(f"{param}.description must be a string", param=f"{param}.description")
    if custom:
        offered.append(_custom(tool, param, model_name))
        return
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError.invalid(f"{param}.parameters must be an object", param=f"{param}.parameters")
    flat: JsonObject = {"type": "function", "name": model_name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            flat[key] = tool[key]
    offered.append(flat)


def _custom(tool: Mapping[str, Any], param: str, model_name: str) -> JsonObject:
    """A custom tool: `format` absent or `{"type": "text"}` (any text), or `{"type": "grammar", "syntax": "lark" |
    "regex", "definition"}`."""
    flat: JsonObject = {"type": "custom", "name": model_name}
    if isinstance(tool.get("description"), str):
        flat["description"] = tool["description"]
    shape = tool.get("format")
    if shape is None or (isinstance(shape, dict) and shape.get("type") == "text"):
        return flat
    where = f"{param}.format"
    if not isinstance(shape, dict) or shape.get("type") != "grammar":
        raise ApiError.invalid(f"{where} must be {{'type': 'text'}} or {{'type': 'grammar', ...}}", param=where)
    syntax, definition = shape.get("syntax"), shape.get("definition")
    if syntax not in CUSTOM_SYNTAXES:
        raise ApiError.invalid(f"{where}.syntax must be 'lark' or 'regex', not {syntax!r}", param=f"{where}.syntax")
    if not isinstance(definition, str) or not definition.strip():
        raise ApiError.invalid(f"{where}.definition must be a non-empty string", param=f"{where}.definition")
    flat["format"] = {"type": "grammar", "syntax": syntax, "definition": definition}
    return flat


def forced_tool(choice: Any, tools: ResponsesTools) -> Any:
    """`tool_choice` in the terms the output spec reads: a custom or namespaced tool named by the name the model
    knows it by, `allowed_tools` refused; a hosted tool forced is refused (it is never offered)."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            return choice  # the output spec names what is wrong
        namespace = choice.get("namespace")
        model_name = qualified(name, namespace if isinstance(namespace, str) and namespace else None)
        if model_name not in tools.by_model_name:
            matches = [tool.model_name for tool in tools.by_model_name.values() if tool.name == name]
            model_name = matches[0] if len(matches) == 1 else model_name
        return {"type": "function", "name": model_name}
    if kind in NOT_OFFERED or kind == "mcp":
        message = (
            f"'tool_choice' forces the hosted tool {kind!r}, which this server does not run (hosted tools are left out "
            "of what the model is offered); force a function or custom tool, or use 'auto'"
        )
        raise ApiError.invalid(message, param="tool_choice")
    if kind == "allowed_tools":
        raise ApiError.invalid("'tool_choice' of type 'allowed_tools' is not supported", param="tool_choice")
    return choice


def _kind(tool: Any, param: str) -> str:
    if not isinstance(tool, dict):
        raise ApiError.invalid(f"{param} must be an object", param=param)
    kind = tool.get("type")
    if not isinstance(kind, str):
        raise ApiError.invalid(f"{param}.type must be a string", param=f"{param}.type")
    return kind


def _name(tool: Mapping[str, Any], param: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError.invalid(f"{param}.name must be a non-empty string", param=f"{param}.name")
    return name
