"""Validation of Chat Completions and Completions bodies into typed requests.

Each refusal is a 400 naming the offending `param`. Unknown fields are ignored:
real clients send extras. Features the engine cannot honour are refused rather
than silently ignored.
"""

from __future__ import annotations

import math
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
from courier.http import unsupported_fields
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.unsupported_fields import refuse_obfuscation, refuse_unsupported
from courier.http.validation import optional_bool
from courier.media.address_policy import MediaRefused
from courier.media.urls import parse_image_url
from courier.messages.ingress import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from courier.messages.media import ImageRef

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1_000_000
# A penalty divides (or multiplies) logits: outside [1/100, 10] it only overflows them or turns the reply to noise.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024


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
    refuse_unsupported(body, unsupported_fields.CHAT)
    normalized, images = parse_chat_messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    output = refusing(lambda: _chat_output(body, tools))
    if output.tool_choice.mode == "none":
        tools = None
    logprobs = optional_bool(body, "logprobs", False)
    top_logprobs = int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT, 0)
    if top_logprobs and not logprobs:
        raise ApiError.invalid("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    sampling = sampling_params(
        body, _max_tokens_key(body), logprobs=logprobs, top_logprobs=top_logprobs, defaults=defaults
    )
    return GenerationRequest(
        model=model_name(body),
        prompt=ChatPrompt(messages=normalized, tools=tools, images=images, options=_template_options(body)),
        sampling=sampling,
        stream=optional_bool(body, "stream", False),
        include_usage=_include_usage(body),
        tools=tools,
        output=output,
        session=session_key(body, fallback_field="safety_identifier"),
        cache_prompt=optional_bool(body, "cache_prompt", True),
        n=int_in(body, "n", 1, max_n, 1),
    )


