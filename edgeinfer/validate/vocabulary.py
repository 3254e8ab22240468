"""The vocabulary llama.cpp builds (llama-vocab.cpp `load`): a tokenizer model it can tokenize with,
no two tokens with the same text, complete scores and types, merges for BPE, special tokens that
exist."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..gguf_file import TOKENS_KEY, ArraySummary, GGUFInfo
from .metadata import fail

__all__ = ["check_vocabulary"]

log = logging.getLogger(__name__)

# tokenizer.ggml.model values llama.cpp builds a vocabulary for ("none"/"no_vocab" build none,
# and then every tokenize call asserts).
_TOKENIZER_MODELS = ("llama", "bert", "gpt2", "hybriddna", "whitespace", "t5", "rwkv", "plamo2", "gemma4")
_BPE_MODELS = ("gpt2", "hybriddna", "whitespace", "gemma4")
# Default special ids and add_bos/add_eos per tokenizer model (llama-vocab.cpp), used to find a
# BOS/EOS that tokenizing would assert on.
_DEFAULT_IDS = {  # model: (bos, eos)
    "llama": (1, 2), "bert": (101, None), "gpt2": (11, 11), "hybriddna": (11, 11), "whitespace": (11, 11),
    "t5": (None, 1), "rwkv": (None, None), "plamo2": (1, 2), "gemma4": (None, None),
}
_DEFAULT_ADD = {"llama": (True, False), "bert": (True, False), "t5": (False, True)}  # model: (add_bos, add_eos)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")
# Special ids that must name a real token: a generation stops on them and chat templates print them.
_REQUIRED_SPECIAL = ("bos", "eos", "eot", "eom")
_OTHER_SPECIAL = ("unk", "sep", "padding", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


def check_vocabulary(info: GGUFInfo) -> int:
    meta = info.metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise fail(info, "tokenizer.ggml.model is missing")
    if model not in _TOKENIZER_MODELS:
        raise fail(info, f"tokenizer.ggml.model {model!r} is not a vocabulary llama.cpp can tokenize with")
    tokens = meta.get(TOKENS_KEY)
    n_vocab = _array_length(info, TOKENS_KEY, tokens, ("STRING",))
    if n_vocab is None:
        raise fail(info, f"{TOKENS_KEY} is missing")
    if n_vocab == 0:
        raise fail(info, f"{TOKENS_KEY} is empty")
    duplicate = tokens.duplicate if isinstance(tokens, ArraySummary) else _first_duplicate(tokens)
    if duplicate is not None:
        i, j = duplicate
        raise fail(info, f"{TOKENS_KEY}: tokens {i} and {j} have the same text")
    for key, types in (("tokenizer.ggml.scores", ("FLOAT32", "INT32")), ("tokenizer.ggml.token_type", ("INT32",))):
        n = _array_length(info, key, meta.get(key), types)
        if n is not None and n < n_vocab:
            raise fail(info, f"{key} has {n} entries for {n_vocab} tokens")
    pre = meta.get("tokenizer.ggml.pre")
    if model in _BPE_MODELS and not (model != "gemma4" and pre == "kimi-k2"):
        if _array_length(info, "tokenizer.ggml.merges", meta.get("tokenizer.ggml.merges"), ("STRING",)) is None:
            raise fail(info, "tokenizer.ggml.merges is missing (a BPE vocabulary needs its merges)")
    _check_special_tokens(info, model, pre, n_vocab)
    return n_vocab


def _array_length(info: GGUFInfo, key: str, value: Any, element_types: tuple[str, ...]) -> int | None:
    if value is None:
        return None
    if isinstance(value, ArraySummary):
        element = value.element_type
        length = value.length
    elif isinstance(value, list):
        length = len(value)
        kinds = {_kind(v) for v in value}
        element = kinds.pop() if len(kinds) == 1 else (element_types[0] if not kinds else "mixed")
    else:
        raise fail(info, f"{key} must be an array")
    if element not in element_types and not (element == "INT" and set(element_types) & {"INT32", "FLOAT32"}):
        raise fail(info, f"{key} must be an array of {' or '.join(element_types)}, not {element}")
    return length


def _kind(v: Any) -> str:
    if isinstance(v, str):
        return "STRING"
    if isinstance(v, bool):
        return "BOOL"
    if isinstance(v, int):
        return "INT"
    return "FLOAT32" if isinstance(v, float) else type(v).__name__


def _first_duplicate(tokens: Iterable[str]) -> tuple[int, int] | None:
    seen: dict[str, int] = {}
    for i, text in enumerate(tokens):
        text = text or f"[EMPTY_{i}]"  # what llama.cpp stores for an empty entry
        if text in seen:
            return seen[text], i
        seen[text] = i
    return None


def _check_special_tokens(info: GGUFInfo, model: str, pre: Any, n_vocab: int) -> None:
    meta = info.metadata
    ids: dict[str, int | None] = {}
    for name in _REQUIRED_SPECIAL + _OTHER_SPECIAL:
        key = f"tokenizer.ggml.{name}_token_id"
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(info, f"{key} must be an integer")
        if not 0 <= value < n_vocab:
            if name in _REQUIRED_SPECIAL:
                raise fail(info, f"{key} is {value}, outside the vocabulary (0..{n_vocab - 1})")
            log.warning("%s: %s is %s, outside the vocabulary; llama.cpp ignores it", info.path.name, key, value)
            continue
        ids[name] = value
    default_bos, default_eos = _DEFAULT_IDS[model]
    add_bos, add_eos = _DEFAULT_ADD.get(model, (False, False))
    if model in _BPE_MODELS and pre in _LLAMA3_PRE:
        add_bos = True
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) or (model == "gemma4")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", add_eos))
    for what, add, explicit, default in (("bos", add_bos, ids.get("bos"), default_bos), ("eos", add_eos, ids.get("eos"), default_eos)):
        resolved = explicit if explicit is not None else (default if default is not None and default < n_vocab else None)
        if add and resolved is None:
            raise fail(info, f"tokenizer.ggml.add_{what}_token is set but the vocabulary has no {what.upper()} token")
