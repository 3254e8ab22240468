"""Pilot tests of the chat flows with the scripted backend: send, stream, cancel, regenerate."""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest

import edgeinfer
from tui_helpers import open_screen, run, say, turns, wait_for

# slow tier: Pilot-driven app tests, about a second of CPU each; the fast tier keeps the widget,
# dialog and snapshot tests
pytestmark = pytest.mark.slow


def _views(app):
    from edgeinfer_tui.widgets import MessageView

    return list(app.chat_view.messages_view.query(MessageView))


def test_send_streams_and_persists(make_app, backend, db_path):
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None, what="first chat")
            await pilot.press(*"hello there")
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(_views(app)) == 2, what="user and assistant views")
            assert app.chat_view.chat_input.text == ""
            backend.gate.release(2)  # two tokens: "Echo:" " hello"
            await wait_for(pilot, lambda: _views(app)[1].content == "Echo: hello", what="partial reply")
            assert app.chat_view.generating
            backend.gate.release(10)
            await wait_for(pilot, lambda: not app.chat_view.generating, what="end of reply")
            reply = _views(app)[1]
            assert reply.content == "Echo: hello there"
            assert reply.markdown.source == "Echo: hello there"  # the final full update
            stats = str(app.chat_screen.query_one("#stats").render())
            assert "3 tokens" in stats and "tok/s" in stats
            msgs = app.store.messages(app.chat_view.chat.id)
            assert [(m.role, m.content) for m in msgs] == [("user", "hello there"), ("assistant", "Echo: hello there")]
            assert msgs[1].stats["finish_reason"] == "eos"
            assert app.chat_view.chat.title == "hello there"
            # what reached the engine: the chat so far, with the chat's sampling settings
            ref, messages, options = backend.calls[-1]
            # (and the default model's measured default system prompt: the chat sets none)
            assert messages == [{"role": "system", "content": edgeinfer.DEFAULT_SYSTEM_PROMPT},
                                {"role": "user", "content": "hello there"}]
            assert options.sampling.temperature == 0.7

    run(main())


def test_newline_keys_do_not_send(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("a", "ctrl+j", "b")
            assert app.chat_view.chat_input.text == "a\nb"
            assert not backend.calls
            await pilot.press("enter")
            await wait_for(pilot, lambda: backend.calls and not app.chat_view.generating)
            assert backend.calls[-1][1][-1]["content"] == "a\nb"

    run(main())


def test_escape_cancels_and_keeps_partial_reply(make_app, backend):
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.text = "one two three four"
            await pilot.press("enter")
            backend.gate.release(2)
            await wait_for(pilot, lambda: len(_views(app)) == 2 and _views(app)[1].content == "Echo: one")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.chat_view.generating, what="cancel")
            reply = _views(app)[1]
            assert reply.content == "Echo: one"
            assert "cancelled" in str(reply.query_one(".note").render())
            msgs = app.store.messages(app.chat_view.chat.id)
            assert msgs[-1].content == "Echo: one" and msgs[-1].stats["finish_reason"] == "cancelled"
            assert "cancelled" in str(app.chat_screen.query_one("#stats").render())
            # a new message works after a cancel
            backend.gate.release(100)
            await pilot.press("x", "enter")
            await wait_for(pilot, lambda: len(_views(app)) == 4 and not app.chat_view.generating)
            assert _views(app)[3].content == "Echo: x"

    run(main())


def test_regenerate_replaces_last_reply(make_app, backend):
    replies = iter(["first answer", "second answer"])
    backend.script = lambda messages, options: [(w, False) for w in next(replies).split(" ")]

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("q", "enter")
            await wait_for(pilot, lambda: len(_views(app)) == 2 and not app.chat_view.generating)
            assert _views(app)[1].content == "firstanswer"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.chat_view.generating)
            await wait_for(pilot, lambda: len(_views(app)) == 2 and _views(app)[1].content == "secondanswer")
            assert [m.content for m in app.store.messages(app.chat_view.chat.id)] == ["q", "secondanswer"]
            assert turns(backend.calls[1][1]) == [{"role": "user", "content": "q"}]

    run(main())


def test_the_stats_line_after_regenerate_gives_a_time_that_reads(make_app, backend):
    """Regenerate reads the prompt from the cache, so the first token comes in milliseconds: the
    status line read "ttft 0.00 s", which looks broken; it says the milliseconds."""

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("q", "enter")
            await wait_for(pilot, lambda: len(backend.calls) == 1 and not app.chat_view.generating)
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.chat_view.generating)
            stats = str(app.chat_screen.query_one("#stats").render())
            assert re.search(r"· ttft (<0\.1|\d+(\.\d)?) ms ·", stats) and "0.00 s" not in stats, stats

    run(main())


def test_copy_reply_and_last_code_block(make_app, backend):
    reply = "Here:\n\n```python\nprint(1)\n```\n\nand\n\n```sh\nls -l\n```\n"
    backend.script = lambda messages, options: [(line, False) for line in reply.splitlines(keepends=True)]

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("c", "enter")
            await wait_for(pilot, lambda: backend.calls and not app.chat_view.generating)
            await pilot.press("f4")
            assert app.clipboard == reply
            await pilot.press("f9")
            assert app.clipboard == "ls -l"

    run(main())


