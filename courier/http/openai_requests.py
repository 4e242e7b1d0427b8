"""Chat Completions and Completions bodies read into typed requests.

Each body is first checked against its route's schema (`schemas/chat.py`, `schemas/completions.py`): types, ranges,
and the fields this server cannot honour, each refusal a 400 naming its `param`. What is left here is what a schema
cannot say: rules across fields (`top_logprobs` needs `logprobs`; a message needs content unless it is an assistant's
with calls; a named tool must be one of the tools), image URLs, and the conversion into the internal request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from courier.conversation.chat_content import IMAGE_PART, chat_content, text_part
from courier.conversation.chat_render import template_tool_call
from courier.core.failure_codes import FailureCode
from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.core.template_options import TemplateOptionRefused, TemplateOptions, reasoning_effort, template_kwargs
from courier.engine.generation import SamplingParams
from courier.grammar import output_spec
from courier.grammar.output_spec import OutputSpec
from courier.http.checked_fields import flag, optional_whole, real, whole
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.schemas import chat, completions
from courier.http.schemas.validator import check
from courier.media.address_policy import MediaRefused
from courier.media.urls import parse_image_url
from courier.messages.ingress import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from courier.messages.media import ImageRef


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    model: str | None
    prompt: Prompt
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    tools: tuple[Mapping[str, Any], ...] | None = None
    output: OutputSpec = field(default_factory=OutputSpec)  # response format, tool choice
    session: str = ""
    cache_prompt: bool = True
    n: int = 1  # samples of the prompt, each a choice
    # Cap `max_tokens` at what the context leaves instead of refusing (the Messages API: agents ask for more output
    # than a small model's window holds, on every call).
    fit_to_context: bool = False


def parse_chat_request(body: dict[str, Any], defaults: SamplingDefaults = OPENAI, max_n: int = 1) -> GenerationRequest:
    check(chat.request(max_n), body)
    normalized, images = parse_chat_messages(body["messages"])
    tools = tuple(body.get("tools") or ()) or None
    output = refusing(lambda: _chat_output(body, tools))
    if output.tool_choice.mode == "none":
        tools = None
    logprobs = flag(body, "logprobs", False)
    top_logprobs = whole(body, "top_logprobs", 0)
    if top_logprobs and not logprobs:
        raise ApiError.invalid("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    sampling = sampling_params(
        body, _max_tokens_key(body), logprobs=logprobs, top_logprobs=top_logprobs, defaults=defaults
    )
    return GenerationRequest(
        model=body.get("model"),
        prompt=ChatPrompt(messages=normalized, tools=tools, images=images, options=_template_options(body)),
        sampling=sampling,
        stream=flag(body, "stream", False),
        include_usage=_include_usage(body),
        tools=tools,
        output=output,
        session=session_key(body, fallback_field="safety_identifier"),
        cache_prompt=flag(body, "cache_prompt", True),
        n=whole(body, "n", 1),
    )


def parse_completion_request(
    body: dict[str, Any], defaults: SamplingDefaults = OPENAI, max_n: int = 1
) -> GenerationRequest:
    check(completions.request(max_n), body)
    if body.get("best_of") is not None and whole(body, "n", 1) > 1:  # best_of 1 (the only one served) < n
        raise ApiError.invalid(
            "'best_of' must be at least n: it is how many samples n are chosen from", param="best_of"
        )
    logprobs_count = optional_whole(body, "logprobs")
    sampling = sampling_params(
        body,
        _max_tokens_key(body),
        logprobs=logprobs_count is not None,
        top_logprobs=logprobs_count or 0,
        default_max=16,
        defaults=defaults,
    )
    return GenerationRequest(
        model=body.get("model"),
        prompt=_completion_prompt(body["prompt"]),
        sampling=sampling,
        stream=flag(body, "stream", False),
        include_usage=_include_usage(body),
        output=refusing(lambda: OutputSpec(format=output_spec.chat_response_format(body.get("response_format")))),
        session=session_key(body),
        cache_prompt=flag(body, "cache_prompt", True),
        n=whole(body, "n", 1),
    )


def session_key(body: Mapping[str, Any], fallback_field: str | None = None) -> str:
    """Whose conversation this is, for the prompt cache: `prompt_cache_key`, else `user` (else `fallback_field`).

    Empty strings count as absent; callers that send none of them share one anonymous session.
    """
    for key in ("prompt_cache_key", "user", fallback_field):
        value = body.get(key) if key is not None else None
        if value:
            return str(value)
    return ""


def _max_tokens_key(body: dict[str, Any]) -> str:
    """`max_completion_tokens` (OpenAI's newer name) wins over `max_tokens` (checked too, by the schema)."""
    return "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"


def sampling_params(
    body: Mapping[str, Any],
    max_tokens_key: str,
    *,
    logprobs: bool,
    top_logprobs: int,
    default_max: int = 0,
    defaults: SamplingDefaults = OPENAI,
) -> SamplingParams:
    """The sampling fields chat, completions and the Responses API share (`max_tokens_key`: the body's name for
    the limit; 0 for none, then the context decides)."""
    stop = body.get("stop")
    return SamplingParams(
        max_tokens=whole(body, max_tokens_key, default_max),
        temperature=real(body, "temperature", defaults.temperature),
        top_p=real(body, "top_p", defaults.top_p),
        seed=optional_whole(body, "seed"),
        stop=tuple(text for text in ([stop] if isinstance(stop, str) else stop or ()) if text),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        top_k=max(0, whole(body, "top_k", 0)),  # -1 or 0: off (vLLM's -1 too)
        min_p=real(body, "min_p", 0.0),
        presence_penalty=real(body, "presence_penalty", 0.0),
        frequency_penalty=real(body, "frequency_penalty", 0.0),
        repetition_penalty=real(body, "repetition_penalty", 1.0),
        # Token ids past the vocabulary are refused by the ingress, which knows its size.
        logit_bias=tuple((int(token), float(bias)) for token, bias in (body.get("logit_bias") or {}).items()),
    )


def parse_chat_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]]:
    """Chat `messages`, which the schema has checked, normalised (each part of each message), with the images they
    refer to."""
    images: list[ImageRef] = []
    normalized = [_chat_message(message, index, images) for index, message in enumerate(messages)]
    return normalized, tuple(images)


