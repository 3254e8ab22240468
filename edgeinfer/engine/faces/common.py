"""What both engine faces (Engine, BatchEngine) share: a loaded model's facts, its text and the
checks every request passes before it reaches the scheduler core.

One place for these so that the two faces cannot drift: the same token-id checks, the same option
checks, the same meaning of `n_ctx` (the whole context, as loaded) and `n_ctx_per_request` (what one
request may use: the whole context on Engine, a slot's share on BatchEngine).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ContextLengthError, EngineClosedError, GrammarError, InvalidOptionError
from ...gguf_file import GGUFInfo
from ...store import ModelManifest, Store
from ..embedding import Embedder, EmbeddingResult, EmbedOptions
from ..chat.tools import ToolSetup, tool_request
from ...devices import last_placement
from ..chat.template import BUILTIN_TEMPLATES, CHATML_TEMPLATE, ChatVocab, Message, chat_tokens, render_chat
from ..llama.runtime import LlamaRuntime
from ..core.sampler import Sampler
from ..speculation.head_models import mtp_layers
from ..core.options import GenerateOptions, LoadOptions
from ..speculation.policy import CostModel

__all__ = ["ModelFace"]

log = logging.getLogger(__name__)


class ModelFace:
    """A model loaded in one llama.cpp context, as the public API shows it (see the module)."""

    path: Path
    info: GGUFInfo
    manifest: ModelManifest | None
    options: LoadOptions
    store: Store
    _runtime: LlamaRuntime
    _chosen_template: str | None = None
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

    def _with_tools(self, messages: Sequence[Message], options: GenerateOptions | None, tools: Any, tool_choice: Any,
                    parallel_tool_calls: bool, start: Callable[[list[int], GenerateOptions | None], Any]) -> Any:
        """Start a chat request (with `start(tokens, options)`), its events parsed into tool calls
        when tools are offered."""
        if tools is None and tool_choice == "auto":
            return start(self.chat_tokens(messages), options)
        setup = self.tool_setup(tools, tool_choice, parallel_tool_calls)
        return setup.wrap(start(self.chat_tokens(messages, tools=setup.render_tools), setup.options(options)))

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
        """Before the runtime is freed (a running embed finishes first: it holds the embedder's lock)."""
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
