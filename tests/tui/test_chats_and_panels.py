"""Pilot tests: several chats (switch, persist, rename, delete, export), model picker, settings,
speculation panel and drafted-token colouring, help, command palette, remapped keys."""

from __future__ import annotations

import pytest
from tui_helpers import open_screen, run, say, turns, wait_for

# slow tier: Pilot-driven app tests, about a second of CPU each; the fast tier keeps the widget,
# dialog and snapshot tests
pytestmark = pytest.mark.slow


def _views(app):
    from edgeinfer_tui.widgets import MessageView

    return list(app.chat_view.messages_view.query(MessageView))


def _items(app):
    from edgeinfer_tui.widgets import ChatListItem

    return list(app.chat_screen.query(ChatListItem))


def test_chat_model_opens_a_new_chat_for_that_model_and_the_last_is_one_key_away(make_app, backend, db_path):
    """`edgeinfer chat MODEL` used to reopen the last chat and send its whole history to MODEL."""
    from edgeinfer_tui.chat_store import ChatStore

    store = ChatStore(db_path)
    last = store.create_chat(title="About France", model="smollm2-135m-instruct:q4_1")
    store.add_message(last.id, "user", "What is the capital of France?")
    store.add_message(last.id, "assistant", "Paris.")
    store.close()

    async def main():
        app = make_app(model="smollm2-135m-instruct:q8_0")
        async with app.run_test(size=(100, 30)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None and backend.loads)
            assert view.chat.id != last.id and view.model_ref == "smollm2-135m-instruct:q8_0" and _views(app) == []
            assert backend.loads == ["smollm2-135m-instruct:q8_0"]
            assert [i.title for i in _items(app)][1:] == ["About France"]
            assert any("ctrl+b goes back to your last chat" in n.message for n in app._notifications)
            assert app.store.get_chat(last.id).model == "smollm2-135m-instruct:q4_1"  # the last chat keeps its model
            await say(pilot, backend, "hello")
            assert turns(backend.calls[-1][1]) == [{"role": "user", "content": "hello"}]  # no history sent along
            new = view.chat.id
            await pilot.press("ctrl+b")  # the last chat, one key away
            await wait_for(pilot, lambda: view.chat.id == last.id)
            assert [v.content for v in _views(app)] == ["What is the capital of France?", "Paris."]
            await pilot.press("ctrl+b")  # and back
            await wait_for(pilot, lambda: view.chat.id == new)

    run(main())


def test_chat_model_with_an_empty_last_chat_uses_it(make_app, backend, db_path):
    from edgeinfer_tui.chat_store import ChatStore

    store = ChatStore(db_path)
    empty = store.create_chat(model="smollm2-135m-instruct:q4_1")
    store.close()

    async def main():
        app = make_app(model="smollm2-135m-instruct:q8_0")
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None and backend.loads)
            assert app.chat_view.chat.id == empty.id and len(_items(app)) == 1  # no empty chats pile up
            assert app.chat_view.model_ref == "smollm2-135m-instruct:q8_0"

    run(main())


def test_switch_chats_and_persist_across_restart(make_app, backend):
    async def first_session():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await say(pilot, backend, "alpha")
            first = app.chat_view.chat.id
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: app.chat_view.chat.id != first)
            assert _views(app) == []
            await say(pilot, backend, "beta")
            assert [i.title for i in _items(app)] == ["beta", "alpha"]
            # switch back through the sidebar
            lst = app.chat_screen.query_one("#chats")
            lst.focus()
            await pilot.press("down", "enter")
            await wait_for(pilot, lambda: app.chat_view.chat.id == first)
            await wait_for(pilot, lambda: [v.content for v in _views(app)] == ["alpha", "Echo: alpha"])
            # the history sent to the model is this chat's only
            await say(pilot, backend, "again")
            assert [m["content"] for m in turns(backend.calls[-1][1])] == ["alpha", "Echo: alpha", "again"]

    async def second_session():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None and len(_views(app)) == 4)
            assert app.chat_view.chat.title == "alpha"  # the most recently updated chat opens
            assert [v.content for v in _views(app)] == ["alpha", "Echo: alpha", "again", "Echo: again"]
            assert [i.title for i in _items(app)] == ["alpha", "beta"]

    run(first_session())
    run(second_session())


def test_rename_delete_export(make_app, backend, edgeinfer_home):
    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await say(pilot, backend, "hello")
            await pilot.press("f2")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "PromptScreen")
            app.screen.query_one("#prompt-input").value = "Greetings"
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.chat_view.chat.title == "Greetings")
            assert _items(app)[0].title == "Greetings"
            await pilot.press("f3")
            export = edgeinfer_home / "exports" / f"chat-{app.chat_view.chat.id}.md"
            await wait_for(pilot, export.exists)
            text = export.read_text()
            assert text.startswith("# Greetings\n") and "## User\n\nhello" in text and "## Assistant\n\nEcho: hello" in text
            doomed = app.chat_view.chat.id
            await pilot.press("f8")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
            await pilot.press("y")
            await wait_for(pilot, lambda: app.chat_view.chat is not None and app.chat_view.chat.id != doomed)
            assert all(c.id != doomed for c in app.store.list_chats())
            assert [i.chat_id for i in _items(app)] == [app.chat_view.chat.id]

    run(main())


