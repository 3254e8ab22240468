"""Smoke test in a real terminal: tmux runs `edgeinfer chat` with the real default model, a message
is typed with send-keys, and capture-pane shows the reply and the stats line (polled, no sleeps)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
]


QUESTION = "What is the capital of France?"


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _poll(session: str, predicate, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = _capture(session)
        if predicate(screen):
            return screen
        time.sleep(0.05)  # polling interval between captures; the predicate decides, not the clock
    raise AssertionError(f"timed out waiting for {what}; screen was:\n{screen}")


def test_chat_in_tmux(edgeinfer_home, default_model_path):
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.settings import ChatSettings

    # a short greedy reply keeps the test quick
    store = ChatStore(edgeinfer_home / "chats.sqlite3")
    settings = ChatSettings(temperature=0.0, max_tokens=32)
    store.create_chat(settings=settings.to_dict())
    store.close()

    session = f"edgeinfer-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "EDGEINFER_HOME": str(edgeinfer_home), "TERM": "xterm-256color"}
    cmd = f"{sys.executable} -m edgeinfer chat --ctx 2048"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "35", cmd], env=env, check=True)
    try:
        _poll(session, lambda s: "· ready" in s, 90, "the model to load")
        subprocess.run(["tmux", "send-keys", "-t", session, "-l", QUESTION], check=True)
        subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
        screen = _poll(session, lambda s: re.search(r"\d+ tokens · [\d.]+ tok/s .*· (done|max tokens)", s), 90, "the reply's stats line")
        assert "You" in screen and QUESTION in screen
        assert "Assistant" in screen
        reply_lines = screen.split("Assistant", 1)[1].strip().splitlines()
        assert reply_lines and reply_lines[0].strip(), screen
        # the reply on screen is the library's own greedy reply to the same chat
        import edgeinfer

        with edgeinfer.load(default_model_path, n_ctx=2048) as engine:
            expected = engine.chat([{"role": "user", "content": QUESTION}], settings.to_options()).result().text
        first_words = " ".join(expected.split()[:4])
        assert first_words and first_words in " ".join(screen.split()), (expected, screen)
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        deadline = time.monotonic() + 20
        while subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the app did not quit on ctrl+q"
            time.sleep(0.05)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
