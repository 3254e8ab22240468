"""A new user's first hour in the chat UI (issue 26): the footer at common widths, the settings
dialog at 40 rows, the dialogs' keys, settings that stay with their chat, Ctrl+Q during a reply,
prompt progress, the default model's note and system prompt."""

from __future__ import annotations

import threading

import pytest

import edgeinfer
from edgeinfer import PrefillProgress
from tui_helpers import open_screen, run, say, wait_for

pytestmark = pytest.mark.slow  # Pilot-driven app tests


def _footer_keys(app) -> dict[str, tuple[int, int]]:
    """Footer key display → (left, right) column of each key the footer shows."""
    from textual.widgets._footer import FooterKey

    return {k.key_display: (k.region.x, k.region.right) for k in app.screen.query(FooterKey) if k.region.width}


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_footer_shows_every_main_key_whole(make_app, backend, width):
    """Ctrl+L, F1 and Ctrl+Q were hidden or cut off at 80-120 columns; now every key the footer
    offers lies inside the screen, idle and while a reply streams (Esc to cancel it)."""
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(width, 24)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None and "^q" in _footer_keys(app))
            keys = _footer_keys(app)
            for key in ("^n", "^o", "^s", "^t", "^l", "^r", "f1", "^q"):
                assert key in keys and keys[key][1] <= width, (key, keys)
            assert "esc" not in keys  # nothing to cancel
            app.chat_view.chat_input.text = "hi"
            await pilot.press("enter")
            await wait_for(pilot, lambda: "esc" in _footer_keys(app), what="Esc while the reply streams")
            keys = _footer_keys(app)
            for key in ("esc", "^l", "f1", "^q"):
                assert key in keys and keys[key][1] <= width, (key, keys)
            backend.gate.release(10)
            await wait_for(pilot, lambda: not app.chat_view.generating and "esc" not in _footer_keys(app))

    run(main())


@pytest.mark.parametrize("size", [(110, 40), (80, 40), (80, 24)])
def test_settings_dialog_title_label_and_buttons_in_view(make_app, size):
    async def main():
        app = make_app()
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            await pilot.pause()
            width, height = size
            for selector in ("#settings-title", "#system-label", "#system", "#save", "#cancel"):
                region = screen.query_one(selector).region
                assert region.height and region.y >= 0 and region.bottom <= height and region.right <= width, selector
            assert "Chat settings" in str(screen.query_one("#settings-title").render())
            label = str(screen.query_one("#system-label").render())
            assert label.startswith("System prompt") and "default" in label
            # the default model's default prompt shows (grey) in the empty box
            assert screen.query_one("#system").placeholder == edgeinfer.DEFAULT_SYSTEM_PROMPT

    run(main())


def test_speculation_panel_applies_with_its_own_key_not_the_settings_key(make_app):
    """The panel said "Ctrl+S: apply" while Ctrl+S is the Settings key: it applies with Ctrl+T, the
    key that opened it, and says so; Ctrl+S there does nothing."""

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 32)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+t", "SpeculationScreen")
            title = str(screen.query_one(".title").render())
            assert "Ctrl+T: apply" in title and "Ctrl+S" not in title
            screen.query_one("#spec-method").value = "lookup"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.screen is screen and app.chat_view.settings.speculation.method == "off"
            await pilot.press("ctrl+t")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.chat_view.settings.speculation.method == "lookup"

    run(main())


def test_settings_saved_for_a_chat_stay_with_it(make_app, backend):
    async def main():
        app = make_app()
        async with app.run_test(size=(110, 40)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            screen.query_one("#system").text = "You are a pirate."
            screen.query_one("#set-temperature").value = "0"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            first = view.chat.id
            assert view.settings.temperature == 0
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: view.chat.id != first)
            from edgeinfer_tui.settings import ChatSettings

            assert view.settings == ChatSettings()  # "saved for this chat": not for the next one
            await say(pilot, backend, "hi")
            _, messages, options = backend.calls[-1]
            assert messages[0] == {"role": "system", "content": edgeinfer.DEFAULT_SYSTEM_PROMPT}
            assert options.sampling.temperature == edgeinfer.DEFAULT_SAMPLING.temperature
            app.chat_screen.open_chat(first)  # the first chat kept its own
            assert view.settings.temperature == 0 and view.settings.system_prompt == "You are a pirate."

    run(main())


