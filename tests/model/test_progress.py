from __future__ import annotations

import io

import pytest

from courier.model.progress import Progress


def test_step_reports_start_percentages_and_duration_on_a_pipe() -> None:
    stream = io.StringIO()
    with Progress(stream).step("converting", total=20) as step:
        for _ in range(20):
            step.advance()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "courier: converting ..."
    assert [line for line in lines if line.endswith("%")] == [f"  converting: {p}%" for p in range(10, 101, 10)]
    assert lines[-1].startswith("courier: converting done in ")


def test_failed_step_says_so() -> None:
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Progress(stream).step("loading"):
        raise RuntimeError("boom")
    assert "courier: loading failed after" in stream.getvalue()


def test_disabled_progress_writes_nothing() -> None:
    stream = io.StringIO()
    with Progress(stream, enabled=False).step("quiet", total=2) as step:
        step.advance(2)
    assert stream.getvalue() == ""
