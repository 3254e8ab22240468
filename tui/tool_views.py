"""A tool call the model made, and the result the user pasted for it, as collapsed blocks in the chat.

Collapsed, a call is one line: `▶ called get_weather({"city": "Paris"})`, or `▶ waiting for a
result: get_weather(…)` while its result is wanted; expanded (click it, or Enter on it) it shows the
call's id and the arguments as indented JSON. A result is `▶ get_weather returned: <its first
line>`, expanded its whole text. (Plain characters only: an emoji's width differs between terminals.)
"""

from __future__ import annotations

import json

from textual.content import Content
from textual.widgets import Collapsible, Static

from .tools import call_title

__all__ = ["ToolCallBlock", "ToolResultBlock", "PENDING_NOTE"]

PENDING_NOTE = "waiting for a result:"


def _pretty(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


class ToolCallBlock(Collapsible):
    """One call: {"id", "name", "arguments"} (arguments: the JSON text the model wrote)."""

    DEFAULT_CSS = """
    ToolCallBlock { background: $boost; border-top: none; padding: 0 0 0 1; margin: 0 1; }
    ToolCallBlock .call-body { color: $text; padding: 0 1; }
    ToolCallBlock.-pending CollapsibleTitle { color: $warning; }
    """

    def __init__(self, call: dict[str, str], *, pending: bool = False):
        self.call = dict(call)
        self.pending = pending
        body = Static(Content(f"id: {call['id']}\n{_pretty(call['arguments'])}"), classes="call-body")
        # the title as Content, not markup: arguments may hold [brackets]
        super().__init__(body, title=Content(self.title_text), collapsed=True, classes="-pending" if pending else "")

    @property
    def title_text(self) -> str:
        return f"{PENDING_NOTE if self.pending else 'called'} {call_title(self.call, 52)}"

    def set_pending(self, pending: bool) -> None:
        self.pending = pending
        self.set_class(pending, "-pending")
        self.title = Content(self.title_text)


class ToolResultBlock(Collapsible):
    """A pasted tool result (role "tool"), collapsed to its first line."""

    DEFAULT_CSS = """
    ToolResultBlock { background: $boost; border-top: none; padding: 0 0 0 1; margin: 0 1; }
    ToolResultBlock .result-body { padding: 0 1; }
    """

    def __init__(self, content: str, name: str | None = None):
        self.content = content
        self.tool_name = name
        lines = content.strip().splitlines()
        first = lines[0] if lines else "(empty)"
        self.title_text = f"{name or 'the tool'} returned: " + (first if len(first) <= 52 else first[:51] + "…")
        super().__init__(Static(Content(content), classes="result-body"), title=Content(self.title_text), collapsed=True)
