"""The dialogs through their widgets' state: what has the focus when one opens, what Enter does,
labels that do not run into their fields, notices that read as sentences, the library's defaults."""

from __future__ import annotations

import re
from pathlib import Path

from tui_helpers import open_screen, run, select_options, wait_for


def _labels_clear_of_their_fields(screen) -> None:
    for row in screen.query(".field"):
        label, field = row.children[0], row.children[1]
        text = str(label.render())
        assert len(text) < label.content_region.width, f"{text!r} is cut or touches its field"
        assert label.region.x + len(text) < field.region.x, f"{text!r} runs into its field"


def test_settings_dialog_opens_on_the_system_prompt_and_enter_saves(make_app, backend):
    import edgeinfer

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+s", "SettingsScreen")
            await wait_for(pilot, lambda: app.focused is screen.query_one("#system"), what="the system prompt focused")
            await pilot.press(*"Be brief.")  # typed text lands in the first field, nothing is lost
            assert screen.query_one("#system").text == "Be brief."
            # the fields show the chat's settings: for a new chat, the library's defaults
            sampling = edgeinfer.SamplingOptions()
            assert screen.query_one("#set-temperature").value == str(sampling.temperature)
            assert screen.query_one("#set-top_k").value == str(sampling.top_k)
            assert screen.query_one("#set-seed").value == ""
            assert screen.query_one("#set-max_tokens").value == str(edgeinfer.GenerateOptions().max_tokens)
            _labels_clear_of_their_fields(screen)
            # the KV-cache types: every type the library knows, f16 (its default) for a new chat
            kv = [screen.query_one(f"#set-kv_type_{c}") for c in "kv"]
            assert [select_options(s) for s in kv] == [list(edgeinfer.KV_TYPE_NAMES)] * 2
            assert [s.value for s in kv] == list(edgeinfer.DEFAULT_LOAD.kv_types) == ["f16", "f16"]
            kv[0].value, kv[1].value = "q8_0", "q4_0"
            await pilot.press("tab")
            await pilot.press("enter")  # Enter in a field saves
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app.chat_view.settings.system_prompt == "Be brief."
            saved = app.store.get_chat(app.chat_view.chat.id).settings
            assert (saved["system_prompt"], saved["kv_type_k"], saved["kv_type_v"]) == ("Be brief.", "q8_0", "q4_0")

    run(main())


def test_speculation_dialog_focus_layout_and_notice(make_app, backend):
    import edgeinfer

    async def main():
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            screen = await open_screen(pilot, "ctrl+t", "SpeculationScreen")
            await wait_for(pilot, lambda: app.focused is screen.query_one("#spec-method"))
            # a new chat drafts up to the library's default length
            assert screen.query_one("#spec-k").value == str(edgeinfer.SpeculationOptions().draft_max)
            _labels_clear_of_their_fields(screen)
            screen.query_one("#spec-method").value = "lookup"
            screen.query_one("#spec-k").value = "16"
            screen.query_one("#spec-k").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ChatScreen")
            assert app._notifications and list(app._notifications)[-1].message == "Speculation: lookup, drafts up to 16 tokens."
            assert app.sub_title.endswith("speculation: lookup, drafts up to 16 tokens")

    run(main())


def test_speculation_settings_describe_themselves_in_words():
    from edgeinfer_tui.settings import SpeculationSettings

    assert SpeculationSettings(method="off").describe() == "off"
    assert SpeculationSettings(method="auto", draft_max=8).describe() == "auto, drafts up to 8 tokens"
    assert SpeculationSettings(method="self", self_quant="Q3_K_M", draft_max=4).describe() == "self-draft Q3_K_M, drafts up to 4 tokens"
    assert SpeculationSettings(method="draft", draft_model="m:q4", draft_max=3).describe() == "draft model m:q4, drafts up to 3 tokens"


def test_new_chat_settings_are_the_library_defaults():
    import edgeinfer
    from edgeinfer_tui.settings import ChatSettings

    assert ChatSettings().to_options() == edgeinfer.GenerateOptions().validate()


README = Path(__file__).resolve().parents[2] / "README.md"
# What the README's chat paragraph says each key does -> the action it must be bound to (None: quit,
# Textual's own binding, which the help screen lists too).
README_KEYS = {
    "Ctrl+Q quits": None,
    "Enter sends": "send",
    "Ctrl+J adds a newline": "newline",
    "Esc cancels": "cancel",
    "Ctrl+O picks a model": "pick_model",
    "Ctrl+T opens the speculation panel": "speculation",
    "Ctrl+G colours": "toggle_drafted",
    "Ctrl+S edits": "settings",
    "Ctrl+L manages models": "manage",
    "Ctrl+B goes back to the chat open before": "last_chat",
    "F1 lists every key": "help",
    "Ctrl+F opens it again": "tool_result",
}


def test_the_readme_says_how_to_quit_and_names_the_keys_as_bound(make_app, backend):
    """A newcomer learns from the README how to leave the chat (once only F1 said so), and every key
    the README names is the one the app binds for what the README says it does; Ctrl+Q quits."""
    from edgeinfer_tui.config import TuiConfig
    from edgeinfer_tui.modals.help import help_markdown

    text = README.read_text()
    start = text.index("In the chat UI:")
    paragraph = text[start:text.index("\n\n", start)]
    named = re.findall(r"\b(?:Ctrl\+[A-Z]|F\d+|Esc|Enter)\b", paragraph)
    phrases = [p.split()[0] for p in README_KEYS]
    assert set(named) == set(phrases), f"the README names {sorted(set(named))}, the test checks {sorted(set(phrases))}"
    config = TuiConfig()
    for phrase, action in README_KEYS.items():
        assert " ".join(phrase.split()) in " ".join(paragraph.split()), phrase
        key = {"Esc": "escape"}.get(phrase.split()[0], phrase.split()[0]).lower()
        if action is not None:
            assert key in config.key_list(action), (phrase, config.key_list(action))
    assert "| `ctrl+q` | Quit (asks first while a reply is being generated) |" in help_markdown(config)

    async def main():
        app = make_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat_view.chat is not None)
            app.chat_view.chat_input.focus()  # even from the message input
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None or not app.is_running, what="the app to quit")

    run(main())
