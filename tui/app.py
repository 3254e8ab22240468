"""EdgeInferApp: opens the chat history, loads models, shows the chat screen and help.

The chat screen (chat_screen.py) holds the chats and the open ChatView (chat_view.py), which owns
the reply being generated (reply.py: its buffer and pacing); the dialogs live in modals/, the
manage screen in manage.py. The app keeps what they share: the chat store, the one loaded model
(ModelHost) and the key map.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from textual import work
from textual.worker import get_current_worker
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message as TMessage
from textual.screen import Screen

from edgeinfer import SpeculationOptions, SpeculationProgress

from .backend import Backend, LibraryBackend, one_line
from .chat_screen import ChatScreen
from .chat_store import ChatStore
from .chat_view import ChatView
from .config import ACTIONS, APP_ACTIONS, TuiConfig, load_config
from .modals.confirm import ConfirmScreen
from .modals.help import HelpScreen
from .model_host import ModelHost, ModelKey
from .sessions import ChatSessions

__all__ = ["EdgeInferApp"]

QUIT_QUESTION = "A reply is being generated. Quit and discard it? (y/n)"


class ModelReady(TMessage):
    """The model `wanted` loaded as `ref` (error: it did not); speculation_error: its speculation
    could not be prepared."""

    def __init__(self, wanted: ModelKey, ref: str | None, error: str | None = None, speculation_error: str | None = None,
                 note: str | None = None):
        super().__init__()
        self.wanted, self.ref, self.error, self.speculation_error = wanted, ref, error, speculation_error
        self.note = note  # something the user should know about the model (a base model without a chat template)


class ModelPreparing(TMessage):
    """The loaded model is preparing the chat's speculation (e.g. quantizing a self-draft copy)."""

    def __init__(self, ref: str, progress: SpeculationProgress):
        super().__init__()
        self.ref, self.progress = ref, progress


