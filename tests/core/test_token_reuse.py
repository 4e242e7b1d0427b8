"""Tokenizing only what is new (core/token_reuse.py): reused tokens are exactly the tokenizer's own, for the real
SmolLM2 tokenizer on a recorded Claude Code session and for small tokenizers of each family built here (byte-level
BPE, SentencePiece-style Metaspace with either prepend scheme, Llama-2's legacy normalizer), on hypothesis' texts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from courier.core import token_reuse
from courier.core.token_prefix import common_prefix_length
from courier.core.token_reuse import CHECKPOINT_CHARS, Encoded, RecentEncodings
from courier.model.tokenizer_offsets import FastTokenizerOffsets, WholeTexts, offsets_encoder

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# Pieces texts are made of: the anchors, a normalized added token, digits (split apart by some pre-tokenizers),
# combining marks (NFC composes them), whitespace runs, and halves of an anchor that join into one.
PIECES = [
    *SPECIALS,
    "hello",
    " world",
    "wörld",
    "123",
    "4",
    "e",
    "\u0301",
    "café",
    " ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    '{"a": [1, 2]}',
    "<|im",
    "_end|>",
    "user",
    "assistant",
    "☃",
]
CORPUS = ["hello world, this is a test of tokenizers 123 4567", "wörld über naïve café e\u0301 tab\tnew\nline"] * 20


def _trained(normalizer: Any, pre_tokenizer: Any) -> FastTokenizerOffsets:
    backend = Tokenizer(models.BPE())
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    backend.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    backend.add_tokens([AddedToken("wörld", normalized=True)])  # matched after normalizing: never an anchor
    encoder = offsets_encoder(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert encoder is not None
    return encoder


FAMILIES: dict[str, Callable[[], FastTokenizerOffsets]] = {
    "byte-level BPE": lambda: _trained(None, pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "byte-level BPE, a prefix space": lambda: _trained(None, pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "Metaspace, first": lambda: _trained(normalizers.NFC(), pre_tokenizers.Metaspace(prepend_scheme="first")),
    "Metaspace, always": lambda: _trained(normalizers.NFC(), pre_tokenizers.Metaspace(prepend_scheme="always")),
    "Llama-2 legacy": lambda: _trained(
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None
    ),
}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def families() -> dict[str, FastTokenizerOffsets]:
    return {name: build() for name, build in FAMILIES.items()}


def whole(encoder: FastTokenizerOffsets, text: str) -> list[int]:
    return list(encoder.tokenizer.encode(text, add_special_tokens=False))


texts = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=texts, before=texts, after=texts, family=st.sampled_from(sorted(FAMILIES)))
def test_a_text_encoded_from_another_is_what_the_tokenizer_gives(
    families: dict[str, FastTokenizerOffsets], shared: str, before: str, after: str, family: str
) -> None:
    encoder = families[family]
    base = token_reuse.encode(shared + before, encoder)
    assert list(base.encoded.ids) == whole(encoder, shared + before)
    assert base.reused_tokens == 0
    reused = token_reuse.encode(shared + after, encoder, base.encoded)
    assert list(reused.encoded.ids) == whole(encoder, shared + after)
    assert reused.reused_tokens <= common_prefix_length(list(reused.encoded.ids), list(base.encoded.ids))
    # The anchors it records are where its anchors are.
    anchors = [i for i, token in enumerate(reused.encoded.ids) if token in encoder.anchors]
    assert list(reused.encoded.anchor_tokens) == anchors


def test_a_recorded_agent_session_reuses_all_but_its_new_turn(smollm2: TokenizerWrapper) -> None:
    """Claude Code's ten-turn session (bench/data/agents), as its turns render: each turn's tokens are the
    tokenizer's own, and all but the last message or two come from the turn before."""
    from bench import agent_sessions

    encoder = offsets_encoder(smollm2)
    assert encoder is not None
    session = agent_sessions.load(agent_sessions.Dialect.ANTHROPIC)
    recent, reused_shares = RecentEncodings(), []
    for turn in (1, 2, 3):
        messages = agent_sessions.chat_turn(session, turn, "chat session 1")
        text = smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        result = token_reuse.encode(text, encoder, recent.closest("", text))
        recent.remember("", result.encoded)
        assert list(result.encoded.ids) == list(smollm2.encode(text, add_special_tokens=False))
        reused_shares.append(result.reused_tokens / len(result.encoded.ids))
    assert reused_shares[0] == 0
    assert min(reused_shares[1:]) > 0.97, reused_shares


