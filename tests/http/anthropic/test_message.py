"""The reply's shapes: usage split as Anthropic's, stop reasons, content blocks, and the stop sequence found."""

from __future__ import annotations

import pytest

from courier.core.failure_codes import FailureCode
from courier.core.tools.calls import ToolCall
from courier.http.anthropic.message import Usage, content_blocks, stop_reason
from courier.http.anthropic.run import reached_stop
from courier.http.errors import ApiError

CALL = ToolCall(id="call_7", name="f", arguments='{"a": [1]}')


def test_usage_splits_the_prompt_into_read_and_the_rest_and_never_reports_creation() -> None:
    usage = Usage(prompt_tokens=100, output_tokens=7, cached_tokens=60, thinking_tokens=3)
    assert usage.as_dict() == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 60,
        "output_tokens": 7,
        "output_tokens_details": {"thinking_tokens": 3},
        "service_tier": "standard",
    }
    # A hit never covers a prompt's last token, which is always prefilled.
    assert Usage(prompt_tokens=5, output_tokens=0, cached_tokens=9).as_dict()["input_tokens"] == 1


@pytest.mark.parametrize(
    ("cut", "calls", "stop", "reason"),
    [
        (True, [CALL], None, "max_tokens"),
        (False, [CALL], None, "tool_use"),
        (False, [], "END", "stop_sequence"),
        (False, [], None, "end_turn"),
    ],
)
def test_stop_reasons(cut: bool, calls: list[ToolCall], stop: str | None, reason: str) -> None:
    assert stop_reason(cut=cut, calls=calls, stop_sequence=stop) == reason
    by_window = "model_context_window_exceeded" if cut else reason  # the limit that cut it was the window's
    assert stop_reason(cut=cut, calls=calls, stop_sequence=stop, window_capped=True) == by_window


def test_content_blocks_in_order_whitespace_text_dropped() -> None:
    assert content_blocks("hmm", "  \n", [CALL]) == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "tool_use", "id": "toolu_7", "name": "f", "input": {"a": [1]}},
    ]
    assert content_blocks("", "Hi", []) == [{"type": "text", "text": "Hi"}]


@pytest.mark.parametrize(
    ("decoded", "sent", "stops", "found"),
    [
        ("The answer END and more", "The answer ", ("END", "STOP"), "END"),
        ("The answer", "The answer", ("END",), None),  # an end-of-sequence token ended it
        ("a STOP b END", "a ", ("END", "STOP"), "STOP"),  # the earliest
        ("xEND", "y", ("END",), "END"),  # the decode differs from what was sent: searched from the start
    ],
)
def test_the_stop_sequence_is_found_after_the_text_sent(
    decoded: str, sent: str, stops: tuple[str, ...], found: str | None
) -> None:
    assert reached_stop(decoded, sent, stops) == found


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (408, "invalid_request_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_anthropics_error_type_follows_the_status(status: int, kind: str) -> None:
    body = ApiError(status, "what happened", param="messages", code=FailureCode.INTERNAL_ERROR).anthropic_body()
    assert body == {
        "type": "error",
        "error": {"type": kind, "message": "what happened", "code": "internal_error", "param": "messages"},
        "request_id": None,
    }


def test_a_prompt_past_the_window_says_so_in_anthropics_words() -> None:
    error = ApiError.invalid(
        "This model's maximum context length is 10 tokens.", "messages", FailureCode.CONTEXT_LENGTH_EXCEEDED
    )
    message = error.anthropic_body()["error"]["message"]
    assert message.startswith("prompt is too long: This model's maximum context length is 10 tokens.")