def test_ctrl_q_during_a_reply_asks_before_discarding_it(make_app, backend):
    backend.gate = threading.Semaphore(0)

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 32)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.chat_input.text = "hello there"
            await pilot.press("enter")
            backend.gate.release(1)
            await wait_for(pilot, lambda: view.generating and view.active.n_tokens == 1)
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
            assert "discard" in str(app.screen.query_one(".title").render())
            await pilot.press("n")  # keep it: the reply goes on
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.return_code is None and view.generating
            backend.gate.release(2)  # the reply's other two tokens
            await wait_for(pilot, lambda: not view.generating)
            assert app.store.messages(view.chat.id)[-1].content == "Echo: hello there"
            view.chat_input.text = "again"
            await pilot.press("enter")
            await wait_for(pilot, lambda: view.generating)
            await pilot.press("ctrl+q", "y")
            await wait_for(pilot, lambda: app.return_code is not None, what="the app to quit")

    run(main())


def test_ctrl_q_when_idle_quits_at_once(make_app):
    async def main():
        app = make_app()
        async with app.run_test(size=(110, 32)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None, what="the app to quit")

    run(main())


def test_a_long_prompt_shows_its_progress_before_the_first_token(make_app, backend):
    """A chat read again after a settings change showed only "generating…" for seconds: the
    engine's PrefillProgress events show as tokens read of the prompt's total."""
    backend.gate = threading.Semaphore(0)
    backend.prefill = (PrefillProgress(512, 1300), PrefillProgress(1024, 1300), PrefillProgress(1300, 1300))

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 32)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None)
            view.chat_input.text = "summarize all that"
            await pilot.press("enter")
            stats = app.chat_screen.query_one("#stats")
            await wait_for(pilot, lambda: "generating" in str(stats.render()))
            for done, percent in ((512, 39), (1024, 78)):
                backend.gate.release(1)
                await wait_for(pilot, lambda d=done: f"reading the prompt: {d}/1300 tokens" in str(stats.render()),
                               what=f"{done}/1300")
                assert f"({percent} %)" in str(stats.render())
            backend.gate.release(20)
            await wait_for(pilot, lambda: not view.generating)
            assert "reading the prompt" not in str(stats.render())

    run(main())


def test_the_default_model_says_it_is_tiny_and_how_to_get_a_real_one(make_app, backend):
    backend.gate = None

    async def main():
        app = make_app()
        async with app.run_test(size=(110, 32)) as pilot:
            view = app.chat_view
            await wait_for(pilot, lambda: view.chat is not None and view.query(".first-note"))
            note = view.query_one(".first-note").source
            assert "tiny" in note and f"edgeinfer pull {edgeinfer.RECOMMENDED_MODEL}" in note
            await say(pilot, backend, "hi")
            await wait_for(pilot, lambda: not view.query(".first-note"))
            assert backend.calls[-1][1][0] == {"role": "system", "content": edgeinfer.DEFAULT_SYSTEM_PROMPT}
            # another model: no note, and its own template's default (no system message from us)
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: view.query(".first-note"))
            view.update_chat(model="qwen2.5-coder-1.5b-instruct:q4_k_m")
            await wait_for(pilot, lambda: not view.query(".first-note"))
            backend.models.append(backend.models[0].__class__(ref="qwen2.5-coder-1.5b-instruct:q4_k_m"))
            await say(pilot, backend, "hello")
            assert [m["role"] for m in backend.calls[-1][1]] == ["user"]

    run(main())
