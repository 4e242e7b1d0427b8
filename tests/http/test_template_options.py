"""`chat_template_kwargs` and reasoning efforts reach the chat template, or are refused when it has no switch.

Two copies of the tiny llama: one whose template has Qwen3's `enable_thinking` switch and reads a custom variable,
one with SmolLM2's plain ChatML template. What the template wrote is seen in `usage.prompt_tokens`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import TINY_MODEL, RunningServer, running_server

MODEL = TINY_MODEL  # both servers serve it under this name
# Appended to the template's generation prompt: an empty thinking block when thinking is off (as Qwen3's does), a
# line naming a `reasoning_effort` other than none (as gpt-oss's writes its effort), and a line when the request's
# chat_template_kwargs set `persona`.
SWITCHES = (
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if reasoning_effort is defined and reasoning_effort != 'none' %}{{ 'Effort: ' + reasoning_effort + '\\n' }}"
    "{%- endif %}"
    "{%- if persona is defined %}{{ 'Speaking as ' + persona + '.\\n' }}{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def servers(
    tiny_llama_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, tiny_server: RunningServer
) -> Iterator[dict[str, RunningServer]]:
    """The switched copy on a server of its own; the plain one is the session's shared server (tests/conftest.py)."""
    switched = tmp_path_factory.mktemp("switched") / "model"
    shutil.copytree(tiny_llama_dir, switched)
    config_path = switched / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"] + SWITCHES
    config_path.write_text(json.dumps(config))
    args = ["--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server(["--model", str(switched), *args]) as with_switch:
        yield {"switch": with_switch, "plain": tiny_server}


def prompt_tokens(http: httpx.Client, **fields: Any) -> int:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields})
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


def test_a_reasoning_effort_sets_the_templates_thinking_switch(servers: dict[str, RunningServer]) -> None:
    with servers["switch"].http() as http:
        # This tokenizer has no thinking tokens, so mlx-lm renders with thinking off unless asked: the template
        # writes its empty thinking block by default and for "none", and leaves it out when thinking is on.
        default = prompt_tokens(http)
        assert prompt_tokens(http, reasoning_effort="none") == default
        assert prompt_tokens(http, reasoning_effort="high") < default
        assert prompt_tokens(http, chat_template_kwargs={"enable_thinking": True}) < default
        body = {"model": MODEL, "input": "Hello", "max_output_tokens": 1}
        thinking = http.post("/v1/responses", json=body | {"reasoning": {"effort": "medium"}}).json()
        plain = http.post("/v1/responses", json=body).json()
        assert thinking["usage"]["input_tokens"] < plain["usage"]["input_tokens"]
        assert thinking["reasoning"]["effort"] == "medium"
        counted = http.post(
            "/v1/responses/input_tokens", json={"model": MODEL, "input": "Hello", "reasoning": {"effort": "medium"}}
        ).json()
        assert counted["input_tokens"] == thinking["usage"]["input_tokens"]


def test_anthropics_effort_reaches_a_template_that_takes_one_and_is_left_out_by_one_that_does_not(
    servers: dict[str, RunningServer],
) -> None:
    """`output_config.effort` sets the template's `reasoning_effort` (xhigh and max as its most, high), never its
    thinking switch (that is `thinking`'s); a template without the variable serves the request without it, as
    Claude Code sends an effort on every request."""

    def counted(http: httpx.Client, effort: str | None) -> int:
        body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
        if effort is not None:
            body["output_config"] = {"effort": effort}
        reply = http.post("/v1/messages/count_tokens", json=body)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["input_tokens"])

    with servers["switch"].http() as http:
        without = counted(http, None)
        assert counted(http, "low") > without  # the template's effort line
        assert counted(http, "max") == counted(http, "xhigh") == counted(http, "high") > without
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "output_config": {"effort": "low"}}
        usage = http.post("/v1/messages", json=body).json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted(http, "low")
    with servers["plain"].http() as http:
        assert counted(http, "high") == counted(http, None)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "output_config": {"effort": "high"}}
        assert http.post("/v1/messages", json=body).status_code == 200


def test_chat_template_kwargs_reach_the_template(servers: dict[str, RunningServer]) -> None:
    with servers["switch"].http() as http:
        assert prompt_tokens(http, chat_template_kwargs={"persona": "a pirate"}) > prompt_tokens(http)


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("switch", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("switch", {"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("switch", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("switch", {"chat_template_kwargs": {"persona": {"nested": 1}}}, "chat_template_kwargs.persona"),
    ("plain", {"reasoning_effort": "none"}, "reasoning_effort"),  # a template with no switch cannot honour it
]


@pytest.mark.parametrize(("server_name", "fields", "param"), REFUSED)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    servers: dict[str, RunningServer], server_name: str, fields: dict[str, Any], param: str
) -> None:
    with servers[server_name].http() as http:
        reply = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
        assert http.get("/health").status_code == 200


def test_responses_reasoning_is_checked(servers: dict[str, RunningServer]) -> None:
    with servers["plain"].http() as http:
        for reasoning, param in (
            ({"effort": "low"}, "reasoning.effort"),
            ({"effort": "max"}, "reasoning.effort"),
            ({"summary": "brief"}, "reasoning.summary"),
            ("high", "reasoning"),
        ):
            body = {"model": MODEL, "input": "Hello", "reasoning": reasoning, "max_output_tokens": 1}
            reply = http.post("/v1/responses", json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param
        # Codex sends `summary: "auto"` on every turn: a model that does not reason accepts it and echoes it.
        body = {"model": MODEL, "input": "Hello", "reasoning": {"summary": "auto"}, "max_output_tokens": 1}
        reply = http.post("/v1/responses", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["reasoning"]["summary"] == "auto"
