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
