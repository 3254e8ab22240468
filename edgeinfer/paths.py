"""Where edgeinfer keeps its state. `EDGEINFER_HOME` relocates all of it (tests use a temp dir)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["home", "profiles_dir", "HOME_ENV"]

HOME_ENV = "EDGEINFER_HOME"


def home() -> Path:
    """The state directory; created on first use, never at import time."""
    env = os.environ.get(HOME_ENV)
    if env:
        root = Path(env).expanduser()
    else:
        import platformdirs

        root = Path(platformdirs.user_data_dir("edgeinfer", appauthor=False))
    root.mkdir(parents=True, exist_ok=True)
    return root


def profiles_dir() -> Path:
    """User quant profiles (TOML), next to the shipped ones."""
    d = home() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    return d