class EdgeInferApp(App[None]):
    """`edgeinfer chat`: a chat UI for the store's models, with speculation and manage screens."""

    TITLE = "edgeinfer"
    CSS_PATH = "styles.tcss"
    # Help and quit work on every screen (quit also under a dialog: priority, as Textual's own Ctrl+Q).
    BINDINGS = [
        Binding(a.keys, a.id, a.description, show=a.show, id=f"edgeinfer.{a.id}", tooltip=a.help, priority=a.id == "quit")
        for a in ACTIONS
        if a.id in APP_ACTIONS
    ]

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        model: str | None = None,
        kv_types: tuple[str, str] | None = None,
        db_path: Path | None = None,
        config: TuiConfig | None = None,
        speculation: str | None = None,
    ):
        """`model`, `kv_types` (K, V cache types) and `speculation` (the CLI form): what `edgeinfer
        chat` asked for (or the model's tuned profile), given to the open chat (None: the chat's own)."""
        super().__init__()
        self.backend: Backend = backend or LibraryBackend()
        self.models = ModelHost(self.backend)
        self.config = config if config is not None else load_config()
        self.initial_model = model
        self.initial_kv_types = kv_types
        self.initial_speculation = speculation
        self.db_path = db_path
        self.store: ChatStore | None = None
        self._chat_screen: ChatScreen | None = None
        if self.config.keymap:
            self.set_keymap(self.config.keymap)
        if self.config.theme:
            try:
                self.theme = self.config.theme
            except Exception as e:  # noqa: BLE001 - an unknown theme name
                self.config.error = f"theme {self.config.theme!r}: {one_line(e)}"

    def on_mount(self) -> None:
        try:
            self.store = ChatStore(self.db_path)
        except Exception as e:  # noqa: BLE001 - a broken database must not lose the app
            self.notify(f"chat history unavailable: {one_line(e)}", severity="error", timeout=10)
            self.store = ChatStore(Path(":memory:"))
        if self.store.path != Path(":memory:"):  # each chat's KV cache is kept beside the history
            self.models.sessions = ChatSessions(self.store.path.parent / "chat-sessions")
            self.models.sessions.prune([c.id for c in self.store.list_chats()])
        self._chat_screen = ChatScreen(
            self.store, self.models, self.config, initial_model=self.initial_model, initial_kv_types=self.initial_kv_types,
            initial_speculation=self.initial_speculation,
        )
        self.push_screen(self._chat_screen)
        if self.config.error:
            self.notify(self.config.error, severity="warning", timeout=10)

    @property
    def chat_screen(self) -> ChatScreen:
        assert self._chat_screen is not None, "the app is not mounted"
        return self._chat_screen

    @property
    def chat_view(self) -> ChatView:
        return self.chat_screen.chat_view

    # -- models ----------------------------------------------------------------------------------
    def on_chat_screen_model_wanted(self, message: ChatScreen.ModelWanted) -> None:
        self.preload_model(ModelKey(message.ref, message.kv_types), message.speculation)

    @work(thread=True, exclusive=True, exit_on_error=False, group="load")
    def preload_model(self, wanted: ModelKey, speculation: SpeculationOptions | None = None) -> None:
        """Load the model `wanted` (its ref with its KV-cache types) and prepare `speculation` on
        it (a self-draft is made on first use), so the first reply does not wait for either; a
        newer request cancels the preparation."""
        try:
            loaded = self.models.ensure_loaded(wanted.ref, wanted.kv_types)
        except Exception as e:  # noqa: BLE001
            self.post_message(ModelReady(wanted, None, one_line(e)))
            return
        worker = get_current_worker()
        speculation_error = None
        if speculation is not None and speculation.method != "off":
            try:
                loaded.engine.prepare_speculation(
                    speculation,
                    progress=lambda ev: self.post_message(ModelPreparing(loaded.ref, ev)),
                    cancel=lambda: worker.is_cancelled,
                )
            except Exception as e:  # noqa: BLE001 - the model works without it; the reply says more
                if worker.is_cancelled:
                    return
                speculation_error = one_line(e)
        note = None
        if not getattr(loaded.engine, "has_chat_template", True):
            note = (f"{loaded.ref} has no chat template (a base model?): replies are rendered with ChatML, which it "
                    "never learned; `edgeinfer run` completes its text raw")
        self.post_message(ModelReady(wanted, loaded.ref, speculation_error=speculation_error, note=note))

    def on_model_preparing(self, message: ModelPreparing) -> None:
        self.chat_view.show_preparing(message.ref, message.progress)

    def on_model_ready(self, message: ModelReady) -> None:
        if message.error:
            error = self.chat_view.show_load_failure(message.wanted, message.error)
            self.notify(error, title="Model", severity="error", timeout=10)
            return
        if message.speculation_error:
            self.notify(message.speculation_error, title="Speculation", severity="warning", timeout=10)
        if message.note:
            self.notify(message.note, title="Model", severity="warning", timeout=12)
        self.chat_view.show_model_state(message.ref, kv_types=message.wanted.kv_types)

    # -- screens ---------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.config))

    def action_quit(self) -> None:
        """Quit; while a reply is being generated, ask first (quitting discards it)."""
        if self._chat_screen is None or not self.chat_view.generating:
            self.exit()
            return
        if isinstance(self.screen, ConfirmScreen) and self.screen.question == QUIT_QUESTION:
            return  # already asking

        def done(yes: bool | None) -> None:
            if yes:
                self.exit()

        self.push_screen(ConfirmScreen(QUIT_QUESTION), done)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette: Textual's commands, help everywhere, the chat actions on the chat screen."""
        yield from super().get_system_commands(screen)
        for a in ACTIONS:
            if a.id in APP_ACTIONS:
                target: App[None] | Screen = self
            elif isinstance(screen, ChatScreen):
                target = screen
            else:
                continue
            yield SystemCommand(a.palette_title, a.help, getattr(target, f"action_{a.id}"))

    def on_unmount(self) -> None:
        if self._chat_screen is not None:
            self._chat_screen.chat_view.cancel_reply()
        self.models.close()
        if self.store is not None:
            self.store.close()
