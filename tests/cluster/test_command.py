"""`courier cluster haproxy-config`: flags in, configuration out; bad flags are a usage error."""

from __future__ import annotations

import logging

import pytest

from courier.server.cli import EXIT_USAGE, main


def test_it_prints_the_configuration_for_the_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cluster", "haproxy-config", "--replica", "10.0.0.1:8000", "--replica", "b=10.0.0.2:8000"]
    assert main([*argv, "--port", "9000", "--max-body-bytes", "1MiB", "--balance-factor", "125"], {}) == 0
    text = capsys.readouterr().out
    assert "bind 0.0.0.0:9000" in text
    assert "server r1 10.0.0.1:8000" in text and "server b 10.0.0.2:8000" in text
    assert "hash-balance-factor 125" in text
    assert "tune.bufsize 1115136" in text  # 1 MiB + 64 KiB of headers + 1 KiB kept for rewrites


def test_route_body_bytes_sets_how_much_of_a_body_the_front_reads(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cluster", "haproxy-config", "--replica", "10.0.0.1:8000", "--route-body-bytes", "256KiB"]
    assert main(argv, {}) == 0
    assert "tune.bufsize 328704" in capsys.readouterr().out  # 256 KiB + 64 KiB + 1 KiB


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--replica", "Bad=h:1"],
        ["--replica", "h:1", "--replica", "h:1"],
        ["--replica", "h:1", "--balance-factor", "90"],
        ["--replica", "h:1", "--route-body-bytes", "0"],
    ],
)
def test_flags_that_describe_no_front_are_a_usage_error(argv: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["cluster", "haproxy-config", *argv], {}) == EXIT_USAGE
    assert caplog.text


def test_a_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "haproxy-config", "--replica", "h:1", "--max-body-bytes", "lots"], {})
    assert exit_info.value.code == EXIT_USAGE
    assert "--max-body-bytes" in capsys.readouterr().err
