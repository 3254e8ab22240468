"""EdgeInferApp: the chat screen, its sidebar of chats, and the actions on them.

Threading: the model is loaded and every reply generated in a thread worker. The worker appends
tokens to the reply's buffer and posts one TokensReady message when the buffer was idle; the UI
drains the buffer in batches, at most every FLUSH_S and stretched so that rendering stays within
UI_CPU_BUDGET of a core. The UI never waits on generation and generation never waits on the UI.
SQLite and widgets are touched from the UI thread only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message as TMessage
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, Static

from .backend import Backend, LibraryBackend, LoadedModel
from .chat_store import Chat, ChatStore, export_markdown
from .config import ACTIONS, TuiConfig, load_config
from .screens import ConfirmScreen, HelpScreen, ModelPickerScreen, PromptScreen, SettingsScreen, SpeculationScreen
from .settings import ChatSettings
from .widgets import ChatInput, ChatList, ChatListItem, MessageView, last_code_block, merge_spans

__all__ = ["EdgeInferApp", "LiveStats", "FLUSH_S"]

FLUSH_S = 0.03  # token batches reach the UI at most ~33 times a second...
MAX_FLUSH_S = 0.5  # ...and at least twice a second
# ...but the UI's own CPU while a reply streams stays under this share of one core, so rendering
# (Markdown layout, compositing: tens of ms per frame on a slow CPU) cannot eat into decoding: the
# interval between drains stretches to (UI CPU per frame) / UI_CPU_BUDGET.
UI_CPU_BUDGET = 0.05


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(frozen=True)
class LiveStats:
    """A snapshot of a generation's numbers, taken in the worker thread."""

    generated: int = 0
    tok_s: float = 0.0
    method: str | None = None
    acceptance: float | None = None
    mean_len: float | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0

    def line(self, model: str) -> str:
        """The stats line, most useful first (a narrow terminal cuts the end)."""
        parts = [f"{self.generated} tokens", f"{self.tok_s:.1f} tok/s"]
        if self.method and self.method != "off":
            if self.acceptance is not None:
                parts.append(f"{self.method} {self.acceptance * 100:.0f}% accepted, mean {self.mean_len or 0:.1f}")
            else:
                parts.append(self.method)
        if self.ttft_s:
            parts.append(f"ttft {self.ttft_s:.2f} s")
        if self.finish_reason:
            parts.append({"cancelled": "cancelled", "length": "max tokens"}.get(self.finish_reason, "done"))
        parts.append(model)
        return " · ".join(parts)


def _snapshot(stats: Any, own_rate: float, finish_reason: str | None = None) -> LiveStats:
    spec = getattr(stats, "speculation", None)
    rate = float(getattr(stats, "decode_tok_s", 0.0) or 0.0)
    return LiveStats(
        generated=int(getattr(stats, "generated_tokens", 0) or 0),
        tok_s=rate if rate > 0 else own_rate,
        # A drafter that switched itself off (too slow to pay) says so instead of showing 0 %.
        method=(f"{spec.method} off" if getattr(spec, "note", "") else getattr(spec, "method", None)),
        acceptance=(spec.acceptance_rate if spec is not None and spec.drafted else None),
        mean_len=(spec.mean_accepted_len if spec is not None and spec.steps else None),
        ttft_s=float(getattr(stats, "ttft_s", 0.0) or 0.0) or None,
        finish_reason=finish_reason,
        prompt_tokens=int(getattr(stats, "prompt_tokens", 0) or 0),
    )


# -- messages from workers ----------------------------------------------------------------------
class TokensReady(TMessage):
    """Tokens are waiting in the reply's buffer (posted once per drain, not once per token)."""

    def __init__(self, gen_id: int):
        super().__init__()
        self.gen_id = gen_id


class GenerationFinished(TMessage):
    def __init__(self, gen_id: int, done: Any, stats: LiveStats):
        super().__init__()
        self.gen_id, self.done, self.stats = gen_id, done, stats


