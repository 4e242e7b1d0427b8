"""How closely two computations of the same values agree on the MLX device the tests run on.

On the CPU (float32 through OpenBLAS) a batch's rows compute alike whatever the batch's shape, so the engine tests
compare a sequence run alone with the same sequence in a batch (or verified with drafts) token for token, and logprobs
and cached states to 1e-3 / 1e-4. On CUDA, float32 matrix products run on TF32 tensor cores and the kernel depends on
the shapes: on an H200 (scripts/gpu-check.sh, 2026-12-04) the same logprob differed by up to 1.09e-3 between a
verified step and a plain one, a boundary state cut from a prompt's prefill missed 1e-4, and sampled continuations
moved to a neighbouring token where a draw fell near a boundary of the distribution. There the tolerances below are
wider, and the tests that need sampled draws equal across batch shapes are skipped (`bitwise_across_shapes`).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

ON_CPU = mx.default_device().type == mx.DeviceType.cpu

# A logprob computed in two batch shapes (a plain step against a verified one, a row alone against in a batch).
LOGPROB_ABS = 1e-3 if ON_CPU else 1e-2
# A KV state computed in two ways (cut from a longer prefill against prefilled alone).
STATE_ATOL = 1e-4 if ON_CPU else 1e-2

bitwise_across_shapes = pytest.mark.skipif(
    not ON_CPU,
    reason="sampled draws equal across batch shapes need rows computed bitwise alike (MLX's CPU backend); "
    "on CUDA the TF32 kernels chosen by shape differ in the last bits (tests/support/device.py)",
)
