"""The suite's own sandbox: the guard in tests/conftest.py fails a test that touches the user's real
data directory. Proven here on a throwaway test run in a separate pytest, whose "real" data
directory is a temporary one (XDG_DATA_HOME), so nothing real is ever written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

PROBE = '''
import os
from pathlib import Path


def test_writes_into_the_real_data_dir():
    real = Path(os.environ["GUARD_REAL_DATA"]) / "edgeinfer"
    real.mkdir(parents=True, exist_ok=True)
    (real / "chats.sqlite3").write_text("oops")


def test_writes_into_its_sandbox(edgeinfer_home):
    edgeinfer_home.mkdir(parents=True, exist_ok=True)
    (edgeinfer_home / "chats.sqlite3").write_text("fine")
'''


@pytest.mark.slow  # a pytest in a subprocess
def test_the_guard_fails_a_test_that_touches_the_real_data_dir(tmp_path):
    real = tmp_path / "real-xdg-data"
    real.mkdir()
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "EDGEINFER_"))}
    env |= {"XDG_DATA_HOME": str(real), "HF_HOME": str(tmp_path / "real-hf"), "GUARD_REAL_DATA": str(real),
            "PYTHONPATH": str(TESTS)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # the run fails: the guard reports at the test's teardown
    assert "ERROR test_probe.py::test_writes_into_the_real_data_dir" in out, out
    assert f"this test touched the real user directory {real / 'edgeinfer'}" in out, out
    assert "2 passed, 1 error" in out, out  # the sandboxed test is not blamed
