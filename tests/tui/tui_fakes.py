"""A scripted backend for the UI tests: deterministic tokens, adjustable speed.

This is a fake only to make the UI's flows deterministic; the engine itself is tested with real
models elsewhere, and the end-to-end and tmux tests here use the real default model.

Speed: `delay` seconds between tokens, or a `gate` (threading.Semaphore) the test releases one
token at a time, so a test can look at the screen mid-reply without sleeping.

Tools: with `calls_script` set, a chat request that offers tools (`tools=`) may end with tool calls,
streamed as the library streams them (ToolCallEvents: a first one naming the call, then pieces of its
arguments, the last with the whole call) and returned in DoneEvent.tool_calls.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import edgeinfer
from edgeinfer import (DoneEvent, GenerationStats, PrefillProgress, SpeculationProgress, SpeculationStats, TokenEvent,
                       ToolCall, ToolCallEvent)
from edgeinfer_tui.backend import LoadedModel, ModelEntry, TaskProgress

Script = Callable[[list[dict[str, str]], Any], list[tuple[str, bool]]]
# (messages, tools offered) -> the calls the reply ends with, as (name, arguments JSON); [] for none
CallsScript = Callable[[list[dict[str, Any]], tuple[dict[str, Any], ...]], list[tuple[str, str]]]


def echo_script(messages: list[dict[str, str]], options: Any) -> list[tuple[str, bool]]:
    """'Echo: <last user message>' word by word; every third token is 'drafted' when speculating."""
    last = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    words = f"Echo: {last}".split(" ")
    tokens = [(w if i == 0 else " " + w) for i, w in enumerate(words)]
    spec = getattr(getattr(options, "speculation", None), "method", "off")
    return [(t, spec != "off" and i % 3 != 0) for i, t in enumerate(tokens)]


class ScriptedGeneration:
    def __init__(self, tokens: list[tuple[str, bool]], delay: float, gate: threading.Semaphore | None, method: str,
                 preparing: tuple[SpeculationProgress, ...] = (), prefill: tuple[PrefillProgress, ...] = (),
                 calls: tuple[ToolCall, ...] = ()):
        self.tokens = tokens
        self.calls = calls
        self.preparing = preparing
        self.prefill = prefill
        self.delay = delay
        self.gate = gate
        self._cancel = threading.Event()
        self.stats = GenerationStats(prompt_tokens=7)
        if method != "off":
            self.stats.speculation = SpeculationStats(method=method)

    def cancel(self) -> None:
        self._cancel.set()

    def _wait_turn(self) -> bool:
        """Wait for the next token's turn; False when cancelled meanwhile."""
        if self.gate is not None:
            while not self._cancel.is_set():
                if self.gate.acquire(timeout=0.01):
                    return True
            return False
        if self.delay:
            return not self._cancel.wait(self.delay)
        return not self._cancel.is_set()

    def __iter__(self):
        t0 = time.perf_counter()
        yield from self.preparing  # as a generation whose speculation was not prepared yet
        text, ids = [], []
        reason = "eos"
        for progress in self.prefill:  # a long prompt read in steps, each taking its turn as a token does
            if not self._wait_turn():
                yield DoneEvent(text="", tokens=[], finish_reason="cancelled", stats=self.stats)
                return
            yield progress
        run = 0
        for i, (piece, drafted) in enumerate(self.tokens):
            if not self._wait_turn():
                reason = "cancelled"
                break
            text.append(piece)
            ids.append(i)
            self.stats.generated_tokens += 1
            now = time.perf_counter()
            if i == 0:
                self.stats.ttft_s = now - t0
                first = now
            else:
                self.stats.decode_s = now - first
            spec = self.stats.speculation
            if spec is not None:
                if drafted:
                    run += 1
                else:
                    if run:
                        spec.record(run + 1, run)
                    run = 0
            yield TokenEvent(token=i, text=piece, drafted=drafted)
        if self.stats.speculation is not None and run:
            self.stats.speculation.record(run + 1, run)
        made: list[ToolCall] = []  # the calls streamed to their end (a call cut off is not a call)
        for i, call in enumerate(self.calls if reason == "eos" else ()):
            half = len(call.arguments) // 2
            for ev in (ToolCallEvent(i, call.id, call.name), ToolCallEvent(i, call.id, call.name, call.arguments[:half]),
                       ToolCallEvent(i, call.id, call.name, call.arguments[half:], call=call)):
                if not self._wait_turn():
                    reason = "cancelled"
                    break
                yield ev
            if reason == "cancelled":
                break
            made.append(call)
        if made and reason == "eos":
            reason = "tool_calls"
        yield DoneEvent(text="".join(text), tokens=ids, finish_reason=reason, stats=self.stats, tool_calls=tuple(made))


