"""llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`) for the child processes
(quantize_child.py, load_probe.py), without running the `llama_cpp` package's `__init__`.

That `__init__` also imports the high-level `Llama` class with numpy, jinja2 and its chat formats:
three quarters of a child's start-up (0.3 of 0.4 CPU-seconds), paid by every quantization and by
the first load of every new file, for classes a child never uses. Here the package is entered as
a bare module whose search path is the real package folder, so only the bindings (and the small
modules they import) load.

Only for a process of its own: the `llama_cpp` it leaves in sys.modules is that bare package. The
scripts run with `-I` (their folder is not on sys.path) and load this file by its path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["bindings"]


def bindings() -> types.ModuleType:
    """The `llama_cpp.llama_cpp` module (llama_backend_init, llama_model_quantize, ...)."""
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None:
        return loaded
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("llama-cpp-python is not installed", name="llama_cpp")
        package = types.ModuleType("llama_cpp")
        package.__spec__ = spec
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        sys.modules["llama_cpp"] = package
    return importlib.import_module("llama_cpp.llama_cpp")
