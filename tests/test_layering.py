"""The library never imports a UI toolkit: front ends depend on it, not the other way round."""

import subprocess
import sys


def test_library_imports_no_ui_toolkit():
    code = (
        "import sys, edgeinfer, edgeinfer.cli, edgeinfer.engine.generation, edgeinfer.store;"
        "import pkgutil, importlib;"
        "[importlib.import_module('edgeinfer.' + m.name) for m in pkgutil.iter_modules(edgeinfer.__path__)"
        " if m.name not in ('__main__',)];"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich'));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"edgeinfer imported UI modules: {out}"


def test_public_api_is_declared():
    import edgeinfer

    assert edgeinfer.__all__, "edgeinfer must declare its public API"
    for name in edgeinfer.__all__:
        assert hasattr(edgeinfer, name), name
