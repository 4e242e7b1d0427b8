"""How the prompt cache stores attention KV: as the model computed it, or quantized (`--prompt-cache-bits`).

Pure: which layers are quantized, what shapes their stored arrays take, what a
stored token costs in bytes, and whether a model's head dimensions allow a group
size. MLX's affine quantization packs each group of `group_size` values of a row's
last axis (the head dimension) into `bits`-bit integers, 32 / `bits` to a uint32,
with one scale and one bias per group in the values' own dtype. Groups never cross
positions, so a position's stored values do not depend on any other position.
Only plain attention KV caches are quantized; recurrent and convolution state
(a hybrid model's `ArraysCache` layers), sliding-window and chunked caches stay
exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization supports
DEFAULT_GROUP_SIZE = 64
# The one mlx-lm cache class whose layers are stored quantized, and the class they are stored as.
QUANTIZED_CLASS = "KVCache"
STORED_CLASS = "QuantizedKVCache"
_PACK_BITS = 32  # values are packed into uint32 words
_PACKED_ITEMSIZE = 4
# The options a refusal names: the prompt cache's, or the running batch's (`--kv-bits`).
PROMPT_CACHE_FLAGS = ("--prompt-cache-bits", "--prompt-cache-group-size")
BATCH_KV_FLAGS = ("--kv-bits", "--kv-group-size")


class QuantizationRefused(ValueError):
    """A quantization the served model's attention cannot take (its head dimension is not a multiple of the group)."""


@dataclass(frozen=True, slots=True)
class KvQuantization:
    """Attention KV stored with `bits` bits per value, in groups of `group_size` values along the head dimension."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"prompt-cache bits must be one of {', '.join(map(str, BITS))}, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise ValueError(f"the prompt-cache group size must be one of {sizes}, not {self.group_size}")

    @property
    def label(self) -> str:
        """How the identity and logs name it: `8-bit/64`."""
        return f"{self.bits}-bit/{self.group_size}"

    def fits(self, head_dim: int) -> bool:
        return head_dim > 0 and head_dim % self.group_size == 0 and head_dim * self.bits % _PACK_BITS == 0

    def packed_width(self, head_dim: int) -> int:
        """uint32 words holding one position's `head_dim` values."""
        return head_dim * self.bits // _PACK_BITS

    def groups(self, head_dim: int) -> int:
        """Scales (and biases) per position."""
        return head_dim // self.group_size

    def stored_shapes(self, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The packed values' shape and the scales' (= the biases') shape stored for KV of `shape` (..., head_dim)."""
        *outer, head_dim = shape
        if not self.fits(head_dim):
            raise QuantizationRefused(f"a head dimension of {head_dim} is not a multiple of {self.group_size}")
        return (*outer, self.packed_width(head_dim)), (*outer, self.groups(head_dim))

    def row_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes stored for one position of one head's keys (or values): packed values, scales and biases."""
        return self.packed_width(head_dim) * _PACKED_ITEMSIZE + 2 * self.groups(head_dim) * itemsize

    def header(self) -> dict[str, int]:
        """As a snapshot file's header states it."""
        return {"bits": self.bits, "group_size": self.group_size}

    @classmethod
    def from_header(cls, value: Any) -> KvQuantization | None:
        """A file header's `quantization` field (None: stored as computed). Raises `ValueError` for anything else."""
        if value is None:
            return None
        if not isinstance(value, dict) or value.keys() != {"bits", "group_size"}:
            raise ValueError(f"not a quantization: {str(value)[:80]}")
        bits, group_size = value["bits"], value["group_size"]
        if type(bits) is not int or type(group_size) is not int:
            raise ValueError(f"not a quantization: {str(value)[:80]}")
        return cls(bits=bits, group_size=group_size)


def quantization_from_settings(bits: int | None, group_size: int) -> KvQuantization | None:
    """`--prompt-cache-bits` (None: off) and `--prompt-cache-group-size` as one value; raises `ValueError`."""
    return None if bits is None else KvQuantization(bits=bits, group_size=group_size)


def quantized_layers(classes: Sequence[str]) -> tuple[bool, ...]:
    """Per layer (by its mlx-lm cache class name), whether it is stored quantized."""
    return tuple(name == QUANTIZED_CLASS for name in classes)


def check_head_dims(
    head_dims: Iterable[int], quantization: KvQuantization, flags: tuple[str, str] = PROMPT_CACHE_FLAGS
) -> None:
    """Raise `QuantizationRefused` unless every attention head dimension (keys' and values') fits the group size;
    `flags`: the bits and group-size options the message names."""
    misfits = sorted({dim for dim in head_dims if not quantization.fits(dim)})
    if misfits:
        dims = ", ".join(map(str, misfits))
        raise QuantizationRefused(
            f"{flags[1]} {quantization.group_size} does not divide the model's attention head "
            f"dimension ({dims}): choose a group size that does ({_fitting_sizes(misfits, flags[0])})"
        )


def kv_bytes(shape: Sequence[int], itemsize: int, quantization: KvQuantization | None) -> int:
    """Bytes stored for one attention layer's keys and values of `shape` (batch, heads, positions, head_dim)."""
    *outer, head_dim = shape
    rows = 1
    for size in outer:
        rows *= size
    per_row = head_dim * itemsize if quantization is None else quantization.row_bytes(head_dim, itemsize)
    return 2 * rows * per_row


def compression(head_dim: int, itemsize: int, quantization: KvQuantization) -> float:
    """How many times smaller a stored attention position is than as computed (8-bit/64 of float32: 3.56)."""
    return head_dim * itemsize / quantization.row_bytes(head_dim, itemsize)


def _fitting_sizes(head_dims: Sequence[int], bits_flag: str) -> str:
    sizes = [size for size in GROUP_SIZES if all(dim > 0 and dim % size == 0 for dim in head_dims)]
    return ", ".join(map(str, sizes)) if sizes else f"none does: leave {bits_flag} off for this model"