def test_engine_error_is_a_notification_not_a_crash(make_app, backend):
    backend.fail_chat = "the prompt is 5000 tokens but the context holds 4096"

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("x", "enter")
            await wait_for(pilot, lambda: backend.calls and not app.chat_view.generating)
            await pilot.pause()
            assert any("context holds 4096" in n.message for n in app._notifications)
            assert len(_views(app)) == 1  # the empty reply is removed; the question stays
            assert app.is_running

    run(main())


def test_model_load_error_is_shown(make_app, backend):
    backend.fail_load = {"missing:q4": "model missing:q4 is not in the store (see `edgeinfer list`)"}

    async def main():
        app = make_app(model="missing:q4")
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: any("not in the store" in n.message for n in app._notifications))
            assert "not in the store" in str(app.chat_screen.query_one("#stats").render())
            assert app.is_running

    run(main())


WHAT = "making the Q3_K_M self-draft of smollm2-135m-instruct:q4_1"


def _quantizing(backend) -> None:
    from edgeinfer import SpeculationProgress

    backend.preparing = (SpeculationProgress("quantize", WHAT, 0, 200), SpeculationProgress("quantize", WHAT, 90, 200))


def test_speculation_is_prepared_as_soon_as_it_is_chosen(make_app, backend):
    """Choosing self-draft speculation (Ctrl+T) makes the copy at once, its progress on the stats
    line, so the first reply does not sit on 'generating…' while it is quantized."""
    _quantizing(backend)
    backend.prepare_gate = threading.Event()

    async def main():
        app = make_app()
        async with app.run_test(size=(140, 30)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            screen = await open_screen(pilot, "ctrl+t", "SpeculationScreen")
            screen.query_one("#spec-method").value = "self"
            await pilot.press("ctrl+t")
            stats = app.chat_screen.query_one("#stats")
            await wait_for(pilot, lambda: f"{WHAT}: 45 %" in str(stats.render()), what="the preparation's progress")
            backend.prepare_gate.set()
            await wait_for(pilot, lambda: "ready" in str(stats.render()), what="ready")
            assert backend.preparations == [("smollm2-135m-instruct:q4_1", "self")]
            await say(pilot, backend, "hi")
            assert "2 tokens" in str(stats.render())

    run(main())


def test_a_reply_shows_the_preparation_it_waits_for(make_app, backend):
    """A reply whose speculation was not prepared ahead prepares it first: the stats line shows
    how far that is, then the reply's own numbers."""
    from edgeinfer_tui.settings import SpeculationSettings

    _quantizing(backend)
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(140, 30)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.update_chat(settings=replace(view.settings, speculation=SpeculationSettings(method="self")).to_dict())
            view.chat_input.text = "hi"
            await pilot.press("enter")
            stats = app.chat_screen.query_one("#stats")
            await wait_for(pilot, lambda: f"{WHAT}: 45 %" in str(stats.render()), what="the preparation's progress")
            backend.gate.release(10)
            await wait_for(pilot, lambda: not view.generating)
            assert "2 tokens" in str(stats.render()) and WHAT not in str(stats.render())
            assert backend.preparations == []

    run(main())


def test_a_cancelled_reply_is_kept_exactly_as_shown(make_app, backend):
    """The text of a cancelled reply on the screen is the assistant turn the next request sends:
    nothing more (no tokens the screen never showed), nothing less."""
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.chat_input.text = "apples pears plums figs"
            await pilot.press("enter")
            backend.gate.release(3)
            await wait_for(pilot, lambda: len(_views(app)) == 2 and _views(app)[1].content == "Echo: apples pears")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not view.generating, what="cancel")
            shown = _views(app)[1]
            assert shown.content == "Echo: apples pears" and "cancelled" in str(shown.query_one(".note").render())
            backend.gate.release(100)
            view.chat_input.text = "repeat this list"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not view.generating)
            assert turns(backend.calls[1][1]) == [
                {"role": "user", "content": "apples pears plums figs"},
                {"role": "assistant", "content": "Echo: apples pears"},
                {"role": "user", "content": "repeat this list"},
            ]
            # regenerating the answer sends the same history again
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: len(backend.calls) == 3 and not view.generating)
            assert backend.calls[2][1] == backend.calls[1][1]

    run(main())


def test_a_reply_cancelled_before_its_first_token_is_dropped(make_app, backend):
    """Nothing came, so nothing is shown and nothing is kept: no empty assistant turn in the
    history the next request sends."""
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.chat_input.text = "first"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(_views(app)) == 2 and view.active is not None and view.active.generation is not None)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not view.generating, what="cancel")
            await pilot.pause()
            assert [v.role for v in _views(app)] == ["user"]
            assert [m.role for m in app.store.messages(view.chat.id)] == ["user"]
            assert "cancelled" in str(app.chat_screen.query_one("#stats").render())
            backend.gate.release(100)
            view.chat_input.text = "second"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not view.generating)
            assert turns(backend.calls[1][1]) == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]

    run(main())


def test_a_model_without_a_chat_template_is_said(make_app, backend):
    """A base model (no chat template) is chatted with through ChatML, which it never learned: the
    app says so when the model is loaded instead of leaving the user to wonder at its replies."""
    backend.no_template = {"smollm2-135m-instruct:q4_1"}

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: any("no chat template" in n.message for n in app._notifications),
                           what="the note")
            note = next(n for n in app._notifications if "no chat template" in n.message)
            assert note.severity == "warning" and "smollm2-135m-instruct:q4_1" in note.message

    run(main())
