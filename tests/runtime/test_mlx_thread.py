from __future__ import annotations

import logging
import subprocess
import sys
import threading
from functools import partial

import pytest

from courier.runtime import mlx_thread
from courier.runtime.mlx_thread import THREAD_NAME, MlxThread, MlxThreadClosed


@pytest.mark.anyio
async def test_work_runs_on_the_one_mlx_thread_and_errors_come_back() -> None:
    worker = MlxThread()
    names = {await worker.call(lambda: threading.current_thread().name) for _ in range(3)}
    assert names == {THREAD_NAME}

    def fail() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        await worker.call(fail)
    assert worker.close(timeout=5)
    with pytest.raises(MlxThreadClosed):
        await worker.call(lambda: 1)


def _square(value: int) -> int:
    return value * value


@pytest.mark.anyio
async def test_a_call_that_holds_the_thread_past_the_threshold_is_logged_with_its_name(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = MlxThread()
    with caplog.at_level(logging.DEBUG, logger=mlx_thread.__name__):
        assert await worker.call(partial(_square, 3)) == 9
        assert not [record for record in caplog.records if "_square" in record.getMessage()]
        monkeypatch.setattr(mlx_thread, "SLOW_CALL_S", 0.0)
        assert await worker.call(partial(_square, 4)) == 16
    assert worker.close(timeout=5)
    held = [record.getMessage() for record in caplog.records if "MLX thread held" in record.getMessage()]
    assert len(held) == 1 and held[0].endswith("by _square")


EXIT_SCRIPT = """
import anyio, mlx.core as mx
from courier.runtime.mlx_thread import MlxThread
async def main():
    worker = MlxThread()
    await worker.call(lambda: mx.eval(mx.random.normal((128, 128)) @ mx.random.normal((128, 128))))
    assert worker.close(timeout=5)
anyio.run(main)
"""


def test_a_process_that_used_mlx_on_the_thread_exits_cleanly() -> None:
    # MLX aborts at exit in most runs when a thread that used it has ended; the parked thread avoids that.
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr
