"""A tiny host app that mounts one widget, to test it with Pilot on its own (as oterm does)."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widget import Widget


class HostApp(App[None]):
    def __init__(self, widget: Widget):
        super().__init__()
        self.widget = widget
        self.messages: list[object] = []

    def compose(self) -> ComposeResult:
        yield self.widget

    def on_chat_input_submitted(self, message) -> None:
        self.messages.append(message)
