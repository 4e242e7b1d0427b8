"""A tiny MLX llama, overfitted in seconds on CPU, that reliably makes one tool call.

The server's tool-call path (the chat template rendering `tools`, mlx-lm spotting
`<tool_call>` in the output and its parser turning the text into a call) can only
be tested end to end with a model that actually emits a tool call. Random weights
never do, and real tool-calling models cannot be downloaded here, so this module
builds a 2-layer llama on the SmolLM2 tokenizer, gives it a Hermes/Qwen2.5-style
chat template with tool support, and trains it until greedy decoding reproduces a
fixed two-turn script exactly:

1. tools=[TOOL], user asks USER_QUESTION -> the model answers with TOOL_CALL_TEXT
   (a call to `get_weather` with `{"city": "Paris"}`) and stops at `<|im_end|>`;
2. the same conversation, plus that assistant tool call and a `tool` message
   holding TOOL_RESULT -> the model answers FINAL_ANSWER and stops.

Training uses the template's rendering of exactly the messages a server builds
from OpenAI requests (`first_turn_messages`, `second_turn_messages`), so prompts
at serving time match the training prompts token for token. Everything is seeded,
so the build is deterministic; it stops as soon as both answers reproduce with a
safety margin and fails loudly if they never do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tests.support import scripted_model

EOS_TOKEN_ID = scripted_model.EOS_TOKEN_ID
END_OF_TURN = "<|im_end|>"

TOOL_NAME = "get_weather"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name."}},
            "required": ["city"],
        },
    },
}
USER_QUESTION = "What is the weather in Paris?"
TOOL_ARGUMENTS: dict[str, Any] = {"city": "Paris"}
# The arguments as a JSON string, as `json.dumps` writes them (and as mlx-lm's server returns them in
# `tool_calls[].function.arguments`): the template renders this string and TOOL_ARGUMENTS identically.
TOOL_ARGUMENTS_JSON = json.dumps(TOOL_ARGUMENTS)
TOOL_CALL_ID = "call_0"
TOOL_RESULT = "18 degrees and sunny"
FINAL_ANSWER = "It is 18 degrees and sunny in Paris."
# The assistant's first reply, verbatim (mlx-lm's `json_tools` parser reads the JSON between the markers).
TOOL_CALL_TEXT = f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {TOOL_ARGUMENTS_JSON}}}\n</tool_call>'

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Hermes/Qwen2.5 style: tools go into the system prompt as JSON, assistant tool calls are
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` (arguments may be a mapping,
# rendered with `tojson`, or a JSON string, rendered verbatim), and consecutive `tool`
# messages become one user turn of `<tool_response>` blocks. The `<tool_call>` marker and
# `tool_call.name` in the template make mlx-lm pick its `json_tools` parser; the
# tokenizer config also names it explicitly.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM_PROMPT + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONFIG = scripted_model.CONFIG


def first_turn_messages() -> list[dict[str, Any]]:
    """The request that should make the model call TOOL_NAME (send it with `tools=[TOOL]`)."""
    return [{"role": "user", "content": USER_QUESTION}]


def second_turn_messages(tool_call_id: str = TOOL_CALL_ID) -> list[dict[str, Any]]:
    """The follow-up request, as an OpenAI client sends it, that should get FINAL_ANSWER back.

    The template renders `arguments` identically whether it is the mapping TOOL_ARGUMENTS
    or the string TOOL_ARGUMENTS_JSON; this uses the mapping, as mlx-lm's server passes it.
    """
    tool_call = {"id": tool_call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS}}
    return [
        *first_turn_messages(),
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": tool_call_id, "content": TOOL_RESULT},
    ]


def build_tool_model(tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the trained model to `out_dir` (loadable by `mlx_lm.load`) and return `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json")
    tokenizer_config = orjson.loads((tokenizer_dir / "tokenizer_config.json").read_bytes())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config["tool_parser_type"] = "json_tools"
    (out_dir / "tokenizer_config.json").write_bytes(orjson.dumps(tokenizer_config, option=orjson.OPT_INDENT_2))
    tokenizer = load_tokenizer(out_dir, eos_token_ids=[EOS_TOKEN_ID])

    script = [
        (_prompt_tokens(tokenizer, first_turn_messages()), TOOL_CALL_TEXT),
        (_prompt_tokens(tokenizer, second_turn_messages()), FINAL_ANSWER),
    ]
    examples = [
        (prompt, list(tokenizer.encode(answer + END_OF_TURN, add_special_tokens=False))) for prompt, answer in script
    ]

    weights = scripted_model.train(examples)
    scripted_model.check(weights, CONFIG, tokenizer, script)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    return out_dir


def _prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Render and tokenize as the server does: the template to text, then encode without special tokens."""
    text = tokenizer.apply_chat_template(messages, tools=[TOOL], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