class GenerationFailed(TMessage):
    def __init__(self, gen_id: int, error: str):
        super().__init__()
        self.gen_id, self.error = gen_id, error


class ModelReady(TMessage):
    def __init__(self, ref: str | None, error: str | None = None):
        super().__init__()
        self.ref, self.error = ref, error


@dataclass
class ActiveReply:
    """The reply being generated. The worker appends to `pending` under `lock` and posts one
    TokensReady when the buffer was idle; the UI drains it at most every FLUSH_S."""

    gen_id: int
    chat_id: int
    model: str
    view: MessageView | None
    drafted: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    generation: Any = None
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


class ChatScreen(Screen):
    """The main screen: chats on the left, the conversation, the stats line and the input."""

    def __init__(self, config: TuiConfig):
        super().__init__(id="chat-screen")
        self.config = config

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Chats", id="sidebar-title")
                yield ChatList(id="chats")
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="messages")
                yield Static("", id="stats")
                yield ChatInput(
                    id="input",
                    send_keys=self.config.key_list("send"),
                    newline_keys=self.config.key_list("newline"),
                )
        yield Footer()


class EdgeInferApp(App[None]):
    """`edgeinfer chat`: a chat UI for the store's models, with speculation and manage screens."""

    TITLE = "edgeinfer"
    CSS_PATH = "styles.tcss"
    BINDINGS = [
        Binding(a.keys, a.id, a.description, show=a.show, id=f"edgeinfer.{a.id}", tooltip=a.help) for a in ACTIONS
    ]

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        model: str | None = None,
        db_path: Path | None = None,
        config: TuiConfig | None = None,
    ):
        super().__init__()
        self.backend: Backend = backend or LibraryBackend()
        self.config = config if config is not None else load_config()
        self.initial_model = model
        self.db_path = db_path
        self.store: ChatStore | None = None
        self.chat: Chat | None = None
        self.settings = ChatSettings()
        self.show_drafted = False
        self.loaded: LoadedModel | None = None
        self._loaded_request: str | None = None
        self._load_lock = threading.Lock()
        self._gen_counter = 0
        self.active: ActiveReply | None = None
        self.last_stats: LiveStats | None = None
        self.last_done: Any = None
        if self.config.keymap:
            self.set_keymap(self.config.keymap)
        if self.config.theme:
            try:
                self.theme = self.config.theme
            except Exception as e:  # noqa: BLE001 - an unknown theme name
                self.config.error = f"theme {self.config.theme!r}: {_one_line(e)}"

    # -- setup -----------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self._chat_screen = ChatScreen(self.config)
        self.push_screen(self._chat_screen)
        try:
            self.store = ChatStore(self.db_path)
        except Exception as e:  # noqa: BLE001 - a broken database must not lose the app
            self.notify(f"chat history unavailable: {_one_line(e)}", severity="error", timeout=10)
            self.store = _memory_store()
        if self.config.error:
            self.notify(self.config.error, severity="warning", timeout=10)
        self.call_after_refresh(self._start)

    def _start(self) -> None:
        self.messages_view.anchor()
        chats = self.store.list_chats()
        self._fill_chat_list(chats)
        if chats:
            self.open_chat(chats[0].id)
            if self.initial_model and self.chat.model != self.initial_model:
                # `edgeinfer chat MODEL`: the model asked for on the command line wins
                self.chat = self.store.update_chat(self.chat.id, model=self.initial_model)
                self._refresh_header()
        else:
            self.new_chat()
        self.chat_input.focus()
        self.preload_model(self.current_model_ref)

    @property
    def chat_screen(self) -> ChatScreen:
        return self._chat_screen

    @property
    def messages_view(self) -> VerticalScroll:
        return self._chat_screen.query_one("#messages", VerticalScroll)

    @property
    def chat_input(self) -> ChatInput:
        return self._chat_screen.query_one(ChatInput)

    @property
    def current_model_ref(self) -> str:
        if self.chat is not None and self.chat.model:
            return self.chat.model
        return self.initial_model or self.backend.default_ref()

    @property
    def generating(self) -> bool:
        return self.active is not None

    def _fill_chat_list(self, chats: list[Chat]) -> None:
        lst = self.chat_screen.query_one(ChatList)
        lst.clear()
        for c in chats:
            lst.append(ChatListItem(c.id, c.title))

    def _refresh_header(self) -> None:
        self.sub_title = f"{self.current_model_ref} · {self.settings.speculation.describe()}"

    # -- chats -----------------------------------------------------------------------------------
    def new_chat(self) -> None:
        # a new chat starts with the current chat's model and settings
        model = self.initial_model if self.chat is None else self.current_model_ref
        chat = self.store.create_chat(model=model, settings=self.settings.to_dict())
        lst = self.chat_screen.query_one(ChatList)
        lst.insert(0, [ChatListItem(chat.id, chat.title)])
        self.open_chat(chat.id)

    def open_chat(self, chat_id: int) -> None:
        self._cancel_generation()
        self.chat = self.store.get_chat(chat_id)
        self.settings = ChatSettings.from_dict(self.chat.settings)
        view = self.messages_view
        view.remove_children()
        widgets = []
        for m in self.store.messages(chat_id):
            if m.role == "system":
                continue
            note = ""
            if m.stats and m.stats.get("finish_reason") == "cancelled":
                note = "(cancelled)"
            widgets.append(MessageView(m.role, m.content, drafted=m.drafted, show_drafted=self.show_drafted, note=note, message_id=m.id))
        if widgets:
            view.mount_all(widgets)
        view.anchor()
        view.scroll_end(animate=False)
        lst = self.chat_screen.query_one(ChatList)
        for i, item in enumerate(lst.children):
            if isinstance(item, ChatListItem) and item.chat_id == chat_id and lst.index != i:
                lst.index = i
        self._set_stats("")
        self._refresh_header()

    @on(ChatList.Selected)
    def _chat_selected(self, event: ChatList.Selected) -> None:
        item = event.item
        if isinstance(item, ChatListItem) and (self.chat is None or item.chat_id != self.chat.id):
            self.open_chat(item.chat_id)
            self.chat_input.focus()

    def _list_item(self, chat_id: int) -> ChatListItem | None:
        for item in self.chat_screen.query(ChatListItem):
            if item.chat_id == chat_id:
                return item
        return None

    def _set_stats(self, text: str) -> None:
        try:
            self.chat_screen.query_one("#stats", Static).update(text)
        except NoMatches:  # the screen is being torn down (a late worker message at exit)
            pass

    # -- sending and streaming -------------------------------------------------------------------
    @on(ChatInput.Submitted)
    def _submitted(self, event: ChatInput.Submitted) -> None:
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
        msg = self.store.add_message(self.chat.id, "user", text)
        if self.chat.title == "New chat":
            title = " ".join(text.split())[:40] or "Chat"
            self.chat = self.store.update_chat(self.chat.id, title=title)
            item = self._list_item(self.chat.id)
            if item is not None:
                item.set_title(title)
        self.messages_view.mount(MessageView("user", text, message_id=msg.id))
        self._start_reply()

    def _start_reply(self) -> None:
        assert self.chat is not None
        try:
            options = self.settings.to_options()
        except Exception as e:  # noqa: BLE001 - invalid settings: say so, keep the message
            self.notify(_one_line(e), severity="error", timeout=8)
            return
        turns = [(m.role, m.content) for m in self.store.messages(self.chat.id) if m.role in ("user", "assistant")]
        messages = self.settings.messages(turns)
        view = MessageView("assistant", show_drafted=self.show_drafted)
        self.messages_view.mount(view)
        self.messages_view.anchor()
        self._gen_counter += 1
        model = self.current_model_ref
        self.active = ActiveReply(gen_id=self._gen_counter, chat_id=self.chat.id, model=model, view=view)
        self._set_stats(f"{model} · generating…")
        self.generate(self.active, model, messages, options)

    def _ensure_loaded(self, ref: str) -> LoadedModel:
        """Load `ref` unless it is the model already loaded (worker thread)."""
        with self._load_lock:
            if self.loaded is not None and self._loaded_request == ref:
                return self.loaded
            old, self.loaded, self._loaded_request = self.loaded, None, None
            if old is not None:
                try:
                    old.engine.close()
                except Exception:  # noqa: BLE001 - closing a model we are replacing
                    pass
            self.loaded = self.backend.load(ref)
            self._loaded_request = ref
            return self.loaded

    @work(thread=True, exclusive=True, exit_on_error=False, group="load")
    def preload_model(self, ref: str) -> None:
        try:
            loaded = self._ensure_loaded(ref)
        except Exception as e:  # noqa: BLE001
            self.post_message(ModelReady(None, _one_line(e)))
            return
        self.post_message(ModelReady(loaded.ref))

    def on_model_ready(self, message: ModelReady) -> None:
        if message.error:
            self.notify(message.error, title="Model", severity="error", timeout=10)
            if not self.generating:
                self._set_stats(f"model not loaded: {message.error}")
        elif not self.generating:
            self._set_stats(f"{message.ref} · ready")

    @work(thread=True, exclusive=True, exit_on_error=False, group="generate")
    def generate(self, active: ActiveReply, model: str, messages: list[dict[str, str]], options: Any) -> None:
        gen_id = active.gen_id
        try:
            loaded = self._ensure_loaded(model)
            gen = loaded.engine.chat(messages, options)
        except Exception as e:  # noqa: BLE001
            self.post_message(GenerationFailed(gen_id, _one_line(e)))
            return
        active.generation = gen
        if active.cancel.is_set():
            gen.cancel()
        done = None
        try:
            for ev in gen:
                if hasattr(ev, "token"):  # a TokenEvent: buffer it; wake the UI only if it is idle
                    now = time.perf_counter()
                    with active.lock:
                        if active.first_token_at is None:
                            active.first_token_at = now
                        active.last_token_at = now
                        active.n_tokens += 1
                        if ev.text:
                            active.pending.append((ev.text, bool(ev.drafted)))
                        wake = not active.wake_posted and bool(active.pending)
                        if wake:
                            active.wake_posted = True
                    if wake:
                        self.post_message(TokensReady(gen_id))
                else:
                    done = ev
        except Exception as e:  # noqa: BLE001 - an engine error mid-reply: keep what came
            self.post_message(GenerationFailed(gen_id, _one_line(e)))
            return
        stats = getattr(done, "stats", None) or getattr(gen, "stats", None)
        self.post_message(GenerationFinished(gen_id, done, _snapshot(stats, active.own_rate(), getattr(done, "finish_reason", None))))

    async def on_tokens_ready(self, message: TokensReady) -> None:
        active = self.active
        if active is None or message.gen_id != active.gen_id or active.drain_scheduled:
            return
        wait = self._flush_interval(active) - (time.perf_counter() - active.last_render)
        if wait > 0:  # rendered very recently: let more tokens gather first
            active.drain_scheduled = True
            self.set_timer(wait, self._drain_later)
        else:
            await self._drain(active)

    @staticmethod
    def _flush_interval(active: ActiveReply) -> float:
        return min(max(FLUSH_S, active.frame_cpu / UI_CPU_BUDGET), MAX_FLUSH_S)

    async def _drain_later(self) -> None:
        active = self.active
        if active is not None:
            active.drain_scheduled = False
            await self._drain(active)

    async def _drain(self, active: ActiveReply) -> None:
        """Move the buffered tokens into the reply view (UI thread)."""
        with active.lock:
            batch, active.pending = active.pending, []
            active.wake_posted = False
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
            active.frame_cpu = 0.7 * active.frame_cpu + 0.3 * (cpu - active.ui_cpu_mark) if active.frame_cpu else cpu - active.ui_cpu_mark
        active.ui_cpu_mark = cpu
        if active.view is not None and active.view.is_attached:
            await active.view.append(text, spans)
            gen = active.generation
            self._set_stats(_snapshot(getattr(gen, "stats", None), active.own_rate()).line(active.model))

    async def on_generation_finished(self, message: GenerationFinished) -> None:
        active = self.active
        if active is None or message.gen_id != active.gen_id:
            return
        await self._drain(active)
        self.active = None
        done = message.done
        self.last_done = done
        self.last_stats = message.stats
        view = active.view if active.view is not None and active.view.is_attached else None
        text = getattr(done, "text", None)
        if text is None:
            text = view.content if view is not None else ""
        reason = getattr(done, "finish_reason", None)
        stats = done.stats.to_dict() if done is not None and hasattr(done.stats, "to_dict") else {}
        stats["finish_reason"] = reason
        msg = self.store.add_message(active.chat_id, "assistant", text, model=active.model, stats=stats, drafted=active.drafted)
        if view is not None:
            view.message_id = msg.id
            view.drafted = list(active.drafted)
            await view.finish(text)
            if reason == "cancelled":
                view.set_note("(cancelled)")
            self._set_stats(message.stats.line(active.model))

    async def on_generation_failed(self, message: GenerationFailed) -> None:
        active = self.active
        if active is None or message.gen_id != active.gen_id:
            return
        await self._drain(active)
        self.active = None
        view = active.view if active.view is not None and active.view.is_attached else None
        if view is not None:
            if view.content:
                await view.finish()
                self.store.add_message(active.chat_id, "assistant", view.content, model=active.model, stats={"finish_reason": "error"}, drafted=active.drafted)
                view.set_note(f"(stopped: {message.error})")
            else:
                await view.remove()
        self.notify(message.error, title="Error", severity="error", timeout=10)
        self._set_stats(f"error: {message.error}")

    def _cancel_generation(self) -> bool:
        active = self.active
        if active is None:
            return False
        active.cancel.set()
        if active.generation is not None:
            active.generation.cancel()
        return True

    # -- actions ---------------------------------------------------------------------------------
    def action_cancel(self) -> None:
        if self._cancel_generation():
            self._set_stats("cancelling…")

    def action_new_chat(self) -> None:
        self.new_chat()
        self.chat_input.focus()

    def _last_assistant(self) -> MessageView | None:
        views = [v for v in self.messages_view.query(MessageView) if v.role == "assistant"]
        return views[-1] if views else None

    def action_regenerate(self) -> None:
        if self.generating:
            self.notify("A reply is being generated.", severity="warning")
            return
        assert self.chat is not None
        msgs = self.store.messages(self.chat.id)
        if not msgs or not any(m.role == "user" for m in msgs):
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
        view = self._last_assistant()
        if view is None or not view.content:
            self.notify("No reply to copy.", severity="warning")
            return
        self.copy_to_clipboard(view.content)
        self.notify("Copied the last reply.")

    def action_copy_code(self) -> None:
        view = self._last_assistant()
        code = last_code_block(view.content) if view is not None else None
        if code is None:
            self.notify("The last reply has no code block.", severity="warning")
            return
        self.copy_to_clipboard(code)
        self.notify("Copied the last code block.")

    def action_toggle_drafted(self) -> None:
        self.show_drafted = not self.show_drafted
        for v in self.messages_view.query(MessageView):
            v.set_show_drafted(self.show_drafted)
        self.notify(f"Drafted tokens {'coloured' if self.show_drafted else 'not coloured'}.")

    def _save_settings(self, settings: ChatSettings) -> None:
        self.settings = settings
        if self.chat is not None:
            self.chat = self.store.update_chat(self.chat.id, settings=settings.to_dict())
        self._refresh_header()

    def action_settings(self) -> None:
        def done(result: ChatSettings | None) -> None:
            if result is not None:
                self._save_settings(result)
                self.notify("Settings saved for this chat.")

        self.push_screen(SettingsScreen(self.settings), done)

    def action_speculation(self) -> None:
        def done(result: tuple | None) -> None:
            if result is None:
                return
            spec, show = result
            self._save_settings(replace(self.settings, speculation=spec))
            if show != self.show_drafted:
                self.action_toggle_drafted()
            self.notify(f"Speculation: {spec.describe()}.")

        self.push_screen(SpeculationScreen(self.settings.speculation, self.show_drafted, self._model_refs()), done)

    def _model_refs(self) -> list[str]:
        try:
            return [e.ref for e in self.backend.list_models()]
        except Exception:  # noqa: BLE001 - the panel works without the list
            return []

    def action_pick_model(self) -> None:
        def done(ref: str | None) -> None:
            if not ref or self.chat is None:
                return
            if self.generating:
                self.notify("Cancel the reply first (Esc), then switch models.", severity="warning")
                return
            self.chat = self.store.update_chat(self.chat.id, model=ref)
            self._refresh_header()
            self._set_stats(f"{ref} · loading…")
            self.preload_model(ref)

        self.push_screen(ModelPickerScreen(self.backend, self.current_model_ref), done)

    def action_rename_chat(self) -> None:
        if self.chat is None:
            return

        def done(title: str | None) -> None:
            if title and self.chat is not None:
                self.chat = self.store.update_chat(self.chat.id, title=title)
                item = self._list_item(self.chat.id)
                if item is not None:
                    item.set_title(title)

        self.push_screen(PromptScreen("Rename chat", self.chat.title), done)

    def action_delete_chat(self) -> None:
        if self.chat is None:
            return
        chat_id = self.chat.id

        def done(yes: bool | None) -> None:
            if not yes:
                return
            if self.active is not None and self.active.chat_id == chat_id:
                self._cancel_generation()
                self.active = None
            self.store.delete_chat(chat_id)
            item = self._list_item(chat_id)
            if item is not None:
                item.remove()
            self.chat = None
            chats = self.store.list_chats()
            if chats:
                self.open_chat(chats[0].id)
            else:
                self.new_chat()

        self.push_screen(ConfirmScreen(f"Delete the chat {self.chat.title!r}? (y/n)"), done)

    def action_export_chat(self) -> None:
        if self.chat is None:
            return
        import edgeinfer.paths
        from edgeinfer.fsutil import atomic_write_text

        text = export_markdown(self.chat, self.store.messages(self.chat.id))
        target = edgeinfer.paths.home() / "exports" / f"chat-{self.chat.id}.md"
        try:
            atomic_write_text(target, text)
        except OSError as e:
            self.notify(f"export failed: {_one_line(e)}", severity="error")
            return
        self.last_export = target
        self.notify(f"Exported to {target}", timeout=8)

    def action_manage(self) -> None:
        from .manage import ManageScreen

        self.push_screen(ManageScreen(self.backend))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.config))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat actions only on the chat screen (not over a modal or the manage screen), so the
        footer shows what works where; help works everywhere."""
        if action in _CHAT_ACTIONS and not isinstance(self.screen, ChatScreen):
            return False
        return True

    def get_system_commands(self, screen: Screen) -> Any:
        yield from super().get_system_commands(screen)
        for a in ACTIONS:
            if a.id in _CHAT_ACTIONS and not isinstance(screen, ChatScreen):
                continue
            yield SystemCommand(a.description if a.description != "Model" else "Pick model", a.help, getattr(self, f"action_{a.id}"))

    def on_unmount(self) -> None:
        self._cancel_generation()
        if self.loaded is not None:
            try:
                self.loaded.engine.close()
            except Exception:  # noqa: BLE001
                pass
        if self.store is not None:
            self.store.close()


_CHAT_ACTIONS = {a.id for a in ACTIONS} - {"help"}


def _memory_store() -> ChatStore:
    return ChatStore(Path(":memory:"))
