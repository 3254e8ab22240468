"""Predicate waits for Pilot tests (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time


async def wait_for(pilot, predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.005)


def run(coro) -> None:
    asyncio.run(coro)


async def open_screen(pilot, key: str, name: str):
    """Press `key` and wait until the screen class `name` is on top; returns that screen."""
    await pilot.press(key)
    await wait_for(pilot, lambda: pilot.app.screen.__class__.__name__ == name, what=name)
    return pilot.app.screen


async def say(pilot, backend, text: str) -> None:
    """Send `text` from the chat input (set at once; typing is tested on its own) and wait for
    the reply to end."""
    view = pilot.app.chat_view
    n = len(backend.calls)
    view.chat_input.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(backend.calls) == n + 1 and not view.generating, what=f"reply to {text!r}")


def select_options(select) -> list[str]:
    """The labels a Select's drop-down lists (its overlay is an OptionList)."""
    overlay = select.query_one("SelectOverlay")
    return [str(overlay.get_option_at_index(i).prompt) for i in range(overlay.option_count)]


def turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A request's messages without the system prompt (the default model's chats send its default one)."""
    return [m for m in messages if m["role"] != "system"]
