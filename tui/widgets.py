"""The chat screen's widgets: the message input, one message, the chat list."""

from __future__ import annotations

import re

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message as TMessage
from textual.widgets import Label, ListItem, ListView, Markdown, Static, TextArea

from .tool_views import ToolCallBlock, ToolResultBlock

__all__ = ["ChatInput", "MessageView", "ChatList", "ChatListItem", "last_code_block", "merge_spans"]

_FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
_OPEN_FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n(.*)\Z", re.S | re.M)


def last_code_block(markdown: str) -> str | None:
    """The body of the last fenced code block (a still-open last fence counts)."""
    blocks, pos = [], 0
    for m in _FENCE_RE.finditer(markdown):
        blocks.append(m.group(2))
        pos = m.end()
    m = _OPEN_FENCE_RE.search(markdown, pos)
    if m:
        blocks.append(m.group(2))
    return blocks[-1].rstrip("\n") if blocks else None


def merge_spans(spans: list[tuple[int, int]], start: int, end: int) -> None:
    """Add [start, end) to a sorted list of spans, merging with the last when adjacent."""
    if end <= start:
        return
    if spans and spans[-1][1] >= start:
        spans[-1] = (spans[-1][0], max(spans[-1][1], end))
    else:
        spans.append((start, end))


class ChatInput(TextArea):
    """The message box. Enter sends; Shift+Enter or Ctrl+J inserts a new line (both remappable)."""

    class Submitted(TMessage):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, send_keys: list[str], newline_keys: list[str], **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, **kw)
        self.send_keys = set(send_keys)
        self.newline_keys = set(newline_keys)

    async def _on_key(self, event: events.Key) -> None:
        if event.key in self.send_keys:
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in self.newline_keys:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class MessageView(Vertical):
    """One turn. Assistant replies render as Markdown (streamed through `Markdown.get_stream`), or,
    with the drafted view on, as text where drafted-and-accepted tokens have their own colour. A
    reply's tool calls follow it as collapsed blocks; a tool result (role "tool") is one."""

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; }
    MessageView > .role { text-style: bold; color: $text-muted; }
    MessageView.user > .role { color: $accent; }
    MessageView.assistant > .role { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0 1; }
    MessageView > .drafted-view { padding: 0 1; }
    MessageView > .note { color: $text-muted; text-style: italic; padding: 0 1; }
    """

    def __init__(
        self,
        role: str,
        content: str = "",
        *,
        drafted: list[tuple[int, int]] | None = None,
        show_drafted: bool = False,
        note: str = "",
        message_id: int | None = None,
        tool_calls: list[dict[str, str]] | None = None,
        pending: frozenset[str] = frozenset(),
        tool_name: str | None = None,
    ):
        """`tool_calls`: an assistant's calls ({"id", "name", "arguments"}), those in `pending`
        still waiting for a result; `tool_name`: the tool a "tool" message is the result of."""
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.tool_calls = list(tool_calls or [])
        self.pending = pending
        self.tool_name = tool_name
        self.drafted: list[tuple[int, int]] = list(drafted or [])
        self.show_drafted = show_drafted
        self.message_id = message_id
        self._note = note
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Label({"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}.get(self.role, self.role),
                    classes="role")
        md = Markdown("" if self.role == "tool" else self.content, classes="body")
        md.display = self._markdown_shown
        yield md
        view = Static(self._drafted_text(), classes="drafted-view")
        view.display = self._drafted_mode
        yield view
        note = Static(self._note, classes="note")
        note.display = bool(self._note)
        yield note
        if self.role == "tool":
            yield ToolResultBlock(self.content, self.tool_name)
        for call in self.tool_calls:
            yield ToolCallBlock(call, pending=call["id"] in self.pending)

    @property
    def _drafted_mode(self) -> bool:
        return self.show_drafted and self.role == "assistant"

    @property
    def _markdown_shown(self) -> bool:
        return not self._drafted_mode and self.role != "tool"

    async def add_tool_calls(self, calls: list[dict[str, str]], pending: frozenset[str]) -> None:
        """The reply's calls, after its text (when it ends with them)."""
        self.tool_calls += calls
        self.pending = pending
        await self.mount_all([ToolCallBlock(c, pending=c["id"] in pending) for c in calls])

    def set_pending(self, pending: frozenset[str]) -> None:
        """Which of this reply's calls still wait for a result."""
        self.pending = pending
        for block in self.query(ToolCallBlock):
            block.set_pending(block.call["id"] in pending)

    def _drafted_text(self) -> Text:
        text = Text(self.content)
        for a, b in self.drafted:
            text.stylize("bold magenta", a, b)
        return text

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def set_note(self, note: str) -> None:
        self._note = note
        w = self.query_one(".note", Static)
        w.update(note)
        w.display = bool(note)

    def set_show_drafted(self, on: bool) -> None:
        self.show_drafted = on
        self.markdown.display = self._markdown_shown
        view = self.query_one(".drafted-view", Static)
        view.display = self._drafted_mode
        if self._drafted_mode:
            view.update(self._drafted_text())
        elif self._stream is None:
            self.markdown.update(self.content)

    # -- streaming -------------------------------------------------------------------------------
    async def append(self, text: str, drafted: list[tuple[int, int]]) -> None:
        """Append a batch of tokens' text; `drafted` spans are relative to the batch."""
        base = len(self.content)
        self.content += text
        for a, b in drafted:
            merge_spans(self.drafted, base + a, base + b)
        if self._drafted_mode:
            self.query_one(".drafted-view", Static).update(self._drafted_text())
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(text)

    async def finish(self, content: str | None = None) -> None:
        """End the stream and set the full text once, so nothing is lost whatever was batched."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()
        if content is not None:
            self.content = content
        if self._drafted_mode:
            self.query_one(".drafted-view", Static).update(self._drafted_text())
        else:
            await self.markdown.update(self.content)


class ChatListItem(ListItem):
    def __init__(self, chat_id: int, title: str):
        super().__init__(Label(title, markup=False))
        self.chat_id = chat_id
        self.title = title

    def set_title(self, title: str) -> None:
        self.title = title
        self.query_one(Label).update(title)


class ChatList(ListView):
    """The sidebar: one item per chat, most recent first."""
