"""Asking for a conversation's next turn to be prepared while the server is idle: one builder for every caller.

After a chat completion, a Responses turn or a compaction, the conversation's next
prompt starts with the history through what was just said. `warm_up_next_turn`
tells the ingress to render it and queue it for an idle scheduler, which extends the
conversation's snapshot over it. A tell: dropped when the ingress is busy or gone,
never waited for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

from anyio import BrokenResourceError, ClosedResourceError, WouldBlock
from anyio.streams.memory import MemoryObjectSendStream

from courier.messages.ingress import IngressMessage, WarmUpConversation


def warm_up_next_turn(
    ingress: MemoryObjectSendStream[IngressMessage],
    session: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tenant: str = "",
) -> None:
    """`messages`: the history through the last reply, as the chat template's messages."""
    warm_up = WarmUpConversation(session=session, messages=messages, tools=tools, tenant=tenant)
    with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
        ingress.send_nowait(warm_up)
