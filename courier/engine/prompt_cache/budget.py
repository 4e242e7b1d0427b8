"""The snapshot store's default byte budget, sized from the model's state and the device's memory.

Per-token state bytes (attention KV) and fixed bytes (recurrent/SSM layers) are
measured by running the model on two short prompts and weighing the caches, so
every architecture mlx-lm supports is sized the same way. The budgets are sized from
the state as the model computes it; with quantized snapshots (`--prompt-cache-bits`)
the same bytes hold proportionally more conversations, and the explanation says how
many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.model_state import compact_copy

MIN_BUDGET = 512 * 1024**2
TYPICAL_CONVERSATIONS = 8
TYPICAL_TOKENS = 4096
# The disk tier's default: room for this many conversations (and at least this many memory budgets), at least
# MIN_DISK_BUDGET, at most half the disk space free to it.
DISK_CONVERSATIONS = 32
DISK_MEMORY_MULTIPLE = 4
MIN_DISK_BUDGET = 1024**3
_SHORT, _LONG = 8, 24


@dataclass(frozen=True, slots=True, kw_only=True)
class StateFootprint:
    per_token_bytes: int
    fixed_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    capacity_bytes: int
    explanation: str


def measure_footprint(model: Any, quantization: KvQuantization | None = None) -> StateFootprint:
    """On the MLX thread: the state bytes of a cache after _SHORT and after _LONG tokens (as stored)."""
    short, long = _state_bytes(model, _SHORT, quantization), _state_bytes(model, _LONG, quantization)
    per_token = max(0, (long - short) // (_LONG - _SHORT))
    return StateFootprint(per_token_bytes=per_token, fixed_bytes=max(0, short - per_token * _SHORT))


def default_budget(footprint: StateFootprint, available_bytes: int, stored: StateFootprint | None = None) -> Budget:
    """Sized from `footprint` (the state as computed); `stored`: its quantized form, whose count the explanation
    adds."""
    per_conversation = footprint.per_token_bytes * TYPICAL_TOKENS + footprint.fixed_bytes
    wanted = TYPICAL_CONVERSATIONS * per_conversation
    ceiling = available_bytes // 4
    capacity = min(max(wanted, MIN_BUDGET), ceiling)
    explanation = (
        f"{footprint.per_token_bytes} B/token + {footprint.fixed_bytes} B fixed per conversation; "
        f"room for {TYPICAL_CONVERSATIONS} conversations of {TYPICAL_TOKENS} tokens = {wanted} B, "
        f"at least {MIN_BUDGET} B, at most a quarter of {available_bytes} B available"
    )
    return Budget(capacity_bytes=capacity, explanation=explanation + _stored_note(capacity, stored))


def default_disk_budget(
    footprint: StateFootprint, memory_capacity: int, disk_available: int, stored: StateFootprint | None = None
) -> Budget:
    """`disk_available`: the bytes free on the disk tier's file system plus those its files already take."""
    per_conversation = footprint.per_token_bytes * TYPICAL_TOKENS + footprint.fixed_bytes
    wanted = max(DISK_CONVERSATIONS * per_conversation, DISK_MEMORY_MULTIPLE * memory_capacity, MIN_DISK_BUDGET)
    capacity = min(wanted, disk_available // 2)
    explanation = (
        f"room for {DISK_CONVERSATIONS} conversations of {TYPICAL_TOKENS} tokens or {DISK_MEMORY_MULTIPLE} memory "
        f"budgets, at least {MIN_DISK_BUDGET} B = {wanted} B, at most half of {disk_available} B free"
    )
    return Budget(capacity_bytes=capacity, explanation=explanation + _stored_note(capacity, stored))


def conversations_held(capacity: int, footprint: StateFootprint, tokens: int = TYPICAL_TOKENS) -> int:
    """How many conversations of `tokens` tokens `capacity` bytes hold at `footprint`."""
    per_conversation = footprint.per_token_bytes * tokens + footprint.fixed_bytes
    return capacity // per_conversation if per_conversation > 0 else 0


def _stored_note(capacity: int, stored: StateFootprint | None) -> str:
    if stored is None:
        return ""
    held = conversations_held(capacity, stored)
    return (
        f"; stored quantized at {stored.per_token_bytes} B/token + {stored.fixed_bytes} B fixed, it holds {held} "
        f"conversations of {TYPICAL_TOKENS} tokens"
    )


def available_memory() -> int:
    """MemAvailable on Linux; the physical memory elsewhere (Metal shares it with the CPU)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _state_bytes(model: Any, tokens: int, quantization: KvQuantization | None) -> int:
    cache = make_prompt_cache(model)
    model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
    return compact_copy(cache, quantization=quantization)[1]
