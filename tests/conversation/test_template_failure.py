"""What a failing chat template tells the client: the message it stopped at and a short reason, nothing of Jinja."""

from __future__ import annotations

from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from courier.conversation.template_failure import TEMPLATE_ERRORS, TemplateFailure, template_failure
from courier.core.tools import generic as generic_tools

LOOP = "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['content'] }}{% endfor %}"
)
# Llama 3's shape: the system message is taken out and `messages` rebound, so the loop counts from the next one.
REBINDING = (
    "{% if messages[0]['role'] == 'system' %}{% set messages = messages[1:] %}{% endif %}"
    "{% for message in messages %}{{ message['content'] + '!' }}{% endfor %}"
)
WHOLE_LIST = (
    LOOP + "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('The last message must be the user\\'s') }}"
    "{% endif %}"
)


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}

CASES: list[tuple[str, str, list[dict[str, Any]], TemplateFailure]] = [
    (
        "raise_exception names the message the loop was on",
        ALTERNATING,
        [user("a"), assistant("b"), assistant("c")],
        TemplateFailure(index=2, reason="Conversation roles must alternate user/assistant/user/assistant/..."),
    ),
    (
        "two equal messages are told apart",
        ALTERNATING,
        [user("same"), user("same")],
        TemplateFailure(index=1, reason="Conversation roles must alternate user/assistant/user/assistant/..."),
    ),
    (
        "a missing field, without Jinja's wording",
        "{% for message in messages %}{{ message.name.upper() }}{% endfor %}",
        [{"role": "user", "content": "hi", "name": "ada"}, user("no name")],
        TemplateFailure(index=1, reason="it needs a 'name' field this message does not have"),
    ),
    (
        "a Python error inside the template, counted in the messages as given despite a rebinding",
        REBINDING,
        [SYSTEM, user("fine"), user(["a", "list"])],
        TemplateFailure(index=2, reason="a value in it has a type the template does not handle"),
    ),
    (
        "a check on the whole list names no message",
        WHOLE_LIST,
        [user("a"), assistant("b")],
        TemplateFailure(index=None, reason="The last message must be the user's"),
    ),
]


@pytest.mark.parametrize(("template", "messages", "expected"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_a_template_failure_names_the_message_and_a_short_reason(
    template: str, messages: list[dict[str, Any]], expected: TemplateFailure
) -> None:
    with pytest.raises(TEMPLATE_ERRORS) as raised:
        render_jinja_template([messages], chat_template=template)
    failure = template_failure(raised.value)
    assert failure == expected
    assert "dict object" not in failure.reason and "jinja" not in failure.reason.lower()


def test_a_long_sentence_is_cut() -> None:
    template = "{{ raise_exception('" + "x" * 500 + "') }}"
    with pytest.raises(TEMPLATE_ERRORS) as raised:
        render_jinja_template([[user("a")]], chat_template=template)
    reason = template_failure(raised.value).reason
    assert len(reason) == 200 and reason.endswith("...")


def test_an_error_raised_outside_any_template_keeps_its_own_words() -> None:
    try:
        raise ValueError("Tools should either be a JSON schema")
    except ValueError as error:
        assert template_failure(error) == TemplateFailure(index=None, reason="Tools should either be a JSON schema")


def test_generic_rendering_says_where_each_message_comes_from() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        user("go"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c1", "content": "two"},
        user("thanks"),
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rendered, sources = generic_tools.render_with_sources(messages, tools)
    assert [message["role"] for message in rendered] == ["system", "user", "assistant", "user", "user"]
    assert sources == [None, 0, 1, 2, 4]  # the tools' description is no client message; both results merge into 2
    assert rendered == generic_tools.render(messages, tools)
