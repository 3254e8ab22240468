"""The engine: a loaded GGUF model and the requests run on it.

    engine/__init__.py  Engine, load(): the public face
    generation.py       the decode loop (Generation), one request's events
    slot.py             one request at a time on the engine's llama.cpp context
    drafts.py           draft models of an engine: found, made (self-draft) and opened explicitly
    speculation/        the speculation policy (pure) and the drafters it steers
    llama.py            a checked layer over llama-cpp-python's ctypes bindings
    options.py, events.py, sampler.py, text.py, chat.py
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..cancel import CancelToken
from ..errors import ContextLengthError, EngineClosedError, InvalidOptionError
from ..gguf_file import GGUFInfo
from ..store import ModelManifest, Store
from ..validate import admit
from .chat import BUILTIN_TEMPLATES, CHATML_TEMPLATE, Message, render_chat
from .drafts import DraftModels, ProgressCallback, TargetModel
from .events import GenerationStats, SpeculationStats
from .generation import Drafter, Generation
from .llama import LlamaRuntime
from .options import GenerateOptions, LoadOptions, SpeculationOptions
from .slot import RequestSlot
from .speculation import CostModel, SpeculationContext, make_drafter, measure_costs

__all__ = ["Engine", "Generation", "load"]

log = logging.getLogger(__name__)


def load(
    model: str | Path | None = None,
    options: LoadOptions | None = None,
    *,
    store: Store | None = None,
    speculation: SpeculationOptions | str | None = None,
    progress: ProgressCallback | None = None,
    **load_options: Any,
) -> Engine:
    """Load a model by store name (`name:tag`), `.gguf` path, or None for the default model.

    Keyword arguments are LoadOptions fields (n_ctx, n_threads, n_batch, kv_type, kv_type_k, kv_type_v,
    flash_attn).
    The file is validated by edgeinfer's own GGUF reader before llama.cpp sees it. With
    `speculation` (SpeculationOptions or the CLI form, e.g. "self=Q4_K_M"), its draft model is
    prepared too (see Engine.prepare_speculation), reporting to `progress`.
    """
    known = {f.name for f in fields(LoadOptions)}
    unknown = set(load_options) - known
    if unknown:
        raise InvalidOptionError(f"unknown load option(s): {', '.join(sorted(unknown))}")
    if options is not None and not isinstance(options, LoadOptions):
        raise InvalidOptionError(f"options must be LoadOptions, got {type(options).__name__}")
    if model is not None and not isinstance(model, (str, Path)):
        raise InvalidOptionError(f"model must be a store name or a path, got {type(model).__name__}")
    options = replace(options or LoadOptions(), **load_options).validate()
    store = store or Store()
    path, manifest = store.resolve(model)
    info = admit(path, store, manifest)  # validated; a never-seen file first loads in a child process
    engine = Engine(path, info, options, manifest=manifest, store=store)
    if speculation is not None:
        try:
            engine.prepare_speculation(speculation, progress=progress)
        except BaseException:
            engine.close()
            raise
    return engine


def _speculation_options(spec: SpeculationOptions | str) -> SpeculationOptions:
    if isinstance(spec, str):
        return SpeculationOptions.parse(spec)
    if not isinstance(spec, SpeculationOptions):
        raise InvalidOptionError(f"speculation must be SpeculationOptions or a string like 'lookup', "
                                 f"got {type(spec).__name__}")
    return spec.validate()


class _EngineSpeculation:
    """The engine's side of speculation as a generation sees it (generation.SpeculationSource)."""

    def __init__(self, context: SpeculationContext, drafts: DraftModels):
        self.context = context
        self.drafts = drafts

    def is_ready(self, spec: SpeculationOptions) -> bool:
        # A recurrent target gets no drafter at all (make_drafter says why): nothing to prepare.
        return self.context.target.facts.recurrent or self.drafts.is_ready(spec)

    def prepare(self, spec: SpeculationOptions, progress: ProgressCallback | None, cancel: CancelToken) -> None:
        if not self.is_ready(spec):
            self.drafts.prepare(spec, progress, cancel)

    def drafter(self, spec: SpeculationOptions, stats: GenerationStats) -> Drafter | None:
        speculation = SpeculationStats()
        drafter = make_drafter(self.context, spec, speculation)
        if drafter is not None:
            speculation.method = drafter.method
            stats.speculation = speculation
        return drafter


