"""Byte-level BPE vocabularies from `tokenizer.json`, as llama.cpp wants them in GGUF.

llama.cpp does not run the Hugging Face pre-tokenizer: it picks one of its own built-in regex sets
by the name in `tokenizer.ggml.pre`. A wrong name tokenizes differently without any error, so the
name is identified here from the tokenizer's own `pre_tokenizer` (its regex and steps) and an
unknown pre-tokenizer is refused rather than defaulted. (llama.cpp's converter hashes the output
of the `tokenizers` library instead; we read the config, which needs no extra dependency.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from ..errors import ConversionError

__all__ = ["Vocab", "load_vocab", "identify_pre_tokenizer", "KNOWN_PRE_TOKENIZERS"]

_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: qwen2's, with combining marks (\p{M}) inside letter runs.
_QWEN35_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o; gpt-oss's o200k_harmony): llama.cpp's "gpt-4o" (llama-vocab.cpp quotes this regex).
_O200K_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A canonical form of each pre-tokenizer llama.cpp implements -> its `tokenizer.ggml.pre` name.
# ("split", regex) is a Split step with behavior Isolated; ("bytelevel", use_regex) a ByteLevel
# step without a prefix space; ("digits",) Digits with individual_digits.
KNOWN_PRE_TOKENIZERS: dict[tuple[tuple[Any, ...], ...], str] = {
    (("split", _LLAMA3_RE), ("bytelevel", False)): "llama-bpe",
    (("split", _QWEN2_RE), ("bytelevel", False)): "qwen2",
    (("split", _QWEN35_RE), ("bytelevel", False)): "qwen35",
    (("split", _O200K_RE), ("bytelevel", False)): "gpt-4o",
    (("digits",), ("bytelevel", True)): "smollm",
    (("bytelevel", True),): "gpt-2",
}
_SUPPORTED_NORMALIZERS = (None, "NFC")


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre
    tokens: list[str] | list[bytes]
    token_types: list[int]
    special: gguf.SpecialVocab  # merges, special token ids, add_bos/eos, chat template
    scores: list[float] | None = None  # SentencePiece only

    def add_to_gguf(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        self.special.add_to_gguf(writer, quiet=True)


def _canonical_step(step: dict[str, Any]) -> tuple[Any, ...]:
    kind = step.get("type")
    if kind == "ByteLevel":
        if step.get("add_prefix_space"):
            return ("bytelevel-prefix-space",)
        return ("bytelevel", bool(step.get("use_regex", True)))
    if kind == "Digits":
        return ("digits",) if step.get("individual_digits") else ("digits-grouped",)
    if kind == "Split":
        pattern = step.get("pattern") or {}
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex == _O200K_RE and step.get("behavior") == "Removed" and step.get("invert"):
            return ("split", regex)  # kept matches of an inverted Removed split: this regex matches every character
        if regex is None or step.get("behavior") != "Isolated" or step.get("invert"):
            return ("split-other", json.dumps(step, sort_keys=True))
        return ("split", regex)
    return (str(kind),)


def identify_pre_tokenizer(tokenizer: dict[str, Any]) -> str:
    """The llama.cpp pre-tokenizer name for a tokenizer.json; ConversionError when unknown."""
    pre = tokenizer.get("pre_tokenizer")
    if not isinstance(pre, dict):
        raise ConversionError("tokenizer.json has no pre_tokenizer; cannot tell which llama.cpp pre-tokenizer to use")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    key = tuple(_canonical_step(s) for s in steps or [] if isinstance(s, dict))
    name = KNOWN_PRE_TOKENIZERS.get(key)
    if name is None:
        summary = ", ".join(s[0] for s in key) or "empty"
        raise ConversionError(
            f"unknown BPE pre-tokenizer ({summary}); supported: {', '.join(sorted(set(KNOWN_PRE_TOKENIZERS.values())))}"
        )
    normalizer = tokenizer.get("normalizer")
    norm_type = normalizer.get("type") if isinstance(normalizer, dict) else None
    if norm_type not in _SUPPORTED_NORMALIZERS:
        raise ConversionError(f"unsupported tokenizer normalizer {norm_type!r} for a byte-level BPE tokenizer")
    return name


def _looks_special(text: str) -> bool:
    # The same heuristic llama.cpp's converter applies to added tokens not flagged special.
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def load_vocab(folder: Path, vocab_size: int | None) -> Vocab:
    """Tokens, types, merges and special tokens of the tokenizer in `folder`.

    A SentencePiece `tokenizer.model` (Llama 2, TinyLlama, Mistral) wins over the tokenizer.json
    that such repos also ship (a byte-fallback BPE llama.cpp runs as SentencePiece anyway);
    otherwise `tokenizer.json` must be a byte-level BPE. `vocab_size` is the model's embedding
    row count: ids the tokenizer does not use are padded with unused `[PAD{i}]` tokens, as
    llama.cpp's converter does.
    """
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        return _load_sentencepiece(folder, vocab_size)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"no tokenizer.json (or SentencePiece tokenizer.model) in {folder}")
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"tokenizer.json is not valid JSON: {e}") from None
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConversionError(f"tokenizer.json model type {kind!r} is not supported (byte-level BPE only)")
    if model.get("byte_fallback"):
        raise ConversionError("tokenizer.json is a SentencePiece-style BPE (byte_fallback); only byte-level BPE is supported")
    pre = identify_pre_tokenizer(tok)

    reverse: dict[int, str] = {}
    for text, idx in model["vocab"].items():
        if not isinstance(idx, int) or idx < 0:
            raise ConversionError(f"tokenizer.json: token {text!r} has invalid id {idx!r}")
        reverse[idx] = text
    added: dict[int, dict[str, Any]] = {}
    for entry in tok.get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str):
            added[entry["id"]] = entry
            reverse[entry["id"]] = entry["content"]
    if not reverse:
        raise ConversionError("tokenizer.json has an empty vocabulary")
    n = vocab_size if vocab_size is not None else max(reverse) + 1
    if max(reverse) >= n:
        raise ConversionError(f"tokenizer has token id {max(reverse)} but the model's vocab_size is {n}")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            text = added[i]["content"]
            tokens.append(text)
            special = bool(added[i].get("special")) or _looks_special(text)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    # gguf's SpecialVocab reads the special tokens; the merges are read here (its loader takes
    # a quarter of a second for a 50k-merge list, a tenth of the whole conversion of a small model).
    special_vocab = gguf.SpecialVocab(folder, load_merges=False, n_vocab=n)
    special_vocab.merges = _merges(model)
    template = folder / "chat_template.jinja"  # gpt-oss ships its template alone, which older gguf releases do not read
    if special_vocab.chat_template is None and template.is_file():
        special_vocab.chat_template = template.read_text(encoding="utf-8")
    return Vocab(model="gpt2", pre=pre, tokens=tokens, token_types=[int(t) for t in types], special=special_vocab)


def _merges(model: dict[str, Any]) -> list[str]:
    """The BPE merges as llama.cpp stores them: "left right", a space inside a part as U+0120.

    tokenizer.json has them as such strings, or (transformers >= 4.45, which allows spaces in
    parts) as [left, right] pairs, which llama.cpp's converter joins this way."""
    merges = model.get("merges")
    if not isinstance(merges, list) or not merges:
        raise ConversionError("tokenizer.json has no merges")
    out: list[str] = []
    for i, m in enumerate(merges):
        if type(m) is str:
            out.append(m)
        elif not (isinstance(m, list) and len(m) == 2 and type(m[0]) is str and type(m[1]) is str):
            raise ConversionError(f"tokenizer.json: merge {i} is {m!r:.60}, not a string or a pair of strings")
        else:
            out.append(m[0].replace(" ", "\u0120") + " " + m[1].replace(" ", "\u0120"))
    return out


