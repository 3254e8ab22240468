"""Engine and load(): the one-user face of the scheduler core (one slot, stepped inline from the
caller's own `next()`, no thread hop between a token and its reader: faces/inline.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ...cancel import CancelToken
from ...errors import ContextLengthError, InvalidOptionError
from ...gguf_file import GGUFInfo
from ...store import ModelManifest, Store
from ..chat.tool_parser import ToolCallParser
from .speculation_setup import DraftModels, ProgressCallback, TargetModel
from .suffix_disk import suffix_memory
from .common import ModelFace
from ..llama.flash_choice import with_measured_flash_attn
from .generation import Generation
from .inline import InlineFeed
from .loading import load_face, speculation_options
from ..llama.runtime import LlamaRuntime
from ..core.options import GenerateOptions, LoadOptions, SpeculationOptions
from ..core.sampler import Sampler
from ..core.scheduler import Scheduler, Slot
from ..core.sequence import KVSequence
from .exclusive import RequestSlot
from ..speculation import CostModel, measure_costs
from ..speculation.head_models import mtp_layers

__all__ = ["Engine", "Generation", "load"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    flash_attn, ...).
    The file is validated by edgeinfer's own GGUF reader before llama.cpp sees it. With
    `speculation` (SpeculationOptions or the CLI form, e.g. "self=Q4_K_M"), its draft model is
    prepared too (see Engine.prepare_speculation), reporting to `progress`. (BatchEngine.load is
    the same path: faces/loading.py.)
    """
    return load_face(Engine, model, options, store=store, speculation=speculation, progress=progress,
                     load_options=load_options)


