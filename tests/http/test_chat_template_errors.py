"""A chat template that refuses a message: a 400 naming that message, through a real server and the openai client.

The tiny llama is served with SmolLM2's template plus two traps: `raise_exception` on an assistant message that
says "forbidden" (the template author's own sentence reaches the client), and a read of a field no message has
when one says "boom" (Jinja's `'dict object' has no attribute ...` must not reach it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.server import RunningServer, serving

MODEL = "tiny-template"
LOOP = "{% for message in messages %}"
TRAPS = (
    "{% if message['role'] == 'assistant' and 'forbidden' in message['content'] %}"
    "{{ raise_exception('Assistant messages may not mention forbidden things') }}{% endif %}"
    "{% if 'boom' in message['content'] %}{{ message.missing_field.value }}{% endif %}"
)
REFUSED_SENTENCE = "Assistant messages may not mention forbidden things"


@pytest.fixture(scope="module")
def trapped_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with the traps in its chat template (tokenizer_config.json's `chat_template`)."""
    model_dir = tmp_path_factory.mktemp("tiny-template")
    for file in tiny_llama_dir.iterdir():
        shutil.copy(file, model_dir / file.name)
    config_path = model_dir / "tokenizer_config.json"
    config = orjson.loads(config_path.read_bytes())
    assert config["chat_template"].startswith(LOOP)
    config["chat_template"] = LOOP + TRAPS + config["chat_template"][len(LOOP) :]
    config_path.write_bytes(orjson.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def server(trapped_model_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(trapped_model_dir, cache_dir, MODEL) as running:
        yield running


def history(assistant_says: str) -> list[Any]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": assistant_says},
        {"role": "user", "content": "Go on."},
    ]


def envelope(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.body
    assert isinstance(body, dict)
    return body


def test_a_message_the_template_refuses_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=history("That is forbidden."), max_tokens=2)
    error = envelope(raised.value)
    assert error["param"] == "messages[2]"
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"messages[2]: the model's chat template cannot render this message ({REFUSED_SENTENCE})"
    )


def test_a_template_error_names_the_message_without_jinja_internals(client: openai.OpenAI) -> None:
    boom: Any = {"role": "user", "content": "boom"}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[*history("Fine.")[:1], boom], max_tokens=2)
    error = envelope(raised.value)
    assert error["param"] == "messages[1]"
    assert error["message"] == (
        "messages[1]: the model's chat template cannot render this message "
        "(it needs a 'missing_field' field this message does not have)"
    )
    assert "dict object" not in error["message"] and "jinja" not in error["message"].lower()


def test_tokenize_names_the_message_too(http: httpx.Client) -> None:
    reply = http.post("/tokenize", json={"messages": history("forbidden, again")})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[2]"


def test_responses_name_the_message_in_the_rendered_conversation(client: openai.OpenAI) -> None:
    items = history("That is forbidden.")[1:]  # the system message comes from `instructions` instead
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=2)
    error = envelope(raised.value)
    assert error["param"] == "input"
    assert error["message"] == (
        "the model's chat template cannot render message 2 of the conversation (role assistant; counting from 0, "
        f"instructions and earlier turns included) ({REFUSED_SENTENCE})"
    )


def test_the_server_keeps_serving_other_messages(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=history("Fine."), max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")
