"""The engine: a loaded GGUF model and the requests run on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ContextLengthError, InvalidOptionError
from ..gguf_file import GGUFInfo, read_gguf
from ..store import ModelManifest, Store
from .chat import CHATML_TEMPLATE, Message, render_chat
from .events import GenerationStats, SpeculationStats
from .generation import Drafter, Generation
from .llama import LlamaRuntime
from .options import GenerateOptions, LoadOptions, SpeculationOptions

__all__ = ["Engine", "Generation", "load"]


def load(
    model: str | Path | None = None,
    options: LoadOptions | None = None,
    *,
    store: Store | None = None,
    **load_options: Any,
) -> Engine:
    """Load a model by store name (`name:tag`), `.gguf` path, or None for the default model.

    Keyword arguments are LoadOptions fields (n_ctx, n_threads, n_batch, kv_type, flash_attn).
    The file is validated by edgeinfer's own GGUF reader before llama.cpp sees it.
    """
    known = {f.name for f in fields(LoadOptions)}
    unknown = set(load_options) - known
    if unknown:
        raise InvalidOptionError(f"unknown load option(s): {', '.join(sorted(unknown))}")
    options = replace(options or LoadOptions(), **load_options).validate()
    store = store or Store()
    path, manifest = store.resolve(model)
    info = read_gguf(path)
    return Engine(path, info, options, manifest=manifest, store=store)


class Engine:
    """A model loaded in llama.cpp with one context.

    Thread safety: requests are serialized. One engine holds one llama.cpp context; a generation
    takes the engine's lock when it starts running and releases it when it ends, so two threads
    can share an engine safely — the second request waits for the first (and can be cancelled
    while it waits). For truly parallel requests, load two engines.
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
        self._lock = threading.Lock()
        self._active: Generation | None = None
        self._closed = False
        self._costs = None  # speculation.CostModel, measured on first speculative request
        self._drafts: dict[tuple, LlamaRuntime] = {}  # draft-model runtimes, kept between requests

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
    def n_ctx_train(self) -> int:
        return self._runtime.facts.n_ctx_train

    @property
    def chat_template(self) -> str:
        tpl = self.info.metadata.get("tokenizer.chat_template")
        return tpl if isinstance(tpl, str) and tpl.strip() else CHATML_TEMPLATE

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_open()
        return self._runtime.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        self._check_open()
        return b"".join(self._runtime.piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        self._check_open()
        return self._runtime.token_text(token)

    def render_chat(self, messages: Sequence[Message]) -> str:
        rt = self._runtime
        bos = rt.token_text(rt.bos) if rt.bos >= 0 else ""
        eos = rt.token_text(rt.eos) if rt.eos >= 0 else ""
        return render_chat(self.chat_template, messages, bos, eos)

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
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self._start(tokens, options)

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerateOptions | None = None,
        *,
        system: str | None = None,
    ) -> Generation:
        """Continue a conversation ([{"role": "user", "content": ...}, ...]) as the assistant."""
        msgs = list(messages)
        if system is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        return self._start(self.chat_tokens(msgs), options)

    def _start(self, tokens: list[int], options: GenerateOptions | None) -> Generation:
        self._check_open()
        options = (options or GenerateOptions()).validate()
        if not tokens:
            raise InvalidOptionError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten it or load with a larger context (--ctx)"
            )
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidOptionError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        return Generation(self, tokens, options)

    def _make_drafter(self, spec: SpeculationOptions, stats: GenerationStats) -> Drafter | None:
        if spec.method == "off":
            return None
        from .speculation import make_drafter

        speculation = SpeculationStats()
        drafter = make_drafter(self, spec, speculation)
        if drafter is not None:
            speculation.method = drafter.method
            stats.speculation = speculation
        return drafter

    def _speculation_costs(self, prompt: Sequence[int]):
        """Measured decode times by batch size for this model on this machine: calibrated once
        and remembered in the store (cache/decode-costs.json), then tracked online."""
        import json

        from ..fsutil import atomic_write_text
        from .speculation import CostModel

        if self._costs is not None:
            return self._costs
        o = self.options
        key = f"v2|{self.path.resolve()}|{self.path.stat().st_size}|t{o.threads}|b{self._runtime.n_batch}|{o.kv_type}|fa{o.flash_attn}"
        cache = self.store.root / "cache" / "decode-costs.json"
        try:
            known = json.loads(cache.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
        if isinstance(known.get(key), dict):
            self._costs = CostModel.from_dict(known[key])
        else:
            self._costs = CostModel.calibrate(self._runtime, prompt[-64:])
            known[key] = self._costs.to_dict()
            try:
                with self.store.lock():
                    atomic_write_text(cache, json.dumps(known, indent=1))
            except OSError:
                pass  # a read-only store only costs a re-calibration next time
        return self._costs

    def _draft_runtime(self, spec: SpeculationOptions) -> LlamaRuntime:
        from .speculation import open_draft_runtime

        key = (spec.method == "self" or not spec.draft_model, spec.draft_model, spec.self_quant)
        if key not in self._drafts:
            self._drafts[key] = open_draft_runtime(self, spec)
        return self._drafts[key]

    def _abort_if_active(self, generation: Generation) -> None:
        if self._active is generation:
            self._runtime.abort_flag.set()

    def reset(self) -> None:
        """Forget the cached prompt, so the next request starts from an empty KV cache (a request
        normally re-uses the longest prefix it shares with the previous one)."""
        with self._lock:
            self._runtime.clear()

    # -- evaluation ------------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Logits (float32, [len(tokens) - start, n_vocab]) from a fresh KV cache: row i is the
        distribution of the token that follows tokens[start + i]. Fed in n_batch-sized decodes."""
        self._check_open()
        tokens = [int(t) for t in tokens]
        if not 0 <= start < len(tokens):
            raise InvalidOptionError(f"start must be in [0, {len(tokens)}), got {start}")
        if len(tokens) > self.n_ctx:
            raise ContextLengthError(f"{len(tokens)} tokens do not fit in the context ({self.n_ctx})")
        rt = self._runtime
        out = np.empty((len(tokens) - start, self.n_vocab), dtype=np.float32)
        with self._lock:
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
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidOptionError("this engine is closed")

    def close(self) -> None:
        """Free the model and context (waits for a running generation to end)."""
        if self._closed:
            return
        active = self._active
        if active is not None:
            active.cancel()
            try:
                active.close()  # a generation abandoned mid-iteration still holds the lock
            except ValueError:
                pass  # it is running in another thread and will stop at the cancel
        with self._lock:
            self._closed = True
            for rt in self._drafts.values():
                rt.close()
            self._drafts.clear()
            self._runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, n_ctx={self.n_ctx})"

