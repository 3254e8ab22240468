"""Tool calls in the chat UI: tools from `$EDGEINFER_HOME/tools.json` offered with each reply, a
call shown as a collapsed block (name and arguments; expandable), its result pasted in a dialog and
sent back as a `role: "tool"` message, after which the model continues.

The flows run on the scripted engine (tui_fakes: a reply that is offered tools may end with calls,
streamed as ToolCallEvents as the library streams them), so they are deterministic; one test runs
the real default model through the library's engine, whose reply after a pasted result must be the
library's own. The file is checked by the library's `normalize_tools`, and the UI reaches the engine
only through `engine.chat(..., tools=)`.
"""

from __future__ import annotations

import json
import threading

import pytest
from tui_helpers import run, say, wait_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def write_tools(home, tools) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "tools.json").write_text(tools if isinstance(tools, str) else json.dumps(tools))


def weather_calls(messages, tools):
    """Calls get_weather for Paris when the last message is the user's and asks about the weather;
    after a tool result it answers (no calls)."""
    last = messages[-1]
    if last["role"] == "user" and "weather" in last["content"]:
        return [("get_weather", '{"city": "Paris"}')]
    return []


# -- the tools file and the conversation (no app) ----------------------------------------------------

def test_tools_file_is_checked_by_the_library(edgeinfer_home):
    from edgeinfer_tui.tools import MAX_TOOLS_FILE_BYTES, ToolsFile, load_tools

    path = edgeinfer_home / "tools.json"
    assert load_tools(path).tools == () and load_tools(path).error is None  # no file: no tools
    write_tools(edgeinfer_home, [WEATHER, CLOCK])
    cfg = load_tools(path)
    assert cfg.error is None and cfg.names == ["get_weather", "get_time"]
    assert cfg.tools[1]["function"]["parameters"]["properties"] == {"zone": {"type": "string"}}
    for content, message in [
        ("[{", "Expecting"),  # JSON that does not parse: the parser's line
        ('{"tools": []}', "must be a JSON list of tools"),
        (json.dumps([{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name must be"),
        (json.dumps([WEATHER, WEATHER]), "two tools are named 'get_weather'"),
        (b"\xff\xfe".decode("latin-1"), "no tools offered"),
    ]:
        write_tools(edgeinfer_home, content)
        cfg = load_tools(path)
        assert cfg.tools == () and message in cfg.error and "\n" not in cfg.error, (content, cfg.error)
        assert cfg.error.startswith(str(path)) and cfg.error.endswith("no tools offered")
    path.write_bytes(b" " * (MAX_TOOLS_FILE_BYTES + 1))
    assert "at most" in load_tools(path).error
    # read again only when it changes
    f = ToolsFile(path)
    write_tools(edgeinfer_home, [WEATHER])
    assert f.refresh() and f.config.names == ["get_weather"]
    assert not f.refresh()
    write_tools(edgeinfer_home, [WEATHER, CLOCK])
    assert f.refresh() and f.config.names == ["get_weather", "get_time"]
    path.unlink()
    assert f.refresh() and f.config.tools == () and f.config.error is None


def test_calls_and_results_are_stored_and_become_the_conversation(db_path):
    from edgeinfer_tui.chat_store import ChatStore, export_markdown
    from edgeinfer_tui.tools import call_title, conversation, pending_calls

    store = ChatStore(db_path)
    chat = store.create_chat()
    store.add_message(chat.id, "user", "Weather in Paris and the time in Tokyo?")
    calls = [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"id": "call_2", "name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}]
    store.add_message(chat.id, "assistant", "Let me look.", tool_calls=calls)
    assert pending_calls(store.messages(chat.id)) == calls
    store.add_message(chat.id, "tool", "18 degrees, sunny", tool_call_id="call_1")
    assert pending_calls(store.messages(chat.id)) == calls[1:]
    store.add_message(chat.id, "tool", "09:30", tool_call_id="call_2")
    msgs = store.messages(chat.id)
    assert pending_calls(msgs) == []
    assert conversation(msgs) == [
        {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}]},
        {"role": "tool", "content": "18 degrees, sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "09:30", "tool_call_id": "call_2", "name": "get_time"},
    ]
    # a user message after a reply with calls leaves them unanswered: nothing waits any more
    store.add_message(chat.id, "assistant", "", tool_calls=[{"id": "call_3", "name": "get_time", "arguments": "{}"}])
    assert [c["id"] for c in pending_calls(store.messages(chat.id))] == ["call_3"]
    store.add_message(chat.id, "user", "never mind")
    assert pending_calls(store.messages(chat.id)) == []
    md = export_markdown(store.get_chat(chat.id), store.messages(chat.id))
    assert "Tool call `get_weather` (call_1):" in md and '{"city": "Paris"}' in md and "## Tool result (call_2)" in md
    assert call_title(calls[0]) == 'get_weather({"city": "Paris"})'
    assert call_title({"id": "x", "name": "f", "arguments": json.dumps({"text": "y" * 200})}, width=30).endswith("…")
    store.close()


def test_an_old_history_gains_the_tool_columns(db_path):
    """A database from before tool calls (migrations 1 and 2) is upgraded in place; its messages load
    with no calls."""
    import sqlite3

    from edgeinfer_tui.chat_store import ChatStore, m001_initial, m002_settings_and_stats, migrate

    db = sqlite3.connect(str(db_path))
    migrate(db, [m001_initial, m002_settings_and_stats])
    db.execute("INSERT INTO chats (title, created, updated) VALUES ('old', 'x', 'x')")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'assistant', 'hi', 'x')")
    db.commit()
    db.close()
    store = ChatStore(db_path)
    [m] = store.messages(1)
    assert m.content == "hi" and m.tool_calls == [] and m.tool_call_id is None
    store.close()


# -- the app -----------------------------------------------------------------------------------------

def _blocks(app):
    from edgeinfer_tui.tool_views import ToolCallBlock

    return list(app.chat_view.messages_view.query(ToolCallBlock))


def _screen(app) -> str:
    return app.screen.__class__.__name__


@pytest.mark.slow
def test_a_call_is_a_collapsed_block_and_the_pasted_result_lets_the_model_continue(make_app, backend, edgeinfer_home):
    from edgeinfer_tui.tool_views import PENDING_NOTE, ToolResultBlock
    from textual.widgets import TextArea

    write_tools(edgeinfer_home, [WEATHER])
    backend.calls_script = weather_calls
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None, what="first chat")
            app.chat_view.chat_input.text = "What is the weather in Paris?"
            await pilot.press("enter")
            # the echo's 7 tokens, then the call's first event: the stats line names the call
            backend.gate.release(8)
            await wait_for(pilot, lambda: "calling get_weather" in str(app.chat_screen.query_one("#stats").render()),
                           what="the call being written")
            backend.gate.release(10)
            await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen", what="the result dialog")
            # the tools reached the engine through chat(..., tools=): the file's, checked
            assert backend.tools_offered[-1] == (WEATHER,)
            [block] = _blocks(app)
            assert block.collapsed and block.call["name"] == "get_weather"
            assert block.title_text == f'{PENDING_NOTE} get_weather({{"city": "Paris"}})'
            assert block.title_text in str(block.query_one("CollapsibleTitle").render())  # as text, not markup
            msgs = app.store.messages(app.chat_view.chat.id)
            assert msgs[-1].role == "assistant" and msgs[-1].stats["finish_reason"] == "tool_calls"
            assert msgs[-1].tool_calls == [{"id": block.call["id"], "name": "get_weather", "arguments": '{"city": "Paris"}'}]
            # an empty result is refused with a line in the dialog; a pasted one is sent with Ctrl+F
            await pilot.press("ctrl+f")
            assert _screen(app) == "ToolResultScreen" and "empty" in str(app.screen.query_one("#tool-result-error").render())
            app.screen.query_one("#tool-result", TextArea).text = "18 degrees and sunny"
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: len(backend.calls) == 2, what="the model continuing")
            # what went back: the call on the assistant message, the result as a tool message
            _, messages, _ = backend.calls[-1]
            assert messages[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            assert messages[-1] == {"role": "tool", "content": "18 degrees and sunny",
                                    "tool_call_id": block.call["id"], "name": "get_weather"}
            backend.gate.release(100)
            await wait_for(pilot, lambda: not app.chat_view.generating, what="the answer")
            assert _screen(app) == "ChatScreen"  # no call waits: no dialog
            assert _blocks(app)[0].title_text == 'called get_weather({"city": "Paris"})'
            [result] = app.chat_view.messages_view.query(ToolResultBlock)
            assert result.collapsed and result.title_text == "get_weather returned: 18 degrees and sunny"
            roles = [m.role for m in app.store.messages(app.chat_view.chat.id)]
            assert roles == ["user", "assistant", "tool", "assistant"]
            # expanding the block shows the whole call
            block = _blocks(app)[0]
            block.query_one("CollapsibleTitle").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: not block.collapsed, what="the block expanded")
            body = str(block.query_one(".call-body").render())
            assert block.call["id"] in body and '"city": "Paris"' in body

    run(main())


@pytest.mark.slow
def test_esc_leaves_the_call_waiting_ctrl_f_and_a_restart_bring_it_back(make_app, backend, edgeinfer_home):
    write_tools(edgeinfer_home, [WEATHER])
    backend.calls_script = weather_calls

    async def first():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.text = "weather?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen", what="the result dialog")
            await pilot.press("escape")
            await wait_for(pilot, lambda: _screen(app) == "ChatScreen")
            assert len(backend.calls) == 1 and _blocks(app)[0].pending
            assert any(n.message == "get_weather waits for its result: Ctrl+F to paste it." for n in app._notifications)
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen", what="Ctrl+F reopens it")
            await pilot.press("escape")

    async def second():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: len(_blocks(app)) == 1, what="the stored call shown")
            assert _blocks(app)[0].pending and _blocks(app)[0].collapsed
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen")
            app.screen.query_one("#tool-result").text = "rain"
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.chat_view.generating,
                           what="the model continuing after the restart")
            assert backend.calls[-1][1][-1]["content"] == "rain" and not _blocks(app)[0].pending
            await pilot.press("ctrl+f")  # nothing waits now: a one-line notice, no dialog
            await wait_for(pilot, lambda: any(n.message == "No tool call is waiting for a result."
                                              for n in app._notifications), what="the notice")
            assert _screen(app) == "ChatScreen"

    run(first())
    run(second())


