"""The /v1/embeddings request's checks and the answer's encodings, without a server."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from courier.http.embeddings_request import encoded, parse_embeddings_request, shaped
from courier.http.errors import ApiError
from courier.http.schemas.embeddings import MAX_INPUTS

ACCEPTED: list[tuple[Any, tuple[Any, ...]]] = [
    ("hi", ("hi",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    ([[1], "x"], ((1,), "x")),
]


@pytest.mark.parametrize(("value", "inputs"), ACCEPTED)
def test_every_input_shape_openai_takes(value: Any, inputs: tuple[Any, ...]) -> None:
    assert parse_embeddings_request({"input": value}).inputs == inputs


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [True]}, "input[0]"),
    ({"input": ["a", {"x": 1}]}, "input[1]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": True}, "dimensions"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_a_bad_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_embeddings_request(body)
    assert (error.value.status, error.value.param) == (400, param)


def test_dimensions_truncate_and_normalize_again() -> None:
    assert shaped([0.6, 0.8, 0.0], None) == [0.6, 0.8, 0.0]
    assert shaped([0.6, 0.8, 0.0], 1) == [1.0]
    assert shaped([0.0, 0.0, 1.0], 2) == [0.0, 0.0]  # nothing left to normalize


def test_base64_is_little_endian_float32() -> None:
    text = encoded([1.0, -0.5], "base64")
    assert isinstance(text, str)
    assert struct.unpack("<2f", base64.b64decode(text)) == (1.0, -0.5)
    assert encoded([1.0], "float") == [1.0]