class ScriptedEngine:
    """Speculation other than off/lookup needs preparing once per engine, as the real engine's
    self-draft and draft-model methods do: `prepare_speculation` reports the backend's
    `preparing` events (then waits for `prepare_gate`, when set); a generation whose speculation
    was not prepared yields them before its first token."""

    def __init__(self, ref: str, backend: FakeBackend, kv_types: tuple[str, str] = edgeinfer.DEFAULT_LOAD.kv_types):
        self.ref = ref
        self.backend = backend
        self.kv_types = kv_types
        self.closed = False
        self.prepared: set[str] = set()

    @property
    def has_chat_template(self) -> bool:
        return self.ref not in self.backend.no_template

    def _needs_preparing(self, spec: edgeinfer.SpeculationOptions) -> bool:
        return spec.method not in ("off", "lookup") and spec.method not in self.prepared

    def prepare_speculation(self, speculation, *, progress=None, cancel=None) -> None:
        if not self._needs_preparing(speculation):
            return
        for ev in self.backend.preparing:
            if progress is not None:
                progress(ev)
        gate = self.backend.prepare_gate
        while gate is not None and not gate.wait(0.01):
            if cancel is not None and cancel():
                raise edgeinfer.Cancelled("preparing speculation")
        self.prepared.add(speculation.method)
        self.backend.preparations.append((self.ref, speculation.method))

    def chat(self, messages: list[dict[str, str]], options: Any = None, *, tools=None) -> ScriptedGeneration:
        options = (options or edgeinfer.GenerateOptions()).validate()
        self.backend.calls.append((self.ref, [dict(m) for m in messages], options))
        self.backend.tools_offered.append(tuple(tools or ()))
        if self.backend.fail_chat:
            raise edgeinfer.ContextLengthError(self.backend.fail_chat)
        tokens = self.backend.script(messages, options)
        preparing = self.backend.preparing if self._needs_preparing(options.speculation) else ()
        self.prepared.add(options.speculation.method)
        calls = ()
        if tools and self.backend.calls_script is not None:
            self.backend.call_counter += 1
            calls = tuple(ToolCall(f"call_{self.backend.call_counter}_{i}", name, args)
                          for i, (name, args) in enumerate(self.backend.calls_script(messages, tuple(tools))))
        return ScriptedGeneration(tokens, self.backend.delay, self.backend.gate, options.speculation.method, preparing,
                                  self.backend.prefill, calls)

    # Saved KV state, as Engine.save_session / restore_session: the file records the model, its KV
    # types and the conversation; a restore needs the same model and types and a conversation that
    # begins with the saved one. A state's "tokens": a quarter of its turns' characters.
    @staticmethod
    def _tokens(conversation: list[dict[str, str]]) -> int:
        return sum(len(m["content"]) for m in conversation if m["role"] != "system") // 4

    def save_session(self, path, conversation=None) -> edgeinfer.SessionInfo:
        saved = [dict(m) for m in conversation or []]
        self.backend.session_calls.append(("save", self.ref, Path(path).name, saved))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"ref": self.ref, "kv": list(self.kv_types), "conversation": saved}))
        return edgeinfer.SessionInfo(Path(path), self._tokens(saved), Path(path).stat().st_size, 0.0)

    def restore_session(self, path, conversation=None) -> edgeinfer.RestoreResult:
        data = json.loads(Path(path).read_text())
        saved = data["conversation"]
        self.backend.session_calls.append(("restore", self.ref, Path(path).name, saved))
        if (data["ref"], tuple(data["kv"])) != (self.ref, self.kv_types) or \
                [dict(m) for m in conversation or []][: len(saved)] != saved:
            return edgeinfer.RestoreResult(False, reason="saved for another model, KV types or other tokens")
        return edgeinfer.RestoreResult(True, self._tokens(saved), Path(path).stat().st_size)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeBackend:
    models: list[ModelEntry] = field(
        default_factory=lambda: [
            ModelEntry(ref="smollm2-135m-instruct:q4_1", name="smollm2-135m-instruct", quant="Q4_1", size=91_000_000,
                       bits_per_weight=5.13, fits=True),
            ModelEntry(ref="smollm2-135m-instruct:q8_0", name="smollm2-135m-instruct", quant="Q8_0", size=145_000_000,
                       bits_per_weight=8.5, kld=0.004, same_top=96.6, ppl=10.2, tok_s=122.0, fits=True),
            ModelEntry(ref="smollm2-135m-instruct:q4_k_m", name="smollm2-135m-instruct", quant="Q4_K_M", size=105_000_000,
                       bits_per_weight=5.9, kld=0.060, same_top=87.7, ppl=10.9, tok_s=118.0, fits=True),
        ]
    )
    script: Script = echo_script
    calls_script: CallsScript | None = None  # tool calls a reply ends with (when tools are offered)
    call_counter: int = 0
    tools_offered: list[tuple[dict[str, Any], ...]] = field(default_factory=list)  # the tools of each chat request
    delay: float = 0.0
    gate: threading.Semaphore | None = None
    fail_load: dict[str, str] = field(default_factory=dict)  # ref -> error message
    fail_kv: dict[tuple[str, str], str] = field(default_factory=dict)  # (K, V) cache types -> error message
    load_options: edgeinfer.LoadOptions | None = None  # as `edgeinfer chat` would set them
    fail_chat: str | None = None
    no_template: set[str] = field(default_factory=set)  # models that ship no chat template (base models)
    preparing: tuple[SpeculationProgress, ...] = ()  # what preparing a self-draft/draft speculation reports
    prefill: tuple[PrefillProgress, ...] = ()  # what each generation reports while reading its prompt
    prepare_gate: threading.Event | None = None  # prepare_speculation ends once it is set
    preparations: list[tuple[str, str]] = field(default_factory=list)  # (model, method) prepared ahead
    calls: list[tuple[str, list[dict[str, str]], Any]] = field(default_factory=list)
    session_calls: list[tuple[str, str, str, list[dict[str, str]]]] = field(default_factory=list)  # (save|restore, model, file, conversation)
    loads: list[str] = field(default_factory=list)
    load_requests: list[tuple[str, edgeinfer.LoadOptions | None]] = field(default_factory=list)  # (ref, options) asked for
    listed_with: list[tuple[str, str] | None] = field(default_factory=list)  # list_models' kv_types, per call
    tasks: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def default_ref(self) -> str:
        return self.models[0].ref

    def list_models(self, kv_types: tuple[str, str] | None = None) -> list[ModelEntry]:
        self.listed_with.append(kv_types)
        return list(self.models)

    def load(self, ref: str | None, options: edgeinfer.LoadOptions | None = None) -> LoadedModel:
        ref = ref or self.default_ref()
        self.loads.append(ref)
        self.load_requests.append((ref, options))
        if ref in self.fail_load:
            raise edgeinfer.ModelNotFoundError(self.fail_load[ref])
        if options is not None and options.kv_types in self.fail_kv:  # as llama.cpp failing to make the context
            raise edgeinfer.InvalidModelError(self.fail_kv[options.kv_types])
        kv_types = options.kv_types if options is not None else edgeinfer.DEFAULT_LOAD.kv_types
        return LoadedModel(ref=ref, engine=ScriptedEngine(ref, self, kv_types))

    def remove_model(self, ref: str) -> None:
        if not any(m.ref == ref for m in self.models):
            raise edgeinfer.ModelNotFoundError(f"model {ref} is not in the store")
        self.models = [m for m in self.models if m.ref != ref]

    def run_task(self, kind: str, args: dict[str, str], on_progress: Callable[[TaskProgress], None], cancel=None) -> str:
        self.tasks.append((kind, args))
        if args["source"] == "bad":
            raise edgeinfer.ConversionError("no such model folder: bad")
        if args["source"] == "endless":  # runs until cancelled, as a long quantization would
            on_progress(TaskProgress(key=kind, label="blk.0", done=1, total=100))
            while not cancel.wait(0.01):
                pass
            raise edgeinfer.Cancelled(f"{kind} cancelled")
        if kind == "pull":  # two files, one bar each, and a status line first
            on_progress(TaskProgress(key="pull", label="", done=0, total=None, message="org/repo @ abc: gguf Q4_K_M, 2.0 MB to fetch"))
            for f in ("model-00001.gguf", "model-00002.gguf"):
                for done in (0, 500_000, 1_000_000):
                    on_progress(TaskProgress(key=f, label=f"{f} downloading", done=done, total=1_000_000))
            return "pull: done → org-repo:q4_k_m"
        n = 5
        for i in range(1, n + 1):
            on_progress(TaskProgress(key=kind, label=f"blk.{i}", done=i, total=n))
        ref = f"{args['source']}:{(args.get('qtype') or 'f16').lower()}"
        self.models.append(ModelEntry(ref=ref, name=args["source"], quant=args.get("qtype") or "F16", size=1000))
        return f"{kind}: done → {ref}"
