from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from courier.server.cli import EXIT_USAGE, build_parser, main
from courier.settings import OPTIONS, Settings, SettingsError, resolve
from courier.settings.option import options_of, setting
from courier.settings.parsers import (
    parse_api_prefix,
    parse_bool,
    parse_bytes,
    parse_embedding_pooling,
    parse_kv_bits,
    parse_positive_int,
    parse_prompt_cache_bits,
    parse_prompt_cache_group_size,
    parse_replica_id,
    parse_storage_url,
)


def settings_from(argv: list[str], environ: dict[str, str]) -> Settings:
    return resolve(build_parser().parse_args(["serve", *argv]), environ)


def test_defaults_apply_without_flags_or_environment() -> None:
    settings = settings_from([], {})
    assert settings.port == 8000
    assert settings.host == "127.0.0.1"
    assert settings.model == ()
    assert settings.warmup is True


def test_environment_overrides_default() -> None:
    settings = settings_from([], {"COURIER_PORT": "9001", "COURIER_WARMUP": "off", "COURIER_MAX_BODY_BYTES": "2MiB"})
    assert (settings.port, settings.warmup, settings.max_body_bytes) == (9001, False, 2 * 1024**2)


def test_model_may_be_given_several_times_or_listed_in_the_environment() -> None:
    settings = settings_from(["--model", "a=/m/a", "--model", "/m/b", "--pin", "a,b", "--pin", "c"], {})
    assert (settings.model, settings.pin) == (("a=/m/a", "/m/b"), ("a", "b", "c"))
    settings = settings_from([], {"COURIER_MODEL": "a=/m/a; /m/b", "COURIER_PIN": "a"})
    assert (settings.model, settings.pin) == (("a=/m/a", "/m/b"), ("a",))
    assert settings_from(["--model", "/m/c"], {"COURIER_MODEL": "/m/a;/m/b"}).model == ("/m/c",)


def test_cli_beats_environment() -> None:
    settings = settings_from(["--port", "9002", "--warmup"], {"COURIER_PORT": "9001", "COURIER_WARMUP": "0"})
    assert (settings.port, settings.warmup) == (9002, True)


@pytest.mark.parametrize(
    ("variable", "raw", "field"),
    [
        ("COURIER_PORT", "eighty", "port"),
        ("COURIER_PORT", "70000", "port"),
        ("COURIER_WARMUP", "maybe", "warmup"),
        ("COURIER_MAX_BODY_BYTES", "lots", "max_body_bytes"),
        ("COURIER_SHUTDOWN_TIMEOUT", "-1", "shutdown_timeout"),
        ("COURIER_WEIGHT_FORMAT", "int3", "weight_format"),
    ],
)
def test_unparseable_environment_warns_and_keeps_default(
    variable: str, raw: str, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        settings = settings_from([], {variable: raw})
    assert getattr(settings, field) == getattr(Settings(), field)
    assert variable in caplog.text


def test_unknown_courier_variable_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        settings_from([], {"COURIER_PROT": "1"})
    assert "COURIER_PROT" in caplog.text


def test_bad_cli_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--port", "x"])
    assert exit_info.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_help_names_every_flag_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in OPTIONS:
        assert option.flag in text
        assert option.env in text
    assert "default: 8000" in text


def test_each_setting_is_declared_once_as_a_field() -> None:
    settings_fields = dataclasses.fields(Settings)
    assert [option.name for option in OPTIONS] == [field.name for field in settings_fields]
    assert [option.default for option in OPTIONS] == [field.default for field in settings_fields]
    defaults = Settings()
    for option in OPTIONS:
        assert option.default == getattr(defaults, option.name), option.name


def test_a_field_without_option_metadata_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Partial:
        declared: int = setting(1, parse_positive_int, "a declared option", metavar="N")
        bare: int = 2

    with pytest.raises(TypeError, match=r"Partial\.bare has no option metadata"):
        options_of(Partial)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Complete:
        declared: int = setting(1, parse_positive_int, "a declared option", metavar="N")

    (option,) = options_of(Complete)
    assert (option.name, option.default, option.help, option.metavar, option.is_flag) == (
        "declared",
        1,
        "a declared option",
        "N",
        False,
    )
    assert (option.flag, option.env, option.parse("3")) == ("--declared", "COURIER_DECLARED", 3)


def test_every_setting_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "environment-variables.md").read_text()
    for option in OPTIONS:
        assert option.env in doc, option.env
        assert option.flag in doc, option.flag


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1048576", 1048576), ("512KiB", 512 * 1024), ("32MiB", 32 * 1024**2), ("2GB", 2 * 1000**3), ("1g", 1000**3)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "1.5MiB", "MiB", "12 parsecs"])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("YES", True), ("on", True), ("0", False), ("off", False)])
def test_parse_bool(text: str, expected: bool) -> None:
    assert parse_bool(text) is expected


@pytest.mark.parametrize(("text", "expected"), [("", ""), ("/courier", "/courier"), ("/a/b/", "/a/b"), ("/", "")])
def test_parse_api_prefix(text: str, expected: str) -> None:
    assert parse_api_prefix(text) == expected


@pytest.mark.parametrize("text", ["courier", "/a b", "/x?y=1"])
def test_parse_api_prefix_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="API prefix"):
        parse_api_prefix(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("  ", None),
        ("postgresql://courier:pw@db:5432/courier", "postgresql://courier:pw@db:5432/courier"),
        ("postgres://db/courier", "postgres://db/courier"),
        ("PostgreSQL://db/courier", "PostgreSQL://db/courier"),
    ],
)
def test_parse_storage_url(text: str, expected: str | None) -> None:
    assert parse_storage_url(text) == expected