@pytest.mark.slow
def test_parallel_calls_are_answered_one_after_another_then_the_model_continues(make_app, backend, edgeinfer_home):
    write_tools(edgeinfer_home, [WEATHER, CLOCK])
    backend.calls_script = lambda messages, tools: (
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "Europe/Oslo"}')]
        if messages[-1]["role"] == "user" else [])

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.text = "Oslo now?"
            await pilot.press("enter")
            for name, result in (("get_weather", "snow"), ("get_time", "23:10")):
                await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen" and app.screen.call["name"] == name,
                               what=f"the dialog for {name}")
                assert len(backend.calls) == 1  # the model waits for every result
                app.screen.query_one("#tool-result").text = result
                await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.chat_view.generating)
            tail = backend.calls[-1][1][-2:]
            assert [(m["role"], m["content"], m["name"]) for m in tail] == [("tool", "snow", "get_weather"),
                                                                           ("tool", "23:10", "get_time")]
            assert [b.pending for b in _blocks(app)] == [False, False]

    run(main())


@pytest.mark.slow
def test_a_bad_tools_file_is_one_line_on_screen_and_a_fixed_one_is_offered(make_app, backend, edgeinfer_home):
    write_tools(edgeinfer_home, '[{"type": "function", "function": {"name": "no spaces allowed"}}]')

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: any("no tools offered" in str(n.message) for n in app._notifications),
                           what="the file's problem on screen")
            [note] = [n for n in app._notifications if "no tools offered" in str(n.message)]
            assert "\n" not in str(note.message) and "tools[0].function.name must be" in str(note.message)
            await say(pilot, backend, "hello")
            assert backend.tools_offered[-1] == () and app.chat_view.last_done.text == "Echo: hello"
            write_tools(edgeinfer_home, [WEATHER])  # fixed while the app runs: read again
            await say(pilot, backend, "hello again")
            assert backend.tools_offered[-1] == (WEATHER,)

    run(main())


