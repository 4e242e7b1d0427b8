"""The image parts a history would show the model, each named by where it sits in the request."""

from __future__ import annotations

from collections.abc import Sequence

from courier.messages.media import ImageRef
from courier.storage.records import JsonObject


def image_refs(items: Sequence[JsonObject], request_items: Sequence[JsonObject]) -> tuple[ImageRef, ...]:
    """`input[i].content[j]` for an item of this request (`request_items`); `stored item <id>` for one from storage."""
    positions = {item["id"]: index for index, item in enumerate(request_items)}
    refs: list[ImageRef] = []
    for item in items:
        if item["type"] != "message":
            continue
        where = positions.get(item["id"])
        for part_index, part in enumerate(item["content"]):
            if part["type"] == "input_image":
                param = f"input[{where}].content[{part_index}]" if where is not None else f"stored item {item['id']}"
                refs.append(ImageRef(url=part["image_url"], param=param))
    return tuple(refs)
