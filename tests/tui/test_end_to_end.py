"""End to end with the real default model: the reply the TUI shows and saves is exactly the
library's own greedy reply to the same conversation and options."""

from __future__ import annotations

import pytest
from tui_helpers import run, wait_for


@pytest.mark.slow
def test_real_model_reply_matches_library(default_model_path, db_path):
    import edgeinfer
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.backend import LibraryBackend
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.config import TuiConfig
    from edgeinfer_tui.settings import ChatSettings
    from edgeinfer_tui.widgets import MessageView

    # a chat whose settings are greedy and short, prepared in the store the app opens
    settings = ChatSettings(temperature=0.0, max_tokens=24, system_prompt="You are a helpful assistant.")
    store = ChatStore(db_path)
    store.create_chat(settings=settings.to_dict())
    store.close()

    question = "What is the capital of France?"
    app = EdgeInferApp(LibraryBackend(edgeinfer.LoadOptions(n_ctx=2048)), db_path=db_path, config=TuiConfig())

    async def main():
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.chat is not None)
            app.chat_input.text = question
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.last_done is not None, timeout=120, what="the real model's reply")
            views = list(app.messages_view.query(MessageView))
            return views[-1].content, str(app.chat_screen.query_one("#stats").render())

    result = {}

    async def runner():
        result["reply"], result["stats"] = await main()

    run(runner())
    reply, stats = result["reply"], result["stats"]
    with edgeinfer.load(default_model_path, n_ctx=2048) as engine:
        expected = engine.chat(settings.messages([("user", question)]), settings.to_options()).result()
    assert reply == expected.text and reply.strip()
    assert "tok/s" in stats and f"{len(expected.tokens)} tokens" in stats
    saved = ChatStore(db_path).messages(1)
    assert saved[-1].content == expected.text and saved[-1].stats["finish_reason"] == expected.finish_reason
