"""The prompt a compaction's summary is generated from: the summarized items as a transcript, then what to keep.

One user message, transcript first and the request last: small models follow a
request that comes after the text far better than a system prompt before it
(SmolLM2-135M loops on the latter and writes a faithful summary with the former).
"""

from __future__ import annotations

from collections.abc import Sequence

from courier.conversation.chat_content import IMAGE_PART, chat_content, text_part
from courier.conversation.items import image_urls, message_text
from courier.storage.records import JsonObject

# The summary is written as bullet lines (its grammar, `grammar/summary.py`, holds it to them): asked for as such.
SUMMARY_REQUEST = (
    "Summarize the conversation above as a short list of bullet points, one line each starting with '- ', so "
    "that it can be continued from your summary alone. Keep the user's goals and constraints, the decisions made, "
    "the progress so far, open questions, and every name, number and identifier exactly as written."
)


def summary_messages(items: Sequence[JsonObject]) -> list[JsonObject]:
    """The summary prompt; each image of the summarized items sits in the transcript where it was shown. The
    model's reasoning is left out: the summary keeps what was said and done, not how it was thought through."""
    parts: list[JsonObject] = [text_part("Conversation:\n\n")]
    for index, item in enumerate(item for item in items if item["type"] != "reasoning"):
        if index:
            parts.append(text_part("\n\n"))
        parts.extend(_line(item))
    parts.append(text_part(f"\n\n{SUMMARY_REQUEST}"))
    return [{"role": "user", "content": chat_content(parts)}]


def _line(item: JsonObject) -> list[JsonObject]:
    kind = item["type"]
    if kind == "message":
        images = [IMAGE_PART for _ in image_urls(item)]
        return [text_part(f"{str(item['role']).capitalize()}: {message_text(item)}"), *images]
    if kind == "function_call":
        return [text_part(f"Tool call {item['name']} ({item['call_id']}): {item['arguments']}")]
    if kind == "custom_tool_call":
        return [text_part(f"Tool call {item['name']} ({item['call_id']}): {item['input']}")]
    if kind in ("function_call_output", "custom_tool_call_output"):
        return [text_part(f"Tool result ({item['call_id']}): {item['output']}")]
    return [text_part(str(kind).capitalize())]