class Engine:
    """A model loaded in llama.cpp with one context.

    Thread safety: requests are serialized. One engine holds one llama.cpp context; a generation
    takes the engine's lock when it starts running and releases it when it ends, so two threads
    can share an engine safely — the second request waits for the first (and can be cancelled
    while it waits). For truly parallel requests, load two engines (or a BatchEngine).

    Misuse is an error, never a crash or a hang: calls after `close()` raise EngineClosedError,
    token ids are range-checked, a generation that is dropped or closed frees the engine at once,
    and a request from a thread whose own earlier generation is unfinished raises EngineBusyError.
    """

    def __init__(
        self,
        path: Path,
        info: GGUFInfo,
        options: LoadOptions,
        *,
        manifest: ModelManifest | None = None,
        store: Store | None = None,
    ):
        self.path = Path(path)
        self.info = info
        self.manifest = manifest
        self.options = options
        self.store = store or Store()
        self._runtime = LlamaRuntime(self.path, options)
        self._slot = RequestSlot(self._runtime)
        self._closed = False
        self._costs: CostModel | None = None  # measured on the first speculative request
        self._drafts = DraftModels(TargetModel(self.name, self.path, info, manifest, self.store, options),
                                   self._runtime)
        self._speculation = _EngineSpeculation(
            SpeculationContext(target=self._runtime, costs=self._decode_costs, draft_runtime=self._drafts.runtime,
                               name=self.name),
            self._drafts,
        )

    # -- facts -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.ref if self.manifest else self.path.name

    @property
    def n_vocab(self) -> int:
        return self._runtime.facts.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._runtime.n_ctx

    @property
    def n_ctx_per_request(self) -> int:
        """Positions one request may use (prompt + output): the whole context on one slot."""
        return self._runtime.n_ctx

    @property
    def n_ctx_train(self) -> int:
        return self._runtime.facts.n_ctx_train

    @property
    def threads(self) -> int:
        """llama.cpp's threads now: LoadOptions.n_threads when pinned, else the cores that other
        processes leave free, re-checked every few seconds while decoding (edgeinfer.cpu)."""
        return self._runtime.threads

    @property
    def chat_template(self) -> str:
        """The template `chat` renders with: the model's own (ChatML when it has none), unless
        another was assigned, e.g. `engine.chat_template = "chatml"` when the model's is unusable."""
        chosen = getattr(self, "_chosen_template", None)
        if chosen is not None:
            return chosen
        tpl = self.info.metadata.get("tokenizer.chat_template")
        return tpl if isinstance(tpl, str) and tpl.strip() else CHATML_TEMPLATE

    @chat_template.setter
    def chat_template(self, template: str) -> None:
        if not isinstance(template, str) or not template.strip():
            raise InvalidOptionError("a chat template must be a non-empty string (or 'chatml')")
        self._chosen_template = BUILTIN_TEMPLATES.get(template, template)

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_open()
        if not isinstance(text, str):
            raise InvalidOptionError(f"text to tokenize must be a string, got {type(text).__name__}")
        return self._runtime.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        self._check_open()
        ids = self._token_ids(tokens)
        return b"".join(self._runtime.piece(t, special) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        self._check_open()
        return self._runtime.token_text(token)

    def render_chat(self, messages: Sequence[Message]) -> str:
        self._check_open()
        messages = self._messages(messages)
        rt = self._runtime
        bos = rt.token_text(rt.bos) if rt.bos >= 0 else ""
        eos = rt.token_text(rt.eos) if rt.eos >= 0 else ""
        return render_chat(self.chat_template, messages, bos, eos, name=self.name)

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The prompt tokens of a conversation, rendered with the model's own chat template."""
        self._check_open()
        rendered = self.render_chat(messages)
        rt = self._runtime
        bos_text = rt.token_text(rt.bos) if rt.bos >= 0 else ""
        add_bos = rt.add_bos and not (bos_text and rendered.startswith(bos_text))
        tokens = rt.tokenize(rendered, False, True)
        return ([rt.bos] if add_bos else []) + tokens

    # -- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], options: GenerateOptions | None = None) -> Generation:
        """Raw completion of a prompt (text, or token ids used as they are)."""
        self._check_open()
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else self._token_ids(prompt)
        return self._start(tokens, options)

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerateOptions | None = None,
        *,
        system: str | None = None,
    ) -> Generation:
        """Continue a conversation ([{"role": "user", "content": ...}, ...]) as the assistant."""
        self._check_open()
        msgs = self._messages(messages)
        if system is not None and not isinstance(system, str):
            raise InvalidOptionError(f"system must be a string, got {type(system).__name__}")
        if system is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        return self._start(self.chat_tokens(msgs), options)

    def prepare_speculation(
        self,
        speculation: SpeculationOptions | str,
        *,
        progress: ProgressCallback | None = None,
        cancel: CancelToken = None,
    ) -> None:
        """Make the draft model a speculation needs ready before generating with it.

        `speculation` is SpeculationOptions or the CLI form ("lookup", "draft=MODEL",
        "self=Q4_K_M"). A self-draft is taken from the store or, on first use, made by the
        quantizer and registered (seconds to minutes); a draft model is validated, loaded and
        checked against this model's vocabulary. `progress` receives SpeculationProgress events
        (stage "quantize" with done/total tensors, "load", "ready") from the working thread;
        `cancel` (an Event or a callable) stops it between tensors with `Cancelled`. Returns at
        once when there is nothing to prepare (off, lookup, auto without a draft model, or
        already prepared). A generation whose speculation was not prepared prepares it itself,
        yielding the same events before its first token. Safe to call from any thread.
        """
        self._check_open()
        spec = _speculation_options(speculation)
        self._speculation.prepare(spec, progress, cancel)

    def _start(self, tokens: list[int], options: GenerateOptions | None) -> Generation:
        self._check_open()
        if options is not None and not isinstance(options, GenerateOptions):
            raise InvalidOptionError(f"options must be GenerateOptions, got {type(options).__name__}")
        options = (options or GenerateOptions()).validate()
        if not tokens:
            raise InvalidOptionError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten it or load with a larger context (--ctx)"
            )
        if options.sampling.top_k > self.n_vocab:
            raise InvalidOptionError(f"top_k must be at most the vocabulary size ({self.n_vocab}), "
                                     f"got {options.sampling.top_k}")
        speculation = None if options.speculation.method == "off" else self._speculation
        return Generation(self._slot, tokens, options, speculation)

    def _token_ids(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            raise InvalidOptionError(f"token ids must be a sequence of integers, got {type(tokens).__name__}")
        return [self._runtime.check_token(t) for t in tokens]

    @staticmethod
    def _messages(messages: Sequence[Message]) -> list[Message]:
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
            raise InvalidOptionError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                                     f"got {type(messages).__name__}")
        msgs = list(messages)
        for m in msgs:
            if not isinstance(m, Mapping):
                raise InvalidOptionError(f"each chat message must be a dict, got {type(m).__name__}")
        return msgs

    def _decode_cost_key(self) -> str:
        o = self.options
        return (f"v3|{self.path.resolve()}|{self.path.stat().st_size}|t{o.threads}|b{self._runtime.n_batch}"
                f"|{'/'.join(o.kv_types)}|fa{o.flash_attn}")

    def _decode_costs(self, prompt: Sequence[int]) -> CostModel:
        """Decode times by batch size and depth for this model on this machine: what `edgeinfer
        bench` measured (kept in the store's cache), else a prior from the model's size. Either
        way the policy then learns from the steps it takes, so no request pays for measuring."""
        if self._costs is not None:
            return self._costs
        known = self.store.read_cache("decode-costs", self._decode_cost_key())
        if isinstance(known, dict):
            try:
                self._costs = CostModel.from_dict(known)
            except (ValueError, TypeError, ZeroDivisionError):
                log.debug("ignoring an unusable decode-cost entry for %s", self.name)
        if self._costs is None:
            f = self._runtime.facts
            self._costs = CostModel.prior(f.size_bytes, f.n_layer, f.n_embd)
        return self._costs

    def measure_decode_costs(self, tokens: Sequence[int], *, depths: Sequence[int] = (64, 1024), reps: int = 3,
                             save: bool = True) -> CostModel:
        """Measure the batch cost curve at two context depths (what speculation's policy plans
        with) and use it from now on; `save` keeps it in the store for this model, thread count
        and KV type (see save_decode_costs). Clears the cache. `tokens`: any text's tokens to
        fill the context with."""
        with self._slot.hold():
            self._costs = measure_costs(self._runtime, tokens, depths, reps)
        if save:
            self.save_decode_costs()
        return self._costs

    def save_decode_costs(self) -> None:
        """Keep the measured cost curve in the store (a prior is never kept: it is no fact)."""
        if self._costs is None or self._costs.is_prior:
            return
        try:
            self.store.write_cache("decode-costs", self._decode_cost_key(), self._costs.to_dict())
        except OSError as e:
            log.debug("decode costs not remembered: %s", e)

    def reset(self) -> None:
        """Forget the cached prompt, so the next request starts from an empty KV cache (a request
        normally re-uses the longest prefix it shares with the previous one)."""
        self._check_open()
        with self._slot.hold() as rt:
            rt.clear()

    # -- evaluation ------------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Logits (float32, [len(tokens) - start, n_vocab]) from a fresh KV cache: row i is the
        distribution of the token that follows tokens[start + i]. Fed in n_batch-sized decodes."""
        self._check_open()
        tokens = self._token_ids(tokens)
        if not isinstance(start, int) or not 0 <= start < len(tokens):
            raise InvalidOptionError(f"start must be in [0, {len(tokens)}), got {start}")
        if len(tokens) > self.n_ctx:
            raise ContextLengthError(f"{len(tokens)} tokens do not fit in the context ({self.n_ctx})")
        out = np.empty((len(tokens) - start, self.n_vocab), dtype=np.float32)
        with self._slot.hold() as rt:
            rt.clear()
            for s in range(0, len(tokens), rt.n_batch):
                chunk = tokens[s : s + rt.n_batch]
                first = max(start - s, 0)
                if first >= len(chunk):
                    rt.decode(chunk)
                    continue
                rt.decode(chunk, logits_from=first)
                for i in range(first, len(chunk)):
                    out[s + i - start] = rt.logits_row(i)
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"this engine ({self.name}) is closed")

    def close(self) -> None:
        """Free the model and context. A generation in progress is cancelled (and closed when
        suspended); one running in another thread stops at its next step, which close waits for.
        Every later call, also on generations made before, raises EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._slot.close(self._free)

    def _free(self) -> None:
        self._drafts.close()
        self._runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, n_ctx={self.n_ctx})"

