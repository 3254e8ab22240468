"""Smoke test in a real terminal: tmux runs `edgeinfer chat` with the real default model, a message
is typed with send-keys, and capture-pane shows the reply and the stats line (polled, no sleeps).

The test runs its own tmux server (`tmux -L <unique socket>` on every call), so a server the user
already runs is never asked to start the app (it would give the app its own environment, not the
test's sandbox), and the app's environment is passed explicitly in the command (`env VAR=…`)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
]


QUESTION = "What is the capital of France?"


class Tmux:
    """One private tmux server (its own socket) holding one session."""

    def __init__(self, tmp_path: Path):
        self.socket = f"edgeinfer-test-{uuid.uuid4().hex[:12]}"
        self.session = "chat"
        self.tmp_path = tmp_path
        self.socket_path: Path | None = None

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # -f /dev/null: the user's ~/.tmux.conf cannot change keys or the pane's size
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True, check=check)

    def start(self, env: dict[str, str], argv: list[str]) -> None:
        command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        self.run("new-session", "-d", "-s", self.session, "-x", "120", "-y", "35", command)
        self.socket_path = Path(self.run("display-message", "-p", "#{socket_path}").stdout.strip())

    def capture(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session, check=False).stdout

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.session, check=False).returncode == 0

    def kill_server(self) -> None:
        self.run("kill-server", check=False)
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)  # tmux leaves it behind

    def poll(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if predicate(screen):
                return screen
            time.sleep(0.05)  # polling interval between captures; the predicate decides, not the clock
        raise AssertionError(f"timed out waiting for {what}; screen was:\n{screen}")


@pytest.fixture
def tmux(tmp_path: Path):
    t = Tmux(tmp_path)
    yield t
    t.kill_server()
    assert not t.alive()


def test_chat_in_tmux(tmux, edgeinfer_home, default_model_path):
    from edgeinfer_tui.chat_store import ChatStore
    from edgeinfer_tui.settings import ChatSettings

    # a short greedy reply keeps the test quick
    store = ChatStore(edgeinfer_home / "chats.sqlite3")
    settings = ChatSettings(temperature=0.0, max_tokens=32)
    store.create_chat(settings=settings.to_dict())
    store.close()

    env = {
        "EDGEINFER_HOME": str(edgeinfer_home),
        "XDG_DATA_HOME": str(edgeinfer_home.parent / "xdg-data"),
        "HF_HOME": str(edgeinfer_home.parent / "hf-home"),
        "TERM": "xterm-256color",
    }
    tmux.start(env, [sys.executable, "-m", "edgeinfer", "chat", "--ctx", "2048"])
    first = tmux.poll(lambda s: "· ready" in s, 90, "the model to load")
    assert "tiny" in first and "edgeinfer pull" in first, first  # the default model says what it is
    tmux.run("send-keys", "-t", tmux.session, "-l", QUESTION)
    tmux.run("send-keys", "-t", tmux.session, "Enter")
    screen = tmux.poll(lambda s: re.search(r"\d+ tokens · [\d.]+ tok/s .*· (done|max tokens)", s), 90, "the reply's stats line")
    assert "You" in screen and QUESTION in screen
    assert "Assistant" in screen
    reply_lines = screen.split("Assistant", 1)[1].strip().splitlines()
    assert reply_lines and reply_lines[0].strip(), screen
    # the reply on screen is the library's own greedy reply to the same chat
    import edgeinfer

    with edgeinfer.load(default_model_path, n_ctx=2048) as engine:
        # (with the default model's default system prompt, as the app sends it)
        messages = settings.messages([("user", QUESTION)], edgeinfer.DEFAULT_MODEL)
        expected = engine.chat(messages, settings.to_options()).result().text
    assert "Paris" in expected, expected  # its first answer is right (it once was 512 tokens of French)
    first_words = " ".join(expected.split()[:4])
    assert first_words and first_words in " ".join(screen.split()), (expected, screen)
    # the app wrote its chat into the sandbox it was given, nowhere else
    saved = ChatStore(edgeinfer_home / "chats.sqlite3").messages(1)
    assert [m.role for m in saved] == ["user", "assistant"] and saved[0].content == QUESTION
    tmux.run("send-keys", "-t", tmux.session, "C-q")
    deadline = time.monotonic() + 20
    while tmux.alive():
        assert time.monotonic() < deadline, "the app did not quit on ctrl+q"
        time.sleep(0.05)
