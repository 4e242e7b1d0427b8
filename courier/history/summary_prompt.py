"""The prompt a compaction's summary is generated from: the summarized items as a transcript, then what to keep.

One user message, transcript first and the request last: small models follow a
request that comes after the text far better than a system prompt before it
(SmolLM2-135M loops on the latter and writes a faithful summary with the former).
"""

from __future__ import annotations

from collections.abc import Sequence

from courier.history.items import image_urls, message_text
from courier.storage.records import JsonObject

SUMMARY_REQUEST = (
    "Summarize the conversation above in a few sentences, so that it can be continued from your summary alone. "
    "Keep the user's goals and constraints, the decisions made, the progress so far, open questions, and every "
    "name, number and identifier exactly as written."
)


def summary_messages(items: Sequence[JsonObject]) -> list[JsonObject]:
    transcript = "\n\n".join(_line(item) for item in items)
    return [{"role": "user", "content": f"Conversation:\n\n{transcript}\n\n{SUMMARY_REQUEST}"}]


def _line(item: JsonObject) -> str:
    kind = item["type"]
    if kind == "message":
        images = " [image]" * len(image_urls(item))
        return f"{str(item['role']).capitalize()}: {message_text(item)}{images}"
    if kind == "function_call":
        return f"Tool call {item['name']} ({item['call_id']}): {item['arguments']}"
    if kind == "function_call_output":
        return f"Tool result ({item['call_id']}): {item['output']}"
    return str(kind).capitalize()
