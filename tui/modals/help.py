"""F1: every key, as configured (remapped keys included)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Markdown

from ..config import ACTIONS, INPUT_KEYS, TuiConfig
from .base import Dialog

__all__ = ["HelpScreen", "help_markdown"]


def help_markdown(config: TuiConfig) -> str:
    def keys(action_id: str) -> str:
        return ", ".join(f"`{k}`" for k in config.key_list(action_id))

    lines = [
        "# edgeinfer chat",
        "",
        "| Keys | Action |",
        "|---|---|",
    ]
    for aid, (_default, text) in INPUT_KEYS.items():
        lines.append(f"| {keys(aid)} | {text} |")
    for a in ACTIONS:
        lines.append(f"| {keys(a.id)} | {a.help} |")
    lines += [
        "| `ctrl+p` | Command palette: every action, themes |",
        "",
        "Keys are remappable in `tui.toml` in the store directory (`[keys]` table, action = \"key,key\").",
    ]
    return "\n".join(lines)


class HelpScreen(Dialog):
    BINDINGS = [Binding("f1", "dismiss_none", "Close")]

    def __init__(self, config: TuiConfig):
        super().__init__()
        self.config = config

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Markdown(help_markdown(self.config))
