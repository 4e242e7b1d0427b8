"""Tiny MLX llamas that call two tools at once in other families' formats, trained until they do so reliably.

Mistral/Devstral write `[TOOL_CALLS]name[ARGS]{...}` with no end marker, several calls in a row; LFM2 writes
pythonic calls, several in one `<|tool_call_start|>[a(x=1), b(y=2)]<|tool_call_end|>` block. mlx-lm picks each
family's parser from the chat template (it names the markers); each model is trained on the prompt the server
renders for QUESTION with TOOLS, to answer with two calls of `get_weather`, Paris's then London's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tests.support import scripted_model
from tests.support.tool_model import TOOL

QUESTION = "What is the weather in Paris and in London?"
CITIES = ("Paris", "London")
END_OF_TURN = "<|im_end|>"

FORMATS: dict[str, str] = {
    "mistral": "".join(f'[TOOL_CALLS]get_weather[ARGS]{{"city": "{city}"}}' for city in CITIES),
    "pythonic": "<|tool_call_start|>["
    + ", ".join(f'get_weather(city="{city}")' for city in CITIES)
    + "]<|tool_call_end|>",
}
# How each family renders an assistant turn's calls: the markers in it are what mlx-lm recognises the format by.
_CALLS_IN_HISTORY = {
    "mistral": "{%- for call in message.tool_calls %}{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + "
    "(call.function.arguments | tojson) }}{%- endfor %}",
    "pythonic": "{{- '<|tool_call_start|>[' }}{%- for call in message.tool_calls %}{{- call.function.name + '()' }}"
    "{%- endfor %}{{- ']<|tool_call_end|>' }}",
}


def chat_template(family: str) -> str:
    return (
        "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' and message.tool_calls %}"
        "{{- '<|im_start|>assistant\\n' }}" + _CALLS_IN_HISTORY[family] + "{{- '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def build_tool_format_model(tokenizer_dir: Path, out_dir: Path, family: str) -> Path:
    """Write the trained model to `out_dir` (loadable by `mlx_lm.load`) and return `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json")
    config = orjson.loads((tokenizer_dir / "tokenizer_config.json").read_bytes())
    config["chat_template"] = chat_template(family)
    (out_dir / "tokenizer_config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    tokenizer = load_tokenizer(out_dir, eos_token_ids=[scripted_model.EOS_TOKEN_ID])
    assert tokenizer.has_tool_calling, f"mlx-lm must recognise the {family} format"
    text = tokenizer.apply_chat_template(question(), tools=[TOOL], add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    answer = FORMATS[family]
    weights = scripted_model.train([(prompt, list(tokenizer.encode(answer + END_OF_TURN, add_special_tokens=False)))])
    scripted_model.check(weights, scripted_model.CONFIG, tokenizer, [(prompt, answer)])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(orjson.dumps(scripted_model.CONFIG))
    return out_dir


def question() -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]