def test_pick_model_mid_chat(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None and backend.loads)
            await say(pilot, backend, "hi")
            assert backend.calls[-1][0] == "smollm2-135m-instruct:q4_1"
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPickerScreen")
            table = app.screen.query_one("#models")
            await wait_for(pilot, lambda: table.row_count == 3, what="model rows")
            row = [str(c) for c in table.get_row_at(1)]
            assert row[:5] == ["smollm2-135m-instruct:q8_0", "Q8_0", "145.0 MB", "8.50", "0.0040"]
            assert row[5:] == ["96.6 %", "122.0", "yes"]
            await pilot.press("down", "enter")
            await wait_for(pilot, lambda: app.chat_view.chat.model == "smollm2-135m-instruct:q8_0")
            await wait_for(pilot, lambda: backend.loads[-1] == "smollm2-135m-instruct:q8_0")
            assert "q8_0" in app.sub_title
            await say(pilot, backend, "again")
            ref, messages, _ = backend.calls[-1]
            assert ref == "smollm2-135m-instruct:q8_0"
            assert [m["content"] for m in turns(messages)] == ["hi", "Echo: hi", "again"]  # the same chat continues

    run(main())


def test_settings_modal_validates_and_applies(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            screen.query_one("#system").text = "You are terse."
            screen.query_one("#set-temperature").value = "-1"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: "temperature must be >= 0" in str(screen.query_one("#settings-error").render()))
            screen.query_one("#set-temperature").value = "0"
            screen.query_one("#set-seed").value = "42"
            screen.query_one("#set-max_tokens").value = "64"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.store.get_chat(app.chat_view.chat.id).settings["temperature"] == 0
            await say(pilot, backend, "hi")
            _, messages, options = backend.calls[-1]
            assert messages[0] == {"role": "system", "content": "You are terse."}
            assert options.sampling.temperature == 0 and options.sampling.seed == 42 and options.max_tokens == 64

    run(main())


def test_speculation_panel_stats_and_drafted_colouring(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "SpeculationScreen")
            app.screen.query_one("#spec-method").value = "lookup"
            app.screen.query_one("#spec-k").value = "8"
            app.screen.query_one("#spec-show").value = True
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.chat_view.settings.speculation.method == "lookup" and app.chat_view.show_drafted
            assert "speculation: lookup, drafts up to 8 tokens" in app.sub_title
            await say(pilot, backend, "a b c d e")
            _, _, options = backend.calls[-1]
            assert options.speculation.method == "lookup" and options.speculation.draft_max == 8
            stats = str(app.chat_screen.query_one("#stats").render())
            assert "lookup 67% accepted, mean 2.0" in stats  # 4 of 6 drafted accepted, 2 steps
            reply = _views(app)[-1]
            # tokens 1,2 and 4,5 were drafted: " a b" and " d e"
            assert reply.content == "Echo: a b c d e"
            assert reply.drafted == [(5, 9), (11, 15)]
            view = reply.query_one(".drafted-view")
            assert view.display and not reply.markdown.display
            spans = [(s.start, s.end) for s in view.render().spans]
            assert spans == [(5, 9), (11, 15)]
            assert app.store.messages(app.chat_view.chat.id)[-1].drafted == [(5, 9), (11, 15)]
            await pilot.press("ctrl+g")
            assert not app.chat_view.show_drafted and reply.markdown.display and not view.display

    run(main())


def test_speculation_draft_requires_a_model(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+t", "SpeculationScreen")
            screen.query_one("#spec-method").value = "draft"
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: "needs a draft model" in str(screen.query_one("#spec-error").render()))
            screen.query_one("#spec-draft").value = "smollm2-135m-instruct:q4_k_m"
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.chat_view.settings.speculation.draft_model == "smollm2-135m-instruct:q4_k_m"

    run(main())


def test_help_palette_and_remapped_keys(make_app, backend, tmp_path):
    from edgeinfer_tui.config import load_config

    cfg_file = tmp_path / "tui.toml"
    cfg_file.write_text('[keys]\nnew_chat = "f12"\nsend = "ctrl+s"\nbogus = "x"\n')
    config = load_config(cfg_file)
    assert config.keys == {"new_chat": "f12", "send": "ctrl+s"} and "bogus" in config.error

    async def main():
        app = make_app(config=config)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            assert any("bogus" in n.message for n in app._notifications)
            first = app.chat_view.chat.id
            await pilot.press("f12")
            await wait_for(pilot, lambda: app.chat_view.chat.id != first, what="remapped new chat")
            await pilot.press("h", "enter", "i")
            assert app.chat_view.chat_input.text == "h\ni"  # enter is no longer send
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: backend.calls and not app.chat_view.generating)
            await pilot.press("f1")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
            source = app.screen.query_one("Markdown").source
            assert "`f12` | Start a new chat" in source and "`ctrl+s` | Send the message" in source
            await pilot.press("escape")
            commands = [c.title for c in app.get_system_commands(app.screen)]
            for title in ("New chat", "Pick model", "Speculation", "Regenerate", "Manage", "Export", "Help"):
                assert title in commands

    run(main())
