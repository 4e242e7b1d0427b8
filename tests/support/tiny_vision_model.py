"""A tiny random-weight SmolVLM (mlx-vlm `smolvlm`), built offline in well under a second.

SmolVLM is Idefics3's architecture: a SigLIP-style vision tower, a pixel-shuffle
connector and a llama text model. The directory this module writes loads with
`mlx_vlm.load(path)`: weights, configs, the image processor settings and a
tokenizer rebuilt from the embedded SmolLM2 GGUF plus SmolVLM's image tokens,
with a ChatML template that renders `{"type": "image"}` content parts as
`<image>`. Each image becomes `IMAGE_SEQ_LEN` image tokens (no splitting).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import orjson
from mlx import nn
from mlx.utils import tree_flatten, tree_map
from tokenizers import AddedToken, Tokenizer

from courier.model.gguf_tokenizer import build_tokenizer, tokenizer_config
from courier.model.source import embedded_gguf_path

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE_TOKEN = "<end_of_utterance>"
MAX_TILES_PER_SIDE = 6
ROW_COL_TOKENS = tuple(
    f"<row_{row}_col_{col}>" for row in range(1, MAX_TILES_PER_SIDE + 1) for col in range(1, MAX_TILES_PER_SIDE + 1)
)
ADDED_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE_TOKEN, *ROW_COL_TOKENS)

BASE_VOCAB_SIZE = 49152  # SmolLM2's vocabulary; the added tokens follow it in order.
IMAGE_TOKEN_ID = BASE_VOCAB_SIZE + ADDED_TOKENS.index(IMAGE_TOKEN)
VOCAB_SIZE = BASE_VOCAB_SIZE + len(ADDED_TOKENS)
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = 2

IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
"""Image tokens each image expands to: 4."""

CONTEXT_LENGTH = 8192
TEXT_WEIGHT_SCALE = 4.0
"""Random text weights this much larger, so greedy decoding does not repeat one token forever."""

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT_LENGTH,
    "tie_word_embeddings": False,
}

VISION_CONFIG: dict[str, Any] = {
    "model_type": "smolvlm_vision",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "patch_size": PATCH_SIZE,
    "image_size": IMAGE_SIZE,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}

MODEL_CONFIG: dict[str, Any] = {
    "model_type": "smolvlm",
    "architectures": ["SmolVLMForConditionalGeneration"],
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
    "scale_factor": SCALE_FACTOR,
    "image_token_id": IMAGE_TOKEN_ID,
    "vocab_size": VOCAB_SIZE,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
}

PROCESSOR_CONFIG: dict[str, Any] = {"processor_class": "SmolVLMProcessor", "image_seq_len": IMAGE_SEQ_LEN}

PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "SmolVLMImageProcessor",
    "processor_class": "SmolVLMProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"longest_edge": IMAGE_SIZE},
    "max_image_size": {"longest_edge": IMAGE_SIZE},
    "resample": 1,
    "do_image_splitting": False,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url', 'input_image'] -%}"
    "{{- '" + IMAGE_TOKEN + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""SmolLM2's ChatML without its default system prompt; content is a string or a list of parts."""

WEIGHTS_FILE = "model.safetensors"
OUTPUT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def build_tiny_vision_model(directory: Path) -> Path:
    """Write the tiny SmolVLM into `directory` (reused when already complete) and return it."""
    if _is_complete(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(directory)
    _write_json(directory / "config.json", MODEL_CONFIG)
    _write_json(directory / "processor_config.json", PROCESSOR_CONFIG)
    _write_json(directory / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    _write_json(directory / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    # Weights last: their presence marks the directory complete.
    weights = dict(tree_flatten(build_model().parameters()))
    partial = directory / f"{WEIGHTS_FILE}.partial.safetensors"
    mx.save_safetensors(str(partial), weights, metadata={"format": "mlx"})
    partial.rename(directory / WEIGHTS_FILE)
    return directory


def build_model() -> nn.Module:
    """The random-weight mlx-vlm SmolVLM, built the way `mlx_vlm.utils.load_model` builds one."""
    # mlx-vlm is untyped and not in mypy's skip list: reached through importlib, as courier.model.vision does.
    smolvlm = importlib.import_module("mlx_vlm.models.smolvlm")
    utils = importlib.import_module("mlx_vlm.utils")
    mx.random.seed(0)
    config = smolvlm.ModelConfig.from_dict(MODEL_CONFIG)
    config = utils.update_module_configs(config, smolvlm, MODEL_CONFIG, ["text", "vision"])
    model: nn.Module = smolvlm.Model(config)
    language_model: nn.Module = model.language_model
    language_model.update(tree_map(_scale_matrix, language_model.parameters()))
    mx.eval(model.parameters())
    return model


def _scale_matrix(value: mx.array) -> mx.array:
    return value * TEXT_WEIGHT_SCALE if value.ndim == 2 else value


def _write_tokenizer(directory: Path) -> None:
    """SmolLM2's tokenizer (rebuilt from the embedded GGUF's metadata) plus SmolVLM's tokens."""
    loaded = mx.load(str(embedded_gguf_path()), return_metadata=True)
    _, metadata = cast("tuple[dict[str, mx.array], dict[str, Any]]", loaded)
    tokenizer: Tokenizer = build_tokenizer(metadata)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in ADDED_TOKENS])
    if tokenizer.token_to_id(IMAGE_TOKEN) != IMAGE_TOKEN_ID or tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"unexpected SmolLM2 vocabulary: {IMAGE_TOKEN} is {tokenizer.token_to_id(IMAGE_TOKEN)}")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = tokenizer_config(metadata, CONTEXT_LENGTH)
    config["chat_template"] = CHAT_TEMPLATE
    config["eos_token"] = EOS_TOKEN
    config["image_token"] = IMAGE_TOKEN
    config["extra_special_tokens"] = {"image_token": IMAGE_TOKEN}
    config["additional_special_tokens"] = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE_TOKEN]
    config["processor_class"] = "SmolVLMProcessor"
    _write_json(directory / "tokenizer_config.json", config)
    special: dict[str, Any] = {
        key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token") if key in config
    }
    special["additional_special_tokens"] = config["additional_special_tokens"]
    _write_json(directory / "special_tokens_map.json", special)


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in (*OUTPUT_FILES, WEIGHTS_FILE))


def _write_json(path: Path, value: object) -> None:
    path.write_bytes(orjson.dumps(value, option=orjson.OPT_INDENT_2))
