"""What a sentence-transformers embedding repository adds to a llama-family checkpoint.

An embedding model such as Qwen3-Embedding is the decoder (`Qwen3ForCausalLM` in config.json)
plus a few files that say how its hidden states become one vector:

- `modules.json`: the pipeline. Its Pooling module's `config.json` (`1_Pooling/config.json`) names
  the pooling (mean, cls, lasttoken); a Normalize module means L2-normalized vectors. A Dense
  projection after pooling is refused (llama.cpp would need it as extra tensors).
- `config_sentence_transformers.json`: named prompts (Qwen3-Embedding's "query" is its instruction
  format, `Instruct: <task>\\nQuery:`; documents take none) and the default prompt's name.
- the model card (README.md): Matryoshka (MRL) training and the smallest size the vectors may be
  cut to ("output dimensions ranging from 32 to 1024").

The GGUF gets llama.cpp's own `<arch>.pooling_type` (as llama.cpp's converter writes it) and
edgeinfer's keys for the rest (edgeinfer.embedding_meta). Such repositories often save the bare
`Qwen3Model` (tensors without the `model.` prefix, no lm_head even when config.json says the
embeddings are not tied): `adapt_checkpoint` names the tensors as the causal LM's and lets an
embedding model go without an output layer (llama.cpp then reuses the token embeddings for the
logits it computes and nobody reads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from ..embedding_meta import (
    DEFAULT_PROMPT_KEY,
    MIN_DIMENSIONS_KEY,
    NORMALIZE_KEY,
    POOLING_CODES,
    PROMPTS_KEY,
)
from ..errors import ConversionError
from .arch import HParams
from .safetensors import Checkpoint

__all__ = ["EmbeddingSpec", "read_embedding_spec", "adapt_checkpoint", "embedding_files"]

log = logging.getLogger(__name__)

# What a pull fetches besides the weights and the tokenizer: the files read here.
_EMBEDDING_FILES = ("modules.json", "config_sentence_transformers.json", "README.md")
_POOLING_CONFIG = re.compile(r"^[^/]*Pooling/config\.json$")  # `1_Pooling/config.json`

# sentence-transformers' Pooling config: its boolean flags, and the newer `pooling_mode` string.
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_UNSUPPORTED_FLAGS = {"pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens": "weightedmean"}
_MAX_JSON = 1 << 20  # these files are a few hundred bytes; anything this large is not one of them
_MAX_README = 200_000


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: str  # mean | cls | last
    normalize: bool
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    min_dimensions: int | None = None  # Matryoshka: the vectors may be cut down to this size

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_pooling_type(gguf.PoolingType(POOLING_CODES[self.pooling]))
        w.add_bool(NORMALIZE_KEY, self.normalize)
        if self.prompts:
            w.add_string(PROMPTS_KEY, json.dumps(self.prompts, ensure_ascii=False))
        if self.default_prompt_name:
            w.add_string(DEFAULT_PROMPT_KEY, self.default_prompt_name)
        if self.min_dimensions is not None:
            w.add_uint32(MIN_DIMENSIONS_KEY, self.min_dimensions)


def embedding_files(paths: Iterable[str]) -> list[str]:
    """Of a repository's file paths, those `read_embedding_spec` reads (and the card, for its license)."""
    return sorted(p for p in paths if p in _EMBEDDING_FILES or _POOLING_CONFIG.match(p))


def _json(path: Path, what: str) -> Any:
    try:
        if path.stat().st_size > _MAX_JSON:
            raise ConversionError(f"{path.name} is larger than {_MAX_JSON} bytes ({what})")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path.name} is not valid JSON ({what}): {e}") from None


def _module_dir(folder: Path, module: dict[str, Any]) -> Path:
    """A module's folder, kept inside the model folder."""
    rel = str(module.get("path") or "")
    path = (folder / rel).resolve()
    if rel.startswith("/") or ".." in Path(rel).parts or not path.is_relative_to(folder.resolve()):
        raise ConversionError(f"modules.json names a module outside the model folder: {rel!r}")
    return path


def _pooling(config: dict[str, Any]) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        if mode in _POOLING_MODES:
            return _POOLING_MODES[mode]
        raise ConversionError(f"sentence-transformers pooling {mode!r} is not supported (mean, cls and lasttoken are)")
    chosen = [name for flag, name in _POOLING_FLAGS.items() if config.get(flag) is True]
    other = [name for flag, name in _UNSUPPORTED_FLAGS.items() if config.get(flag) is True]
    if other or len(chosen) != 1:
        what = ", ".join(chosen + other) or "none"
        raise ConversionError(f"sentence-transformers pooling ({what}) is not supported: exactly one of mean, cls "
                              "and lasttoken is")
    return chosen[0]


