"""The model store: manifests, the default model, atomic writes, locking across processes."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer import DEFAULT_MODEL, ModelNotFoundError, Store
from edgeinfer.fsutil import atomic_path


def test_default_model_is_registered(default_model_path, edgeinfer_home):
    models = Store().list()
    m = next(m for m in models if m.ref == DEFAULT_MODEL)
    assert Path(m.file) == default_model_path.resolve()
    assert m.owned is False
    assert m.architecture == "llama"
    assert m.quant == "Q4_1"
    assert m.context_length == 8192
    assert 130e6 < m.parameters < 140e6
    assert len(m.sha256) == 64
    # the manifest is plain JSON in the store
    data = json.loads((edgeinfer_home / "manifests" / "smollm2-135m-instruct" / "q4_1.json").read_text())
    for key in ("name", "tag", "file", "sha256", "size", "architecture", "parameters", "context_length",
                "source", "derived_from", "created"):
        assert key in data


def test_resolve_default_name_and_path(default_model_path):
    store = Store()
    assert store.resolve(None)[0] == default_model_path.resolve()
    assert store.resolve("smollm2-135m-instruct")[0] == default_model_path.resolve()
    assert store.resolve(str(default_model_path))[0] == default_model_path


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="not in the store"):
        Store().get("no-such-model:q4_0")
    with pytest.raises(FileNotFoundError):  # also the built-in
        Store().resolve("./missing.gguf")
    with pytest.raises(ModelNotFoundError, match="invalid model name"):
        Store().get("Bad Name")


def test_register_copy_and_remove(tmp_path, default_model_path):
    store = Store()
    target = store.model_path("copy", "q4_1")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(default_model_path, target)
    m = store.register(target, "copy", "q4_1", derived_from=DEFAULT_MODEL, source={"kind": "test"})
    assert store.get("copy").ref == "copy:q4_1"
    assert m.derived_from == DEFAULT_MODEL
    store.update_metrics("copy:q4_1", "eval", {"kld": 0.5})
    assert store.get("copy:q4_1").metrics["eval"]["kld"] == 0.5
    store.remove("copy:q4_1")
    assert not target.exists()
    assert store.find("copy:q4_1") is None
    # the default model cannot be removed (it would be back at once); purging forgets its manifest
    with pytest.raises(edgeinfer.StoreError, match="cannot be removed"):
        store.remove(DEFAULT_MODEL)
    store.update_metrics(DEFAULT_MODEL, "eval", {"kld": 0.1})
    store.remove(DEFAULT_MODEL, purge=True)
    assert default_model_path.exists()  # referenced, not owned: the file stays
    assert store.get(DEFAULT_MODEL).metrics == {}


def test_name_with_several_tags_asks_to_pick(default_model_path):
    store = Store()
    for tag in ("a", "b"):
        store.register(default_model_path, "twin", tag, owned=False)
    with pytest.raises(ModelNotFoundError, match="twin:a, twin:b"):
        store.get("twin")


def test_damaged_manifest_hides_one_model_only(edgeinfer_home, default_model_path):
    store = Store()
    store.register(default_model_path, "good", "x", owned=False)
    bad = edgeinfer_home / "manifests" / "bad" / "x.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{ not json")
    refs = [m.ref for m in store.list()]
    assert "good:x" in refs and "bad:x" not in refs
    _, problems = store.scan()  # skipped, but never without a word
    assert [p.path for p in problems] == [bad] and "not valid JSON" in str(problems[0])


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def _register_many(args):
    home, model, start = args
    import os

    os.environ["EDGEINFER_HOME"] = home
    store = edgeinfer.Store()
    for i in range(start, start + 10):
        store.register(Path(model), "proc", f"t{i}", owned=False, sha256="0" * 64)
        store.update_metrics(f"proc:t{start}", f"k{i}", i)
    return True


@pytest.mark.slow  # two subprocesses importing the package
def test_two_processes_share_one_store(edgeinfer_home, default_model_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        assert all(pool.map(_register_many, [(str(edgeinfer_home), str(default_model_path), s) for s in (0, 100)]))
    store = Store()
    tags = {m.tag for m in store.list() if m.name == "proc"}
    assert tags == {f"t{i}" for i in list(range(10)) + list(range(100, 110))}
    # read-modify-write under the lock lost no update
    assert set(store.get("proc:t0").metrics) == {f"k{i}" for i in range(10)}
    assert set(store.get("proc:t100").metrics) == {f"k{i}" for i in range(100, 110)}


# -- the small cache API (read_cache / write_cache): what the engine keeps its decode costs in ----------
def test_cache_round_trip(tmp_path):
    store = Store(tmp_path / "store")
    assert store.read_cache("decode-costs", "model-a") is None  # nothing yet
    costs = {"t1": 0.0123, "shape": {"2": 1.4, "4": 1.9}, "alpha": 2.5e-5}
    store.write_cache("decode-costs", "model-a", costs)
    store.write_cache("decode-costs", "model-b", [1, 2, 3])
    store.write_cache("decode-costs", "model-a", {**costs, "t1": 0.02})  # overwrites its own key only
    again = Store(tmp_path / "store")  # another instance (another process) reads what was written
    assert again.read_cache("decode-costs", "model-a") == {**costs, "t1": 0.02}
    assert again.read_cache("decode-costs", "model-b") == [1, 2, 3]
    assert again.read_cache("decode-costs", "model-c") is None
    assert again.read_cache("other-kind", "model-a") is None  # kinds are separate files
    with pytest.raises(edgeinfer.StoreError, match="invalid cache kind '../x'"):
        store.write_cache("../x", "k", 1)


@pytest.mark.parametrize("content", [b"{\"model-a\": {\"t1\": 0.0", b"[1, 2]", b"\xff\xfe not utf-8", b"[" * 100_000, b""],
                         ids=["truncated", "not-a-dict", "not-utf8", "too-deep", "empty"])
def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path, content):
    """A damaged cache is not an error: it reads as empty (costs are measured again) and the next
    write replaces it with a valid file."""
    store = Store(tmp_path / "store")
    store.write_cache("decode-costs", "model-a", {"t1": 0.01})
    path = next((tmp_path / "store").rglob("decode-costs.json"))
    path.write_bytes(content)
    assert store.read_cache("decode-costs", "model-a") is None
    store.write_cache("decode-costs", "model-b", {"t1": 0.02})
    assert json.loads(path.read_text(encoding="utf-8")) == {"model-b": {"t1": 0.02}}
    assert store.read_cache("decode-costs", "model-b") == {"t1": 0.02}


def test_a_failed_cache_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """The write goes to a temporary file renamed over the cache: a failure half-way (here fsync)
    reaches the caller as OSError and leaves the previous cache intact, with no stray file."""
    import edgeinfer.fsutil

    store = Store(tmp_path / "store")
    store.write_cache("decode-costs", "model-a", {"t1": 0.01})
    path = next((tmp_path / "store").rglob("decode-costs.json"))
    before = path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m, pytest.raises(OSError, match="Input/output error"):
        m.setattr(edgeinfer.fsutil.os, "fsync", failing_fsync)
        store.write_cache("decode-costs", "model-b", {"t1": 0.02, "shape": list(range(1000))})
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["decode-costs.json"]
    assert store.read_cache("decode-costs", "model-a") == {"t1": 0.01}
    assert store.read_cache("decode-costs", "model-b") is None
