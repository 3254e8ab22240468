"""Pilot tests of the chat flows with the scripted backend: send, stream, cancel, regenerate."""

from __future__ import annotations

import threading

from tui_helpers import run, wait_for


def _views(app):
    from edgeinfer_tui.widgets import MessageView

    return list(app.messages_view.query(MessageView))


def test_send_streams_and_persists(make_app, backend, db_path):
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="first chat")
            await pilot.press(*"hello there")
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(_views(app)) == 2, what="user and assistant views")
            assert app.chat_input.text == ""
            backend.gate.release(2)  # two tokens: "Echo:" " hello"
            await wait_for(pilot, lambda: _views(app)[1].content == "Echo: hello", what="partial reply")
            assert app.generating
            backend.gate.release(10)
            await wait_for(pilot, lambda: not app.generating, what="end of reply")
            reply = _views(app)[1]
            assert reply.content == "Echo: hello there"
            assert reply.markdown.source == "Echo: hello there"  # the final full update
            stats = str(app.chat_screen.query_one("#stats").render())
            assert "3 tokens" in stats and "tok/s" in stats
            msgs = app.store.messages(app.chat.id)
            assert [(m.role, m.content) for m in msgs] == [("user", "hello there"), ("assistant", "Echo: hello there")]
            assert msgs[1].stats["finish_reason"] == "eos"
            assert app.chat.title == "hello there"
            # what reached the engine: the chat so far, with the chat's sampling settings
            ref, messages, options = backend.calls[-1]
            assert messages == [{"role": "user", "content": "hello there"}]
            assert options.sampling.temperature == 0.7

    run(main())


def test_newline_keys_do_not_send(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None)
            await pilot.press("a", "ctrl+j", "b")
            assert app.chat_input.text == "a\nb"
            assert not backend.calls
            await pilot.press("enter")
            await wait_for(pilot, lambda: backend.calls and not app.generating)
            assert backend.calls[-1][1][-1]["content"] == "a\nb"

    run(main())


def test_escape_cancels_and_keeps_partial_reply(make_app, backend):
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None)
            app.chat_input.text = "one two three four"
            await pilot.press("enter")
            backend.gate.release(2)
            await wait_for(pilot, lambda: len(_views(app)) == 2 and _views(app)[1].content == "Echo: one")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, what="cancel")
            reply = _views(app)[1]
            assert reply.content == "Echo: one"
            assert "cancelled" in str(reply.query_one(".note").render())
            msgs = app.store.messages(app.chat.id)
            assert msgs[-1].content == "Echo: one" and msgs[-1].stats["finish_reason"] == "cancelled"
            assert "cancelled" in str(app.chat_screen.query_one("#stats").render())
            # a new message works after a cancel
            backend.gate.release(100)
            await pilot.press("x", "enter")
            await wait_for(pilot, lambda: len(_views(app)) == 4 and not app.generating)
            assert _views(app)[3].content == "Echo: x"

    run(main())


def test_regenerate_replaces_last_reply(make_app, backend):
    replies = iter(["first answer", "second answer"])
    backend.script = lambda messages, options: [(w, False) for w in next(replies).split(" ")]

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None)
            await pilot.press("q", "enter")
            await wait_for(pilot, lambda: len(_views(app)) == 2 and not app.generating)
            assert _views(app)[1].content == "firstanswer"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.generating)
            await wait_for(pilot, lambda: len(_views(app)) == 2 and _views(app)[1].content == "secondanswer")
            assert [m.content for m in app.store.messages(app.chat.id)] == ["q", "secondanswer"]
            assert backend.calls[1][1] == [{"role": "user", "content": "q"}]

    run(main())


def test_copy_reply_and_last_code_block(make_app, backend):
    reply = "Here:\n\n```python\nprint(1)\n```\n\nand\n\n```sh\nls -l\n```\n"
    backend.script = lambda messages, options: [(line, False) for line in reply.splitlines(keepends=True)]

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None)
            await pilot.press("c", "enter")
            await wait_for(pilot, lambda: backend.calls and not app.generating)
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
            await wait_for(pilot, lambda: app.chat is not None)
            await pilot.press("x", "enter")
            await wait_for(pilot, lambda: backend.calls and not app.generating)
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
