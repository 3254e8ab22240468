"""What both engine faces (Engine, BatchEngine) share: a loaded model's facts, its text, the
requests (`generate`, `chat`, `submit`: every option on both), the checks every request passes
before it reaches the scheduler core, a slot's KV state (`save_slot`, `restore_slot`, `erase_slot`,
as llama-server's /slots actions) and the flash-attention measurement.

One place for these so that the two faces cannot drift: the same token-id checks, the same option
checks, the same meaning of `n_ctx` (the whole context, as loaded) and `n_ctx_per_request` (what one
request may use: the whole context on Engine, a slot's share on BatchEngine). What a face does
itself: `_start` (a request's Generation and the way its events reach it), `_exclusively` (a call
with the context to itself) and `_on_idle_slot`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ...errors import ContextLengthError, EngineBusyError, EngineClosedError, GrammarError, InvalidOptionError
from ...gguf_file import GGUFInfo
from ...store import ModelManifest, Store
from ..embedding import Embedder, EmbeddingResult, EmbedOptions
from ..chat.tool_parser import ToolCallParser
from ..chat.tools import ToolSetup, tool_request
from ...devices import last_placement
from ..chat.template import BUILTIN_TEMPLATES, CHATML_TEMPLATE, ChatVocab, Message, chat_tokens, render_chat
from ..llama.flash_choice import FlashAttnChoice, measure_flash_attn, remember_flash_attn
from ..llama.runtime import LlamaRuntime
from ..core.sampler import Sampler
from ..core.sequence import KVSequence
from ..speculation.head_models import mtp_layers
from ..core.options import GenerateOptions, LoadOptions
from ..speculation.policy import CostModel
from ..state.session import RestoreResult, SessionInfo, conversation_tokens, face_identity
from .generation import Generation

__all__ = ["ModelFace"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class ModelFace:
    """A model loaded in one llama.cpp context, as the public API shows it (see the module)."""

    path: Path
    info: GGUFInfo
    manifest: ModelManifest | None
    options: LoadOptions
    store: Store
    _runtime: LlamaRuntime
    _chosen_template: str | None = None
    _flash_slots = 1  # the attention layout flash-attention verdicts are for (FlashAttnChoice.slots)
    _embedder: Embedder | None = None
    _embed_lock = threading.Lock()  # (one for all engines: creating an embedder is rare)

    # -- facts -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.ref if self.manifest else self.path.name

    @property
    def n_vocab(self) -> int:
        return self._runtime.facts.n_vocab

    @property
    def n_ctx(self) -> int:
        """The whole context, in tokens (as loaded: LoadOptions.n_ctx, llama-server's -c)."""
        return self._runtime.n_ctx

    @property
    def n_ctx_per_request(self) -> int:
        """Positions one request may use (prompt + output): the context split between the slots."""
        return self._runtime.n_ctx // self._slots_count()

    @property
    def n_ctx_train(self) -> int:
        return self._runtime.facts.n_ctx_train

    @property
    def threads(self) -> int:
        """llama.cpp's threads now: LoadOptions.n_threads when pinned, else the cores that other
        processes leave free, re-checked every few seconds while decoding (edgeinfer.cpu)."""
        return self._runtime.threads

    @property
    def parallel(self) -> int:
        """Slots: requests decoded together (1 on an Engine), numbered 0..parallel-1 for `save_slot` & co."""
        return self._slots_count()

    def _slots_count(self) -> int:
        return 1

    @property
    def has_mtp(self) -> bool:
        """Whether the model ships a multi-token-prediction layer (`--speculate mtp` drafts with it)."""
        return mtp_layers(self.info) > 0

    @property
    def backend(self) -> str:
        """Where the model's layers run, in one line: "CPU", or the GPUs and RPC workers holding how
        many layers (edgeinfer.devices; what `bench` and the chat's stats show)."""
        placement = getattr(self, "_placement", None)
        return placement.summary() if placement is not None else "CPU"

    def _note_placement(self) -> None:
        """Right after the load: its placement (devices records each load's, by file)."""
        self._placement = last_placement(self.path)

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(f"this engine ({self.name}) is closed")

    # -- the chat template -----------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        """The template `chat` renders with: the model's own (ChatML when it has none), unless
        another was assigned, e.g. `engine.chat_template = "chatml"` when the model's is unusable."""
        if self._chosen_template is not None:
            return self._chosen_template
        return self.info.metadata["tokenizer.chat_template"] if self.has_chat_template else CHATML_TEMPLATE

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template. A base model does not: `chat` then renders
        ChatML, whose markers such a model never learned (it may print them), so front ends say so
        and complete the text raw (`edgeinfer run`) unless ChatML was asked for."""
        tpl = self.info.metadata.get("tokenizer.chat_template")
        return self._chosen_template is not None or (isinstance(tpl, str) and bool(tpl.strip()))

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

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token prints as (special tokens as their text)."""
        self._check_open()
        return self._runtime.piece(self._runtime.check_token(token), True)

    def token_text(self, token: int) -> str:
        self._check_open()
        return self._runtime.token_text(token)

    def _vocab(self) -> ChatVocab:
        rt = self._runtime
        return ChatVocab(
            bos_text=rt.token_text(rt.bos) if rt.bos >= 0 else "",
            eos_text=rt.token_text(rt.eos) if rt.eos >= 0 else "",
            bos_id=rt.bos,
            add_bos=rt.add_bos,
            tokenize=lambda text, parse_special: rt.tokenize(text, False, parse_special),
        )

    def render_chat(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        self._check_open()
        vocab = self._vocab()
        return render_chat(self.chat_template, self._messages(messages), vocab.bos_text, vocab.eos_text,
                           name=self.name, tools=tools)

    def chat_tokens(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt tokens of a conversation, rendered with the model's own chat template (its
        `tools` variable, or a Hermes-style block where it has none: engine/chat/template.py)."""
        self._check_open()
        return chat_tokens(self.chat_template, self._messages(messages), self._vocab(), name=self.name, tools=tools)

    def tool_setup(self, tools: Any, tool_choice: Any = "auto", parallel_tool_calls: bool = True) -> ToolSetup:
        """What a chat request with `tools` needs on this model: the tools to render, the grammar
        (`required`, a named function, or lazy at the call marker for `auto`) and the parser of the
        model's own call format (engine/chat/tools.py)."""
        self._check_open()
        return tool_request(self.chat_template, tools, tool_choice, parallel_tool_calls,
                            tokenize=self._vocab().tokenize)

    # -- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], options: GenerateOptions | None = None, *,
                 logprobs: int | None = None, notify: Callable[[], None] | None = None) -> Generation:
        """Raw completion of a prompt (text, or token ids used as they are).

        logprobs: None, or how many alternatives (0..20) to report with each token's logprob (its
        events are then ScoredTokenEvent). notify: called whenever events arrive for this request
        (on a BatchEngine from its scheduler thread, on an Engine from the thread stepping it); it
        must not block."""
        self._check_open()
        return self._request(self._prompt_ids(prompt), options, logprobs, notify, None)

    def submit(self, tokens: Sequence[int], options: GenerateOptions | None = None, *,
               logprobs: int | None = None, notify: Callable[[], None] | None = None) -> Generation:
        """A request of prompt token ids (as `generate`)."""
        self._check_open()
        return self._request(self._token_ids(tokens), options, logprobs, notify, None)

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerateOptions | None = None,
        *,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        logprobs: int | None = None,
        notify: Callable[[], None] | None = None,
    ) -> Generation:
        """Continue a conversation ([{"role": "user", "content": ...}, ...]) as the assistant, with the
        model's own chat template. `system`: a system message put first unless the conversation
        starts with one.

        `tools` (OpenAI's function tools): the model may call them; its calls, in its own format,
        arrive as ToolCallEvent and in `done.tool_calls` (finish reason "tool_calls").
        `tool_choice`: "auto", "none", "required" or {"type": "function", "function": {"name": ...}};
        the last two are enforced by a grammar, so the arguments always match the function's schema.
        `logprobs`, `notify`: as `generate`. The one sequence of a chat with tools (the server's too):
        the tools rendered into the prompt, the grammar, the generation's events parsed."""
        self._check_open()
        msgs = self._messages(messages)
        if system is not None and not isinstance(system, str):
            raise InvalidOptionError(f"system must be a string, got {type(system).__name__}")
        if system is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        parser: ToolCallParser | None = None
        if tools is None and tool_choice == "auto":
            tokens = self.chat_tokens(msgs)
        else:
            setup = self.tool_setup(tools, tool_choice, parallel_tool_calls)
            tokens = self.chat_tokens(msgs, tools=setup.render_tools)
            options = setup.options(options)
            if setup.render_tools is not None:  # (tool_choice "none": nothing offered, nothing to parse)
                parser = setup.parser()
        return self._request(tokens, options, logprobs, notify, parser)

    def _request(self, tokens: list[int], options: GenerateOptions | None, logprobs: int | None,
                 notify: Callable[[], None] | None, tools: ToolCallParser | None) -> Generation:
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise InvalidOptionError(f"logprobs must be an integer in [0, 20], got {logprobs!r}")
        if notify is not None and not callable(notify):
            raise InvalidOptionError(f"notify must be a callable, got {type(notify).__name__}")
        options, sampler = self._checked(tokens, options)  # (a grammar compiled here, in the caller's thread)
        return self._start(tokens, options, sampler, logprobs, notify, tools)

    def _start(self, tokens: list[int], options: GenerateOptions, sampler: Sampler | None, logprobs: int | None,
               notify: Callable[[], None] | None, tools: ToolCallParser | None) -> Generation:
        """The face's Generation of a checked request (its Feed: faces/inline.py, faces/channel.py),
        which owns `sampler` (the request's, where it has a grammar)."""
        raise NotImplementedError

    # -- a slot's KV state (engine/state/session.py; llama-server's /slots actions) ------------------
    def save_slot(self, slot: int, path: str | os.PathLike[str],
                  conversation: Sequence[Message] | Sequence[int] | None = None, *,
                  max_bytes: int | None = None) -> SessionInfo:
        """Save what slot `slot`'s KV cache holds (its tokens and their keys and values) to `path`, so
        that an engine of either face on the same model file and KV-cache types can go on without
        reading them again (`restore_slot`, e.g. after the app restarted). An Engine has one slot, 0.
        `conversation`: the messages (as given to `chat`) or token ids the state is for; the cache is
        first cut to the prefix it shares with them, which is what their next turn reuses. A file
        that already holds exactly this state is kept (SessionInfo.written False). Raises
        StoreError / DiskSpaceError when the file cannot be written; see `_on_idle_slot` for a busy slot.
        `max_bytes`: DiskSpaceError, before anything is written, for a state that could take more (a
        server's quota)."""
        keep = conversation_tokens(self, conversation)
        identity = face_identity(self)  # the model's hash: outside the slot (the first one reads the file)
        return self._on_idle_slot(self._slot_index(slot),
                                  lambda seq: seq.save(path, identity, keep, max_bytes=max_bytes))

    def restore_slot(self, slot: int, path: str | os.PathLike[str],
                     conversation: Sequence[Message] | Sequence[int] | None = None) -> RestoreResult:
        """Load the KV state saved at `path` into slot `slot`, if it was saved with this model file and
        these KV-cache types and every check of the file passes; the next request (which lands on
        the slot holding its longest prefix) then reads only what follows the saved tokens.
        `conversation`: the messages or token ids being resumed, which the saved tokens must begin.
        A state that does not match, or a damaged file, is not loaded: one warning in the log and a
        false RestoreResult saying why (the cache is left as it was)."""
        keep = conversation_tokens(self, conversation)
        identity = face_identity(self)
        return self._on_idle_slot(self._slot_index(slot), lambda seq: seq.load(path, identity, keep))

    def erase_slot(self, slot: int) -> int:
        """Empty slot `slot`'s KV cache; returns how many tokens it held."""

        def erase(seq: KVSequence) -> int:
            n = len(seq)
            seq.clear()
            return n

        return self._on_idle_slot(self._slot_index(slot), erase)

    def _slot_index(self, slot: int) -> int:
        self._check_open()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.parallel:
            raise InvalidOptionError(f"slot must be an integer in [0, {self.parallel - 1}], got {slot!r}")
        return slot

    def _on_idle_slot(self, slot: int, fn: Callable[[KVSequence], T]) -> T:
        """fn(the slot's sequence) with the context to itself (`_exclusively`); EngineBusyError when
        a request runs on the slot then. An Engine's slot is free once its lock is: it waits for a
        generation of another thread (and raises for one this thread left unfinished); a
        BatchEngine refuses a busy slot at once (llama-server's 409 is the server's)."""
        slots = self._slots()

        def on_slot() -> T:
            s = slots[slot]
            if s.request is not None:
                raise EngineBusyError(f"slot {slot} is busy with a request")
            return fn(s.seq)

        return self._exclusively(on_slot)

    def _slots(self) -> list[Any]:
        """The scheduler core's slots (engine/core/scheduler.py's Slot)."""
        raise NotImplementedError

    def _exclusively(self, fn: Callable[[], T]) -> T:
        """fn() while no request steps the core (Engine: under its lock; BatchEngine: on its
        scheduler thread between two steps)."""
        raise NotImplementedError

    # -- flash attention (engine/llama/flash_choice.py) --------------------------------------------
    def measure_flash_attn(self, tokens: Sequence[int], *, steps: int = 8, save: bool = True) -> FlashAttnChoice:
        """Time a prefill of `tokens` (any text's, as many as the context depth to judge at) and
        decode steps after it with flash attention on and off, on scratch contexts beside this one
        in this face's attention layout: one sequence (an Engine, a BatchEngine with a KV stream per
        slot), or with one KV cache for every slot that many sequences of `tokens`, a row of each a
        step (see engine/llama/flash_choice.py). `save` keeps the verdict in the store: later loads
        of this model, on either face, with these threads, KV types and layout that leave
        `flash_attn` unset use it. Waits for running requests (a BatchEngine's pause meanwhile)."""
        self._check_open()
        choice = self._exclusively(lambda: measure_flash_attn(self._runtime, tokens, steps, self._flash_slots))
        log.info("%s: %s", self.name, choice.summary())
        if save:
            remember_flash_attn(self.path, self.options, self.store, choice)
        return choice

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, items: str | Sequence[str | Sequence[int]], options: EmbedOptions | None = None, *,
              cancel: Callable[[], bool] | threading.Event | None = None) -> EmbeddingResult:
        """Embeddings of texts (or token-id lists) with the pooling the GGUF declares (or
        `options.pooling`), normalized as the model's card says: on a context of their own on the
        same weights, so they never wait for (or disturb) generation. Safe from any thread."""
        self._check_open()
        with self._embed_lock:
            if self._embedder is None:
                self._embedder = Embedder(self._runtime, max_tokens=self.n_ctx_per_request)
        return self._embedder.embed(items, options, cancel=cancel)

    def _close_embedder(self) -> None:
        """Before the runtime is freed (a running embed stops at its next decode, then frees its context)."""
        if self._embedder is not None:
            self._embedder.close()

    # -- the cost curve (kept in the store per model file, threads, batch and KV cache) ----------
    def _cost_key(self) -> str:
        o = self.options
        return (f"v4|{self.path.resolve()}|{self.path.stat().st_size}|t{o.threads}|b{self._runtime.n_batch}"
                f"|{'/'.join(o.kv_types)}|fa{o.flash_attn}")

    def _stored_costs(self) -> CostModel:
        """The curve `edgeinfer bench` (or a server's idle calibration) measured and kept in the
        store, else a prior from the model's size. Either way the policy then learns from the
        steps it takes, so no request pays for measuring."""
        known = self.store.read_cache("decode-costs", self._cost_key())
        if isinstance(known, dict):
            try:
                return CostModel.from_dict(known)
            except (ValueError, TypeError, ZeroDivisionError):
                log.debug("ignoring an unusable decode-cost entry for %s", self.name)
        f = self._runtime.facts
        return CostModel.prior(f.size_bytes, f.n_layer, f.n_embd)

    def _remember_costs(self, costs: CostModel) -> None:
        """Keep a measured curve in the store (a prior is never kept: it is no fact)."""
        if costs.is_prior:
            return
        try:
            self.store.write_cache("decode-costs", self._cost_key(), costs.to_dict())
        except OSError as e:
            log.debug("decode costs not remembered: %s", e)

    # -- checks ----------------------------------------------------------------------------------
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

    def check_request(self, tokens: Sequence[int], options: GenerateOptions | None = None) -> GenerateOptions:
        """Validate a request (prompt token ids, options) without running it; returns the options."""
        options, sampler = self._checked(tokens, options)
        if sampler is not None:
            sampler.close()
        return options

    def _checked(self, tokens: Sequence[int], options: GenerateOptions | None) -> tuple[GenerateOptions, Sampler | None]:
        """check_request, and the request's sampler where it has a grammar: llama.cpp compiles the
        grammar here, in the submitting thread, once; the request samples with this sampler (the
        scheduler thread, which steps every stream, never compiles one). The caller owns it."""
        self._check_open()
        if options is not None and not isinstance(options, GenerateOptions):
            raise InvalidOptionError(f"options must be GenerateOptions, got {type(options).__name__}")
        options = (options or GenerateOptions()).validate()
        if not tokens:
            raise InvalidOptionError("the prompt is empty")
        limit = self.n_ctx_per_request
        if len(tokens) >= limit:
            n = self._slots_count()
            where = (f"a request can use {limit} (context {self.n_ctx} split between {n} slots: raise --ctx or "
                     "lower --parallel)") if n > 1 else f"the context holds {limit}; shorten it or load with a " \
                "larger context (--ctx)"
            raise ContextLengthError(f"the prompt is {len(tokens)} tokens but {where}")
        if options.sampling.top_k > self.n_vocab:
            raise InvalidOptionError(f"top_k must be at most the vocabulary size ({self.n_vocab}), "
                                     f"got {options.sampling.top_k}")
        grammar = options.resolved_grammar()
        if grammar is None:
            return options, None
        sampler = Sampler(self._runtime, options.sampling, grammar)  # (the vocabulary only: any thread)
        try:
            if not sampler.allows_a_start():
                raise GrammarError("the grammar allows no token of this model's vocabulary to start the "
                                   "output: it can never be satisfied")
        except BaseException:
            sampler.close()
            raise
        return options, sampler

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A raw prompt: text is tokenized, token ids are checked (ints in the vocabulary)."""
        return self.tokenize(prompt) if isinstance(prompt, str) else self._token_ids(prompt)
