"""Chats that resume (tui/sessions.py): the chat the engine holds is saved beside the history when
another chat takes the engine, when the model is replaced and when the app quits; a chat's saved
cache is restored when it is reopened, and the stats line says so. First with the scripted engine
(exact calls), then end to end with the real default model: the app restarted, the next reply
reads only the new message and is the library's own greedy reply to the whole history."""

from __future__ import annotations

import pytest
from tui_helpers import run, say, wait_for

pytestmark = pytest.mark.slow

LONG = "Please remember this note for later: " + " ".join(f"word{i}" for i in range(30))


def _stats(app) -> str:
    return str(app.chat_screen.query_one("#stats").render())


def _saves(backend) -> list[tuple[str, str, list]]:
    return [(model, name, convo) for kind, model, name, convo in backend.session_calls if kind == "save"]


def _restores(backend) -> list[tuple[str, str]]:
    return [(model, name) for kind, model, name, _ in backend.session_calls if kind == "restore"]


async def _a_chat_then_a_new_one(pilot, app, backend) -> int:
    """Say LONG in the open chat, then open a new chat; the first chat's id."""
    await wait_for(pilot, lambda: app.chat_view.chat is not None)
    await say(pilot, backend, LONG)
    first = app.chat_view.chat.id
    await pilot.press("ctrl+n")
    await wait_for(pilot, lambda: app.chat_view.chat.id != first)
    return first


def test_switching_chats_saves_the_one_left_and_restores_the_one_opened(make_app, backend, db_path):
    folder = db_path.parent / "chat-sessions"

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            first = await _a_chat_then_a_new_one(pilot, app, backend)
            await wait_for(pilot, lambda: len(_saves(backend)) == 1, what="the chat left is saved")
            model, name, convo = _saves(backend)[0]
            assert name == f"chat-{first}.kv" and (folder / name).is_file()
            assert convo[-2:] == [{"role": "user", "content": LONG}, {"role": "assistant", "content": f"Echo: {LONG}"}]
            await say(pilot, backend, LONG + " second")
            second = app.chat_view.chat.id
            # back to the first chat: the second is saved, the first restored, and the stats line says so
            app.chat_screen.open_chat(first)
            await wait_for(pilot, lambda: "resumed" in _stats(app), what="the resumed note")
            n = sum(len(m["content"]) for m in convo if m["role"] != "system") // 4  # the fake's tokens
            assert f"ready · resumed ({n} tokens cached)" in _stats(app)
            assert [n for _, n, _ in _saves(backend)] == [f"chat-{first}.kv", f"chat-{second}.kv"]
            assert _restores(backend) == [(model, f"chat-{first}.kv")]
            # its next message needs no restore (the engine holds it) and is answered as before
            await say(pilot, backend, "next")
            assert _restores(backend) == [(model, f"chat-{first}.kv")]
            # deleting a chat deletes its saved cache
            app.chat_screen.open_chat(second)
            await wait_for(pilot, lambda: len(_restores(backend)) == 2, what="the second chat restored")
            await pilot.press("f8")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
            await pilot.press("y")
            await wait_for(pilot, lambda: app.chat_view.chat.id == first, what="the chat deleted")
            assert not (folder / f"chat-{second}.kv").exists()
        return first

    first = {}

    async def runner():
        first["id"] = await main()

    run(runner())
    # quitting saved the chat the engine held (the first, with its last reply)
    model, name, convo = _saves(backend)[-1]
    assert name == f"chat-{first['id']}.kv" and convo[-1] == {"role": "assistant", "content": "Echo: next"}
    assert sorted(p.name for p in (db_path.parent / "chat-sessions").iterdir()) == [name]


def test_a_restarted_app_resumes_the_open_chat_once_the_model_is_ready(make_app, backend, db_path):
    async def first_run():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await say(pilot, backend, LONG)

    async def second_run():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "resumed" in _stats(app), what="the resumed note after a restart")
            await say(pilot, backend, "and then?")
            return app.chat_view.chat.id

    run(first_run())
    assert len(_saves(backend)) == 1  # at quit: nothing is saved while the chat stays open
    holder = {}

    async def runner():
        holder["id"] = await second_run()

    run(runner())
    assert _restores(backend) == [(backend.default_ref(), f"chat-{holder['id']}.kv")]


