"""Fixtures for the TUI tests: a scripted backend, an app factory, and predicate waits (no sleeps)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tui_fakes, host_app

# textual is a test dependency (the [test] extra): without it the TUI tests fail, never skip.
try:
    import textual  # noqa: F401
except ImportError as e:
    raise ImportError(f"the TUI tests need textual, a test dependency: pip install -e '.[test]' ({e})") from e


@pytest.fixture
def backend():
    from tui_fakes import FakeBackend

    return FakeBackend()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "chats.sqlite3"


@pytest.fixture
def make_app(backend, db_path):
    from edgeinfer_tui.app import EdgeInferApp
    from edgeinfer_tui.config import TuiConfig

    def make(**kw):
        kw.setdefault("db_path", db_path)
        kw.setdefault("config", TuiConfig())
        return EdgeInferApp(kw.pop("backend", backend), **kw)

    return make
