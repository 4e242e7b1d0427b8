"""Tiny MLX llamas trained in seconds on CPU until greedy decoding reproduces a fixed script.

Real models that call tools or think in tags cannot be downloaded here, and random weights never do either, so the
tests build 2-layer llamas on the SmolLM2 tokenizer and overfit them on the exact prompts a server renders
(`tool_model.py`, `think_model.py`). `train` teacher-forces each answer after its prompt until every answer token
wins by a safety margin; `check` proves greedy decoding reproduces each answer before a model is written.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate
from mlx_lm.models import llama

EOS_TOKEN_ID = 2
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": EOS_TOKEN_ID,
}

SEED = 0
LEARNING_RATE = 1e-3
MAX_STEPS = 300
CHECK_EVERY = 5
# Each expected token must beat every other by this many logits, so greedy decoding
# (incremental, with a KV cache, possibly on another backend) cannot flip it.
MIN_MARGIN = 4.0
EMBEDDINGS = "model.embed_tokens.weight"


class ScriptNotLearned(RuntimeError):
    pass


Example = tuple[list[int], list[int]]  # prompt tokens, answer tokens


def check(
    weights: dict[str, mx.array], config: dict[str, Any], tokenizer: Any, script: list[tuple[list[int], str]]
) -> None:
    """Greedy decoding reproduces each (prompt, answer) exactly, or `ScriptNotLearned`."""
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    for prompt, answer in script:
        produced = generate(model, tokenizer, prompt=prompt, max_tokens=len(answer) + 8)
        if produced != answer:
            raise ScriptNotLearned(f"greedy decoding produced {produced!r}, expected {answer!r}")


def train(examples: list[Example], vocab_size: int = 49152) -> dict[str, mx.array]:
    """Teacher-force each answer after its prompt until every answer token wins by MIN_MARGIN.

    Training runs on a compact vocabulary, only the tokens of the script, which makes
    a step several times cheaper than over all 49152 tokens. Every other token gets an
    all-zero embedding, so its logit is exactly 0: one zero logit column stands for all
    of them during training. Returns the weights of the full-vocabulary model.
    """
    vocab = sorted({token for prompt, answer in examples for token in prompt + answer})
    compact = {token: index for index, token in enumerate(vocab)}
    inputs: list[mx.array] = []
    positions: list[mx.array] = []
    labels: list[int] = []
    for sequence, targets in _pack(examples):
        inputs.append(mx.array([compact[token] for token in sequence[:-1]])[None])
        positions.append(mx.array([position for position, _ in targets]))
        labels.extend(compact[token] for _, token in targets)
    label_array = mx.array(labels)

    mx.random.seed(SEED)
    model = llama.Model(llama.ModelArgs.from_dict({**CONFIG, "vocab_size": len(vocab)}))

    def logits_of(model: nn.Module) -> mx.array:
        hidden = mx.concatenate([model.model(x)[0][p] for x, p in zip(inputs, positions, strict=True)])
        logits = model.model.embed_tokens.as_linear(hidden)
        return mx.concatenate([logits, mx.zeros((logits.shape[0], 1), dtype=logits.dtype)], axis=-1)

    def loss_fn(model: nn.Module) -> mx.array:
        loss: mx.array = nn.losses.cross_entropy(logits_of(model), label_array, reduction="mean")
        return loss

    def learned() -> bool:
        logits = logits_of(model)
        target = mx.take_along_axis(logits, label_array[:, None], axis=-1)[:, 0]
        others = mx.put_along_axis(logits, label_array[:, None], mx.array(-mx.inf, dtype=logits.dtype), axis=-1)
        return bool(mx.all(target - mx.max(others, axis=-1) >= MIN_MARGIN))

    optimizer = optim.Adam(learning_rate=LEARNING_RATE)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    for step in range(1, MAX_STEPS + 1):
        loss, grads = loss_and_grad(model)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        if step % CHECK_EVERY == 0 and learned():
            break
    else:
        raise ScriptNotLearned(f"the model did not learn its script in {MAX_STEPS} steps")

    weights = dict(tree_flatten(model.parameters()))
    embeddings = mx.zeros((vocab_size, CONFIG["hidden_size"]), dtype=weights[EMBEDDINGS].dtype)
    embeddings[mx.array(vocab)] = weights[EMBEDDINGS]
    weights[EMBEDDINGS] = embeddings
    return weights


def _pack(examples: list[Example]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Sequences to run, each with its (position, expected next token) pairs.

    An example whose prompt and answer open a longer sequence rides along in it: the
    first turn is a prefix of the second turn's prompt, so one forward pass trains both.
    """
    packed: list[tuple[list[int], list[tuple[int, int]]]] = []
    for prompt, answer in sorted(examples, key=lambda example: len(example[0]) + len(example[1]), reverse=True):
        full = prompt + answer
        targets = [(len(prompt) - 1 + offset, token) for offset, token in enumerate(answer)]
        host = next((sequence for sequence in packed if sequence[0][: len(full)] == full), None)
        if host is None:
            packed.append((full, targets))
        else:
            host[1].extend(targets)
    return packed
