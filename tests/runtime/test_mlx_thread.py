from __future__ import annotations

import subprocess
import sys
import threading

import pytest

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
