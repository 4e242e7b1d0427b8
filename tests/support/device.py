"""How closely two computations of the same values agree on the MLX device the tests run on.

On the CPU (float32 through OpenBLAS) the engine tests compare a sequence run alone with the same sequence in a batch
(or verified with drafts) token for token, and logprobs and cached states to 1e-3 / 1e-4. On CUDA, float32 matrix
products run on TF32 tensor cores and the kernel depends on the shapes: on an H200 (scripts/gpu-check.sh, 2026-12-04)
the same logprob differed by up to 1.09e-3 between a verified step and a plain one, a boundary state cut from a prompt's
prefill missed 1e-4, and sampled continuations moved to a neighbouring token where a draw fell near a boundary of the
distribution. There the tolerances below are wider.

Whether a row computes bitwise alike alone and in a batch is the BLAS kernel's choice, not the CPU backend's: OpenBLAS
0.3.21's Zen kernels (AMD EPYC, 2026-12-05) give a product's first row the same bits for 1 to 3 rows and other bits
from 4 rows on, and a seeded sample of a speculative batch moved to a neighbouring token (its logprobs 1e-6 apart).
So the tests that need sampled draws equal across batch shapes (`bitwise_across_shapes`) ask the device first: they
run where a row's product is bitwise alike in every batch shape up to 16 rows, and are skipped elsewhere.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from courier.platform.blas import load_optimized_blas

ON_CPU = mx.default_device().type == mx.DeviceType.cpu

# A logprob computed in two batch shapes (a plain step against a verified one, a row alone against in a batch).
LOGPROB_ABS = 1e-3 if ON_CPU else 1e-2
# A KV state computed in two ways (cut from a longer prefill against prefilled alone).
STATE_ATOL = 1e-4 if ON_CPU else 1e-2


def rows_compute_bitwise_alike(columns: int = 64, rows: int = 16) -> bool:
    """Whether a product's first row has the same bits alone as in a batch of 2 .. `rows` rows (seeded, float32)."""
    load_optimized_blas()  # the BLAS the tests run on (idempotent; conftest loads it first)
    input_key, weight_key = mx.random.split(mx.random.key(0))
    inputs = mx.random.normal((rows, columns), key=input_key)
    weight = mx.random.normal((columns, 4 * columns), key=weight_key)
    alone = inputs[:1] @ weight
    return all(mx.array_equal(alone[0], (inputs[:count] @ weight)[0]).item() for count in range(2, rows + 1))


bitwise_across_shapes = pytest.mark.skipif(
    not (ON_CPU and rows_compute_bitwise_alike()),
    reason="sampled draws equal across batch shapes need rows computed bitwise alike, and this device's kernels "
    "(TF32 on CUDA, some OpenBLAS CPU kernels) differ in the last bits by batch shape (tests/support/device.py)",
)
