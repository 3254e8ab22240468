"""Checks shared by the hostile CLI and store tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from edgeinfer import Store


def one_line_error(err: str, *needles: str) -> str:
    """The CLI's promise for bad input: exactly one `edgeinfer: error:` line, no traceback."""
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert lines[0].startswith("edgeinfer: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], err
    return lines[0]


@contextlib.contextmanager
def writer_elsewhere(store: Store, name: str, tag: str) -> Iterator[None]:
    """Another thread holds the writer lock of `name:tag` (excludes like another process would)."""
    held, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with store.writing(name, tag):
            held.set()
            leave.wait(300)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert held.wait(30)
        yield
    finally:
        leave.set()
        t.join()
