"""ChatView: one open chat — its messages, the stats line and the input — and the reply being made.

The view owns the reply: its thread worker runs the generation and fills the reply's buffer, which
the view drains (tui/reply.py: the buffer, its pacing, the worker's messages). SQLite and widgets
are touched from the UI thread only.

A cancelled reply is kept exactly as the screen shows it (its text, marked CANCELLED_NOTE), and the
next request sends it as part of the history; a reply cancelled before its first token shows
nothing and is dropped, so the history never holds a turn the screen does not show.
"""

from __future__ import annotations

import time
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message as TMessage
from textual.widgets import Static

import edgeinfer
from edgeinfer import (DEFAULT_LOAD, DoneEvent, GenerateOptions, PrefillProgress, SpeculationProgress, TokenEvent,
                       ToolCallEvent)

from .backend import one_line
from .chat_store import Chat, ChatStore
from .chat_tools import ChatTools, reply_turn
from .config import TuiConfig
from .live_stats import LiveStats, preparing_line
from .model_host import ModelHost, ModelKey
from .reply import (ActiveReply, GenerationFailed, GenerationFinished, PrefillShown, SpeculationPreparing, TokensReady,
                    ToolCallStarted)
from .settings import ChatSettings, kv_label
from .tools import ToolsFile, conversation, pending_calls
from .widgets import ChatInput, MessageView, last_code_block, merge_spans

__all__ = ["ChatView", "CANCELLED_NOTE", "model_label", "TINY_MODEL_NOTE"]

# Under a cancelled reply: it stays in the history the model sees, so the note says so.
CANCELLED_NOTE = "(cancelled; kept in the conversation)"
# Above an empty chat with the default model: what it is, and how to get a real one.
TINY_MODEL_NOTE = (
    "**This is the default model, SmolLM2-135M: tiny (135M parameters), so expect simple answers and mistakes.** "
    f"For real answers pull a model that fits this machine, e.g. `edgeinfer pull {edgeinfer.RECOMMENDED_MODEL}` "
    "(1.1 GB; or Ctrl+L → Pull here), then pick it with Ctrl+O."
)


def model_label(ref: str, kv_types: tuple[str, str]) -> str:
    """The model as the header and stats line name it: its KV-cache types only when not the default."""
    return ref if kv_types == DEFAULT_LOAD.kv_types else f"{ref} · KV {kv_label(kv_types)}"


class SessionResumed(TMessage):
    """The saved KV cache of chat `chat_id` was restored: its next reply reads only the new message."""

    def __init__(self, chat_id: int, model: str, tokens: int):
        super().__init__()
        self.chat_id, self.model, self.tokens = chat_id, model, tokens


