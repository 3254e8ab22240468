"""llama.cpp's log lines reach the `edgeinfer.llama_cpp` logger, quiet by default: the CLI shows them
on stderr with -vv only (issue 13, point 7). A real `edgeinfer run` in a subprocess on the default
model, with its own EDGEINFER_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three subprocesses loading the default model


def _run(home: Path, *verbosity: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGEINFER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer", *verbosity, "run", "--raw", "1, 2, 3,", "-n", "2", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )


def _llama_cpp_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("edgeinfer.llama_cpp: ")]


def test_minus_vv_shows_llama_cpp_log_lines_and_no_flag_does_not(tmp_path: Path):
    home = tmp_path / "edgeinfer-home"
    quiet = _run(home)
    one_v = _run(home, "-v")
    loud = _run(home, "-vv")
    for r in (quiet, one_v, loud):
        assert r.returncode == 0, r.stderr[-2000:]
    assert quiet.stdout == one_v.stdout == loud.stdout != ""  # the same two greedy tokens every time

    lines = _llama_cpp_lines(loud.stderr)
    assert len(lines) >= 20, loud.stderr[-2000:]  # model loader, context, ... : llama.cpp's own lines
    assert any("llama_model_loader" in line for line in lines), lines[:5]
    assert any("llama_context" in line for line in lines), lines[:5]
    # llama.cpp's INFO lines (the loader's key/value dump) carry no warning/error label: ggml's levels
    # are DEBUG 1, INFO 2, WARN 3, ERROR 4 (an older order labelled every INFO line "warning:")
    loader = [line for line in lines if "llama_model_loader: - kv" in line]
    assert loader and not any(" warning: " in line or " error: " in line for line in loader), loader[:3]

    for r in (quiet, one_v):  # -v shows edgeinfer's diagnostics, not llama.cpp's log
        assert _llama_cpp_lines(r.stderr) == [], r.stderr[-2000:]
        assert "llama_model_loader" not in r.stderr and "llama_context" not in r.stderr, r.stderr[-2000:]


def test_a_ctrl_c_inside_llama_cpps_log_callback_is_raised_again_in_python():
    """ctypes drops what a callback raises: a Ctrl-C that arrived while llama.cpp's log line was
    being handled used to vanish (a `tune` then finished as if never interrupted). It is raised
    again in the main thread once control is back in Python."""
    import time

    from edgeinfer import llama_backend

    def interrupted(_level: int, _message: str) -> None:
        raise KeyboardInterrupt  # what the SIGINT handler does wherever the signal lands

    with llama_backend.log_capture(interrupted), pytest.raises(KeyboardInterrupt):
        llama_backend._on_log(2, b"a line\n", None)  # as llama.cpp calls it, through ctypes
        time.sleep(1)  # (the interrupt arrives at the next bytecode; never reached)


def test_the_clis_sigint_handler_waits_out_the_log_callbacks_first_instructions():
    """A SIGINT handled at the callback's first instructions (before its own guard) is asked for
    again, to be raised once the callback returned; anywhere else it raises at once."""
    import signal
    import time
    import types

    from edgeinfer import llama_backend

    in_callback = types.SimpleNamespace(f_code=llama_backend._on_log.__code__)
    asked_again: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: asked_again.append(signum))
    try:
        llama_backend.sigint_outside_callbacks(signal.SIGINT, in_callback)  # returns: no raise there
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert asked_again == [signal.SIGINT]  # delivered again, to the handler of wherever control is next
    with pytest.raises(KeyboardInterrupt):
        llama_backend.sigint_outside_callbacks(signal.SIGINT, None)
