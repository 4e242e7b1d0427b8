"""A tiny MLX llama that thinks in `<think>` tags, as Qwen3 and DeepSeek-R1 do, trained until it does so reliably.

The SmolLM2 tokenizer gains Qwen3's `<think>` and `</think>` tokens (so mlx-lm's tokenizer wrapper recognises a
thinking model), and a Qwen3-style chat template: assistant turns render their `reasoning_content` inside the tags,
and `enable_thinking=false` closes an empty block in the generation prompt. Greedy decoding reproduces:

1. QUESTION, thinking on  -> `<think>\\nREASONING\\n</think>\\n\\nANSWER`, then `<|im_end|>`;
2. QUESTION, thinking off -> ANSWER (the template's empty block precedes it);

`train_think_model` trains the weights once; `build_think_model(..., opens_block=True)` writes the DeepSeek-R1
flavour of them: its generation prompt ends with `<think>\\n`, so the reply starts inside the block and only
`</think>` appears in it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tests.support import scripted_model

THINK_START = "<think>"
THINK_END = "</think>"
END_OF_TURN = "<|im_end|>"
QUESTION = "What is two plus two?"
REASONING = "Two plus two is four."
ANSWER = "It is 4."
REPLY = f"{THINK_START}\n{REASONING}\n{THINK_END}\n\n{ANSWER}"
# The added tokens: ids right after SmolLM2's vocabulary.
ADDED_TOKENS = (THINK_START, THINK_END)
VOCAB_SIZE = 49152 + len(ADDED_TOKENS)
CONFIG: dict[str, Any] = {**scripted_model.CONFIG, "vocab_size": VOCAB_SIZE}


def chat_template(opens_block: bool) -> str:
    """Qwen3's shape, cut to what the tests need. `opens_block`: DeepSeek-R1's generation prompt, which opens the
    reasoning block itself."""
    generation_prompt = "{{- '<|im_start|>assistant\\n' }}"
    if opens_block:
        generation_prompt += "{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>\\n' }}"
    else:
        generation_prompt += "{%- if enable_thinking is defined and not enable_thinking %}"
        generation_prompt += "{{- '<think>\\n\\n</think>\\n\\n' }}"
    if opens_block:
        generation_prompt += "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    generation_prompt += "{%- endif %}"
    return (
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- if message.reasoning_content %}"
        "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
        "{%- endif %}"
        "{{- (message.content or '') + '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}" + generation_prompt + "{%- endif %}"
    )


def question() -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]


def train_think_model(tokenizer_dir: Path, work_dir: Path) -> dict[str, mx.array]:
    """The trained weights, shared by both flavours (`build_think_model` writes each): trained once."""
    work_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(tokenizer_dir, work_dir, chat_template(opens_block=False))
    tokenizer = load_tokenizer(work_dir, eos_token_ids=[scripted_model.EOS_TOKEN_ID])
    assert tokenizer.has_thinking, "mlx-lm must see the <think> tokens"
    script = [
        (_prompt_tokens(tokenizer, thinking=True), REPLY),
        (_prompt_tokens(tokenizer, thinking=False), ANSWER),
    ]
    examples = [
        (prompt, list(tokenizer.encode(answer + END_OF_TURN, add_special_tokens=False))) for prompt, answer in script
    ]
    weights = scripted_model.train(examples, vocab_size=VOCAB_SIZE)
    scripted_model.check(weights, CONFIG, tokenizer, script)
    return weights


def build_think_model(
    tokenizer_dir: Path, out_dir: Path, weights: dict[str, mx.array], *, opens_block: bool = False
) -> Path:
    """Write the model with `weights` (from `train_think_model`) to `out_dir` (loadable by `mlx_lm.load`) and
    return `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(tokenizer_dir, out_dir, chat_template(opens_block=opens_block))
    if opens_block:  # the same weights: the R1 prompt is the Qwen3 prompt plus the reply's first tokens
        tokenizer = load_tokenizer(out_dir, eos_token_ids=[scripted_model.EOS_TOKEN_ID])
        opened = _prompt_tokens(tokenizer, thinking=True)
        scripted_model.check(weights, CONFIG, tokenizer, [(opened, REPLY.removeprefix(f"{THINK_START}\n"))])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    return out_dir


def _write_tokenizer(tokenizer_dir: Path, out_dir: Path, template: str) -> None:
    tokenizer = orjson.loads((tokenizer_dir / "tokenizer.json").read_bytes())
    for offset, content in enumerate(ADDED_TOKENS):
        tokenizer["added_tokens"].append(
            {
                "id": 49152 + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,  # as in Qwen3: the tags are text a client may see
            }
        )
    (out_dir / "tokenizer.json").write_bytes(orjson.dumps(tokenizer))
    config = orjson.loads((tokenizer_dir / "tokenizer_config.json").read_bytes())
    config["chat_template"] = template
    config.pop("added_tokens_decoder", None)  # tokenizer.json is the one source of the added tokens
    (out_dir / "tokenizer_config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    if (tokenizer_dir / "special_tokens_map.json").exists():
        shutil.copy(tokenizer_dir / "special_tokens_map.json", out_dir / "special_tokens_map.json")


def _prompt_tokens(tokenizer: Any, *, thinking: bool) -> list[int]:
    """Render and tokenize as the server does: the template to text, then encode without special tokens."""
    text = tokenizer.apply_chat_template(
        question(), add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
