"""What a tuned profile and its measurements hold for: this machine, this llama.cpp build, these files.

- machine: the CPU model, how many cores this process may use, and the RAM (MemTotal, in MiB);
- build: llama-cpp-python's version and llama.cpp's own build line (`llama_print_system_info`: the
  backends and CPU features compiled in), so a rebuild with other flags counts as another build;
- a model file: its resolved path, size, modification time and inode — the cheap identity the
  store already trusts for its hash cache (`store._sha256_cached`): a file replaced or rewritten
  in place changes at least one of them, and nothing has to read gigabytes to check it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from ..cpu import usable_cores

__all__ = ["machine_key", "build_key", "file_identity", "describe_mismatch"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _ram_mib() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    except (ValueError, OSError, AttributeError):
        return 0


@functools.cache
def machine_key() -> dict[str, Any]:
    return {"cpu": _cpu_model(), "cores": usable_cores(), "ram_mib": _ram_mib()}


@functools.cache
def build_key() -> dict[str, str]:
    import llama_cpp

    from ..llama_backend import backend

    ll = backend()
    info = ll.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return {"llama_cpp_python": str(getattr(llama_cpp, "__version__", "?")), "system_info": " ".join(text.split())}


def file_identity(path: str | Path) -> dict[str, Any]:
    """The cheap identity of a model file (see the module); OSError when it is gone."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def describe_mismatch(kind: str, stored: object, now: object) -> str | None:
    """None when equal, else a short reason naming what changed."""
    if stored == now:
        return None
    if isinstance(stored, dict) and isinstance(now, dict):
        changed = sorted(k for k in stored.keys() | now.keys() if stored.get(k) != now.get(k))
        return f"the {kind} changed ({', '.join(changed)})"
    return f"the {kind} changed"
