"""TokenCounterActor: owns the tokenizer and the chat template.

Receives `TokenizeText`, `TokenizeChat`, `Detokenize` and `ForgetRenders`; replies on each message's
own reply stream with a `*Result` or a `RequestFailed`. Invariants: every message
gets exactly one reply; a bad input fails that request only. Tokenizing runs on a
worker thread so a long prompt never stalls the event loop (the tokenizer holds no
MLX state, so it does not belong on the MLX thread). Messages are handled one at a
time, so no request may take long: a text whose byte count alone shows it holds
more tokens than the caller's `max_tokens` (no token stands for more bytes than its
longest vocabulary entry) is refused before it is rendered or tokenized, and what is
left to tokenize is bounded by the context length. Unless told not to, a chat's volatile
system-prompt lines (`core/volatile_lines.py`) are left out before it is rendered, so
they never bust the prompt cache. A render shares most of its text with one tokenized
before (the same conversation's last turn, its history boundary, its warm-up), so only
what is new is tokenized (`core/token_reuse.py`): within a request always, across a
tenant's requests when the prompt cache is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
from mlx_lm.tokenizer_utils import TokenizerWrapper
from opentelemetry import trace

from courier.conversation.chat_content import as_parts
from courier.conversation.template_failure import TEMPLATE_ERRORS, TemplateFailure, template_failure
from courier.core import token_reuse
from courier.core.failure_codes import FailureCode
from courier.core.template_options import NO_OPTIONS, TemplateOptionRefused, TemplateOptions
from courier.core.token_prefix import common_prefix_length
from courier.core.token_reuse import RecentEncodings
from courier.core.tools import generic as generic_tools
from courier.core.volatile_lines import without_volatile_lines
from courier.engine.generation import VisionInputs
from courier.media.images import combined_digest
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.token_counter import (
    Detokenize,
    DetokenizeResult,
    ForgetRenders,
    MessageNames,
    TokenCounterMessage,
    TokenizeChat,
    TokenizeResult,
    TokenizeText,
)
from courier.model.tokenizer_offsets import WholeTexts, offsets_encoder
from courier.model.vision.processing import ImageProcessor
from courier.runtime.actor import Actor
from courier.runtime.trace_attributes import TEMPLATE_LEFT_OUT, TOKENS_REUSED
from courier.status.tokenizer_stats import TokenizerStats

T = TypeVar("T")


class TokenCounterActor(Actor[TokenCounterMessage]):
    name = "token_counter"

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        images: ImageProcessor | None = None,
        *,
        normalize: bool = True,
        remember_renders: bool = True,
        stats: TokenizerStats | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._images = images
        self._normalize = normalize  # leave out volatile system-prompt lines (--prompt-cache-normalize)
        offsets = offsets_encoder(tokenizer)
        self._encoder = offsets if offsets is not None else WholeTexts(tokenizer)  # the latter: every render whole
        # A tenant's recent renders, for its next ones (off with the prompt cache: nothing kept between requests;
        # nothing kept either for a tokenizer whose renders cannot be reused).
        self._recent = RecentEncodings() if remember_renders and offsets is not None else None
        self._stats = stats if stats is not None else TokenizerStats()
        self._native_tools = bool(getattr(tokenizer, "has_tool_calling", False))
        template = getattr(tokenizer, "chat_template", None)
        self._template_text = template if isinstance(template, str) else str(template or "")
        vocabulary = tokenizer.get_vocab()
        self._vocabulary_size = len(vocabulary)
        # At least as many bytes as any one token stands for (a vocabulary entry is never shorter than its bytes).
        self._max_token_bytes = max((len(entry.encode("utf-8")) for entry in vocabulary), default=1)

    async def handle(self, message: TokenCounterMessage) -> None:
        match message:
            case TokenizeText():
                await self._on_tokenize_text(message)
            case TokenizeChat():
                await self._on_tokenize_chat(message)
            case Detokenize():
                await self._on_detokenize(message)
            case ForgetRenders():
                forgotten = self._recent.clear() if self._recent is not None else 0
                self._stats.kept(0, 0)
                await message.reply.send(forgotten)

    async def _on_tokenize_text(self, message: TokenizeText) -> None:
        too_long = self._too_long(len(message.text.encode("utf-8")), message.max_tokens, "prompt")
        if too_long is not None:
            await message.reply.send(too_long)
            return
        tokens = await _off_loop(
            lambda: self._tokenizer.encode(message.text, add_special_tokens=message.add_special_tokens)
        )
        await message.reply.send(TokenizeResult(tokens=tuple(tokens)))

    async def _on_tokenize_chat(self, message: TokenizeChat) -> None:
        if getattr(self._tokenizer, "chat_template", None) is None:
            await message.reply.send(_invalid("the model has no chat template; tokenize a prompt instead", "messages"))
            return
        too_long = self._too_long(text_bytes(message.messages), message.max_tokens, message.names.param)
        if too_long is not None:
            await message.reply.send(too_long)
            return
        try:
            result, reused = await _off_loop(lambda: self._chat_tokens(message))
        except TemplateRefused as refused:
            await message.reply.send(_template_refusal(refused.failure, message))
            return
        except TemplateOptionRefused as refused:
            await message.reply.send(_invalid(refused.message, refused.param))
            return
        except (TypeError, ValueError, KeyError, RecursionError) as error:
            await message.reply.send(_invalid(f"the chat template rejected the messages: {error}", "messages"))
            return
        trace.get_current_span().set_attribute(TOKENS_REUSED, reused)
        kept = (len(self._recent), self._recent.bytes) if self._recent is not None else (0, 0)
        self._stats.rendered(len(result.tokens), reused, *kept)
        await message.reply.send(result)

    async def _on_detokenize(self, message: Detokenize) -> None:
        out_of_range = [token for token in message.tokens if not 0 <= token < self._vocabulary_size]
        if out_of_range:
            failure = _invalid(
                f"token ids outside the vocabulary (0..{self._vocabulary_size - 1}): {out_of_range[:8]}", "tokens"
            )
            await message.reply.send(failure)
            return
        text = await _off_loop(lambda: self._tokenizer.decode(list(message.tokens)))
        await message.reply.send(DetokenizeResult(text=text))

    def _too_long(self, size: int, max_tokens: int | None, param: str) -> RequestFailed | None:
        """A text of `size` bytes is at least `size / max_token_bytes` tokens: refused, without tokenizing it, when
        that is already more than `max_tokens`, so a huge prompt never holds up the requests behind it."""
        if max_tokens is None or size <= max_tokens * self._max_token_bytes:
            return None
        fewest = -(-size // self._max_token_bytes)
        message = (
            f"This model's maximum context length is {max_tokens} tokens. However, the {size} bytes in the {param} "
            f"are at least {fewest} tokens. Please reduce the length of the {param}."
        )
        return RequestFailed(
            kind=FailureKind.INVALID_REQUEST, message=message, param=param, code=FailureCode.CONTEXT_LENGTH_EXCEEDED
        )

    def _chat_tokens(self, message: TokenizeChat) -> tuple[TokenizeResult, int]:
        """The chat's tokens, and how many of them were taken from a render tokenized before."""
        if message.images:
            return self._chat_tokens_with_images(message), 0
        render = partial(self._render_text, message.messages, message.tools, thinking=message.thinking)
        text = render(add_generation_prompt=message.add_generation_prompt, options=message.options)
        recent, scope = self._recent, message.reuse_scope
        base = recent.closest(scope, text) if recent is not None and scope is not None else None
        prompt = token_reuse.encode(text, self._encoder, base)
        if recent is not None and scope is not None:
            recent.remember(scope, prompt.encoded)
        tokens = tuple(prompt.encoded.ids)
        if not message.with_history_boundary:
            return TokenizeResult(tokens=tokens), prompt.reused_tokens
        # The history rendered on its own, clipped to what it shares with the live prompt: the next turn of this
        # conversation renders the same tokens, so a snapshot taken there can be extended by it.
        history_text = render(add_generation_prompt=False, options=message.options)
        history = tuple(token_reuse.encode(history_text, self._encoder, prompt.encoded).encoded.ids)
        boundary = common_prefix_length(history, tokens)
        return TokenizeResult(tokens=tokens, history_boundary=boundary), prompt.reused_tokens

    def _chat_tokens_with_images(self, message: TokenizeChat) -> TokenizeResult:
        """The template writes a placeholder per image; the model's processor expands each into its image tokens
        and prepares the pixels. No history boundary: the history's own render would need its images too."""
        if self._images is None:
            raise ValueError("the model takes no images")
        text = self._render_text(
            message.messages, message.tools, message.add_generation_prompt, message.thinking, message.options
        )
        try:
            tokens, arrays = self._images.encode(text, message.images)
        except Exception as error:  # the model's processor on client bytes: any failure is this request's
            raise ValueError(f"the model's processor could not prepare the images: {type(error).__name__}") from error
        vision = VisionInputs(arrays=arrays, digest=combined_digest(message.images))
        return TokenizeResult(tokens=tuple(tokens), vision=vision)

    def _render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        thinking: bool = True,
        options: TemplateOptions = NO_OPTIONS,
    ) -> str:
        if self._normalize:
            messages = without_volatile_lines(messages)
        sources: Sequence[int | None] = range(len(messages))
        if not self._native_tools and generic_tools.needs_rendering(messages, tools):
            messages, sources = generic_tools.render_with_sources(messages, tools)  # the template knows no tools
            tools = None
        arguments = options.for_template(self._template_text, thinking)  # TemplateOptionRefused: the request's
        if left_out := options.left_out(self._template_text):
            trace.get_current_span().set_attribute(TEMPLATE_LEFT_OUT, list(left_out))
        try:
            rendered = self._tokenizer.apply_chat_template(
                [self._for_template(item) for item in messages],
                tools=[dict(tool) for tool in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **arguments,
            )
        except TEMPLATE_ERRORS as error:
            failure = template_failure(error)
            index = failure.index
            source = sources[index] if index is not None and 0 <= index < len(sources) else None
            raise TemplateRefused(TemplateFailure(index=source, reason=failure.reason)) from error
        return str(rendered)

    def _for_template(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """A vision model's template iterates over content parts; a text-only one wants the text (image parts
        reach it only in counts, never in a generation: the ingress refuses them first)."""
        content = message.get("content")
        if self._images is not None:
            return {**message, "content": as_parts(content)}
        if isinstance(content, list):
            return {**message, "content": "".join(part.get("text", "") for part in content)}
        return dict(message)


class TemplateRefused(Exception):
    """The chat template failed on the messages; `failure.index` counts in the messages the caller sent."""

    def __init__(self, failure: TemplateFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def _template_refusal(failure: TemplateFailure, message: TokenizeChat) -> RequestFailed:
    """A 400 naming the message at fault: `messages[i]` for a request's own messages; for a Responses context
    (rebuilt from items, instructions and history first) its position and role under `input`."""
    index = failure.index
    if index is None or not 0 <= index < len(message.messages) or message.names is MessageNames.BUILT:
        reason = f"the model's chat template cannot render these messages ({failure.reason})"
        return _invalid(reason, message.names.param)
    if message.names is MessageNames.REQUEST:
        param = f"messages[{index}]"
        return _invalid(f"{param}: the model's chat template cannot render this message ({failure.reason})", param)
    role = message.messages[index].get("role")
    text = (
        f"the model's chat template cannot render message {index} of the conversation (role {role}; counting from "
        f"0, instructions and earlier turns included) ({failure.reason})"
    )
    return _invalid(text, "input")


async def _off_loop(work: Callable[[], T]) -> T:
    return await anyio.to_thread.run_sync(work)


def _invalid(text: str, param: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=text, param=param)


def text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in chat messages (contents, tool-call arguments, names): what tokenizing them
    must at least cover. Walked without recursion (a request body is at most a few dozen levels deep)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8"))
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
