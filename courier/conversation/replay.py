"""Replaying a compacted history: what the model sees when the items hold a compaction capsule.

Everything before the newest capsule, except system and developer messages, is
replaced by the capsule's summary (as an assistant message; none when it is empty) followed by the
retained items (found by digest among the items before it: as many as the capsule
lists each digest, the newest that match, so an item sent twice shows once). Items
after the capsule follow as sent. Exactly repeated system/developer messages,
and any repeating the request's `instructions`, are kept once (a set of hashes,
one pass). Older capsules are dropped: the newest one summarized them already.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from courier.conversation.capsule import Capsule, CapsuleCodec, item_digest
from courier.conversation.items import is_instruction, message_item, message_text, text_part
from courier.storage.records import JsonObject

SUMMARY_HEADER = "Summary of the conversation so far:\n"


def newest_capsule_index(items: Sequence[JsonObject]) -> int | None:
    indexes = [index for index, item in enumerate(items) if item["type"] == "compaction"]
    return indexes[-1] if indexes else None


def expand(items: Sequence[JsonObject], codec: CapsuleCodec, instructions: str | None) -> list[JsonObject]:
    """The items the model is shown; raises `CapsuleError` for a capsule that cannot be used."""
    newest = newest_capsule_index(items)
    if newest is None:
        return without_repeated_instructions(items, instructions)
    capsule = codec.decode(items[newest].get("encrypted_content"))
    return replay(capsule, items[:newest], items[newest + 1 :], instructions)


def replay(
    capsule: Capsule, before: Sequence[JsonObject], after: Sequence[JsonObject], instructions: str | None
) -> list[JsonObject]:
    """What the model is shown for `before`, a decoded `capsule`, then `after` (the compactor replays the capsule it
    just made this way, without encoding and decoding it)."""
    matching: defaultdict[str, list[JsonObject]] = defaultdict(list)
    for item in before:
        if not is_instruction(item) and item["type"] != "compaction":
            matching[item_digest(item)].append(item)
    # A digest listed n times names n items (two turns may say the same thing): the newest n that match, so items
    # sent again in front of the capsule (a replayed chain) are shown once.
    chosen = {digest: matching[digest][-count:] for digest, count in Counter(capsule.retained).items()}
    taken: Counter[str] = Counter()
    retained: list[JsonObject] = []
    for digest in capsule.retained:
        if taken[digest] < len(chosen[digest]):
            retained.append(chosen[digest][taken[digest]])
            taken[digest] += 1
    # A capsule of a history that all fit `keep_tokens` has no summary: its retained items are the whole of it.
    text = SUMMARY_HEADER + capsule.summary
    summary = [message_item("assistant", [text_part("output_text", text)])] if capsule.summary else []
    kept = [item for item in before if is_instruction(item)]
    return without_repeated_instructions([*kept, *summary, *retained, *after], instructions)


def without_repeated_instructions(items: Sequence[JsonObject], instructions: str | None) -> list[JsonObject]:
    seen = {("system", instructions)} if instructions else set()
    result: list[JsonObject] = []
    for item in items:
        if is_instruction(item):
            key = (item["role"], message_text(item))
            if key in seen:
                continue
            seen.add(key)
        if item["type"] != "compaction":
            result.append(item)
    return result


def replayed_summary(item: JsonObject) -> str | None:
    """The summary an item replay made of an earlier capsule (its text after the header), or None for any other
    item. A later compaction must carry it on: no stored or sent item is that message, so a capsule that listed it
    among its retained items would lose it on the next replay."""
    if item.get("type") != "message" or item.get("role") != "assistant":
        return None
    text = message_text(item)
    return text.removeprefix(SUMMARY_HEADER) if text.startswith(SUMMARY_HEADER) else None
