"""Snapshot tests (pytest-textual-snapshot) at a fixed size, no cursor blink: the chat screen, the
help screen, two dialogs and a chat with tool calls. Only a few, so a Textual upgrade rewrites little; every other screen is
checked through its widgets' state (the other test files).

Update after an intended visual change with: pytest tests/tui/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest
from tui_helpers import wait_for

SIZE = (110, 32)

REPLY = """Here is a function:

```python
def add(a, b):
    return a + b
```

It **adds** two numbers."""


@pytest.fixture
def snap_app(make_app, db_path):
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.settings import ChatSettings, SpeculationSettings

    store = ChatStore(db_path)
    older = store.create_chat(title="Older chat")
    store.add_message(older.id, "user", "hi")
    chat = store.create_chat(
        title="Adding numbers",
        settings=ChatSettings(speculation=SpeculationSettings(method="lookup", draft_max=8)).to_dict(),
    )
    store.add_message(chat.id, "user", "Write a Python function that adds two numbers.")
    store.add_message(chat.id, "assistant", REPLY, drafted=[(0, 4), (40, 55)])
    store.close()
    return make_app()


def _before(*keys: str, screen: str | None = None):
    async def run_before(pilot) -> None:
        app = pilot.app
        await wait_for(pilot, lambda: app.chat_view.chat is not None and "ready" in str(app.chat_screen.query_one("#stats").render()))
        app.chat_view.chat_input.cursor_blink = False
        if keys:
            await pilot.press(*keys)
        if screen:
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == screen)
            await pilot.pause()
        for table in app.screen.query("DataTable"):
            await wait_for(pilot, lambda t=table: t.row_count > 0 and not t.loading, what="table rows")
        for inp in app.screen.query("Input, TextArea"):
            inp.cursor_blink = False
        await pilot.pause()

    return run_before


def test_chat_screen(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=SIZE, run_before=_before())


def test_speculation_panel(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=SIZE, run_before=_before("ctrl+t", screen="SpeculationScreen"))


def test_settings_dialog(snap_compare, snap_app):
    """At 40 rows: its title, the labelled system-prompt box and the buttons in view (issue 26)."""
    assert snap_compare(snap_app, terminal_size=(110, 40), run_before=_before("ctrl+s", screen="SettingsScreen"))


@pytest.fixture
def tools_app(make_app, db_path):
    """A chat where the model called a tool, got its result and answered, then called it again: the
    second call still waits for its result."""
    from edgeinfer_tui.chat_store import ChatStore

    store = ChatStore(db_path)
    chat = store.create_chat(title="Weather")
    store.add_message(chat.id, "user", "What is the weather in Paris?")
    store.add_message(chat.id, "assistant", "", tool_calls=[
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "units": "celsius"}'}])
    store.add_message(chat.id, "tool", "18 degrees, sunny, light wind [from the station at Orly]",
                      tool_call_id="call_1")
    store.add_message(chat.id, "assistant", "It is 18 degrees and sunny in Paris.")
    store.add_message(chat.id, "user", "And in Oslo?")
    store.add_message(chat.id, "assistant", "Let me check.", tool_calls=[
        {"id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo", "units": "celsius"}'}])
    store.close()
    return make_app()


def test_tool_call_blocks(snap_compare, tools_app):
    """Calls and a result as collapsed one-line blocks; the last call marked as waiting."""
    assert snap_compare(tools_app, terminal_size=SIZE, run_before=_before())


def test_help_screen(snap_compare, snap_app):
    assert snap_compare(snap_app, terminal_size=(110, 40), run_before=_before("f1", screen="HelpScreen"))
