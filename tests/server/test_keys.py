"""The API keys read at start-up: a key flag or file that names no key stops the server instead of failing open."""

from __future__ import annotations

from pathlib import Path

import pytest

from courier.server.errors import ServerFailed
from courier.server.keys import load_api_keys
from courier.settings import Settings
from tests.support.server import run_to_exit


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"api_key": ","}, "--api-key"),
        ({"api_key": " , ,"}, "--api-key"),
        ({"admin_api_key": ","}, "--admin-api-key"),
        ({"api_key": "good", "admin_api_key": " "}, "--admin-api-key"),
    ],
)
def test_a_key_flag_that_names_no_key_stops_start_up(fields: dict[str, str], flag: str) -> None:
    with pytest.raises(ServerFailed, match=f"^{flag} names no key"):
        load_api_keys(Settings(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n  \n"])
def test_a_key_file_that_names_no_key_stops_start_up(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ServerFailed, match=r"--api-key-file .* names no key"):
        load_api_keys(Settings(api_key_file=path))


def test_keys_given_or_none_given_start() -> None:
    assert not load_api_keys(Settings()).enabled  # told nothing: no key is asked for (loopback by default)
    assert len(load_api_keys(Settings(api_key="a, b", admin_api_key="c"))) == 3


def test_the_server_refuses_to_start_with_an_empty_key_file(tmp_path: Path) -> None:
    """Through `courier serve` itself: it exits 1 with the reason, before loading any model."""
    empty = tmp_path / "keys"
    empty.write_text("")
    result = run_to_exit(["--api-key-file", str(empty)])
    assert result.returncode == 1, result.stderr
    assert f"--api-key-file {empty} names no key" in result.stderr