def _encoded(encoder: FastTokenizerOffsets, text: str) -> Encoded:
    return token_reuse.encode(text, encoder).encoded


def test_a_text_is_reused_only_within_its_scope(families: dict[str, FastTokenizerOffsets]) -> None:
    encoder = families["byte-level BPE"]
    history = "<|im_start|>user\n" + "hello world " * CHECKPOINT_CHARS
    recent = RecentEncodings()
    recent.remember("tenant-a", _encoded(encoder, history))
    longer = history + "<|im_end|>\n<|im_start|>assistant\n"
    assert recent.closest("tenant-b", longer) is None
    found = recent.closest("tenant-a", longer)
    assert found is not None and found.text == history
    assert recent.closest("tenant-a", "<|im_start|>user\nsomething else entirely") is None


def test_the_closest_is_the_one_sharing_the_most(families: dict[str, FastTokenizerOffsets]) -> None:
    encoder = families["byte-level BPE"]
    system = "<|im_start|>system\n" + "hello world " * CHECKPOINT_CHARS + "<|im_end|>\n"
    turn_one = system + "<|im_start|>user\n" + "123 " * CHECKPOINT_CHARS + "<|im_end|>\n"
    other_session = system + "<|im_start|>user\n" + "café " * CHECKPOINT_CHARS + "<|im_end|>\n"
    recent = RecentEncodings()
    for text in (turn_one, other_session):
        recent.remember("", _encoded(encoder, text))
    found = recent.closest("", turn_one + "<|im_start|>assistant\n")
    assert found is not None and found.text == turn_one


def test_the_kept_encodings_are_bounded_in_count_and_bytes(families: dict[str, FastTokenizerOffsets]) -> None:
    encoder = families["byte-level BPE"]
    made = [_encoded(encoder, f"<|im_start|>{index} " + "hello " * CHECKPOINT_CHARS) for index in range(5)]
    by_count = RecentEncodings(entries=3)
    for encoded in made:
        by_count.remember("", encoded)
    assert len(by_count) == 3
    assert by_count.closest("", made[0].text) is None  # the oldest went first
    assert by_count.closest("", made[4].text) is made[4]
    one = RecentEncodings()
    one.remember("", made[0])
    each = one.bytes  # the text as stored, ids, anchors and its checkpoints
    assert each > made[0].bytes > len(made[0].text)
    by_bytes = RecentEncodings(max_bytes=2 * each + 1)
    for encoded in made:
        by_bytes.remember("", encoded)
    assert len(by_bytes) == 2 and by_bytes.bytes == 2 * each
    too_big = RecentEncodings(max_bytes=each - 1)
    too_big.remember("", made[0])
    assert len(too_big) == 0 and too_big.bytes == 0
    for _ in range(2):
        one.remember("", made[0])
    assert len(one) == 1 and one.bytes == each
    assert one.clear() == 1 and (len(one), one.bytes) == (0, 0)
    assert one.closest("", made[0].text) is None


def test_a_text_held_as_two_or_four_bytes_a_character_counts_them(families: dict[str, FastTokenizerOffsets]) -> None:
    encoder = families["byte-level BPE"]
    latin, snowmen = (_encoded(encoder, "<|im_start|>" + piece * CHECKPOINT_CHARS) for piece in ("ab", "a☃"))
    assert len(latin.text) == len(snowmen.text)
    assert snowmen.bytes - latin.bytes >= len(snowmen.text) - 100  # ~2 bytes a character, not 1


def test_a_render_too_short_to_be_found_is_not_kept(families: dict[str, FastTokenizerOffsets]) -> None:
    """A render shorter than a checkpoint could never be a base: kept, it would only push out long ones."""
    encoder = families["byte-level BPE"]
    recent = RecentEncodings(entries=2)
    long = _encoded(encoder, "<|im_start|>" + "hello " * CHECKPOINT_CHARS)
    recent.remember("agent", long)
    for index in range(5):
        recent.remember("chat", _encoded(encoder, f"<|im_start|>user\nhi {index}<|im_end|>"))
    assert len(recent) == 1 and recent.closest("agent", long.text + "<|im_end|>") is long


