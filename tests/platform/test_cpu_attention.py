"""The CPU attention with a polynomial exp (`courier/platform/cpu_attention.py`) against MLX's own.

conftest installs it as `courier serve` does, so `mx.fast.scaled_dot_product_attention` here is ours and
`cpu_attention._mlx_attention` is MLX's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from courier.platform import cpu_attention

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or mx.default_device().type != mx.DeviceType.cpu,
    reason="the CPU attention needs MLX on the CPU, and g++ for MLX to compile its kernels",
)

TOLERANCE = 6e-6  # from float64 attention: MLX's own float32 attention is 2-4e-6 off on these inputs


def mlx_attention() -> Callable[..., mx.array]:
    assert cpu_attention._mlx_attention is not None, cpu_attention.install().detail
    return cpu_attention._mlx_attention


def random_inputs(
    batch: int, query_heads: int, kv_heads: int, queries: int, keys: int, seed: int = 0
) -> tuple[mx.array, mx.array, mx.array]:
    q_key, k_key, v_key = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((batch, query_heads, queries, 64), key=q_key),
        mx.random.normal((batch, kv_heads, keys, 64), key=k_key) * 3,  # sharper rows: exp over a wide range
        mx.random.normal((batch, kv_heads, keys, 64), key=v_key),
    )


def masks(batch: int, query_heads: int, queries: int, keys: int) -> dict[str, mx.array | str | None]:
    key = mx.random.key(7)
    causal = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None, :]
    # A left-padded batch, as mlx-lm's batched prefill masks it: row 1's first 5 keys are padding.
    padded = mx.broadcast_to(causal, (batch, 1, queries, keys))
    padded = mx.concatenate([padded[:1], padded[1:] & (mx.arange(keys) >= 5)], axis=0)
    return {
        "none": None,
        "causal": "causal",
        "bool per row": padded,
        "bool per head": mx.random.uniform(shape=(batch, query_heads, queries, keys), key=key) > 0.2,
        "additive": mx.where(causal, 0.0, -mx.inf),
        "additive per head": mx.random.normal((1, query_heads, queries, keys), key=key),
    }


@pytest.mark.parametrize(
    "mask_name", ["none", "causal", "bool per row", "bool per head", "additive", "additive per head"]
)
@pytest.mark.parametrize(("query_heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("blocks", ["one block", "blocks of 16 queries"])
def test_prefill_attention_is_ours_and_agrees_with_mlx(
    mask_name: str, query_heads: int, kv_heads: int, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks != "one block":
        monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", 1)  # 40 queries: blocks of 16, 16 and 8
    q, k, v = random_inputs(2, query_heads, kv_heads, queries=40, keys=72)
    mask = masks(2, query_heads, 40, 72)[mask_name]
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.array_equal(served, cpu_attention.attention(q, k, v, scale=0.125, mask=mask)).item()  # ours ran
    exact = float64_attention(q, k, v, 0.125, mask)
    ours = np.abs(np.array(served) - exact).max()
    mlx = np.abs(np.array(mlx_attention()(q, k, v, scale=0.125, mask=mask)) - exact).max()
    assert served.shape == exact.shape == (2, query_heads, 40, 64)
    assert ours < TOLERANCE
    assert ours < 1.5 * mlx  # no less exact than MLX's


def float64_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None) -> np.ndarray:
    queries, keys, values = (np.array(x).astype(np.float64) for x in (q, k, v))
    repeats = queries.shape[1] // keys.shape[1]
    keys, values = np.repeat(keys, repeats, axis=1), np.repeat(values, repeats, axis=1)
    scores = queries @ keys.swapaxes(-1, -2) * scale
    if isinstance(mask, str):
        queried, keyed = queries.shape[2], keys.shape[2]
        mask = mx.arange(keyed - queried, keyed)[:, None] >= mx.arange(keyed)[None, :]
    if mask is not None:
        allowed = np.array(mask)
        scores = np.where(allowed, scores, -np.inf) if allowed.dtype == np.bool_ else scores + allowed
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    result: np.ndarray = (weights / weights.sum(axis=-1, keepdims=True)) @ values
    return result


def test_blocks_agree_inside_mx_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", 1)
    q, k, v = random_inputs(1, 6, 2, queries=40, keys=56)
    compiled = mx.compile(lambda q, k, v: cpu_attention.attention(q, k, v, scale=0.125, mask="causal"))
    eager = cpu_attention.attention(q, k, v, scale=0.125, mask="causal")
    assert mx.allclose(compiled(q, k, v), eager, atol=1e-6).item()


@pytest.mark.parametrize("blocks", ["one block", "blocks of 16 queries"])
@pytest.mark.parametrize("queries", [40, 56])  # 56 queries over 40 keys: the first 16 see no key
def test_causal_with_more_queries_than_keys_agrees_with_mlx(
    blocks: str, queries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks != "one block":
        monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", 1)
    q, k, v = random_inputs(1, 6, 2, queries=queries, keys=40)
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    expected = mlx_attention()(q, k, v, scale=0.125, mask="causal")  # a query that sees no key: the values' mean
    assert mx.allclose(served, expected, atol=TOLERANCE).item()


def test_an_additive_mask_of_the_lowest_float_agrees_with_mlx() -> None:
    q, k, v = random_inputs(1, 4, 4, queries=24, keys=24)
    lowest = float(mx.finfo(mx.float32).min)
    mask = mx.where(mx.arange(24)[:, None] < 3, lowest, mx.zeros((24, 24)))  # the first 3 rows masked everywhere
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert not mx.any(mx.isnan(served)).item()
    assert mx.allclose(served, mlx_attention()(q, k, v, scale=0.125, mask=mask), atol=TOLERANCE).item()


def test_an_argument_it_does_not_know_goes_to_mlx() -> None:
    q, k, v = random_inputs(1, 4, 4, queries=24, keys=24)
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal", force_fused=False)
    assert mx.array_equal(served, mlx_attention()(q, k, v, scale=0.125, mask="causal")).item()


def test_an_unwritable_kernel_cache_turns_it_off_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = str(getattr(mx, "__version__", "unknown"))
    (tmp_path / "mlx" / version).mkdir(parents=True)
    (tmp_path / "mlx" / version / "cpu").write_text("not a directory")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = cpu_attention._install(True)
    assert not report.active
    assert report.detail.startswith("the probe could not run ("), report.detail


def test_decode_steps_and_other_dtypes_stay_on_mlx() -> None:
    q, k, v = random_inputs(1, 6, 2, queries=cpu_attention.MIN_QUERIES - 1, keys=90)
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.array_equal(served, mlx_attention()(q, k, v, scale=0.125, mask="causal")).item()
    q, k, v = (x.astype(mx.float16) for x in random_inputs(1, 6, 2, queries=32, keys=90))
    served = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert served.dtype == mx.float16
    assert mx.array_equal(served, mlx_attention()(q, k, v, scale=0.125, mask="causal")).item()


@pytest.mark.parametrize("blocks", ["one block", "blocks of 16 queries"])
def test_gradients_agree_with_mlx(blocks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if blocks != "one block":
        monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", 1)
    q, k, v = random_inputs(1, 6, 2, queries=40, keys=40)

    def loss(attention: Callable[..., mx.array]) -> Callable[..., mx.array]:
        return lambda q, k, v: (attention(q, k, v, scale=0.125, mask="causal") * v.sum()).sum()

    ours = mx.grad(loss(cpu_attention.attention), argnums=(0, 1, 2))(q, k, v)
    theirs = mx.grad(loss(mlx_attention()), argnums=(0, 1, 2))(q, k, v)
    for mine, expected in zip(ours, theirs, strict=True):
        largest = float(np.abs(np.array(expected)).max())
        assert float(np.abs(np.array(mine - expected)).max()) < 1e-5 * max(largest, 1.0)


def test_the_exponential_is_within_two_ulps_and_underflows_to_zero() -> None:
    exponents = np.concatenate([np.linspace(-126.0, 0.0, 200_001), [-126.4, -127.0, -200.0, -1e30, -np.inf]])
    row_max = mx.zeros((1,))
    got = np.array(cpu_attention.exp2_shifted(mx.array(exponents.astype(np.float32)), row_max))
    expected = np.exp2(exponents.astype(np.float32).astype(np.float64))
    normal = expected >= np.finfo(np.float32).tiny
    relative = np.abs(got[normal] - expected[normal]) / expected[normal]
    assert relative.max() < 2.5e-7
    assert np.all(got[~normal] < np.finfo(np.float32).tiny * 2)
    assert np.all(got[-4:] == 0.0)


def test_traces_stay_bounded_across_many_shapes() -> None:
    compiled = cpu_attention.Compiled(lambda x: x * 2.0 + 1.0)
    for length in range(1, 2 * cpu_attention.COMPILED_SHAPES + 10):
        x = mx.arange(length, dtype=mx.float32)
        assert mx.array_equal(compiled(x), x * 2.0 + 1.0).item()
        assert compiled.traced_shapes <= cpu_attention.COMPILED_SHAPES


def test_turning_it_off_puts_mlx_back_and_on_again_ours() -> None:
    ours = mx.fast.scaled_dot_product_attention
    original = mlx_attention()
    try:
        report = cpu_attention.install(False)
        assert report == cpu_attention.CpuAttention(False, "off by configuration; MLX's own softmax")
        assert mx.fast.scaled_dot_product_attention is original
        assert cpu_attention.install(False) is report
    finally:
        restored = cpu_attention.install(True)
    assert restored.active
    assert mx.fast.scaled_dot_product_attention is not original
    assert mx.fast.scaled_dot_product_attention.__doc__ == ours.__doc__


REPORT = """
import json
from courier.platform.blas import load_optimized_blas
load_optimized_blas()
from courier.platform import cpu_attention
report = cpu_attention.install()
print(json.dumps(report.as_dict()))
"""


@pytest.mark.parametrize(
    ("environment", "reason"),
    [
        ({"MLX_DISABLE_COMPILE": "1"}, "MLX_DISABLE_COMPILE is set; MLX's own softmax"),
        ({"PATH": "/nonexistent"}, "no g++ for MLX to compile CPU kernels with; MLX's own softmax"),
    ],
)
def test_without_compiled_kernels_it_stays_off_and_says_why(environment: dict[str, str], reason: str) -> None:
    env = {**os.environ, **environment}
    result = subprocess.run(
        [sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"active": False, "detail": reason}
