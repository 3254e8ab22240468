"""One widget at a time in a host app; the chat store's migrations; the CLI without textual."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import pytest
from host_app import HostApp
from tui_helpers import run, wait_for


def test_message_view_streams_markdown_and_keeps_everything():
    from edgeinfer_tui.widgets import MessageView

    view = MessageView("assistant")
    app = HostApp(view)

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            pieces = ["# Ti", "tle\n\n```py", "thon\nx = 1\n", "```\n\nend"]
            for i, p in enumerate(pieces):
                await view.append(p, [(0, len(p))] if i == 1 else [])
            await view.finish()
            await pilot.pause()
            assert view.content == "".join(pieces)
            assert view.markdown.source == view.content  # the final full update
            assert view.drafted == [(4, 14)]
            assert view.query("MarkdownFence")  # the code block is a highlighted fence
            view.set_show_drafted(True)
            await pilot.pause()
            text = view.query_one(".drafted-view").render()
            assert text.plain == view.content and [(s.start, s.end) for s in text.spans] == [(4, 14)]

    run(main())


def test_chat_input_enter_sends_ctrl_j_breaks_line():
    from edgeinfer_tui.widgets import ChatInput

    box = ChatInput(send_keys=["enter"], newline_keys=["shift+enter", "ctrl+j"])
    app = HostApp(box)

    async def main():
        async with app.run_test() as pilot:
            box.focus()
            await pilot.press("a", "ctrl+j", "b", "shift+enter", "c", "enter")
            await wait_for(pilot, lambda: app.messages)
            assert app.messages[0].text == "a\nb\nc"

    run(main())


def test_last_code_block_and_spans():
    from edgeinfer_tui.widgets import last_code_block, merge_spans

    assert last_code_block("no code") is None
    assert last_code_block("```\na\n```\ntext\n~~~sh\nb\nc\n~~~\n") == "b\nc"
    assert last_code_block("```py\nfirst\n```\n```py\nstill open") == "still open"
    spans: list[tuple[int, int]] = []
    for a, b in [(0, 2), (2, 5), (7, 8), (8, 8)]:
        merge_spans(spans, a, b)
    assert spans == [(0, 5), (7, 8)]


@pytest.mark.slow
def test_view_does_not_jump_while_the_user_scrolls_back(make_app, backend):
    from edgeinfer_tui.widgets import MessageView

    backend.gate = threading.Semaphore(0)
    backend.script = lambda messages, options: [(f"line {i}\n\n", False) for i in range(60)]

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.text = "long please"
            await pilot.press("enter")
            backend.gate.release(30)
            view = app.chat_view.messages_view
            await wait_for(pilot, lambda: "line 29" in list(view.query(MessageView))[-1].content)
            await wait_for(pilot, lambda: view.max_scroll_y > 10 and view.scroll_y == view.max_scroll_y)
            view.scroll_home(animate=False)  # the user scrolls back (releases the anchor)
            await wait_for(pilot, lambda: view.scroll_y == 0)
            backend.gate.release(100)
            await wait_for(pilot, lambda: not app.chat_view.generating)
            await pilot.pause()
            assert view.scroll_y == 0  # still where the user is reading
            # sending again follows the new reply to the bottom
            backend.script = lambda messages, options: [("ok", False)]
            app.chat_view.chat_input.text = "thanks"
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.chat_view.generating and backend.calls and backend.calls[-1][1][-1]["content"] == "thanks")
            await wait_for(pilot, lambda: view.scroll_y == view.max_scroll_y)

    run(main())


def test_migrations_upgrade_an_old_database(tmp_path):
    from edgeinfer_tui.chat_store import MIGRATIONS, ChatStore, m001_initial, migrate

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    assert migrate(db, [m001_initial]) == ["m001_initial"]  # a database from the first version
    db.execute("INSERT INTO chats (title, model, created, updated) VALUES ('kept', NULL, 'x', 'x')")
    db.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'user', 'hello', 'x')")
    db.commit()
    db.close()

    store = ChatStore(path)  # applies the rest, keeps the data
    names = [r[0] for r in store.db.execute("SELECT name FROM _migrations ORDER BY rowid")]
    assert names == [fn.__name__ for fn in MIGRATIONS]
    chat = store.get_chat(1)
    assert chat.title == "kept" and chat.settings == {}
    assert [(m.role, m.content, m.drafted) for m in store.messages(1)] == [("user", "hello", [])]
    assert migrate(store.db) == []  # idempotent
    # deleting a chat deletes its messages
    store.delete_chat(1)
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    store.close()


def test_store_lives_in_edgeinfer_home(edgeinfer_home):
    from edgeinfer_tui.chat_store import ChatStore

    store = ChatStore()
    assert store.path == edgeinfer_home / "chats.sqlite3" and store.path.exists()
    store.close()


@pytest.mark.slow  # a subprocess that imports the CLI
def test_cli_without_textual_is_one_line_error():
    code = (
        "import sys; sys.modules['textual'] = None\n"  # as if textual were not installed
        "from edgeinfer.cli import main\n"
        "sys.exit(main(['chat']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "edgeinfer: error: the chat UI needs textual: pip install 'edgeinfer[tui]'"


@pytest.mark.slow  # a subprocess that imports the CLI
def test_cli_unknown_model_is_one_line_error(edgeinfer_home):
    proc = subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "no-such-model:q4"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("edgeinfer: error: model no-such-model:q4 is not in the store")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_stats_line_says_when_a_drafter_switched_itself_off():
    from edgeinfer import GenerationStats, SpeculationStats
    from edgeinfer_tui.live_stats import LiveStats

    stats = GenerationStats(prompt_tokens=12, generated_tokens=11, decode_s=0.5)
    stats.speculation = SpeculationStats(method="self=Q3_K_M", plain_steps=10,
                                         note="self=Q3_K_M off: a drafted token costs 0.71 target steps")
    line = LiveStats.of(stats, 0.0).line("smollm2")
    assert line.startswith("11 tokens · 20.0 tok/s · self=Q3_K_M off ·") and "accepted" not in line
    stats.speculation.note = ""
    assert "· self=Q3_K_M ·" in LiveStats.of(stats, 0.0).line("smollm2")


def test_stats_line_times_read_at_every_scale():
    """A first token in milliseconds (a cached prompt) reads as such, never as "0.00 s"."""
    from edgeinfer import GenerationStats
    from edgeinfer_tui.live_stats import LiveStats, duration_text

    assert [duration_text(s) for s in (1.234, 0.12, 0.0042, 0.00002)] == ["1.23 s", "120 ms", "4.2 ms", "<0.1 ms"]
    cached = GenerationStats(prompt_tokens=40, cached_tokens=39, generated_tokens=5, ttft_s=0.0042, decode_s=0.1)
    assert "· ttft 4.2 ms (prompt cached) ·" in LiveStats.of(cached).line("m")
    fresh = GenerationStats(prompt_tokens=40, cached_tokens=0, generated_tokens=5, ttft_s=1.5, decode_s=0.1)
    assert "· ttft 1.50 s ·" in LiveStats.of(fresh).line("m")