def parse_completion_request(
    body: dict[str, Any], defaults: SamplingDefaults = OPENAI, max_n: int = 1
) -> GenerationRequest:
    refuse_unsupported(body, unsupported_fields.COMPLETIONS)
    if optional_bool(body, "echo", False):
        raise ApiError.invalid("'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError.invalid("'suffix' is not supported", param="suffix")
    if body.get("best_of") not in (None, 1):
        raise ApiError.invalid("'best_of' other than 1 is not supported", param="best_of")
    logprobs_count = body.get("logprobs")
    if logprobs_count is not None and (
        isinstance(logprobs_count, bool)
        or not isinstance(logprobs_count, int)
        or not 0 <= logprobs_count <= MAX_LOGPROBS_COMPLETIONS
    ):
        raise ApiError.invalid(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS_COMPLETIONS}", param="logprobs")
    sampling = sampling_params(
        body,
        _max_tokens_key(body),
        logprobs=logprobs_count is not None,
        top_logprobs=logprobs_count or 0,
        default_max=16,
        defaults=defaults,
    )
    return GenerationRequest(
        model=model_name(body),
        prompt=_completion_prompt(body.get("prompt")),
        sampling=sampling,
        stream=optional_bool(body, "stream", False),
        include_usage=_include_usage(body),
        output=refusing(lambda: OutputSpec(format=output_spec.chat_response_format(body.get("response_format")))),
        session=session_key(body),
        cache_prompt=optional_bool(body, "cache_prompt", True),
        n=int_in(body, "n", 1, max_n, 1),
    )


def session_key(body: dict[str, Any], fallback_field: str | None = None) -> str:
    """Whose conversation this is, for the prompt cache: `prompt_cache_key`, else `user` (else `fallback_field`).

    Empty strings count as absent; callers that send none of them share one anonymous session.
    """
    for key in ("prompt_cache_key", "user", fallback_field):
        if key is None:
            continue
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError.invalid(f"'{key}' must be a string", param=key)
        if value:
            return value
    return ""


def _max_tokens_key(body: dict[str, Any]) -> str:
    """`max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`; both are checked when both are sent."""
    if body.get("max_completion_tokens") is None:
        return "max_tokens"
    if body.get("max_tokens") is not None:
        optional_positive_int(body, "max_tokens")
    return "max_completion_tokens"


def optional_positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ApiError.invalid(f"'{key}' must be a positive integer", param=key)
    return value


def sampling_params(
    body: dict[str, Any],
    max_tokens_key: str,
    *,
    logprobs: bool,
    top_logprobs: int,
    default_max: int = 0,
    defaults: SamplingDefaults = OPENAI,
) -> SamplingParams:
    """The sampling fields chat, completions and the Responses API share (`max_tokens_key`: the body's name for
    the limit; 0 for none, then the context decides)."""
    max_tokens = optional_positive_int(body, max_tokens_key)
    return SamplingParams(
        max_tokens=default_max if max_tokens is None else max_tokens,
        temperature=number_in(body, "temperature", 0.0, MAX_TEMPERATURE, defaults.temperature),
        top_p=number_in(body, "top_p", 0.0, 1.0, defaults.top_p, open_low=True),
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        top_k=max(0, int_in(body, "top_k", -1, MAX_TOP_K, 0)),  # -1 or 0: off (vLLM's -1 too)
        min_p=number_in(body, "min_p", 0.0, 1.0, 0.0),
        presence_penalty=number_in(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number_in(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=number_in(body, "repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as strings) to a bias in [-100, 100]; ids past the vocabulary are refused
    by the ingress, which knows its size."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError.invalid("'logit_bias' must be an object of token ids to numbers", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError.invalid(f"'logit_bias' holds at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    bias: list[tuple[int, float]] = []
    for key, entry in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise ApiError.invalid(f"'logit_bias' keys must be token ids, not {key[:20]!r}", param="logit_bias")
        if isinstance(entry, bool) or not isinstance(entry, int | float) or not -100 <= entry <= 100:
            raise ApiError.invalid(f"'logit_bias' values must be numbers in [-100, 100] ({key})", param="logit_bias")
        bias.append((int(key), float(entry)))
    return tuple(bias)


def model_name(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError.invalid("'model' must be a string", param="model")
    return model


def parse_chat_messages(messages: Any) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]]:
    """Chat `messages` checked and normalised (each part of each message), with the images they refer to."""
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("'messages' must be a non-empty list of message objects", param="messages")
    images: list[ImageRef] = []
    normalized = [_chat_message(message, index, images) for index, message in enumerate(messages)]
    return normalized, tuple(images)


def _chat_message(message: Any, index: int, images: list[ImageRef]) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError.invalid(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise ApiError.invalid(f"{param}.role must be one of {sorted(CHAT_ROLES)}, not {role!r}", param=f"{param}.role")
    normalized: dict[str, Any] = {
        "role": role,
        "content": _content(message.get("content"), f"{param}.content", images),
    }
    if role == "assistant" and message.get("tool_calls") is not None:
        normalized["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
    elif normalized["content"] is None:
        raise ApiError.invalid(f"{param}.content is required", param=f"{param}.content")
    if role == "assistant":
        reasoning = _reasoning(message, param)
        if reasoning:
            normalized["reasoning_content"] = reasoning  # the name chat templates read (Qwen3, DeepSeek-R1)
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        normalized["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        normalized["name"] = message["name"]
    return normalized


def _reasoning(message: dict[str, Any], param: str) -> str:
    """An assistant message's reasoning, sent back as it came (`reasoning_content`, or its alias `reasoning`)."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError.invalid(f"{param}.{key} must be a string", param=f"{param}.{key}")
        if value:
            return value
    return ""


def _content(content: Any, param: str, images: list[ImageRef]) -> str | list[dict[str, Any]] | None:
    """A message's content: its text, or text and image parts in order when it has images (collected in
    `images`, which the ingress admits before anything is fetched)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError.invalid(f"{param} must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise ApiError.invalid(f"{part_param} must be an object", param=part_param)
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(text_part(part["text"]))
        elif kind == "image_url":
            images.append(ImageRef(url=_image_url(part.get("image_url"), part_param), param=part_param))
            parts.append(IMAGE_PART)
        elif kind in ("input_audio", "file"):
            raise ApiError.invalid(f"{part_param}: {kind} parts are not supported", param=part_param)
        else:
            raise ApiError.invalid(f"{part_param} must be a text part with a string 'text'", param=part_param)
    return chat_content(parts)


def _image_url(value: Any, param: str) -> str:
    """The part's URL, refused here (a 400 naming the part) unless the media fetcher could read it."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ApiError.invalid(f"{param}.image_url must be a URL (or an object with 'url')", param=param)
    try:
        parse_image_url(url)
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param, code=FailureCode.INVALID_IMAGE_URL) from None
    return url


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ApiError.invalid(f"{param} must be a list", param=param)
    normalized: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError.invalid(f"{param}[{index}] must have a function with a name", param=f"{param}[{index}]")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            where = f"{param}[{index}].function.arguments"
            raise ApiError.invalid(f"{where} must be a JSON string", param=where)
        normalized.append(template_tool_call(call.get("id"), function["name"], arguments))
    return normalized


def _tools(tools: Any) -> tuple[Mapping[str, Any], ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError.invalid("'tools' must be a list", param="tools")
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError.invalid(f"{param} must be an object with type 'function'", param=param)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError.invalid(f"{param}.function.name must be a non-empty string", param=f"{param}.function")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ApiError.invalid(f"{param}.function.parameters must be an object", param=f"{param}.function")
    return tuple(tools) or None


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
        optional_bool(body, "parallel_tool_calls", True),
        tools,
    )


def _completion_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TextPrompt(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return TokenPrompt(tokens=tuple(prompt))
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError.invalid("batched prompts are not supported: send one prompt per request", param="prompt")
    raise ApiError.invalid("'prompt' must be a string or a non-empty list of token ids", param="prompt")


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_SEQUENCES:
        return tuple(s for s in stop if s)
    raise ApiError.invalid(f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} strings", param="stop")


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ApiError.invalid("'seed' must be a non-negative integer", param="seed")
    return seed


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError.invalid("'stream_options' must be an object", param="stream_options")
    refuse_obfuscation(options)
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError.invalid("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    return bool(include)


def number_in(
    body: dict[str, Any], key: str, low: float, high: float, default: float, *, open_low: bool = False
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ApiError.invalid(f"'{key}' must be a number", param=key)
    if value > high or value < low or (open_low and value == low):
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ApiError.invalid(f"'{key}' must be in {bounds}", param=key)
    return float(value)


def int_in(body: dict[str, Any], key: str, low: int, high: int, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError.invalid(f"'{key}' must be an integer from {low} to {high}", param=key)
    return value