def _matryoshka_min(folder: Path, hidden: int) -> int | None:
    """The smallest size the card says the vectors may be cut to, when it declares Matryoshka (MRL)
    training; None otherwise."""
    try:
        text = (folder / "README.md").read_text(encoding="utf-8", errors="replace")[:_MAX_README]
    except OSError:
        return None
    if not re.search(r"\bMRL\b|matryoshka", text, re.IGNORECASE):
        return None
    for m in re.finditer(r"dimensions?\b[^.\n]{0,80}?\bfrom\s+(\d{1,6})\s+to\s+(\d{1,6})", text, re.IGNORECASE):
        lo, hi = int(m.group(1)), int(m.group(2))
        if hi == hidden and 1 <= lo <= hi:
            return lo
    log.warning("README.md mentions Matryoshka (MRL) training but no range of dimensions ending at %d: "
                "the converted model's vectors will not be shortened", hidden)
    return None


def read_embedding_spec(folder: Path, hidden: int) -> EmbeddingSpec | None:
    """The embedding configuration of a sentence-transformers repository; None without modules.json
    (a generative model). Raises ConversionError for what llama.cpp cannot reproduce."""
    folder = Path(folder)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path, "sentence-transformers modules")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConversionError("modules.json is not a list of modules")
    pooling: str | None = None
    normalize = False
    include_prompt = True
    for m in modules:
        kind = str(m.get("type", ""))
        short = kind.rsplit(".", 1)[-1]
        if short == "Pooling":
            config_path = _module_dir(folder, m) / "config.json"
            if not config_path.is_file():
                raise ConversionError(f"missing {config_path.relative_to(folder.resolve())} (the Pooling module's "
                                      "configuration)")
            config = _json(config_path, "the Pooling module")
            if not isinstance(config, dict):
                raise ConversionError(f"{config_path.name} of the Pooling module is not a JSON object")
            pooling = _pooling(config)
            include_prompt = config.get("include_prompt", True) is not False
        elif short == "Normalize":
            normalize = True
        elif short == "Dense":
            raise ConversionError("a sentence-transformers Dense projection after pooling is not supported")
        elif short not in ("Transformer", ""):
            log.warning("modules.json: ignoring module %s", kind)
    if pooling is None:
        raise ConversionError("modules.json has no Pooling module: cannot tell how this model pools")
    prompts: dict[str, str] = {}
    default_prompt: str | None = None
    st_path = folder / "config_sentence_transformers.json"
    if st_path.is_file():
        st = _json(st_path, "sentence-transformers configuration")
        raw = st.get("prompts") if isinstance(st, dict) else None
        if isinstance(raw, dict):
            prompts = {str(k): v for k, v in raw.items() if isinstance(v, str)}
        name = st.get("default_prompt_name") if isinstance(st, dict) else None
        if isinstance(name, str) and name:
            if name not in prompts:
                raise ConversionError(f"config_sentence_transformers.json: default prompt {name!r} is not among its prompts")
            default_prompt = name
    if not include_prompt and pooling == "mean" and any(prompts.values()):
        log.warning("the Pooling module leaves prompt tokens out of the mean; llama.cpp's mean includes them, so "
                    "vectors of prompted texts will differ slightly from sentence-transformers'")
    return EmbeddingSpec(pooling, normalize, prompts, default_prompt, _matryoshka_min(folder, hidden))


def adapt_checkpoint(ckpt: Checkpoint, hp: HParams, spec: EmbeddingSpec | None) -> tuple[Checkpoint, HParams]:
    """An embedding model's bare decoder checkpoint (`embed_tokens.weight`, `layers.0....`, as
    sentence-transformers saves Qwen3-Embedding) named as the causal LM's, and without lm_head
    treated as tied. Anything else (generative models, drafters) is returned as it is."""
    if spec is None:
        return ckpt, hp
    names = ckpt.names
    if "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names):
        for f in ckpt.files:
            f.tensors = {new: dataclasses.replace(e, name=new) for new, e in
                         ((n if n.startswith("lm_head.") else f"model.{n}", e) for n, e in f.tensors.items())}
        ckpt = Checkpoint(ckpt.files)
        log.info("tensors without the 'model.' prefix (a bare decoder): named as the causal LM's")
    if not hp.tied and "lm_head.weight" not in ckpt.names:
        hp = dataclasses.replace(hp, tied=True)
        log.info("an embedding model without lm_head: llama.cpp reuses the token embeddings as the output layer")
    return ckpt, hp