def test_a_class_that_rewrites_text_in_encode_is_tokenized_whole() -> None:
    """mlx-lm's NewlineTokenizer writes newlines as `<n>` in `encode` only: its offsets call would disagree."""
    from mlx_lm.tokenizer_utils import NewlineTokenizer

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[*SPECIALS, "<n>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    assert offsets_encoder(TokenizerWrapper(NewlineTokenizer(tokenizer_object=backend))) is None


def test_an_anchors_id_a_normalizer_made_is_not_a_cut() -> None:
    """NFKC turns the anchor written in full-width characters into its text, and a Unigram model may then pick its
    id where the text does not spell it: cutting there would give other tokens than the whole text's."""
    anchor = "<|im_start|>"
    pieces = [("<unk>", 0.0), (anchor, -1.0), ("a<|im_start", -1.0), ("|>x", -0.1)]
    backend = Tokenizer(models.Unigram([*pieces, *((c, -10.0) for c in sorted(set("a<|im_start>xy")))], unk_id=0))
    backend.normalizer = normalizers.NFKC()
    backend.add_special_tokens([AddedToken(anchor, normalized=False)])
    encoder = offsets_encoder(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert encoder is not None
    full_width = "\uff1c\uff5cim_start\uff5c\uff1e"
    base = token_reuse.encode("a" + full_width + "y", encoder)
    assert list(base.encoded.anchor_starts) == []
    reused = token_reuse.encode("a" + full_width + "x", encoder, base.encoded)
    assert list(reused.encoded.ids) == whole(encoder, "a" + full_width + "x")


def test_which_tokenizers_are_reused(smollm2: TokenizerWrapper) -> None:
    wrapped = offsets_encoder(smollm2)  # mlx-lm's wrapper: the transformers tokenizer inside it
    assert wrapped is not None and wrapped.tokenizer is smollm2._tokenizer
    assert {smollm2.convert_tokens_to_ids(token) for token in ("<|im_start|>", "<|im_end|>")} <= set(wrapped.anchors)
    assert wrapped.longest_anchor >= len("<|im_start|>")
    keeps_specials_whole = load_tokenizer(Path(smollm2._tokenizer.name_or_path))._tokenizer
    keeps_specials_whole.split_special_tokens = True
    assert offsets_encoder(keeps_specials_whole) is None
    assert offsets_encoder(object()) is None


def test_a_tokenizer_whose_renders_are_not_reused_encodes_every_text_whole(smollm2: TokenizerWrapper) -> None:
    """`WholeTexts` (what the token counter uses when `offsets_encoder` says no): its own `encode`, nothing taken."""
    whole_texts = WholeTexts(smollm2)
    first = "<|im_start|>system\n" + "hello world " * CHECKPOINT_CHARS + "<|im_end|>\n"
    base = token_reuse.encode(first, whole_texts)
    later = token_reuse.encode(first + "<|im_start|>user\nhi<|im_end|>\n", whole_texts, base.encoded)
    assert list(later.encoded.ids) == list(smollm2.encode(later.encoded.text, add_special_tokens=False))
    assert (base.reused_tokens, later.reused_tokens, len(later.encoded.anchor_tokens)) == (0, 0, 0)


def test_of_renders_sharing_the_same_checkpoints_the_closest_parts_latest(
    families: dict[str, FastTokenizerOffsets],
) -> None:
    """An agent's conversation keeps a render per turn, all sharing its start: the one parting from the new text
    latest (within the characters after their last shared checkpoint) is taken."""
    encoder = families["byte-level BPE"]
    start = "<|im_start|>system\n" + "hello world " * (CHECKPOINT_CHARS // 4) + "<|im_end|>\n<|im_start|>user\n"
    start += "a" * (-len(start) % CHECKPOINT_CHARS)  # a whole number of checkpoints
    text = start + "word " * (CHECKPOINT_CHARS // 5) + "<|im_end|>\n<|im_start|>assistant\n"
    renders = [start + "word " * count + "stop<|im_end|>\n" for count in (10, 200, 30, 20)]
    recent = RecentEncodings()
    for render in renders:
        recent.remember("", _encoded(encoder, render))
    found = recent.closest("", text)
    assert found is not None and found.text == renders[1]  # the longest start shared, not the newest
    reused = token_reuse.encode(text, encoder, found)
    assert reused.reused_tokens > 0 and list(reused.encoded.ids) == encoder.encode_with_starts(text)[0]
