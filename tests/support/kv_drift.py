"""How far a model's next tokens move when it resumes from a quantized prompt-cache snapshot instead of the state as
computed: the measurement behind docs/prompt-cache.md's quality table, shared by tests and bench/snapshot_quality.py.

The prompt is prefilled once at full precision. A reference continuation of `count` tokens is generated greedily from
that state; then the same tokens are fed, in one teacher-forced pass, after each restored state (as computed, and
quantized as the server stores it, once or twice: a conversation's carried-over positions are stored again at each
turn). Per generated position: the difference in the log-probability of the reference's token, and whether the most
likely token is the same. The first position where they differ is where greedy output from the restored state would
leave the reference. Runs MLX in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.model_state import CachedPrefix, compact_copy, prefill, resume


@dataclass(frozen=True, slots=True, kw_only=True)
class Drift:
    positions: int
    mean_abs_logprob: float  # mean |log p_quantized(token) - log p_full(token)| of the reference's tokens
    max_abs_logprob: float
    top1_agreement: float  # share of positions whose most likely token is the same
    first_divergence: int | None  # the first position whose most likely token differs (None: none of them)
    mean_kl: float  # mean KL(full || quantized) over the positions, in nats


def reference_continuation(model: Any, state: list[Any], prompt: Sequence[int], count: int) -> list[int]:
    """`count` tokens generated greedily, one at a time, from `state` (after all of `prompt` but its last token)."""
    _, cache = resume(CachedPrefix(state=state, length=len(prompt) - 1, matched=len(prompt) - 1), len(prompt))
    tokens: list[int] = []
    token = prompt[-1]
    for _ in range(count):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = cast("int", mx.argmax(logits).item())
        tokens.append(token)
    return tokens


def forced_logprobs(model: Any, state: list[Any], prompt: Sequence[int], continuation: Sequence[int]) -> mx.array:
    """Log-probabilities (positions x vocabulary) at each token of `continuation`, fed in one pass after `state`."""
    _, cache = resume(CachedPrefix(state=state, length=len(prompt) - 1, matched=len(prompt) - 1), len(prompt))
    inputs = mx.array([[prompt[-1], *continuation[:-1]]])
    logits: mx.array = model(inputs, cache=cache)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


def compare(full: mx.array, other: mx.array, continuation: Sequence[int]) -> Drift:
    tokens = mx.array(list(continuation))[:, None]
    delta = mx.abs(mx.take_along_axis(other, tokens, axis=-1) - mx.take_along_axis(full, tokens, axis=-1))
    same = mx.argmax(full, axis=-1) == mx.argmax(other, axis=-1)
    kl = mx.sum(mx.exp(full) * (full - other), axis=-1)
    agreeing = cast("list[bool]", same.tolist())
    return Drift(
        positions=len(continuation),
        mean_abs_logprob=_scalar(mx.mean(delta)),
        max_abs_logprob=_scalar(mx.max(delta)),
        top1_agreement=sum(agreeing) / len(agreeing),
        first_divergence=next((index for index, flag in enumerate(agreeing) if not flag), None),
        mean_kl=_scalar(mx.mean(kl)),
    )


def _scalar(value: mx.array) -> float:
    return cast("float", value.item())


def measure(
    model: Any, prompt: Sequence[int], quantizations: Sequence[KvQuantization], count: int = 128
) -> dict[str, Drift]:
    """Per quantization (`label`, and `label x2`: stored a second time after a restore), its drift against the state
    as computed over the first `count` generated tokens."""
    cache = prefill(model, prompt[:-1])
    full, _ = compact_copy(cache)
    continuation = reference_continuation(model, full, prompt, count)
    reference = forced_logprobs(model, full, prompt, continuation)
    found: dict[str, Drift] = {}
    for quantization in quantizations:
        stored, _ = compact_copy(cache, quantization=quantization)
        found[quantization.label] = compare(
            reference, forced_logprobs(model, stored, prompt, continuation), continuation
        )
        _, working = resume(CachedPrefix(state=stored, length=len(prompt) - 1, matched=len(prompt) - 1), len(prompt))
        again, _ = compact_copy(working, quantization=quantization)
        twice = forced_logprobs(model, again, prompt, continuation)
        found[f"{quantization.label} x2"] = compare(reference, twice, continuation)
    return found