def _chat_message(message: dict[str, Any], index: int, images: list[ImageRef]) -> dict[str, Any]:
    param = f"messages[{index}]"
    role = message["role"]
    normalized: dict[str, Any] = {"role": role, "content": _content(message.get("content"), f"{param}.content", images)}
    if role == "assistant" and message.get("tool_calls") is not None:
        normalized["tool_calls"] = [
            template_tool_call(call.get("id"), call["function"]["name"], call["function"].get("arguments", "{}"))
            for call in message["tool_calls"]
        ]
    elif normalized["content"] is None:
        raise ApiError.invalid(f"'{param}.content' is required", param=f"{param}.content")
    # An assistant's reasoning, sent back as it came (`reasoning_content`, or its alias `reasoning`), under the name
    # chat templates read (Qwen3, DeepSeek-R1).
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if role == "assistant" and reasoning:
        normalized["reasoning_content"] = reasoning
    if role == "tool" and message.get("tool_call_id") is not None:
        normalized["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        normalized["name"] = message["name"]
    return normalized


def _content(content: str | list[dict[str, Any]] | None, param: str, images: list[ImageRef]) -> Any:
    """A message's content: its text, or text and image parts in order when it has images (collected in
    `images`, which the ingress admits before anything is fetched)."""
    if content is None or isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if part["type"] == "image_url":
            images.append(ImageRef(url=_image_url(part["image_url"], part_param), param=part_param))
            parts.append(IMAGE_PART)
        else:
            parts.append(text_part(part["text"]))
    return chat_content(parts)


def _image_url(value: str | dict[str, Any], param: str) -> str:
    """The part's URL, refused here (a 400 naming the part) unless the media fetcher could read it."""
    url: str = value["url"] if isinstance(value, dict) else value
    try:
        parse_image_url(url)
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param, code=FailureCode.INVALID_IMAGE_URL) from None
    return url


def _template_options(body: dict[str, Any]) -> TemplateOptions:
    try:
        return TemplateOptions(
            kwargs=template_kwargs(body.get("chat_template_kwargs")),
            reasoning_effort=reasoning_effort(body.get("reasoning_effort"), "reasoning_effort"),
        )
    except TemplateOptionRefused as refused:
        raise ApiError.invalid(refused.message, param=refused.param) from None


def _chat_output(body: dict[str, Any], tools: tuple[Mapping[str, Any], ...] | None) -> OutputSpec:
    return output_spec.spec(
        output_spec.chat_response_format(body.get("response_format")),
        output_spec.tool_choice(body.get("tool_choice"), responses=False),
        flag(body, "parallel_tool_calls", True),
        tools,
    )


def _completion_prompt(prompt: str | list[Any]) -> Prompt:
    """A string, token ids, or a one-element list of either; several prompts in one request are refused."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TextPrompt(text=prompt)
    if not all(isinstance(token, int | float) for token in prompt):
        raise ApiError.invalid("batched prompts are not supported: send one prompt per request", param="prompt")
    return TokenPrompt(tokens=tuple(int(token) for token in prompt))


def _include_usage(body: dict[str, Any]) -> bool:
    return flag(body.get("stream_options") or {}, "include_usage", False)