@pytest.mark.slow
def test_a_call_cut_off_by_esc_is_not_a_call(make_app, backend, edgeinfer_home):
    """Esc while the call's arguments stream: the reply keeps its text, no call is stored or shown,
    no dialog opens."""
    write_tools(edgeinfer_home, [WEATHER])
    backend.calls_script = weather_calls
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.text = "weather?"
            await pilot.press("enter")
            backend.gate.release(3)  # "Echo:", " weather?", the call's first event
            await wait_for(pilot, lambda: "calling get_weather" in str(app.chat_screen.query_one("#stats").render()))
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.chat_view.generating, what="the cancelled reply")
            [reply] = [m for m in app.store.messages(app.chat_view.chat.id) if m.role == "assistant"]
            assert reply.content == "Echo: weather?" and reply.tool_calls == []
            assert reply.stats["finish_reason"] == "cancelled"
            assert not _blocks(app) and _screen(app) == "ChatScreen"

    run(main())


@pytest.mark.slow
def test_the_real_default_model_continues_after_a_pasted_result(default_model_path, db_path, edgeinfer_home):
    """With the library's engine (the real default model): the tools file's tools are rendered into
    its prompt, the pasted result goes back in the conversation, and what the model then writes (text
    or another call) is exactly the library's own greedy reply to that conversation with those tools."""
    import edgeinfer
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.backend import LibraryBackend
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.config import TuiConfig
    from edgeinfer_tui.settings import ChatSettings
    from edgeinfer_tui.tools import conversation

    write_tools(edgeinfer_home, [WEATHER])
    settings = ChatSettings(temperature=0.0, max_tokens=24, system_prompt="You are a helpful assistant.")
    store = ChatStore(db_path)
    chat = store.create_chat(settings=settings.to_dict())
    store.add_message(chat.id, "user", "What is the weather in Paris?")
    store.add_message(chat.id, "assistant", "", tool_calls=[
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}])
    store.close()
    app = EdgeInferApp(LibraryBackend(edgeinfer.LoadOptions(n_ctx=2048)), db_path=db_path, config=TuiConfig())

    async def main():
        async with app.run_test(size=(110, 34)) as pilot:
            await wait_for(pilot, lambda: len(_blocks(app)) == 1, what="the stored call")
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: _screen(app) == "ToolResultScreen")
            app.screen.query_one("#tool-result").text = "18 degrees and sunny"
            await pilot.press("ctrl+f")
            await wait_for(pilot, lambda: app.chat_view.last_done is not None, timeout=120, what="the real reply")

    run(main())
    msgs = ChatStore(db_path).messages(chat.id)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    history = settings.messages(conversation(msgs[:3]))
    with edgeinfer.load(default_model_path, n_ctx=2048) as engine:
        expected = engine.chat(history, settings.to_options(), tools=[WEATHER]).result()
    got = app.chat_view.last_done
    assert got.text == expected.text  # (call ids are fresh per reply: calls compare by name and arguments)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in expected.tool_calls]
    assert msgs[-1].content == expected.text and msgs[-1].stats["finish_reason"] == expected.finish_reason
    print(f"\nthe default model after the result: {expected.text!r} {expected.tool_calls}")
