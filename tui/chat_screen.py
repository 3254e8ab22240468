"""The main screen: the sidebar of chats and the open chat (a ChatView), and the actions on chats.

Chats are created, opened, renamed, deleted and exported here; the reply and the actions on it
belong to the ChatView; loading models belongs to the app (this screen asks for one with
ModelWanted).
"""

from __future__ import annotations

from dataclasses import replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as TMessage
from textual.screen import Screen
from textual.widgets import Footer, Header, Label

from edgeinfer import EdgeInferError, SpeculationOptions

from .backend import Backend, one_line
from .chat_store import ChatStore, export_markdown
from .chat_view import ChatView, model_label
from .config import ACTIONS, APP_ACTIONS, TuiConfig
from .manage import ManageScreen
from .modals.confirm import ConfirmScreen
from .modals.model_picker import ModelPickerScreen
from .modals.prompt import PromptScreen
from .modals.settings import SettingsScreen
from .modals.speculation import SpeculationScreen
from .model_host import ModelHost
from .settings import ChatSettings, SpeculationSettings, kv_label
from .widgets import ChatList, ChatListItem

__all__ = ["ChatScreen"]


class ChatScreen(Screen):
    """Chats on the left, the open chat on the right. Its key bindings are the chat actions, so
    they are active (and in the footer) only while this screen is."""

    BINDINGS = [
        Binding(a.keys, a.id, a.description, show=a.show, id=f"edgeinfer.{a.id}", tooltip=a.help)
        for a in ACTIONS
        if a.id not in APP_ACTIONS  # the app's own bindings: help and quit work on every screen
    ]

    class ModelWanted(TMessage):
        """The open chat's model should be loaded with its KV-cache types and its speculation
        prepared (the app does it in the background)."""

        def __init__(self, ref: str, speculation: SpeculationOptions | None, kv_types: tuple[str, str]):
            super().__init__()
            self.ref, self.speculation, self.kv_types = ref, speculation, kv_types

    def __init__(
        self,
        store: ChatStore,
        models: ModelHost,
        config: TuiConfig,
        *,
        initial_model: str | None = None,
        initial_kv_types: tuple[str, str] | None = None,
        initial_speculation: str | None = None,
    ):
        super().__init__(id="chat-screen")
        self.store = store
        self.models = models
        self.config = config
        self.initial_model = initial_model  # `edgeinfer chat MODEL`
        self.initial_kv_types = initial_kv_types  # `edgeinfer chat --kv-type/--kv-type-k/--kv-type-v`
        self.initial_speculation = initial_speculation  # the model's tuned profile (the CLI form)
        self.chat_view = ChatView(
            store, models, config, default_model=initial_model or models.backend.default_ref(), id="chat-pane"
        )
        self.previous_chat_id: int | None = None  # the chat open before this one (Ctrl+B goes back)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Under a dialog this screen's keys do nothing, so its footer does not offer them. Esc
        (cancel) is offered only while a reply is being generated, Regenerate only while none is
        (so the footer fits in 80 columns either way)."""
        if action == "cancel":
            return self.is_active and self.chat_view.generating
        if action == "regenerate":
            return self.is_active and not self.chat_view.generating
        return self.is_active

    @property
    def backend(self) -> Backend:
        return self.models.backend

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Chats", id="sidebar-title")
                yield ChatList(id="chats")
            yield self.chat_view
        yield Footer(compact=True, show_command_palette=False)  # Ctrl+P is in F1's list; 80 columns hold the rest

    @property
    def chat_list(self) -> ChatList:
        return self.query_one(ChatList)

    def on_mount(self) -> None:
        self.call_after_refresh(self._start)

    def _start(self) -> None:
        view = self.chat_view
        view.messages_view.anchor()
        chats = self.store.list_chats()
        for c in chats:
            self.chat_list.append(ChatListItem(c.id, c.title))
        if chats and self.initial_model and self.store.messages(chats[0].id):
            # `edgeinfer chat MODEL`: a new chat for that model (the last chat's history was
            # written with another model in mind); the last chat stays one key away
            self.previous_chat_id = chats[0].id
            self.new_chat(model=self.initial_model)
            self.notify(f"A new chat with {self.initial_model}; {self.config.key_for('last_chat')} goes back to "
                        f"your last chat, {chats[0].title!r}.", timeout=8)
        elif chats:
            self.open_chat(chats[0].id)
            if self.initial_model and view.model_ref != self.initial_model:
                view.update_chat(model=self.initial_model)  # an empty last chat takes the model asked for
        else:
            self.new_chat()
        if self.initial_kv_types is not None and view.settings.kv_types != self.initial_kv_types:
            view.update_chat(settings=view.settings.with_kv_types(self.initial_kv_types).to_dict())  # so do its cache types
        if self.initial_speculation is not None and view.settings.speculation != self._initial_speculation():
            view.update_chat(settings=replace(view.settings, speculation=self._initial_speculation()).to_dict())
        view.chat_input.focus()
        self._want_model()

    def _initial_speculation(self) -> SpeculationSettings:
        """The speculation `edgeinfer chat` gives (a tuned profile's), as a chat's settings hold it."""
        spec = SpeculationOptions.parse(self.initial_speculation or "off")
        return SpeculationSettings(method=spec.method, draft_model=spec.draft_model, self_quant=spec.self_quant,
                                   draft_max=spec.draft_max)

    def _want_model(self) -> None:
        view = self.chat_view
        try:
            speculation = view.settings.speculation.to_options().validate()
        except EdgeInferError:  # settings saved by an older version: the reply will say what is wrong
            speculation = None
        self.post_message(self.ModelWanted(view.model_ref, speculation, view.settings.kv_types))

    def _refresh_header(self) -> None:
        view = self.chat_view
        model = model_label(view.model_ref, view.settings.kv_types)
        self.app.sub_title = f"{model} · speculation: {view.settings.speculation.describe()}"

    # -- chats -----------------------------------------------------------------------------------
    def new_chat(self, model: str | None = None) -> None:
        """A new chat, with `model` (default: the open chat's) and the default settings: settings
        saved for a chat stay with it (the KV-cache types `edgeinfer chat` asked for apply to new
        chats too)."""
        view = self.chat_view
        model = model or (self.initial_model if view.chat is None else view.model_ref)
        before = view.settings.kv_types if view.chat is not None else None
        settings = ChatSettings()
        if self.initial_kv_types is not None:
            settings = settings.with_kv_types(self.initial_kv_types)
        if self.initial_speculation is not None:
            settings = replace(settings, speculation=self._initial_speculation())
        chat = self.store.create_chat(model=model, settings=settings.to_dict())
        self.chat_list.insert(0, [ChatListItem(chat.id, chat.title)])
        self.open_chat(chat.id)
        if before is not None and before != settings.kv_types:  # load with the new chat's cache ahead of its reply
            self._want_model()

    def open_chat(self, chat_id: int) -> None:
        shown = self.chat_view.chat
        if shown is not None and shown.id != chat_id:
            self.previous_chat_id = shown.id
        self.chat_view.show_chat(self.store.get_chat(chat_id))
        lst = self.chat_list
        for i, item in enumerate(lst.children):
            if isinstance(item, ChatListItem) and item.chat_id == chat_id and lst.index != i:
                lst.index = i
        self._refresh_header()

    def _list_item(self, chat_id: int) -> ChatListItem | None:
        for item in self.query(ChatListItem):
            if item.chat_id == chat_id:
                return item
        return None

    @on(ChatList.Selected)
    def _chat_selected(self, event: ChatList.Selected) -> None:
        item = event.item
        chat = self.chat_view.chat
        if isinstance(item, ChatListItem) and (chat is None or item.chat_id != chat.id):
            self.open_chat(item.chat_id)
            self.chat_view.chat_input.focus()

    @on(ChatView.ChatChanged)
    def _chat_changed(self, event: ChatView.ChatChanged) -> None:
        item = self._list_item(event.chat.id)
        if item is not None and item.title != event.chat.title:
            item.set_title(event.chat.title)
        self._refresh_header()

    # -- actions on chats ------------------------------------------------------------------------
    def action_new_chat(self) -> None:
        self.new_chat()
        self.chat_view.chat_input.focus()

    def action_last_chat(self) -> None:
        """Back to the chat open before this one (again: forth)."""
        ids = {c.id for c in self.store.list_chats()}
        if self.previous_chat_id not in ids:
            self.notify("No other chat was open before this one.", severity="warning")
            return
        self.open_chat(self.previous_chat_id)  # (as a chat picked in the sidebar)
        self.chat_view.chat_input.focus()

    def action_rename_chat(self) -> None:
        chat = self.chat_view.chat
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title and self.chat_view.chat is not None:
                self.chat_view.update_chat(title=title)

        self.app.push_screen(PromptScreen("Rename chat", chat.title), done)

    def action_delete_chat(self) -> None:
        chat = self.chat_view.chat
        if chat is None:
            return

        def done(yes: bool | None) -> None:
            if not yes:
                return
            self.chat_view.forget_reply(chat.id)
            self.store.delete_chat(chat.id)
            self.models.forget_chat(chat.id)
            item = self._list_item(chat.id)
            if item is not None:
                item.remove()
            chats = self.store.list_chats()
            if chats:
                self.open_chat(chats[0].id)
            else:
                self.new_chat()

        self.app.push_screen(ConfirmScreen(f"Delete the chat {chat.title!r}? (y/n)"), done)

    def action_export_chat(self) -> None:
        chat = self.chat_view.chat
        if chat is None:
            return
        import edgeinfer.paths
        from edgeinfer.fsutil import atomic_write_text

        target = edgeinfer.paths.home() / "exports" / f"chat-{chat.id}.md"
        try:
            atomic_write_text(target, export_markdown(chat, self.store.messages(chat.id)))
        except OSError as e:
            self.notify(f"export failed: {one_line(e)}", severity="error")
            return
        self.notify(f"Exported to {target}", timeout=8)

    def action_manage(self) -> None:
        self.app.push_screen(ManageScreen(self.backend))

    # -- dialogs that change the open chat -------------------------------------------------------
    def action_settings(self) -> None:
        view = self.chat_view

        def done(result: ChatSettings | None) -> None:
            if result is None:
                return
            reload = result.kv_types != view.settings.kv_types
            view.update_chat(settings=result.to_dict())
            if not reload:
                self.notify("Settings saved for this chat.")
            elif view.generating:  # the reply holds the model: the next one reloads it
                self.notify(f"Settings saved; the next reply reloads the model with a {kv_label(result.kv_types)} KV cache.")
            else:
                self.notify(f"Settings saved; reloading the model with a {kv_label(result.kv_types)} KV cache.")
                view.set_stats(f"{model_label(view.model_ref, result.kv_types)} · loading…")
                self._want_model()

        self.app.push_screen(SettingsScreen(view.settings, model=view.model_ref, save_keys=self.config.key_for("settings")), done)

    def action_speculation(self) -> None:
        view = self.chat_view

        def done(result: tuple[SpeculationSettings, bool] | None) -> None:
            if result is None:
                return
            spec, show = result
            view.update_chat(settings=replace(view.settings, speculation=spec).to_dict())
            if show != view.show_drafted:
                view.action_toggle_drafted()
            self.notify(f"Speculation: {spec.describe()}.")
            if spec.method in ("self", "draft"):  # make the self-draft / load the draft model now
                self._want_model()

        self.app.push_screen(SpeculationScreen(view.settings.speculation, view.show_drafted, self._model_refs(),
                                               save_keys=self.config.key_for("speculation")), done)

    def _model_refs(self) -> list[str]:
        try:
            return [e.ref for e in self.backend.list_models()]
        except Exception:  # noqa: BLE001 - the panel works without the list
            return []

    def action_pick_model(self) -> None:
        view = self.chat_view

        def done(ref: str | None) -> None:
            if not ref or view.chat is None:
                return
            if view.generating:
                self.notify("Cancel the reply first (Esc), then switch models.", severity="warning")
                return
            view.update_chat(model=ref)
            view.set_stats(f"{ref} · loading…")
            self._want_model()

        self.app.push_screen(ModelPickerScreen(self.backend, view.model_ref, view.settings.kv_types), done)

    # -- the reply's actions are the ChatView's; the keys are bound here so they work wherever
    # -- the focus is on this screen (the sidebar included)
    def action_cancel(self) -> None:
        self.chat_view.action_cancel()

    def action_regenerate(self) -> None:
        self.chat_view.action_regenerate()

    def action_copy_reply(self) -> None:
        self.chat_view.action_copy_reply()

    def action_copy_code(self) -> None:
        self.chat_view.action_copy_code()

    def action_toggle_drafted(self) -> None:
        self.chat_view.action_toggle_drafted()

    def action_tool_result(self) -> None:
        self.chat_view.action_tool_result()
