"""`edgeinfer pull` and `edgeinfer du` against the local Hub: in process, and in a subprocess that gets
HF_ENDPOINT / HF_HOME from its environment and is interrupted with a real SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from hub_server import local_hub, tiny_gguf

from edgeinfer.hub import download
from edgeinfer.cli import main

REPO = "tester/Tiny-GGUF"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "_BACKOFF_S", 0.0)
    src = tmp_path / "src"
    src.mkdir()
    with local_hub(monkeypatch, tmp_path / "hf-home" / "hub") as server:
        server.add_repo(
            REPO,
            {
                "Tiny-Q4_K_M.gguf": tiny_gguf(src / "a.gguf", "Q4_K_M"),
                "Tiny-Q8_0.gguf": tiny_gguf(src / "b.gguf", "Q8_0", rows=16),
                "Tiny-F16.gguf": tiny_gguf(src / "c.gguf", "F16", rows=4096),  # 4 MiB
            },
        )
        yield server


def test_pull_prints_plan_progress_and_ref(hub, capsys):
    assert main(["pull", f"{REPO}:Q8_0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "tiny:q8_0"
    assert "Tiny-Q8_0.gguf" in err and "to download" in err and "RAM" in err
    assert "pulled tiny:q8_0" in err and "memory at n_ctx=" in err
    assert main(["pull", f"{REPO}:Q8_0"]) == 0  # again: nothing to download
    assert "reused" in capsys.readouterr().err


def test_du_lists_store_and_cache_use(hub, capsys):
    assert main(["pull", REPO]) == 0
    capsys.readouterr()
    assert main(["du"]) == 0
    out = capsys.readouterr().out
    line = next(li for li in out.splitlines() if li.startswith("tiny:q4_k_m"))
    assert line.split()[-1] == "1" and "HF cache" in out


@pytest.mark.parametrize(
    ("spec", "setup", "needle"),
    [
        ("tester/none", None, "repository tester/none not found"),
        (REPO, "gate", "hf auth login"),
        (f"{REPO}:Q2_K", None, "no Q2_K file in this repository; it has: F16, Q4_K_M, Q8_0"),
        ("not a repo", None, "invalid Hugging Face repo id"),
    ],
)
def test_errors_are_one_line(hub, capsys, spec, setup, needle):
    if setup == "gate":
        hub.tokens[REPO] = "secret"
    assert main(["pull", spec]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgeinfer: error:") and needle in err and "\n" not in err


@pytest.mark.slow  # a real process, stopped mid-file and run again
def test_ctrl_c_in_a_real_process_then_resume(hub, tmp_path):
    """HF_ENDPOINT/HF_HOME come from the environment of a fresh process; SIGINT stops it mid-file."""
    hub.slow[(REPO, "Tiny-F16.gguf")] = 0.02
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-env"),
        "EDGEINFER_HOME": os.environ["EDGEINFER_HOME"],
    }
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        env.pop(var, None)
    blobs = tmp_path / "hf-env" / "hub" / "models--tester--Tiny-GGUF" / "blobs"
    cmd = [sys.executable, "-m", "edgeinfer", "pull", f"{REPO}:F16"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 256 * 1024 for p in blobs.glob("*.incomplete")) if blobs.exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    (partial,) = blobs.glob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < 4096 * 1024

    hub.slow.clear()
    before = len(hub.log)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tiny:f16"
    ranges = [r.range for r in hub.log[before:] if r.method == "GET" and "/resolve/" in r.path]
    assert ranges == [f"bytes={kept}-"]
    assert not list(blobs.glob("*.incomplete"))
    snapshot = next((tmp_path / "hf-env" / "hub" / "models--tester--Tiny-GGUF" / "snapshots").iterdir())
    assert (snapshot / "Tiny-F16.gguf").resolve().parent == blobs


def test_list_shows_the_hub_source_and_rm_purge_cache_deletes_cached_files(hub, tmp_path, capsys):
    assert main(["pull", f"{REPO}:Q8_0"]) == 0
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert any(li.startswith("tiny:q8_0") and f"hf:{REPO}" in li for li in out.splitlines())
    blobs = tmp_path / "hf-home" / "hub" / "models--tester--Tiny-GGUF" / "blobs"
    assert len(list(blobs.iterdir())) == 1
    assert main(["rm", "tiny:q8_0", "--purge-cache"]) == 0
    assert not blobs.exists()
