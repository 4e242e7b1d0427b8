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

from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.messages.ingress import IngressMessage, WarmUpConversation


def warm_up_next_turn(
    ingress: MemoryObjectSendStream[IngressMessage],
    session: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tenant: str = "",
    *,
    options: TemplateOptions = NO_OPTIONS,
    thinking: bool = True,
) -> None:
    """`messages`: the history through the last reply, as the chat template's messages; `options` and `thinking`:
    the request's, so the history renders as the next turn's will (an effort written in a system message would
    otherwise make every warm-up miss)."""
    warm_up = WarmUpConversation(
        session=session, messages=messages, tools=tools, tenant=tenant, options=options, thinking=thinking
    )
    with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
        ingress.send_nowait(warm_up)
