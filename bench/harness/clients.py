"""Clients of a server under measure: the official `openai` client (no retries), and one timed streaming chat
completion that every bench's TTFT and decode rate come from."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema

from bench.harness.stats import percentile

REQUEST_TIMEOUT_S = 900.0
Messages = list[ChatCompletionMessageParam]


def async_client(base_url: str, timeout: float = REQUEST_TIMEOUT_S) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=timeout)


def sync_client(base_url: str, timeout: float = REQUEST_TIMEOUT_S) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=timeout)


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


@dataclass(frozen=True, slots=True, kw_only=True)
class Streamed:
    """One streamed chat completion, timed on `time.perf_counter()`: sent, first and last content delta (the finish
    chunk, then the end, when no delta carries text), done. `texts` by choice index; `headers` those asked for."""

    label: str
    texts: dict[int, str]
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int
    content_deltas: int
    finish_reason: str | None
    sent: float
    first_token: float
    last_token: float
    done: float
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent

    @property
    def total_s(self) -> float:
        return self.done - self.sent

    @property
    def decode_tps(self) -> float:
        """(completion tokens - 1) / (last - first content delta): mlx-lm's figure counts one token more."""
        span = self.last_token - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else math.nan


async def stream_chat(
    client: openai.AsyncOpenAI,
    model: str,
    messages: Messages,
    *,
    max_tokens: int,
    label: str = "",
    temperature: float = 0.0,
    keep_headers: Sequence[str] = (),
    **extra: Any,
) -> Streamed:
    """Stream one chat completion (`extra`: more request fields, `openai` client keywords) with usage."""
    sent = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    headers = {name: raw.headers.get(name, "?") for name in keep_headers}
    texts: dict[int, str] = {}
    stamps: list[float] = []
    finish_reason: str | None = None
    finished: float | None = None
    usage: Any = None
    async for chunk in raw.parse():
        now = time.perf_counter()
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                stamps.append(now)
                texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
            if choice.finish_reason is not None:
                finish_reason = finish_reason or choice.finish_reason
                finished = finished or now
    done = time.perf_counter()
    first = stamps[0] if stamps else (finished or done)
    details = usage.prompt_tokens_details if usage is not None else None
    return Streamed(
        label=label,
        texts=texts,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=details.cached_tokens if details is not None else None,
        completion_tokens=usage.completion_tokens if usage is not None else len(stamps),
        content_deltas=len(stamps),
        finish_reason=finish_reason,
        sent=sent,
        first_token=first,
        last_token=stamps[-1] if stamps else first,
        done=done,
        headers=headers,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Burst:
    """Streams sent together: all completion tokens / (first sent .. last done), TTFT percentiles, replies cut."""

    streams: list[Streamed]

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens_per_stream)

    @property
    def tokens_per_stream(self) -> list[int]:
        return [stream.completion_tokens for stream in self.streams]

    @property
    def capped(self) -> int:
        """Streams cut by max_tokens."""
        return sum(stream.finish_reason == "length" for stream in self.streams)

    @property
    def wall_s(self) -> float:
        return max(s.done for s in self.streams) - min(s.sent for s in self.streams)

    @property
    def tps(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else math.nan

    def ttft(self, fraction: float) -> float:
        return percentile([stream.ttft_s for stream in self.streams], fraction)


async def burst(streams: Sequence[Awaitable[Streamed]]) -> Burst:
    return Burst(streams=list(await asyncio.gather(*streams)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """One arm's burst in round `index` of a comparison of two arms over the same requests."""

    arm: str
    index: int
    burst: Burst
    valid_json: int | None = None  # a constrained arm's replies that parse and validate

    def cells(self) -> str:
        """round | arm | tokens | tokens per stream | capped | wall s | tok/s, as a table row's start."""
        b = self.burst
        per_stream = f"{min(b.tokens_per_stream)}-{max(b.tokens_per_stream)}"
        return (
            f"{self.index} | {self.arm} | {b.completion_tokens} | {per_stream} | {b.capped}/{len(b.streams)} "
            f"| {b.wall_s:.2f} | {b.tps:.1f}"
        )


def pooled_tps(rounds: Sequence[Round], arm: str) -> float:
    """An arm's completion tokens over its rounds' wall time, all rounds pooled."""
    mine = [r.burst for r in rounds if r.arm == arm]
    wall = sum(b.wall_s for b in mine)
    return sum(b.completion_tokens for b in mine) / wall if wall > 0 else math.nan


def json_schema_format(name: str, schema: dict[str, Any]) -> ResponseFormatJSONSchema:
    """A strict `response_format` json_schema."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
