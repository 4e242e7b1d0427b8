"""`thinking: {"type": "enabled", "budget_tokens": N}` enforced: reasoning past its budget is closed, and the answer
follows it.

The engine cannot close a block itself, so the route does it in two generations. The prompt is rendered first
(exactly as admission renders it, which admission then takes as it is), so its tokens are known. When the reply has
spent `budget_tokens` inside its reasoning block, the route stops reading it (which takes it out of the batch) and
admits a continuation: the prompt's tokens, the tokens the reply wrote, and the block's end (`\\n</think>\\n\\n`),
with what is left of `max_tokens`; the prompt cache serves the prefix the first generation prefilled. The client
sees one message: thinking of at most the budget (markers included), then the answer.

A prompt with images is rendered by the model's processor on admission only, so a budget cannot be enforced for
it: refused (400 naming `thinking.budget_tokens`) on a reasoning model; adaptive thinking works.
"""

from __future__ import annotations

from dataclasses import replace

from courier.http.anthropic.request import MessagesRequest
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.generation import admit, new_request_id
from courier.messages.asking import call
from courier.messages.ingress import Admitted, ChatPrompt, TokenPrompt
from courier.messages.token_counter import TokenizeChat, TokenizeText


def enforced(context: AppContext, request: MessagesRequest) -> bool:
    """Whether the request's reasoning has a budget this model can overrun (it thinks in tags)."""
    return request.thinking.budget_tokens is not None and context.state.reasoning is not None


async def prerendered(context: AppContext, request: MessagesRequest, tenant: str) -> MessagesRequest:
    """`request` with its prompt rendered as admission would render it (for the caller's `tenant`), so a
    continuation can extend its tokens."""
    prompt = request.generation.prompt
    assert isinstance(prompt, ChatPrompt)
    if prompt.images:
        raise ApiError.invalid(
            "'thinking.budget_tokens' cannot be enforced for a prompt with images on this model; "
            "use thinking of type adaptive",
            param="thinking.budget_tokens",
        )
    context.require_ready()
    rendered = await call(
        context.outboxes.token_counter,
        lambda reply: TokenizeChat(
            messages=prompt.messages,
            tools=prompt.tools,
            add_generation_prompt=True,
            reply=reply,
            with_history_boundary=request.generation.cache_prompt,
            thinking=prompt.thinking,
            options=prompt.options,
            max_tokens=context.context_length,
            reuse_scope=tenant if request.generation.cache_prompt else None,
        ),
    )
    generation = replace(request.generation, prompt=replace(prompt, rendered=rendered))
    return replace(request, generation=generation)


async def closing_tokens(context: AppContext) -> tuple[str, tuple[int, ...]]:
    """The text that ends a reasoning block early, and its tokens."""
    markers = context.state.reasoning
    assert markers is not None
    text = f"\n{markers.end}\n\n"
    result = await call(
        context.outboxes.token_counter,
        lambda reply: TokenizeText(text=text, add_special_tokens=False, reply=reply),
    )
    return text, result.tokens


async def continuation(
    context: AppContext, request: MessagesRequest, written: tuple[int, ...], room: int, *, tenant: str, deadline: float
) -> Admitted | None:
    """The generation that goes on after the closed block (`written`: the reply's tokens, then the block's end), with
    `room` tokens left of its limit, for the caller's `tenant`, by the message's own `deadline` (and let finish by a
    draining server, as the message it is part of); None when no tokens are left."""
    prompt = request.generation.prompt
    assert isinstance(prompt, ChatPrompt) and prompt.rendered is not None
    if room < 1:
        return None
    tokens = (*prompt.rendered.tokens, *written)
    generation = replace(
        request.generation,
        prompt=TokenPrompt(tokens=tokens),
        sampling=replace(request.generation.sampling, max_tokens=room),
        fit_to_context=False,
    )
    return await admit(context, generation, new_request_id(), tenant, deadline=deadline, continuing=True)