def _load_sentencepiece(folder: Path, vocab_size: int | None) -> Vocab:
    """tokenizer.model -> llama.cpp's "llama" (SPM) vocabulary, following llama.cpp's converter."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ConversionError("converting a SentencePiece tokenizer.model needs: pip install sentencepiece") from None
    path = folder / "tokenizer.model"
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(path.read_bytes())
    except Exception as e:  # the library raises RuntimeError / OSError on a damaged file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(f"tokenizer.model is not a valid SentencePiece model: {first}") from None
    n_sp = sp.vocab_size()
    n = vocab_size if vocab_size is not None else n_sp
    tokens: list[bytes] = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(gguf.TokenType.UNUSED)] * n
    for i in range(min(n_sp, n)):
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = float(sp.GetScore(i))
        if sp.IsUnknown(i):
            types[i] = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            types[i] = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            types[i] = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            types[i] = gguf.TokenType.BYTE
        else:
            types[i] = gguf.TokenType.NORMAL
    # Tokens added on top (tokenizer_config.json's added_tokens_decoder).
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConversionError(f"tokenizer_config.json is not valid JSON: {e}") from None
        for key, data in (cfg.get("added_tokens_decoder") or {}).items():
            if not str(key).isdigit() or not isinstance(data, dict) or not isinstance(data.get("content"), str):
                continue
            i, text = int(key), data["content"]
            if i >= n:
                raise ConversionError(f"tokenizer_config.json adds token id {i} but the model's vocab_size is {n}")
            if i < n_sp:
                continue  # already in the model (e.g. <s>, </s>, <unk>)
            special = bool(data.get("special")) or _looks_special(text)
            tokens[i] = (text if special else text.replace(" ", "\u2581")).encode("utf-8")
            scores[i] = -1000.0
            types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    special_vocab = gguf.SpecialVocab(folder, n_vocab=n)
    return Vocab(model="llama", pre="default", tokens=tokens, token_types=[int(t) for t in types],
                 special=special_vocab, scores=scores)