def test_another_model_for_the_chat_saves_it_first_and_refuses_the_old_state(make_app, backend, db_path):
    """The model is replaced: the chat it held is saved before it closes. The chat, now on another
    model, does not get the other model's state (the engine refuses it: the fake checks the model)."""
    other = backend.models[1].ref

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await say(pilot, backend, LONG)
            app.chat_view.update_chat(model=other)
            await say(pilot, backend, "on the other model")
            assert "resumed" not in _stats(app)

    run(main())
    saves = _saves(backend)
    assert saves[0][0] == backend.default_ref() and saves[-1][0] == other
    assert [m for m, _ in _restores(backend)] == [other]  # tried once, refused: the reply read it all


def test_a_state_folder_that_cannot_be_written_is_no_error_in_the_chat(make_app, backend, db_path):
    (db_path.parent / "chat-sessions").write_text("a file where the folder should be")

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await _a_chat_then_a_new_one(pilot, app, backend)
            await say(pilot, backend, "still works")
            assert app.chat_view.last_done.text == "Echo: still works"

    run(main())


def _notes() -> str:
    """About 900 tokens of text that does not repeat itself."""
    towns = ["Lyon", "Porto", "Graz", "Turku", "Split", "Ghent", "Bergen", "Cork", "Brno", "Pisa"]
    lines = [f"Item {i}: the crate from {towns[i % 10]} weighs {17 * i % 97 + 3} kg and leaves on day {i * 7 % 31 + 1}."
             for i in range(1, 46)]
    return "Shipping notes for this week.\n" + "\n".join(lines) + "\n\nWhich town does item 3 come from?"


def test_real_model_chat_resumes_after_the_app_restarted(default_model_copy, db_path):
    """The real default model (its F16 copy: comparable across batch shapes): a ~1k-token chat,
    the app quit and started again; the stats line says the chat resumed, the next reply's prompt
    reads only the new message, and the reply is the library's own greedy reply to the whole
    history (a fresh engine that reads it all), or parts from it only at a near-tie."""
    from greedy_compare import assert_same_or_near_tie

    import edgeinfer
    from edgeinfer.engine.state.session import read_trailer
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.backend import LibraryBackend
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.config import TuiConfig
    from edgeinfer_tui.settings import ChatSettings

    model = str(default_model_copy("F16"))
    settings = ChatSettings(temperature=0.0, max_tokens=16, system_prompt="You are a helpful assistant.")
    store = ChatStore(db_path)
    chat_id = store.create_chat(model=model, settings=settings.to_dict()).id
    store.close()

    def app(asked: str | None = None) -> EdgeInferApp:
        """`edgeinfer chat` (the last chat, with its model) or `edgeinfer chat MODEL` (a new chat once
        the last has messages)."""
        return EdgeInferApp(LibraryBackend(edgeinfer.LoadOptions(n_ctx=2048)), model=asked, db_path=db_path,
                            config=TuiConfig())

    async def first_run():
        a = app(model)
        async with a.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: a.chat_view.chat is not None)
            a.chat_view.chat_input.text = _notes()
            await pilot.press("enter")
            await wait_for(pilot, lambda: a.chat_view.last_done is not None, timeout=180, what="the first reply")

    out = {}

    async def second_run():
        a = app()
        async with a.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "resumed" in _stats(a), timeout=120, what="the resumed note")
            out["note"] = _stats(a)
            a.chat_view.chat_input.text = "And how heavy is item 5?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: a.chat_view.last_done is not None, timeout=180, what="the next reply")
            out["done"] = a.chat_view.last_done

    run(first_run())
    saved = db_path.parent / "chat-sessions" / f"chat-{chat_id}.kv"
    assert saved.is_file()
    n_saved = read_trailer(saved)["n_tokens"]
    assert n_saved > 900
    run(second_run())
    assert f"resumed ({n_saved} tokens cached)" in out["note"]
    done = out["done"]
    assert done.stats.cached_tokens == n_saved and done.stats.prompt_tokens - n_saved < 40
    store = ChatStore(db_path)
    turns = [(m.role, m.content) for m in store.messages(chat_id) if m.role in ("user", "assistant")]
    store.close()
    assert turns[-1] == ("assistant", done.text)
    history = settings.messages(turns[:-1], model)
    with edgeinfer.load(model, n_ctx=2048) as fresh:
        reference = fresh.chat(history, settings.to_options()).result()
        assert reference.stats.cached_tokens == 0
        assert_same_or_near_tie(fresh, fresh.chat_tokens(history), reference.tokens, done.tokens)
