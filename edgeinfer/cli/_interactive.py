"""What `edgeinfer run` shows a person at a terminal: the prompt's progress while a long prompt is
read, and a line chat when no prompt is given (as `ollama run` does)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import edgeinfer

__all__ = ["PrefillLine", "line_chat", "LINE_CHAT_HELP"]


class PrefillLine:
    """"reading the prompt: 1024/2600 tokens (39 %)" on one stderr line while a long prompt is read
    (the engine's PrefillProgress events), erased at the first token. Silent when the stream is not
    a terminal: a log or a pipe gets nothing."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False

    def update(self, done: int, total: int) -> None:
        if not self.tty:
            return
        self.stream.write(f"\r\033[Kreading the prompt: {done}/{total} tokens ({done * 100 // max(total, 1)} %)")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def stream_reply(gen: edgeinfer.Generation, out: TextIO, prefill: PrefillLine, show: bool = True) -> None:
    """Write a generation's text to `out` as it comes, the prompt's progress before it."""
    import edgeinfer

    try:
        for event in gen:
            if isinstance(event, edgeinfer.PrefillProgress):
                prefill.update(event.done, event.total)
            elif isinstance(event, edgeinfer.TokenEvent):
                prefill.clear()
                if show and event.text:
                    out.write(event.text)
                    out.flush()
    finally:
        prefill.clear()


LINE_CHAT_HELP = """Commands:
  /set system TEXT   set the system prompt (/set system alone: back to the model's default)
  /clear             forget the conversation so far
  /bye               quit (also Ctrl-D)
  /? or /help        this help
Start a message with \"\"\" to write several lines; end it with \"\"\".
Ctrl-C stops a reply (what came stays in the conversation)."""


def _read_message(read: Callable[[str], str], out: TextIO) -> str | None:
    """One message: a line, or the lines between \"\"\" and \"\"\". None at end of input."""
    try:
        line = read(">>> ")
    except EOFError:
        return None
    if not line.lstrip().startswith('"""'):
        return line
    text = line.lstrip()[3:]
    if text.rstrip().endswith('"""') and text.strip():  # """one line"""
        return text.rstrip()[:-3]
    lines = [text] if text else []
    while True:
        try:
            more = read("... ")
        except EOFError:
            return "\n".join(lines)
        if more.rstrip().endswith('"""'):
            lines.append(more.rstrip()[:-3])
            return "\n".join(lines).rstrip("\n")
        lines.append(more)


def line_chat(
    engine: edgeinfer.Engine,
    options: edgeinfer.GenerateOptions,
    system: str | None,
    *,
    read: Callable[[str], str] = input,
    out: TextIO | None = None,
    err: TextIO | None = None,
    raw: bool = False,
) -> int:
    """A chat on the terminal: each line (or \"\"\"-block) is a message, the reply streams after it,
    the conversation carries on. `system`: the --system prompt (None: the model's default). `raw`
    (a model without a chat template): no roles, the model continues the text so far, each line
    appended to it. Ends at /bye or end of input, exit code 0."""
    import edgeinfer

    out, err = out or sys.stdout, err or sys.stderr
    default_system = edgeinfer.default_system_prompt(engine.manifest.ref if engine.manifest else engine.path)
    chosen = system
    history: list[dict[str, str]] = []
    print(f"{engine.name}: type a message (/? for help, /bye to quit)", file=err, flush=True)
    while True:
        try:
            text = _read_message(read, out)
        except KeyboardInterrupt:
            print("\n(use Ctrl-D or /bye to quit)", file=err, flush=True)
            continue
        if text is None:
            print(file=out, flush=True)
            return 0
        command = text.strip()
        if not command:
            continue
        if command in ("/bye", "/exit", "/quit"):
            return 0
        if command in ("/?", "/help"):
            print(LINE_CHAT_HELP, file=err, flush=True)
            continue
        if command == "/clear":
            history.clear()
            print("(conversation cleared)", file=err, flush=True)
            continue
        if command.split()[:2] == ["/set", "system"]:
            rest = command[len("/set system"):].strip()
            chosen = rest or None
            print(f"(system prompt: {rest!r})" if rest else "(system prompt: the model's default)", file=err, flush=True)
            continue
        if command.startswith("/"):
            print(f"unknown command {command.split()[0]} (/? lists them)", file=err, flush=True)
            continue
        history.append({"role": "user", "content": text})
        if raw:  # the transcript so far, continued
            transcript = "\n".join(m["content"] for m in history)
            reply = _reply(engine, transcript, options, None, out)
        else:
            reply = _reply(engine, history, options, chosen if chosen is not None else default_system, out)
        if reply is None:  # cancelled before any text: the turn never happened
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})


def _reply(engine: edgeinfer.Engine, history: Iterable[dict[str, str]] | str, options: edgeinfer.GenerateOptions,
           system: str | None, out: TextIO) -> str | None:
    """Stream one reply (to a conversation, or a raw text's continuation); Ctrl-C stops it (its
    text so far is kept). None when nothing came."""
    if isinstance(history, str):
        gen = engine.generate(history, options)
    else:
        gen = engine.chat(list(history), options, system=system or None)

    def on_interrupt(_signum: int, _frame: object) -> None:
        gen.cancel()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        stream_reply(gen, out, PrefillLine())
    finally:
        signal.signal(signal.SIGINT, previous)
    out.write("\n")
    out.flush()
    done = gen.done
    if done is None or (done.finish_reason == "cancelled" and not done.text):
        return None
    return done.text