@pytest.mark.parametrize(
    "text", ["mysql://user:hunter2@db/x", "sqlite:///tmp/hunter2.db", "hunter2", "postgresq://u:hunter2@db"]
)
def test_parse_storage_url_refuses_without_repeating_the_url(text: str) -> None:
    with pytest.raises(ValueError, match="postgresql://") as error:
        parse_storage_url(text)
    assert "hunter2" not in str(error.value)


def test_storage_selects_postgres_by_flag_or_environment() -> None:
    url = "postgresql://courier:pw@db/courier"
    assert settings_from([], {}).storage is None
    assert settings_from([], {"COURIER_STORAGE": url}).storage == url
    assert settings_from(["--storage", url], {"COURIER_STORAGE": "postgres://other/x"}).storage == url


def test_a_bad_storage_url_stops_the_start_and_never_shows_the_password(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(SettingsError, match="COURIER_STORAGE"):
        settings_from([], {"COURIER_STORAGE": "postgresq://u:hunter2@db/x"})  # not SQLite: that would split replicas
    with caplog.at_level(logging.ERROR):
        assert main(["serve"], {"COURIER_STORAGE": "mysql://u:hunter2@db/x"}) == EXIT_USAGE
    assert "COURIER_STORAGE" in caplog.text and "hunter2" not in caplog.text
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--storage", "mysql://u:hunter2@db/x"])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--storage" in err and "hunter2" not in err


@pytest.mark.parametrize(
    ("text", "expected"), [("", None), (" ", None), ("r1", "r1"), ("gpu-a", "gpu-a"), ("a" * 16, "a" * 16)]
)
def test_parse_replica_id(text: str, expected: str | None) -> None:
    assert parse_replica_id(text) == expected


@pytest.mark.parametrize("text", ["R1", "r_1", "r.1", "a" * 17, "r 1", "é"])
def test_parse_replica_id_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="replica id"):
        parse_replica_id(text)


def test_replica_id_by_flag_or_environment_and_a_bad_one_stops_the_start() -> None:
    assert settings_from([], {}).replica_id is None
    assert settings_from([], {"COURIER_REPLICA_ID": "r2"}).replica_id == "r2"
    assert settings_from(["--replica-id", "r3"], {"COURIER_REPLICA_ID": "r2"}).replica_id == "r3"
    with pytest.raises(SettingsError, match="COURIER_REPLICA_ID"):  # no token would route this replica's ids
        settings_from([], {"COURIER_REPLICA_ID": "Replica_2"})


def test_embedding_pooling_is_a_name_and_a_pooling_each() -> None:
    assert parse_embedding_pooling("mean") == ("=mean",)
    assert parse_embedding_pooling("chat=last, coder = mean") == ("chat=last", "coder=mean")
    with pytest.raises(ValueError, match="mean, last"):
        parse_embedding_pooling("chat=max")
    given = settings_from(["--embedding-pooling", "a=mean", "--embedding-pooling", "b=last"], {})
    assert given.embedding_pooling == ("a=mean", "b=last")


@pytest.mark.parametrize(
    ("text", "expected"), [("8", 8), ("4", 4), (" 8 ", 8), ("off", None), ("", None), ("none", None), ("0", None)]
)
@pytest.mark.parametrize("parse", [parse_prompt_cache_bits, parse_kv_bits])
def test_the_bits_settings(text: str, expected: int | None, parse: Callable[[str], int | None]) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize("text", ["16", "2", "eight", "8.0"])
@pytest.mark.parametrize("parse", [parse_prompt_cache_bits, parse_kv_bits])
def test_the_bits_settings_refuse(text: str, parse: Callable[[str], int | None]) -> None:
    with pytest.raises(ValueError, match="8, 4 or off"):
        parse(text)


@pytest.mark.parametrize(("text", "expected"), [("32", 32), ("64", 64), ("128", 128)])
def test_the_group_size_setting(text: str, expected: int) -> None:
    assert parse_prompt_cache_group_size(text) == expected


@pytest.mark.parametrize("text", ["16", "48", "256", "x"])
def test_the_group_size_setting_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_prompt_cache_group_size(text)


def test_quantized_snapshots_are_off_unless_asked_for_by_flag_or_environment() -> None:
    assert settings_from([], {}).prompt_cache_bits is None
    assert settings_from([], {}).prompt_cache_group_size == 64
    chosen = settings_from(["--prompt-cache-bits", "4"], {"COURIER_PROMPT_CACHE_GROUP_SIZE": "32"})
    assert (chosen.prompt_cache_bits, chosen.prompt_cache_group_size) == (4, 32)
    assert settings_from([], {"COURIER_PROMPT_CACHE_BITS": "8"}).prompt_cache_bits == 8


def test_a_quantized_batch_kv_is_off_unless_asked_for_by_flag_or_environment() -> None:
    assert (settings_from([], {}).kv_bits, settings_from([], {}).kv_group_size) == (None, 64)
    chosen = settings_from(["--kv-bits", "4"], {"COURIER_KV_GROUP_SIZE": "32"})
    assert (chosen.kv_bits, chosen.kv_group_size) == (4, 32)
    assert settings_from([], {"COURIER_KV_BITS": "8"}).kv_bits == 8
