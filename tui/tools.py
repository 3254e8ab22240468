"""Tools the user defines for the chat, offered to the model with every reply.

    # $EDGEINFER_HOME/tools.json: OpenAI's `tools` list, as a chat request takes it
    [
      {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    ]

The file is checked by the library (`edgeinfer.engine.chat.tools.normalize_tools`); a file that does not
parse or check is one line on screen and no tools are offered, never a crash. It is read again when
it changes, so tools can be edited while the app runs.

The app does not run tools. A call the model makes is shown as a collapsed block (its name and
arguments; expand it for the whole call); the user runs the tool however they like and pastes its
result (Ctrl+F, or the dialog that opens when the reply ends), which goes back to the model as a
`role: "tool"` message, and the model continues.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import edgeinfer
from edgeinfer.engine.chat.tools import normalize_tools

from .chat_store import Message

__all__ = ["ToolsConfig", "ToolsFile", "tools_path", "load_tools", "conversation", "pending_calls", "call_title",
           "MAX_TOOLS_FILE_BYTES"]

MAX_TOOLS_FILE_BYTES = 1 << 20  # a tools file larger than this is refused (it goes into every prompt)


def tools_path() -> Path:
    import edgeinfer.paths

    return edgeinfer.paths.home() / "tools.json"


@dataclass(frozen=True)
class ToolsConfig:
    """The checked tools (empty: none offered) and a one-line problem with the file, if any."""

    tools: tuple[dict[str, Any], ...] = ()
    error: str | None = None

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def load_tools(path: Path | None = None) -> ToolsConfig:
    """The tools in `path` (default: tools_path()); no file is no tools."""
    path = path or tools_path()
    try:
        if not path.exists():
            return ToolsConfig()
        size = path.stat().st_size
        if size > MAX_TOOLS_FILE_BYTES:
            return ToolsConfig(error=f"{path}: {size} bytes, at most {MAX_TOOLS_FILE_BYTES}; no tools offered")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return ToolsConfig(error=f"{path}: {_one_line(e)}; no tools offered")
    if not isinstance(data, list):
        return ToolsConfig(error=f"{path}: must be a JSON list of tools "
                                 '([{"type": "function", "function": {...}}]); no tools offered')
    try:
        return ToolsConfig(tools=normalize_tools(data))
    except edgeinfer.InvalidOptionError as e:
        return ToolsConfig(error=f"{path}: {_one_line(e)}; no tools offered")


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class ToolsFile:
    """The tools file, read again whenever it changes (size or modification time)."""

    def __init__(self, path: Path | None = None):
        self.path = path or tools_path()
        self.config = ToolsConfig()
        self._stamp: tuple[int, int] | None = None
        self._read = False

    def refresh(self) -> bool:
        """Read the file if it changed since the last look; True when `config` changed."""
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if self._read and stamp == self._stamp:
            return False
        self._stamp, self._read = stamp, True
        new = load_tools(self.path)
        changed = new != self.config
        self.config = new
        return changed


# -- the conversation with calls and results --------------------------------------------------------

def conversation(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """A chat's stored turns as the engine takes them: user and assistant messages, an assistant's
    tool calls (OpenAI's shape) and the tool results pasted for them (`role: "tool"`)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("user", "assistant"):
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.role == "assistant" and m.tool_calls:
                turn["tool_calls"] = [{"id": c["id"], "type": "function",
                                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                                      for c in m.tool_calls]
            out.append(turn)
        elif m.role == "tool":
            turn = {"role": "tool", "content": m.content, "tool_call_id": m.tool_call_id or ""}
            name = _call_name(messages, m.tool_call_id)
            if name:
                turn["name"] = name
            out.append(turn)
    return out


def _call_name(messages: Sequence[Message], call_id: str | None) -> str | None:
    for m in messages:
        for c in m.tool_calls or ():
            if c["id"] == call_id:
                return c["name"]
    return None


def pending_calls(messages: Sequence[Message]) -> list[dict[str, str]]:
    """The calls of the chat's last reply that have no result yet ({"id", "name", "arguments"}, in
    order). A user message after the reply leaves them unanswered: nothing is pending then."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user":
            return []
        if m.role == "assistant":
            answered = {r.tool_call_id for r in messages[i + 1:] if r.role == "tool"}
            return [c for c in m.tool_calls or () if c["id"] not in answered]
    return []


def call_title(call: dict[str, str], width: int = 72) -> str:
    """One line for a collapsed call: `name(arguments)`, the arguments compacted and cut to fit."""
    try:
        args = json.dumps(json.loads(call["arguments"]), ensure_ascii=False, separators=(", ", ": "))
    except ValueError:
        args = " ".join(call["arguments"].split())
    text = f"{call['name']}({args})"
    return text if len(text) <= width else text[: width - 1] + "…"