class ChatView(ChatTools, Vertical):
    """The open chat and the reply being generated for it (its tool calls: chat_tools.py)."""

    class ChatChanged(TMessage):
        """The chat's title, model or settings changed (the screen updates its sidebar and header)."""

        def __init__(self, chat: Chat):
            super().__init__()
            self.chat = chat

    def __init__(self, store: ChatStore, models: ModelHost, config: TuiConfig, *, default_model: str, **kw: Any):
        super().__init__(**kw)
        self.store = store
        self.models = models
        self.config = config
        self.default_model = default_model  # for a chat that names no model
        self.chat: Chat | None = None
        self.settings = ChatSettings()
        self.show_drafted = False
        self.active: ActiveReply | None = None
        self.last_stats: LiveStats | None = None
        self.last_done: DoneEvent | None = None
        self._gen_counter = 0
        self.tools = ToolsFile()  # the user's tools ($EDGEINFER_HOME/tools.json), offered with each reply

    def on_mount(self) -> None:
        self.offered_tools()  # a problem with the tools file shows at start

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="messages")
        yield Static("", id="stats")
        yield ChatInput(id="input", send_keys=self.config.key_list("send"), newline_keys=self.config.key_list("newline"))

    # -- parts and state -------------------------------------------------------------------------
    @property
    def messages_view(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def generating(self) -> bool:
        return self.active is not None

    @property
    def model_ref(self) -> str:
        """The model this chat talks to."""
        if self.chat is not None and self.chat.model:
            return self.chat.model
        return self.default_model

    def set_stats(self, text: str) -> None:
        try:
            self.query_one("#stats", Static).update(text)
        except NoMatches:  # the view is being torn down (a late worker message at exit)
            pass

    def show_model_state(self, ref: str | None, error: str | None = None, kv_types: tuple[str, str] = DEFAULT_LOAD.kv_types) -> None:
        """A model finished loading (or failed to): say so unless a reply is streaming."""
        if self.generating:
            return
        self.set_stats(f"model not loaded: {error}" if error or ref is None else f"{model_label(ref, kv_types)} · ready")
        if ref is not None and not error:
            self.resume_open_chat()

    def show_load_failure(self, wanted: ModelKey, error: str) -> str:
        """Loading `wanted` failed; returns the one line to show. When the host kept this chat's
        model with other cache types (a new cache type failed), the chat goes back to those, so its
        next reply works with the model that is loaded."""
        kept = self.models.key
        if (
            self.chat is None
            or kept is None
            or not kept.ref == wanted.ref == self.model_ref
            or kept.kv_types == wanted.kv_types
            or self.settings.kv_types != wanted.kv_types
        ):
            self.show_model_state(None, error)
            return error
        self.update_chat(settings=self.settings.with_kv_types(kept.kv_types).to_dict())
        self.show_model_state(kept.ref, kv_types=kept.kv_types)
        return f"KV cache {kv_label(wanted.kv_types)}: {error} (kept {kv_label(kept.kv_types)})"

    def show_preparing(self, ref: str, progress: SpeculationProgress) -> None:
        """Speculation is being prepared (by the reply or ahead of it): say how far, until the
        reply's first tokens take the stats line."""
        if self.active is None or self.active.length == 0:
            self.set_stats(preparing_line(ref, progress))

    def _assistant_views(self) -> list[MessageView]:
        return [v for v in self.messages_view.query(MessageView) if v.role == "assistant"]

    # -- the chat --------------------------------------------------------------------------------
    def show_chat(self, chat: Chat) -> None:
        """Open `chat` (a reply still streaming for another chat is cancelled)."""
        self.cancel_reply()
        self.chat = chat
        self.settings = ChatSettings.from_dict(chat.settings)
        view = self.messages_view
        view.remove_children()
        widgets = []
        msgs = self.store.messages(chat.id)
        waiting = frozenset(c["id"] for c in pending_calls(msgs))
        names = {c["id"]: c["name"] for m in msgs for c in m.tool_calls}
        for m in msgs:
            if m.role == "system":
                continue
            note = CANCELLED_NOTE if m.stats and m.stats.get("finish_reason") == "cancelled" else ""
            widgets.append(
                MessageView(m.role, m.content, drafted=m.drafted, show_drafted=self.show_drafted, note=note, message_id=m.id,
                            tool_calls=m.tool_calls, pending=waiting, tool_name=names.get(m.tool_call_id or ""))
            )
        if widgets:
            view.mount_all(widgets)
        self._show_first_note()
        view.anchor()
        view.scroll_end(animate=False)
        self.set_stats("")
        self.resume_open_chat()

    # -- chats that resume (tui/sessions.py) -------------------------------------------------------
    def resume_open_chat(self) -> None:
        """The open chat goes on the loaded model (if that is its model), in the background: the
        chat the model held is saved, this chat's saved KV cache restored, so that its next reply
        reads only the new message."""
        if self.chat is None or self.models.sessions is None or self.generating:
            return
        turns = conversation(self.store.messages(self.chat.id))
        self._resume(self.chat.id, self.model_ref, self.settings.kv_types, self.settings.messages(turns, self.model_ref))

    @work(thread=True, exclusive=True, exit_on_error=False, group="resume")
    def _resume(self, chat_id: int, model: str, kv_types: tuple[str, str], messages: list[dict[str, str]]) -> None:
        result = self.models.resume(model, kv_types, chat_id, messages)
        if result:
            self.post_message(SessionResumed(chat_id, model, result.tokens))

    def on_session_resumed(self, message: SessionResumed) -> None:
        if self.chat is not None and self.chat.id == message.chat_id and not self.generating:
            label = model_label(message.model, self.settings.kv_types)
            self.set_stats(f"{label} · ready · resumed ({message.tokens} tokens cached)")

    def _show_first_note(self) -> None:
        """TINY_MODEL_NOTE above an empty chat with the default model; gone once the chat starts."""
        for old in self.messages_view.query(".first-note"):
            old.remove()
        if self.chat is None or edgeinfer.default_system_prompt(self.model_ref) is None:
            return
        if not any(m.role in ("user", "assistant") for m in self.store.messages(self.chat.id)):
            from textual.widgets import Markdown

            self.messages_view.mount(Markdown(TINY_MODEL_NOTE, classes="first-note"))

    def update_chat(self, **changes: Any) -> None:
        """Save title / model / settings of the open chat."""
        assert self.chat is not None
        self.chat = self.store.update_chat(self.chat.id, **changes)
        if "settings" in changes:
            self.settings = ChatSettings.from_dict(self.chat.settings)
        if "model" in changes:
            self._show_first_note()
        self.post_message(self.ChatChanged(self.chat))

    # -- sending and streaming -------------------------------------------------------------------
    @on(ChatInput.Submitted)
    def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        text = event.text.strip()
        if not text:
            return
        if self.generating:
            self.notify("A reply is being generated: wait, or press Esc to cancel it.", severity="warning")
            return
        self.chat_input.clear()
        self.send(text)

    def send(self, text: str) -> None:
        assert self.chat is not None
        for note in self.messages_view.query(".first-note"):
            note.remove()
        msg = self.store.add_message(self.chat.id, "user", text)
        if self.chat.title == "New chat":
            self.update_chat(title=" ".join(text.split())[:40] or "Chat")
        self.messages_view.mount(MessageView("user", text, message_id=msg.id))
        self._start_reply()

    def _start_reply(self) -> None:
        assert self.chat is not None
        try:
            options = self.settings.to_options()
        except Exception as e:  # noqa: BLE001 - invalid settings: say so, keep the message
            self.notify(one_line(e), severity="error", timeout=8)
            return
        turns = conversation(self.store.messages(self.chat.id))
        messages = self.settings.messages(turns, self.model_ref)
        tools = self.offered_tools()
        view = MessageView("assistant", show_drafted=self.show_drafted)
        self.messages_view.mount(view)
        self.messages_view.anchor()
        self._gen_counter += 1
        model = self.model_ref
        self.active = ActiveReply(gen_id=self._gen_counter, chat_id=self.chat.id, model=model, view=view,
                                  kv_types=self.settings.kv_types)
        self.set_stats(f"{model} · generating…")
        self._reply_changed()
        self.generate(self.active, messages, options, tools)

    @work(thread=True, exclusive=True, exit_on_error=False, group="generate")
    def generate(self, active: ActiveReply, messages: list[dict[str, Any]], options: GenerateOptions,
                 tools: tuple[dict[str, Any], ...] = ()) -> None:
        gen_id = active.gen_id
        try:
            loaded = self.models.ensure_loaded(active.model, active.kv_types)
        except Exception as e:  # noqa: BLE001
            self.post_message(GenerationFailed(gen_id, one_line(e), ModelKey(active.model, active.kv_types)))
            return
        # the chat the engine holds keeps its cache on disk; this chat's saved cache comes back
        self.models.resume(active.model, active.kv_types, active.chat_id, messages)
        try:
            gen = loaded.engine.chat(messages, options, tools=tools) if tools else loaded.engine.chat(messages, options)
        except Exception as e:  # noqa: BLE001
            self.post_message(GenerationFailed(gen_id, one_line(e)))
            return
        active.generation = gen
        if active.cancel.is_set():
            gen.cancel()
        done: DoneEvent | None = None
        try:
            for ev in gen:
                if isinstance(ev, TokenEvent):  # buffer it; wake the UI only if it is idle
                    if active.add_token(ev):
                        self.post_message(TokensReady(gen_id))
                elif isinstance(ev, SpeculationProgress):
                    self.post_message(SpeculationPreparing(gen_id, ev))
                elif isinstance(ev, PrefillProgress):
                    self.post_message(PrefillShown(gen_id, ev))
                elif isinstance(ev, ToolCallEvent) and not ev.arguments and ev.call is None:  # a call starts
                    self.post_message(ToolCallStarted(gen_id, ev.name))
                elif isinstance(ev, DoneEvent):
                    done = ev
        except Exception as e:  # noqa: BLE001 - an engine error mid-reply: keep what came
            self.post_message(GenerationFailed(gen_id, one_line(e)))
            return
        if done is None:
            self.post_message(GenerationFailed(gen_id, "the generation ended without a result"))
            return
        self.models.note_conversation(active.model, active.kv_types, active.chat_id, messages + reply_turn(done))
        self.post_message(GenerationFinished(gen_id, done, LiveStats.of(done.stats, active.own_rate(), done.finish_reason)))

    def _current(self, gen_id: int) -> ActiveReply | None:
        active = self.active
        return active if active is not None and active.gen_id == gen_id else None

    def on_prefill_shown(self, message: PrefillShown) -> None:
        """A long prompt (e.g. the whole chat again after a settings change) is being read: say how
        far, until the first tokens take the stats line."""
        active = self._current(message.gen_id)
        if active is not None and active.n_tokens == 0:
            p = message.progress
            self.set_stats(f"{active.model} · reading the prompt: {p.done}/{p.total} tokens ({p.done * 100 // max(p.total, 1)} %)")

    def on_tool_call_started(self, message: ToolCallStarted) -> None:
        active = self._current(message.gen_id)
        if active is not None:
            self.set_stats(f"{active.model} · calling {message.name}…")

    def on_speculation_preparing(self, message: SpeculationPreparing) -> None:
        active = self._current(message.gen_id)
        if active is not None:
            self.show_preparing(active.model, message.progress)

    async def on_tokens_ready(self, message: TokensReady) -> None:
        active = self._current(message.gen_id)
        if active is None or active.drain_scheduled:
            return
        wait = active.flush_interval() - (time.perf_counter() - active.last_render)
        if wait > 0:  # rendered very recently: let more tokens gather first
            active.drain_scheduled = True
            self.set_timer(wait, self._drain_later)
        else:
            await self._drain(active)

    async def _drain_later(self) -> None:
        active = self.active
        if active is not None:
            active.drain_scheduled = False
            await self._drain(active)

    async def _drain(self, active: ActiveReply) -> None:
        """Move the buffered tokens into the reply view (UI thread)."""
        batch = active.take_pending()
        if not batch:
            return
        text_parts: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for text, drafted in batch:
            if drafted:
                merge_spans(spans, pos, pos + len(text))
            text_parts.append(text)
            pos += len(text)
        text = "".join(text_parts)
        for a, b in spans:
            merge_spans(active.drafted, active.length + a, active.length + b)
        active.length += len(text)
        active.last_render = time.perf_counter()
        cpu = time.thread_time()  # the UI thread's CPU since the last drain: what a frame costs
        if active.ui_cpu_mark is not None:
            frame = cpu - active.ui_cpu_mark
            active.frame_cpu = 0.7 * active.frame_cpu + 0.3 * frame if active.frame_cpu else frame
        active.ui_cpu_mark = cpu
        if active.view is not None and active.view.is_attached:
            await active.view.append(text, spans)
            gen = active.generation
            self.set_stats(LiveStats.of(gen.stats if gen is not None else None, active.own_rate()).line(active.model))

    def _end(self, active: ActiveReply) -> MessageView | None:
        """The reply is over: forget it; its view if still on screen."""
        self.active = None
        self._reply_changed()
        view = active.view
        return view if view is not None and view.is_attached else None

    async def on_generation_finished(self, message: GenerationFinished) -> None:
        active = self._current(message.gen_id)
        if active is None:
            return
        await self._drain(active)
        view = self._end(active)
        done = message.done
        self.last_done = done
        self.last_stats = message.stats
        cancelled = done.finish_reason == "cancelled"
        if cancelled and not done.text and not done.tool_calls:  # nothing came: nothing is shown, nothing is kept
            if view is not None:
                await view.remove()
                self.set_stats(message.stats.line(active.model))
            return
        stats: dict[str, Any] = done.stats.to_dict()
        stats["finish_reason"] = done.finish_reason
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in done.tool_calls]
        msg = self.store.add_message(active.chat_id, "assistant", done.text, model=active.model, stats=stats,
                                     drafted=active.drafted, tool_calls=calls)
        if view is not None:
            view.message_id = msg.id
            view.drafted = list(active.drafted)
            await view.finish(done.text)
            if cancelled:
                view.set_note(CANCELLED_NOTE)
            self.set_stats(message.stats.line(active.model))
        await self.show_tool_calls(view, done)

    async def on_generation_failed(self, message: GenerationFailed) -> None:
        active = self._current(message.gen_id)
        if active is None:
            return
        await self._drain(active)
        view = self._end(active)
        if view is not None:
            if view.content:
                await view.finish()
                self.store.add_message(
                    active.chat_id, "assistant", view.content, model=active.model, stats={"finish_reason": "error"}, drafted=active.drafted
                )
                view.set_note(f"(stopped: {message.error})")
            else:
                await view.remove()
        if message.load_failed is not None:
            error = self.show_load_failure(message.load_failed, message.error)
            self.notify(error, title="Model", severity="error", timeout=10)
            return
        self.notify(message.error, title="Error", severity="error", timeout=10)
        self.set_stats(f"error: {message.error}")

    def cancel_reply(self) -> bool:
        """Ask the reply being generated to stop (it keeps what came); False when there is none."""
        active = self.active
        if active is None:
            return False
        active.cancel.set()
        if active.generation is not None:
            active.generation.cancel()
        return True

    def forget_reply(self, chat_id: int) -> None:
        """Cancel and forget a reply for `chat_id` (its chat is being deleted): nothing is saved."""
        if self.active is not None and self.active.chat_id == chat_id:
            self.cancel_reply()
            self.active = None
            self._reply_changed()

    def _reply_changed(self) -> None:
        """A reply started or ended: the footer offers Esc (cancel) only while one runs."""
        if self.is_attached:
            self.screen.refresh_bindings()

    def on_unmount(self) -> None:
        self.cancel_reply()

    # -- actions on replies ----------------------------------------------------------------------
    def action_cancel(self) -> None:
        if self.cancel_reply():
            self.set_stats("cancelling…")

    def action_regenerate(self) -> None:
        if self.generating:
            self.notify("A reply is being generated.", severity="warning")
            return
        assert self.chat is not None
        msgs = self.store.messages(self.chat.id)
        if not any(m.role == "user" for m in msgs):
            self.notify("Nothing to regenerate.", severity="warning")
            return
        while msgs and msgs[-1].role == "assistant":  # drop the last reply, keep the question
            last = msgs.pop()
            self.store.delete_message(last.id)
            for v in self.messages_view.query(MessageView):
                if v.message_id == last.id:
                    v.remove()
        self._start_reply()

    def action_copy_reply(self) -> None:
        views = self._assistant_views()
        if not views or not views[-1].content:
            self.notify("No reply to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(views[-1].content)
        self.notify("Copied the last reply.")

    def action_copy_code(self) -> None:
        views = self._assistant_views()
        code = last_code_block(views[-1].content) if views else None
        if code is None:
            self.notify("The last reply has no code block.", severity="warning")
            return
        self.app.copy_to_clipboard(code)
        self.notify("Copied the last code block.")

    def action_toggle_drafted(self) -> None:
        self.set_show_drafted(not self.show_drafted)
        self.notify(f"Drafted tokens {'coloured' if self.show_drafted else 'not coloured'}.")

    def set_show_drafted(self, on: bool) -> None:
        self.show_drafted = on
        for v in self.messages_view.query(MessageView):
            v.set_show_drafted(on)
