"""Test artefacts built once per test run, shared by every pytest-xdist worker."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

__all__ = ["once_per_run"]


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(root)` once per run, under pytest's basetemp (or beside it for all xdist workers: their
    basetemps share a parent), by the first worker that asks while the others wait on a file lock.
    Returns the path `make` returned, remembered in a file written once it is complete."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    made = root / f"{name}.path"
    with FileLock(str(root / f".{name}.lock")):
        if not made.exists():
            made.write_text(str(make(root)))
    return Path(made.read_text())
