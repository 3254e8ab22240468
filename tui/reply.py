"""The reply being made: the buffer between the worker that runs the generation and the UI that
shows it, how often the UI drains it, and the messages the worker posts.

The worker appends tokens to the reply's buffer, posting one TokensReady message when the buffer was
idle; the view drains the buffer in batches, at most every FLUSH_S and stretched so that rendering
stays within UI_CPU_BUDGET of a core. The UI never waits on generation and generation never waits
on the UI.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from textual.message import Message as TMessage

from edgeinfer import DEFAULT_LOAD, DoneEvent, Generation, PrefillProgress, SpeculationProgress, TokenEvent

from .live_stats import LiveStats
from .model_host import ModelKey
from .widgets import MessageView

__all__ = ["FLUSH_S", "MAX_FLUSH_S", "UI_CPU_BUDGET", "ActiveReply", "GenerationFailed", "GenerationFinished",
           "PrefillShown", "SpeculationPreparing", "TokensReady", "ToolCallStarted"]

FLUSH_S = 0.03  # token batches reach the UI at most ~33 times a second...
MAX_FLUSH_S = 0.5  # ...and at least twice a second
# ...but the UI's own CPU while a reply streams stays under this share of one core, so rendering
# (Markdown layout, compositing: tens of ms per frame on a slow CPU) cannot eat into decoding: the
# interval between drains stretches to (UI CPU per frame) / UI_CPU_BUDGET.
UI_CPU_BUDGET = 0.05
# Under a cancelled reply: it stays in the history the model sees, so the note says so.


# -- messages from the worker ---------------------------------------------------------------------
class TokensReady(TMessage):
    """Tokens are waiting in the reply's buffer (posted once per drain, not once per token)."""

    def __init__(self, gen_id: int):
        super().__init__()
        self.gen_id = gen_id


class SpeculationPreparing(TMessage):
    """The generation is preparing its speculation (e.g. quantizing a self-draft) before its first token."""

    def __init__(self, gen_id: int, progress: SpeculationProgress):
        super().__init__()
        self.gen_id, self.progress = gen_id, progress


class PrefillShown(TMessage):
    """The prompt is being read: `done` of `total` tokens (before the reply's first token)."""

    def __init__(self, gen_id: int, progress: PrefillProgress):
        super().__init__()
        self.gen_id, self.progress = gen_id, progress


class GenerationFinished(TMessage):
    def __init__(self, gen_id: int, done: DoneEvent, stats: LiveStats):
        super().__init__()
        self.gen_id, self.done, self.stats = gen_id, done, stats


class ToolCallStarted(TMessage):
    """The reply is writing a call of the tool `name` (its arguments stream; the block comes at the end)."""

    def __init__(self, gen_id: int, name: str):
        super().__init__()
        self.gen_id, self.name = gen_id, name


class GenerationFailed(TMessage):
    """The reply failed; `load_failed`: loading that model and cache failed (the host kept what it had)."""

    def __init__(self, gen_id: int, error: str, load_failed: ModelKey | None = None):
        super().__init__()
        self.gen_id, self.error, self.load_failed = gen_id, error, load_failed


@dataclass
class ActiveReply:
    """The reply being generated. The worker appends to `pending` under `lock` and posts one
    TokensReady when the buffer was idle; the UI drains it at most every FLUSH_S."""

    gen_id: int
    chat_id: int
    model: str
    view: MessageView | None
    kv_types: tuple[str, str] = DEFAULT_LOAD.kv_types
    drafted: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    generation: Generation | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[tuple[str, bool]] = field(default_factory=list)
    wake_posted: bool = False
    n_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_render: float = 0.0
    ui_cpu_mark: float | None = None  # main-thread CPU time at the previous drain
    frame_cpu: float = 0.0  # EMA of the UI's CPU seconds per drain (render included)
    drain_scheduled: bool = False

    def own_rate(self) -> float:
        """Tokens per second as seen by the UI (after the first token)."""
        if self.first_token_at is None or self.last_token_at is None or self.n_tokens < 2:
            return 0.0
        dt = self.last_token_at - self.first_token_at
        return (self.n_tokens - 1) / dt if dt > 0 else 0.0

    def flush_interval(self) -> float:
        return min(max(FLUSH_S, self.frame_cpu / UI_CPU_BUDGET), MAX_FLUSH_S)

    def add_token(self, event: TokenEvent) -> bool:
        """(worker thread) Buffer a token; True when the UI must be woken (its buffer was idle)."""
        now = time.perf_counter()
        with self.lock:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.n_tokens += 1
            if event.text:
                self.pending.append((event.text, event.drafted))
            wake = not self.wake_posted and bool(self.pending)
            if wake:
                self.wake_posted = True
        return wake

    def take_pending(self) -> list[tuple[str, bool]]:
        """(UI thread) The buffered (text, drafted) pieces; the next token wakes the UI again."""
        with self.lock:
            batch, self.pending = self.pending, []
            self.wake_posted = False
        return batch