class _EngineSpeculation:
    """The engine's side of speculation as a generation sees it (generation.SpeculationSource)."""

    def __init__(self, runtime: LlamaRuntime, drafts: DraftModels, slot: RequestSlot, scheduler: Scheduler):
        self.runtime = runtime
        self.drafts = drafts
        self.slot = slot
        self.scheduler = scheduler

    def is_ready(self, spec: SpeculationOptions) -> bool:
        return self.drafts.is_ready(spec)

    def prepare(self, spec: SpeculationOptions, progress: ProgressCallback | None, cancel: CancelToken) -> None:
        if not self.is_ready(spec):
            self.drafts.prepare(spec, progress, cancel, exclusive=self._exclusive)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The context to itself (a head links to it; a hybrid model's is made again: then empty)."""
        with self.slot.hold():
            epoch = self.runtime.epoch
            try:
                yield
            finally:
                if self.runtime.epoch != epoch:
                    for s in self.scheduler.slots:
                        s.seq.forget()


class Engine(ModelFace):
    """A model loaded in llama.cpp with one context and one slot of the scheduler core.

    Thread safety: requests are serialized. A generation takes the engine's lock when it starts
    running and releases it when it ends, so two threads can share an engine safely — the second
    request waits for the first (and can be cancelled while it waits). For parallel requests, use
    a BatchEngine (the same core with N slots, stepped by a thread).

    Misuse is an error, never a crash or a hang: calls after `close()` raise EngineClosedError,
    token ids are range-checked, a generation that is closed frees the engine at once and one that
    is dropped is given up by the next request (faces/exclusive.py), and a request from a thread
    whose own earlier generation is unfinished raises EngineBusyError.

    Requests, their options and their Generation handle, a slot's KV state and the flash-attention
    measurement are the same as a BatchEngine's (faces/common.py); its one slot is slot 0.
    """

    def __init__(
        self,
        path: Path,
        info: GGUFInfo,
        options: LoadOptions,
        *,
        manifest: ModelManifest | None = None,
        store: Store | None = None,
        speculation: SpeculationOptions | str | None = None,
        progress: ProgressCallback | None = None,
    ):
        self.path = Path(path)
        self.info = info
        self.manifest = manifest
        self.store = store or Store()
        # flash attention left to us: on or off as `measure_flash_attn` found faster here (flash_choice)
        self.options = options = with_measured_flash_attn(self.path, options, self.store)
        self._closed = False
        self._runtime = LlamaRuntime(self.path, options, load_mtp=mtp_layers(info) > 0)
        self._note_placement()
        self._slot = RequestSlot(self._runtime)
        self._drafts = DraftModels(TargetModel(self.name, self.path, info, manifest, self.store, options),
                                   self._runtime)
        self._scheduler = Scheduler(self._runtime, 1, self._stored_costs(), drafts=self._drafts.context,
                                    abortable=True, heads=self._drafts.heads,
                                    memory=suffix_memory(self.path, options, self.store.root, self.n_vocab))
        self._speculation = _EngineSpeculation(self._runtime, self._drafts, self._slot, self._scheduler)
        if speculation is not None:
            try:
                self.prepare_speculation(speculation, progress=progress)
            except BaseException:
                self.close()
                raise

    @property
    def closed(self) -> bool:
        return self._closed

    # -- requests --------------------------------------------------------------------------------
    def prepare_speculation(
        self,
        speculation: SpeculationOptions | str,
        *,
        progress: ProgressCallback | None = None,
        cancel: CancelToken = None,
    ) -> None:
        """Make the draft model a speculation needs ready before generating with it.

        `speculation` is SpeculationOptions or the CLI form ("lookup", "draft=MODEL",
        "self=Q4_K_M", "mtp", "eagle3=MODEL", "medusa=HEADS"). A self-draft is taken from the store or, on first
        use, made by the quantizer and registered (seconds to minutes); a draft model is validated,
        loaded and checked against this model's vocabulary; a head (mtp: the model's own MTP layer;
        eagle3: an EAGLE-3 drafter for it; medusa: a file of Medusa heads for it, evaluated in
        numpy on the hidden states the model's context then keeps) is linked to the model's context, and a hybrid model
        (Qwen3.5) first gets rollback snapshots, which empties its cache. `progress` receives
        SpeculationProgress events (stage "quantize" with done/total tensors, "load", "ready") from
        the working thread;
        `cancel` (an Event or a callable) stops it between tensors with `Cancelled`. Returns at
        once when there is nothing to prepare (off, lookup, auto without a draft model, or
        already prepared). A generation whose speculation was not prepared prepares it itself,
        yielding the same events before its first token. Safe to call from any thread.
        """
        self._check_open()
        self._speculation.prepare(speculation_options(speculation), progress, cancel)

    def _start(self, tokens: list[int], options: GenerateOptions, sampler: Sampler | None, logprobs: int | None,
               notify: Callable[[], None] | None, tools: ToolCallParser | None) -> Generation:
        speculation = None if options.speculation.method == "off" else self._speculation
        feed = InlineFeed(self._slot, self._scheduler, tokens, options, sampler, logprobs, notify, speculation)
        return Generation(feed, tools)

    def _slots(self) -> list[Slot]:
        return self._scheduler.slots

    def _exclusively(self, fn: Callable[[], T]) -> T:
        with self._slot.hold():
            return fn()

    # -- the cost curve --------------------------------------------------------------------------
    def measure_decode_costs(self, tokens: Sequence[int], *, depths: Sequence[int] = (64, 1024), reps: int = 3,
                             save: bool = True) -> CostModel:
        """Measure the batch cost curve at two context depths (what speculation's policy plans
        with) and use it from now on; `save` keeps it in the store for this model, thread count
        and KV type. Clears the cache. `tokens`: any text's tokens to fill the context with."""
        with self._slot.hold():
            costs = measure_costs(self._scheduler.slots[0].seq, tokens, depths, reps)
            self._scheduler.costs = costs
        if save:
            self.save_decode_costs()
        return costs

    def save_decode_costs(self) -> None:
        """Keep the measured cost curve in the store (a prior is never kept: it is no fact)."""
        self._remember_costs(self._scheduler.costs)

    def reset(self) -> None:
        """Forget the cached prompt, so the next request starts from an empty KV cache (a request
        normally re-uses the longest prefix it shares with the previous one), in its draft models too."""

        def forget(seq: KVSequence) -> int:
            seq.clear()
            self._drafts.forget_cached()
            return 0

        self._on_idle_slot(0, forget)

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
            seq = self._scheduler.slots[0].seq
            seq.clear()
            for s in range(0, len(tokens), rt.n_batch):
                chunk = tokens[s : s + rt.n_batch]
                first = max(start - s, 0)
                if first >= len(chunk):
                    seq.decode(chunk)
                    continue
                seq.decode(chunk, logits_from=first)
                for i in range(first, len(chunk)):
                    out[s + i - start] = rt.logits_row(i)
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model and context. A generation in progress is cancelled (and closed when
        suspended); one running in another thread stops at its next step, which close waits for.
        Every later call, also on generations made before, raises EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._slot.close(self._free)

    def _free(self) -> None:
        self._scheduler.memory.save(force=True)  # (kept on disk only when asked: LoadOptions.suffix_memory)
        self._close_embedder()
        self._drafts.close()
        self._runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, n_ctx={self.n_ctx})"
