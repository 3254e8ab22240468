"""The child-process load: `probe_load` loads a file in llama.cpp in a child process (the script
`edgeinfer/load_probe.py`), so that an abort there becomes one InvalidModelError line and this
process lives."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..errors import InvalidModelError

__all__ = ["probe_load"]

log = logging.getLogger(__name__)

# The script the child runs, beside this package.
_PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "load_probe.py"


def probe_load(path: str | Path, *, timeout: float | None = None) -> None:
    """Load `path` in llama.cpp in a child process (spawned, not forked) and tokenize, decode and
    detokenize a few tokens there; raise InvalidModelError with llama.cpp's last log line when
    that child fails or dies (an abort, a segfault), or does not finish within `timeout`."""
    path = Path(path)
    size = path.stat().st_size
    if timeout is None:
        timeout = 60.0 + 30.0 * size / 1e9  # a first, cold load reads the whole file
    env = dict(os.environ, GGML_NO_BACKTRACE="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-I", str(_PROBE_SCRIPT), str(path)]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InvalidModelError(f"llama.cpp could not load {path.name}: no answer within {timeout:.0f} s") from None
    log.debug("load probe of %s: exit %s in %.2f s", path.name, proc.returncode, time.monotonic() - started)
    if proc.returncode == 0:
        return
    reason = _last_log_line(proc.stderr.decode("utf-8", errors="replace")).removeprefix(f"{path.name}: ")
    if proc.returncode < 0:
        reason = f"{reason} (killed by signal {-proc.returncode})" if reason else f"killed by signal {-proc.returncode}"
    raise InvalidModelError(f"llama.cpp could not load {path.name}: {reason or f'exit status {proc.returncode}'}")


def _last_log_line(stderr: str) -> str:
    """The line that says why: an assert, an uncaught exception, an 'error loading model' line,
    the probe's own one-line error, or else the last line llama.cpp printed."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for marker in ("GGML_ASSERT", "GGML_ABORT", "terminate called", "what():", "error loading model", "edgeinfer-probe:"):
        hits = [ln for ln in lines if marker in ln]
        if hits:
            line = _SOURCE_DIR_RE.sub("", hits[-1].split("edgeinfer-probe:", 1)[-1].strip())
            return line[:300]
    return _SOURCE_DIR_RE.sub("", lines[-1])[:300] if lines else ""


# The build directory in front of a source file name ("/tmp/pip-.../src/llama-vocab.cpp:2544:").
_SOURCE_DIR_RE = re.compile(r"(?<![\w.])/[^\s:]*/(?=[\w.-]+\.(?:c|cc|cpp|h):\d+)")
