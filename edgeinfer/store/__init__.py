"""The model store: one JSON manifest per model under $EDGEINFER_HOME/manifests/<name>/<tag>.json.

Models are named like Ollama tags, `name:tag` (the tag is usually the quant, e.g. `q4_k_m`). A path
to a `.gguf` file works wherever a store name does. Every write is atomic (temp name + rename)
and made under an inter-process file lock, so two processes sharing one store cannot corrupt it.

The store trusts nothing it reads: a manifest is schema-checked (a damaged one is reported, never
a traceback), and nothing is deleted or written outside the store's own folders whatever a
manifest says. Files nothing uses (partial writes of killed processes, model files no manifest
names) are listed by `garbage()` and removed by `collect_garbage()`.

    store.py      Store: locations, reading, registering, removing (over the modules below)
    manifest.py   the manifest's schema and its careful reading
    names.py      store names (`name:tag`) and references that are paths
    locks.py      the writer lock of each name
    garbage.py    what nothing uses, and its removal
    cache.py      small JSON caches by kind and key
    bootstrap.py  the default model, registered in every store once
"""

from __future__ import annotations

from ..default_model import DEFAULT_MODEL  # its one source, beside the code that finds the shipped file
from .garbage import Garbage
from .manifest import SIDECAR_SUFFIXES, ManifestError, ModelManifest
from .names import normalize_name, parse_ref
from .store import Store

__all__ = [
    "ModelManifest",
    "ManifestError",
    "Garbage",
    "Store",
    "parse_ref",
    "normalize_name",
    "DEFAULT_MODEL",
    "SIDECAR_SUFFIXES",
]
