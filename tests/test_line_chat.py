"""`edgeinfer run` at a terminal: with no prompt a line chat opens (as `ollama run`), and a long
prompt shows its progress while it is read. Driven in a real pseudo-terminal, with the real
default model; the progress line's own logic also with a scripted generation."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

import edgeinfer
from edgeinfer import DoneEvent, GenerationStats, PrefillProgress, TokenEvent


class Terminal:
    """A command on a pseudo-terminal: what it wrote so far, and waits for a pattern in it."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=os.environ.copy(),
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.output = ""

    def expect(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """Wait until `pattern` (a regex) is in the output; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (m := re.search(pattern, self.output, flags=re.S)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; the terminal showed:\n{self.output}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the command ended and closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the command ended before {pattern!r}; the terminal showed:\n{self.output}")
                self.output += data.decode("utf-8", "replace")
        return m

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        t = Terminal([sys.executable, "-m", "edgeinfer", *args])
        opened.append(t)
        return t

    yield start
    for t in opened:
        if t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait()


@pytest.mark.slow
def test_run_without_a_prompt_at_a_terminal_is_a_line_chat(terminal):
    t = terminal("run", "--temperature", "0", "-n", "48", "--threads", "1")
    t.expect(r"type a message \(/\? for help, /bye to quit\).*>>> ")
    t.send("What is the capital of France?\r")
    t.expect(r"Paris.*\n>>> ")
    # several lines between """ ... """, one message; the chat goes on with what was said before
    t.send('"""Name one fruit\r')
    t.expect(r"\.\.\. ")
    t.send('that is yellow."""\r')
    t.expect(r"yellow\.\"\"\"\r?\n(.+?)\n>>> ")
    t.send("/set system Reply with one word.\r")
    t.expect(r"\(system prompt: 'Reply with one word\.'\)")
    t.send("/?\r")
    t.expect(r"/set system TEXT.*>>> ")
    # a long message: its progress shows while it is read (the engine reads 512 tokens a step)
    t.send(" ".join(["hello"] * 700) + "\r")
    m = t.expect(r"reading the prompt: (\d+)/(\d+) tokens \(\d+ %\)", timeout=240)
    assert 0 < int(m[1]) < int(m[2]) > 700, m[0]  # part of the prompt read, the rest to come
    t.expect(r"\n>>> ", timeout=240)
    t.send("/bye\r")
    assert t.close() == 0


@pytest.mark.slow
def test_ctrl_d_ends_the_line_chat(terminal):
    t = terminal("run", "--threads", "1")
    t.expect(r">>> ")
    t.send("\x04")  # Ctrl-D: end of input
    assert t.close() == 0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Scripted:
    """A generation as the engine streams one: the prompt read in steps, then tokens."""

    def __init__(self):
        self.done = None

    def __iter__(self):
        yield PrefillProgress(512, 1300)
        yield PrefillProgress(1024, 1300)
        yield PrefillProgress(1300, 1300)
        for text in ("Hi", " there"):
            yield TokenEvent(token=1, text=text)
        self.done = DoneEvent(text="Hi there", tokens=[1, 1], finish_reason="eos", stats=GenerationStats())
        yield self.done


def test_the_prompt_s_progress_shows_on_a_terminal_and_is_erased_at_the_first_token():
    from edgeinfer.cli._interactive import PrefillLine, stream_reply

    err, out = _Tty(), io.StringIO()
    stream_reply(_Scripted(), out, PrefillLine(err))
    assert out.getvalue() == "Hi there"
    shown = err.getvalue()
    assert "reading the prompt: 512/1300 tokens (39 %)" in shown and "1024/1300 tokens (78 %)" in shown
    assert shown.endswith("\r\033[K")  # gone before the reply's text
    piped = io.StringIO()  # not a terminal: nothing (a log must not fill with progress lines)
    stream_reply(_Scripted(), io.StringIO(), PrefillLine(piped))
    assert piped.getvalue() == ""
    assert edgeinfer.PrefillProgress is PrefillProgress
