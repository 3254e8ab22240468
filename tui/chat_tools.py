"""The tool calls of a chat (a part of ChatView): the user's tools offered with every reply, the
calls a reply ends with shown as collapsed blocks, and their results pasted back (tui/tools.py
says how the tools are defined). Once every call of a reply has its result, the model continues.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgeinfer import DoneEvent

from .modals.base import key_label
from .modals.tool_result import ToolResultScreen
from .tools import ToolsFile, pending_calls
from .widgets import MessageView

if TYPE_CHECKING:
    from .chat_store import Chat, ChatStore
    from .config import TuiConfig

__all__ = ["ChatTools", "reply_turn"]


def reply_turn(done: DoneEvent) -> list[dict[str, Any]]:
    """The reply as the conversation continues it: its text and its calls (nothing when it is empty)."""
    if not done.text and not done.tool_calls:
        return []
    turn: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in done.tool_calls]
    return [turn]


class ChatTools:
    """Mixed into ChatView (which has the chat, its store and its message views)."""

    chat: Chat | None
    store: ChatStore
    config: TuiConfig
    tools: ToolsFile

    def offered_tools(self) -> tuple[dict[str, Any], ...]:
        """The tools offered with the next reply: the tools file's, read again if it changed; a
        problem with the file is one line on screen (once per change) and no tools are offered."""
        if self.tools.refresh() and self.tools.config.error:
            self.notify(self.tools.config.error, title="Tools", severity="warning", timeout=10)  # type: ignore[attr-defined]
        return self.tools.config.tools

    def waiting_calls(self) -> list[dict[str, str]]:
        """The open chat's calls still waiting for a result."""
        return pending_calls(self.store.messages(self.chat.id)) if self.chat is not None else []

    def ask_tool_result(self) -> None:
        """Open the dialog for the first call waiting for its result (if the chat has one)."""
        waiting = self.waiting_calls()
        if not waiting or self.chat is None:
            return
        chat_id, call = self.chat.id, waiting[0]

        def done(result: str | None) -> None:
            if result is None:
                key = key_label(self.config.key_for("tool_result"))
                self.notify(f"{call['name']} waits for its result: {key} to paste it.")  # type: ignore[attr-defined]
            elif self.chat is not None and self.chat.id == chat_id:
                self.give_tool_result(call, result)

        screen = ToolResultScreen(call, waiting=len(waiting), save_keys=self.config.key_for("tool_result"))
        self.app.push_screen(screen, done)  # type: ignore[attr-defined]

    def action_tool_result(self) -> None:
        if self.generating:  # type: ignore[attr-defined]
            self.notify("A reply is being generated.", severity="warning")  # type: ignore[attr-defined]
        elif not self.waiting_calls():
            self.notify("No tool call is waiting for a result.", severity="warning")  # type: ignore[attr-defined]
        else:
            self.ask_tool_result()

    def give_tool_result(self, call: dict[str, str], result: str) -> None:
        """`result` answers `call`: saved and shown as a `tool` message; the next waiting call is
        asked for, and when none is left the model continues."""
        assert self.chat is not None
        if call not in self.waiting_calls():  # answered meanwhile (two dialogs for one call)
            return
        msg = self.store.add_message(self.chat.id, "tool", result, tool_call_id=call["id"])
        self.messages_view.mount(MessageView("tool", result, message_id=msg.id, tool_name=call["name"]))  # type: ignore[attr-defined]
        waiting = self.waiting_calls()
        ids = frozenset(c["id"] for c in waiting)
        for view in self.messages_view.query(MessageView):  # type: ignore[attr-defined]
            if any(c["id"] == call["id"] for c in view.tool_calls):
                view.set_pending(ids)
        if waiting:
            self.ask_tool_result()
        else:
            self._start_reply()  # type: ignore[attr-defined]

    async def show_tool_calls(self, view: MessageView | None, done: DoneEvent) -> None:
        """A reply ended with calls: shown under it, and the first one's result asked for."""
        if not done.tool_calls:
            return
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in done.tool_calls]
        if view is not None:  # (None: the chat is no longer on screen; Ctrl+F asks when it is again)
            await view.add_tool_calls(calls, frozenset(c["id"] for c in calls))
            self.ask_tool_result()
