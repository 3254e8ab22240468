"""What the store benchmarks share: the EDGEINFER_HOME they run in."""

from __future__ import annotations

import os
import tempfile


def use_home(home: str | None, prefix: str) -> tempfile.TemporaryDirectory[str] | None:
    """Point EDGEINFER_HOME at `home` (kept, reused by a later run), or at a fresh temporary store,
    returned so the caller cleans it up. Call before importing edgeinfer."""
    if home:
        os.environ["EDGEINFER_HOME"] = home
        return None
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    os.environ["EDGEINFER_HOME"] = tmp.name
    return tmp
