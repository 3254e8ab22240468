"""llama.cpp's process-wide state: backend initialisation and its log.

The bottom of everything that calls llama.cpp (the engine, the quantizer, evaluation): it imports
nothing of edgeinfer but the errors. llama.cpp logs through one process-wide callback; here every
complete line goes to the `edgeinfer.llama_cpp` logger at DEBUG level (quiet unless a front end
asks, e.g. the CLI's --verbose) and, while a `log_capture` block runs, to its sink as well (the
quantizer's per-tensor progress). Nothing is printed to stderr by llama.cpp itself.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .errors import InvalidOptionError

__all__ = ["backend", "log_capture", "recent_log_lines", "max_threads", "env_threads", "threads_out_of_range",
           "check_threads",
           "LOGGER_NAME", "THREADS_ENV", "THREADS_PER_CORE"]

LOGGER_NAME = "edgeinfer.llama_cpp"
_logger = logging.getLogger(LOGGER_NAME)

# ggml_log_level (ggml.h of the pinned llama.cpp): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
# (continues the previous line). llama-cpp-python's own comment still has an older order.
_LEVEL_NAMES = {3: "warning", 4: "error"}
_CONT = 5

_lock = threading.Lock()
_lines_lock = threading.Lock()
_ready = False
_sinks: list[Callable[[int, str], None]] = []
_callback_ref: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it
_partial = ""  # the start of a line whose end has not arrived yet
_partial_level = 1
_recent: deque[str] = deque(maxlen=50)

# More llama.cpp threads than this per core only thrash (`--threads 9999` took a machine's load to ~1,000).
THREADS_PER_CORE = 4


def max_threads() -> int:
    """The most threads llama.cpp may be given (decoding, quantizing): a small multiple of the CPUs."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


# Pins llama.cpp's thread count wherever the caller gives none: a container whose CPU quota the
# affinity mask does not show, or a test runner's workers that each own a share of the cores.
THREADS_ENV = "EDGEINFER_THREADS"


def env_threads() -> int | None:
    """The thread count EDGEINFER_THREADS pins, or None when it is unset or empty."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= max_threads():
        raise threads_out_of_range(f"{THREADS_ENV} must be a whole number", repr(raw))
    return n


def check_threads(n_threads: int | None) -> int:
    """A thread count that fits llama.cpp's int and this machine (None: EDGEINFER_THREADS, else every
    core), for work that runs alone (quantizing, an importance matrix)."""
    if n_threads is None:
        return env_threads() or os.cpu_count() or 1
    if isinstance(n_threads, bool) or not isinstance(n_threads, int):
        raise InvalidOptionError(f"threads must be an integer, got {n_threads!r}")
    if not 1 <= n_threads <= max_threads():  # 9,999 threads once took the machine to a load of 1,000
        raise threads_out_of_range("threads must be", n_threads)
    return n_threads


def threads_out_of_range(what: str, got: object) -> InvalidOptionError:
    """The one error for a thread count outside [1, max_threads()]; `what` says whose it is."""
    return InvalidOptionError(f"{what} in [1, {max_threads()}] ({THREADS_PER_CORE} per CPU core), got {got}")


def backend() -> Any:
    """Import llama_cpp and initialise the backend once; route llama.cpp's log to our logger."""
    global _ready, _callback_ref
    import llama_cpp

    with _lock:
        if not _ready:
            llama_cpp.llama_backend_init()
            _callback_ref = llama_cpp.llama_log_callback(_on_log)
            llama_cpp.llama_log_set(_callback_ref, ctypes.c_void_p(0))
            atexit.register(_close_binding_devnull)
            _ready = True
    return llama_cpp


def sigint_outside_callbacks(_signum: int, frame: Any) -> None:
    """A SIGINT handler for a process that owns its signals (the CLI): raise KeyboardInterrupt as
    Python's default does, except at the first instructions of llama.cpp's log callback, before its
    own guard, where ctypes would drop it (a `tune` then ran on after Ctrl-C): there, ask again,
    to be raised once the callback has returned."""
    if frame is not None and frame.f_code is _on_log.__code__:
        _thread.interrupt_main()
        return
    raise KeyboardInterrupt


def _on_log(level: int, text: bytes | None, _user: Any) -> None:
    # An exception cannot cross into C (ctypes would print and drop it): keep this infallible.
    try:
        message = text.decode("utf-8", errors="replace") if text else ""
        for sink in list(_sinks):
            try:
                sink(level, message)
            except Exception:  # noqa: BLE001 - a sink's own error handling is its business
                _logger.debug("a llama.cpp log sink raised", exc_info=True)
        _to_logger(level, message)
    except KeyboardInterrupt:
        # A Ctrl-C that lands in this callback would be dropped with it (tune once finished normally
        # after one): raise it again in the main thread, once control is back in Python.
        _thread.interrupt_main()
    except BaseException:  # noqa: BLE001
        pass


def _to_logger(level: int, message: str) -> None:
    """Assemble fragments into lines; each complete line becomes one record."""
    global _partial, _partial_level
    with _lines_lock:
        if level != _CONT and not _partial:
            _partial_level = level
        _partial += message
        if "\n" not in _partial:
            return
        *lines, _partial = _partial.split("\n")
        line_level = _partial_level
    for line in lines:
        if not line.strip():
            continue
        _recent.append(line)
        if _logger.isEnabledFor(logging.DEBUG):
            kind = _LEVEL_NAMES.get(line_level)
            _logger.debug("%s%s", f"{kind}: " if kind else "", line)


def recent_log_lines(n: int = 10) -> list[str]:
    """The last `n` complete lines llama.cpp logged in this process (for error messages)."""
    return list(_recent)[-n:]


@contextlib.contextmanager
def log_capture(sink: Callable[[int, str], None]) -> Iterator[None]:
    """Also send llama.cpp's raw log fragments (level, text) to `sink` while the block runs.

    The sink is called from whatever thread llama.cpp logs in; what it raises is logged and
    dropped (it must never reach C), so a sink that wants to stop work records the error itself.
    """
    backend()
    _sinks.append(sink)
    try:
        yield
    finally:
        _sinks.remove(sink)


def _close_binding_devnull() -> None:
    """llama-cpp-python opens os.devnull twice when imported (llama_cpp/_utils.py, for its
    stdout/stderr suppression) and never closes the files, so every process that imported it
    ended with two `ResourceWarning: unclosed file ... /dev/null` lines. Close them at exit,
    when nothing can use them any more."""
    import sys

    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        f = getattr(utils, name, None)
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()
