"""OpenAI response shapes for Chat Completions and Completions (whole objects and stream chunks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from courier.core.tools.calls import ToolCall
from courier.engine.generation import GenerationFinished, TokenLogprob
from courier.storage.records import JsonObject

SERVICE_TIER = "default"  # the one tier this server has, reported as OpenAI reports the tier used


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """What every object and chunk of one completion repeats."""

    completion_id: str
    created: int
    model: str


def usage(finishes: Sequence[GenerationFinished], reasoning_tokens: int = 0) -> JsonObject:
    """Of every sample of the prompt (`n` of them): the prompt counted once, the completions summed.
    `reasoning_tokens`: of the completion tokens, those reasoning blocks took (their markers included)."""
    first = finishes[0]
    completion = sum(finished.completion_tokens for finished in finishes)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": first.cached_tokens,
            "cache_write_tokens": sum(finished.cache_write_tokens for finished in finishes),
        },
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def delta(reasoning: str, content: str) -> JsonObject:
    """A chunk's delta: the reasoning under `reasoning_content` and its alias `reasoning` (vLLM's and mlx-lm's
    names; clients read one or the other), the answer under `content`."""
    fields: JsonObject = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
    if content or not reasoning:
        fields["content"] = content
    return fields


def chat_logprobs(entries: Sequence[TokenLogprob]) -> JsonObject:
    def item(token: str, logprob: float) -> JsonObject:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(entry.token, entry.logprob), "top_logprobs": [item(text, lp) for _, text, lp in entry.top]}
            for entry in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> JsonObject:
    offsets: list[int] = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{text: lp for _, text, lp in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def tool_call_objects(calls: Sequence[ToolCall], *, indexed: bool = False) -> list[JsonObject]:
    objects: list[JsonObject] = []
    for index, call in enumerate(calls):
        obj: JsonObject = {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        objects.append({"index": index, **obj} if indexed else obj)
    return objects


def chat_choice(
    index: int,
    *,
    content: str,
    calls: Sequence[ToolCall],
    logprobs: Sequence[TokenLogprob] | None,
    finish_reason: str,
    reasoning: str = "",
) -> JsonObject:
    message: JsonObject = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = tool_call_objects(calls)
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason,
    }


def chat_completion(header: Header, choices: Sequence[JsonObject], usage: JsonObject) -> JsonObject:
    return {
        "id": header.completion_id,
        "object": "chat.completion",
        "created": header.created,
        "model": header.model,
        "choices": list(choices),
        "usage": usage,
        "system_fingerprint": None,
        "service_tier": SERVICE_TIER,
    }


def chat_chunk(
    header: Header,
    *,
    delta: JsonObject | None,
    index: int = 0,
    logprobs: Sequence[TokenLogprob] | None = None,
    finish_reason: str | None = None,
    usage_object: JsonObject | None = None,
    include_usage: bool = False,
) -> JsonObject:
    """One stream chunk: a delta of choice `index`, or (`delta` None) the usage chunk with no choices."""
    chunk: JsonObject = {
        "id": header.completion_id,
        "object": "chat.completion.chunk",
        "created": header.created,
        "model": header.model,
        "system_fingerprint": None,
        "service_tier": SERVICE_TIER,
        "choices": []
        if delta is None
        else [
            {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = usage_object
    return chunk


def text_choice(
    index: int,
    *,
    text: str,
    logprobs: Sequence[TokenLogprob] | None,
    finish_reason: str | None,
    text_offset: int = 0,
) -> JsonObject:
    return {
        "text": text,
        "index": index,
        "logprobs": completion_logprobs(logprobs, text_offset) if logprobs is not None else None,
        "finish_reason": finish_reason,
    }


def text_completion(
    header: Header,
    choices: Sequence[JsonObject],
    *,
    usage_object: JsonObject | None,
    include_usage: bool = True,
) -> JsonObject:
    """A whole completion, or one stream chunk (its choices a delta each, or none for the usage chunk)."""
    obj: JsonObject = {
        "id": header.completion_id,
        "object": "text_completion",
        "created": header.created,
        "model": header.model,
        "system_fingerprint": None,
        "choices": list(choices),
    }
    if include_usage:
        obj["usage"] = usage_object
    return obj
