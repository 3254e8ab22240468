"""Opening a drafting head (speculation/heads.py) for a target, after checking in Python what
llama.cpp would abort on or silently get wrong: an MTP context on a model without a loaded MTP
layer, an EAGLE-3 drafter whose target layers or width are not this target's, another vocabulary.
Every refusal is one line that says what the model has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import IncompatibleDraftError, InvalidModelError, SpeculationError
from ...gguf_file import GGUFInfo
from ..llama.runtime import LlamaRuntime, _load_error, log_capture, set_fields
from ..llama.heads_api import ext
from ..core.options import LoadOptions
from .draft_model import check_draft_compatible
from .heads import Eagle3Head, MtpHead, eagle3_cost_prior, mtp_cost_prior

__all__ = ["mtp_layers", "auto_head_key", "open_mtp_head", "open_eagle3_head"]

# The MTP layout this driver runs: one nextn block after the trunk, its own KV cache (llama.cpp's
# "neither shared memory nor chained heads" mode of common_speculative's draft-mtp).
_MTP_ARCHS = ("qwen35", "qwen35moe")


def mtp_layers(info: GGUFInfo) -> int:
    """How many multi-token-prediction (nextn) layers the GGUF declares."""
    n = info.metadata.get(f"{info.architecture}.nextn_predict_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def auto_head_key(info: GGUFInfo, rt: LlamaRuntime) -> tuple[str, str] | None:
    """The head `auto` drafts with on this model: its own MTP layer where it has one we can run."""
    return ("mtp", "") if info.architecture in _MTP_ARCHS and mtp_layers(info) == 1 and rt.n_nextn == 1 else None


def open_mtp_head(name: str, info: GGUFInfo, rt: LlamaRuntime, n_slots: int) -> MtpHead:
    n = mtp_layers(info)
    if n == 0:
        raise SpeculationError(f"{name} has no MTP layer to draft with (a {info.architecture} model with "
                               f"{rt.facts.n_layer} layers and no {info.architecture}.nextn_predict_layers): "
                               "use lookup, auto or draft=MODEL")
    if info.architecture not in _MTP_ARCHS or n != 1:
        raise SpeculationError(f"{name} has {n} MTP layer(s) of a {info.architecture} model: mtp drafts with one "
                               f"MTP layer of {' or '.join(_MTP_ARCHS)} models")
    if rt.n_nextn != 1:
        raise SpeculationError(f"{name}: its MTP layer was not loaded with the model (load it with load_mtp)")
    return MtpHead(rt, n_slots, mtp_cost_prior(info, rt.facts.n_layer))


class _ModelVocab:
    """What check_draft_compatible reads of a model, for a drafter that has no context of its own."""

    def __init__(self, ll: Any, model: Any):
        self._ll = ll
        self._vocab = ll.llama_model_get_vocab(model)
        self.vocab_type = int(ll.llama_vocab_type(self._vocab))
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self._vocab))
        self.bos = int(ll.llama_vocab_bos(self._vocab))
        self.eos = int(ll.llama_vocab_eos(self._vocab))
        self.facts = type("Facts", (), {"n_vocab": int(ll.llama_vocab_n_tokens(self._vocab))})()

    def token_text(self, i: int) -> str:
        raw = self._ll.llama_vocab_get_text(self._vocab, i)
        return raw.decode("utf-8", errors="replace") if raw else ""


def open_eagle3_head(name: str, target_info: GGUFInfo, rt: LlamaRuntime, path: Path, info: GGUFInfo, n_slots: int,
                     options: LoadOptions) -> Eagle3Head:
    """The EAGLE-3 drafter at `path` (validated: `info`) over this target."""
    label = path.name
    if info.architecture != "eagle3":
        raise IncompatibleDraftError(f"{label} is not an EAGLE-3 drafter (a {info.architecture} model): eagle3=MODEL "
                                     "takes a drafter converted with its target")
    meta = info.metadata
    layers = meta.get("eagle3.target_layers")
    width = meta.get("eagle3.target_hidden_size")
    n_layer, n_embd = rt.facts.n_layer, rt.facts.n_embd
    if not isinstance(layers, list) or len(layers) != 3 or not all(isinstance(x, int) and 0 <= x <= n_layer
                                                                    for x in layers):
        raise IncompatibleDraftError(f"{label} reads target layers {layers}, but {name} has {n_layer} layers")
    if width != n_embd:
        raise IncompatibleDraftError(f"{label} was made for a target {width} wide; {name} is {n_embd} wide")
    api = ext()
    ll = api.ll
    mparams = set_fields(ll.llama_model_default_params(), load_mode=ll.LLAMA_LOAD_MODE_MMAP,
                         **options.placement_fields(ll, path))
    said: list[str] = []
    with log_capture(lambda _level, text: said.append(text)):
        model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise InvalidModelError(f"{label}: llama.cpp could not load this drafter ({_load_error(said)})")
    try:
        ids = [int(api.target_layer_ids(model)[i]) for i in range(int(api.target_layer_ids_n(model)))]
        if ids != layers:
            raise IncompatibleDraftError(f"{label}: llama.cpp reads target layers {ids}, its GGUF says {layers}")
        check_draft_compatible(rt, _ModelVocab(ll, model), f"{label} (EAGLE-3)")  # type: ignore[arg-type]
        return Eagle3Head(rt, n_slots, eagle3_cost_prior(info, target_info), model, layers)
    except BaseException:
        ll.llama_model_free(model)
        raise
