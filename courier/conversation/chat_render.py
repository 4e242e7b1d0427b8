"""Items as the chat template's messages: the one translation every Responses turn renders through.

A new turn, the token count of `/v1/responses/input_tokens`, a compaction's
counts and the idle warm-ups all render through `chat_messages` (a warm-up extends
a turn's render with `extend_messages`), which is what makes a stored chain's
prompt an exact prefix of its next turn's. `template_tool_call` is the one shape of
a tool call in a chat template's assistant message, for Chat Completions too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from courier.conversation.chat_content import IMAGE_PART, chat_content, text_part
from courier.conversation.items import reasoning_text
from courier.core.tools import custom as custom_tools
from courier.core.tools.calls import json_arguments
from courier.storage.records import JsonObject


def template_tool_call(call_id: str | None, name: str, arguments: str | dict[str, Any]) -> JsonObject:
    """A tool call as chat templates expect it: arguments as a mapping when they are JSON (as the model saw them in
    training), else the string."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json_arguments(arguments)}}


def assistant_message(content: str, calls: Sequence[JsonObject]) -> JsonObject:
    """The assistant's reply as a chat message: its text (None when it only called tools) and its tool calls."""
    message: JsonObject = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def chat_messages(instructions: str | None, items: Iterable[Mapping[str, Any]]) -> list[JsonObject]:
    """Items as the chat template's messages: function calls join the assistant message before them."""
    head: list[JsonObject] = [{"role": "system", "content": instructions}] if instructions else []
    return extend_messages(head, items)


def extend_messages(messages: Sequence[JsonObject], items: Iterable[Mapping[str, Any]]) -> list[JsonObject]:
    """`messages` (a render, left as it is) followed by `items` rendered the same way.

    A reasoning item opens the assistant turn it belongs to as `reasoning_content` (the name chat templates read);
    the assistant's message and calls after it join that turn."""
    result = list(messages)
    for item in items:
        kind = item["type"]
        if kind == "message":
            last = result[-1] if result else None
            if item["role"] == "assistant" and _reasoning_only(last):
                assert last is not None
                result[-1] = {**last, "content": chat_content(_parts(item))}
            else:
                result.append({"role": item["role"], "content": chat_content(_parts(item))})
        elif kind == "reasoning":
            result.append({"role": "assistant", "content": "", "reasoning_content": reasoning_text(item)})
        elif kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item)
            last = result[-1] if result else None
            if last is not None and last["role"] == "assistant":
                result[-1] = {
                    **last,
                    "content": last["content"] or None,
                    "tool_calls": [*last.get("tool_calls", []), call],
                }
            else:
                result.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            result.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return result


def model_tool_name(item: Mapping[str, Any]) -> str:
    """The name the model knows a called tool by: a namespaced tool's is `<namespace>.<name>`."""
    namespace = item.get("namespace")
    return f"{namespace}.{item['name']}" if namespace else str(item["name"])


def _tool_call(item: Mapping[str, Any]) -> JsonObject:
    """A function or custom tool call item as the chat template's tool call; a custom call's input is its raw
    `arguments`, marked so the generic format writes it as the model wrote it (`core/tools/custom.py`)."""
    name = model_tool_name(item)
    if item["type"] == "function_call":
        return template_tool_call(item["call_id"], name, item["arguments"])
    call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["input"]}}
    return {**call, custom_tools.CUSTOM_CALL_KEY: True}


def _reasoning_only(message: JsonObject | None) -> bool:
    """An assistant turn that so far holds only reasoning."""
    return (
        message is not None
        and message["role"] == "assistant"
        and "reasoning_content" in message
        and not message["content"]
        and not message.get("tool_calls")
    )


def _parts(item: Mapping[str, Any]) -> list[JsonObject]:
    """A message item's content as chat parts: its text, and a placeholder part for each image."""
    return [
        IMAGE_PART if part["type"] == "input_image" else text_part(part.get("text", "")) for part in item["content"]
    ]


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[JsonObject]:
    """Responses function tools (flat) -> the chat template's tool shape (nested under `function`). A custom tool
    is shown as a function whose description says how to write its free-form input."""
    return [
        {"type": "function", "function": {"name": tool["name"], "description": custom_tools.described(tool)}}
        if tool.get("type") == "custom"
        else {
            "type": "function",
            "function": {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None},
        }
        for tool in tools
    ]
