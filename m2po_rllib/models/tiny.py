"""Tiny Hugging Face causal LMs that the project builds itself (no hub).

A character-level tokenizer (made with the `tokenizers` library, saved as `tokenizer.json`)
plus a randomly initialised Qwen2 model: both transformers and vLLM load the directory.
Tests use these; the built-in model (`builtin:arith-tiny`) starts from the same recipe and is
then warm-started on arithmetic by `scripts/build_builtin_model.py`.
"""

from __future__ import annotations

import os
import string

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
BOXED = "\\boxed{"
# Characters of the arithmetic tasks and their prompts; `\boxed{` is one token so an answer
# costs a handful of tokens.
DEFAULT_ALPHABET = string.digits + "+-*/=()., \n}" + string.ascii_letters + "?:"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, extra_tokens=(BOXED,)):
    """A fast tokenizer with one token per character of `alphabet` (ASCII), left padding.

    It is a byte-level BPE without merges, i.e. exactly the pipeline that `Qwen2Tokenizer`
    builds from a vocabulary: transformers 5 loads the tokenizer of every `model_type:
    qwen2` directory as `Qwen2Tokenizer`, whatever class was saved, and vLLM loads it through
    `AutoTokenizer`, so only this pipeline reads back unchanged (a plain character split
    would lose spaces and newlines on reload). Characters outside `alphabet` are dropped.
    """
    from tokenizers import AddedToken, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    # Byte-level BPE spells its vocabulary in the GPT-2 byte alphabet (" " is "Ġ").
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK])}
    for tok in extra_tokens:
        vocab.setdefault(tok, len(vocab))
    for ch in dict.fromkeys(alphabet):  # ordered, unique
        if not ch.isascii():
            raise ValueError(f"alphabet character {ch!r} is not ASCII; one byte per token is assumed")
        vocab.setdefault(to_bytes.pre_tokenize_str(ch)[0][0], len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    # Added tokens are matched before pre-tokenisation, so `\boxed{` stays one token.
    tokenizer.add_tokens([AddedToken(tok, normalized=False) for tok in extra_tokens])
    return tokenizer


def tiny_qwen2_config(vocab_size: int, **overrides):
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def new_tiny_model(seed: int = 0, **config_overrides):
    """A randomly initialised tiny Qwen2 model (in memory) and its char tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_qwen2_config(len(tokenizer), **config_overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tokenizer


def build_tiny_model(path: str | os.PathLike, seed: int = 0, **config_overrides) -> str:
    """Writes a random tiny Qwen2 model and its char tokenizer to `path`; returns the path."""
    model, tokenizer = new_tiny_model(seed, **config_overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
