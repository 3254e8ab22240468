"""The store trusts nothing it reads: damaged manifests, manifests that point outside the store,
hostile `-o` paths, leftovers of killed runs, two writers of one name.

Every case checks the three promises: a clear one-line error (or a one-line warning), no
traceback, and nothing touched outside the store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgeinfer import DEFAULT_MODEL, Store
from edgeinfer.cli import main
from edgeinfer.errors import InvalidOptionError, StoreError
from edgeinfer.fsutil import PARTIAL_SUFFIX, atomic_path, being_written

from ._support import one_line_error, writer_elsewhere

LONG_AGO = time.time() - 3600  # older than any test process: what a killed earlier run leaves


def _manifest(store: Store, **changes: object) -> dict:
    data = json.loads(store.get(DEFAULT_MODEL).to_json())
    data.update(changes)
    return data


def _write_manifest(home: Path, name: str, tag: str, content: bytes | str | dict | list | int | None) -> Path:
    path = home / "manifests" / name / f"{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


# -- damaged manifests ------------------------------------------------------------------------------

def _bad_manifests(store: Store) -> dict[str, object]:
    good = _manifest(store, name="bad", tag="x", owned=False)
    return {
        "array": [],
        "string": "hello",
        "number": 42,
        "null": None,
        "truncated": json.dumps(good)[:100],
        "empty": b"",
        "not-utf8": b"\xff\xfe{\"name\": 1}",
        "missing-fields": {"name": "bad", "tag": "missing-fields"},
        "size-is-string": {**good, "size": "big"},
        "owned-is-string": {**good, "owned": "yes"},
        "metrics-is-list": {**good, "metrics": []},
        "source-is-null": {**good, "source": None},
        "name-is-number": {**good, "name": 5},
        "bool-as-size": {**good, "size": True},
        "nan-bpw": json.dumps({**good, "bits_per_weight": 0.0}).replace("0.0", "NaN"),
        "negative-size": {**good, "size": -1},
        "relative-file": {**good, "file": "models/x.gguf"},
        "nul-in-file": {**good, "file": "/tmp/a\x00b"},
        "deep-nesting": "[" * 100_000 + "]" * 100_000,
        "huge": " " * (5 << 20) + "{}",
    }


def _bad_store(home: Path, store: Store) -> list[Path]:
    paths = []
    for tag, content in _bad_manifests(store).items():
        paths.append(_write_manifest(home, "bad", tag, content))
    # a manifest that names another place than where it lives
    paths.append(_write_manifest(home, "bad", "elsewhere", _manifest(store, name="other", tag="elsewhere")))
    # not a file: a folder, a FIFO (must not hang), a link to a file outside
    d = home / "manifests" / "bad" / "folder.json"
    d.mkdir()
    paths.append(d)
    fifo = home / "manifests" / "bad" / "fifo.json"
    os.mkfifo(fifo)
    paths.append(fifo)
    link = home / "manifests" / "bad" / "link.json"
    link.symlink_to("/etc/hostname")
    paths.append(link)
    return paths


def test_damaged_manifests_are_reported_one_line_each_and_skipped(edgeinfer_home, capsys):
    store = Store()
    store.register(store.get(DEFAULT_MODEL).path, "good", "x", owned=False)
    bad = _bad_store(edgeinfer_home, store)
    assert main(["list"]) == 0
    out, err = capsys.readouterr()
    assert "good:x" in out and DEFAULT_MODEL in out
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == len(bad), err  # every bad manifest: exactly one line naming its file
    for path in bad:
        assert sum(str(path) in line for line in lines) == 1, (path, err)
    assert all(line.startswith("edgeinfer: warning: skipped damaged manifest ") for line in lines)
    # the library says the same
    models, problems = store.scan()
    assert {p.path for p in problems} == set(bad)
    assert {m.ref for m in models} >= {"good:x", DEFAULT_MODEL}


@pytest.mark.parametrize("command", ["show", "rm", "run"])
def test_commands_on_a_damaged_manifest_give_one_line(edgeinfer_home, capsys, command):
    store = Store()
    _bad_store(edgeinfer_home, store)
    for tag in [*_bad_manifests(store), "elsewhere", "fifo"]:
        ref = f"bad:{tag}"
        argv = {"show": ["show", ref], "rm": ["rm", ref], "run": ["run", ref, "hi", "-n", "1"]}[command]
        code = main(argv)
        out, err = capsys.readouterr()
        if command == "rm":  # removing the damaged manifest itself is what rm is for
            assert code == 0 and "removed the damaged manifest" in out, (ref, out, err)
            assert not (edgeinfer_home / "manifests" / "bad" / f"{tag}.json").exists()
        else:
            assert code == 1, (ref, out, err)
            one_line_error(err, "damaged manifest", f"{tag}.json")


def test_damaged_default_manifest_keeps_every_command_working(edgeinfer_home, capsys):
    store = Store()
    path = edgeinfer_home / "manifests" / "smollm2-135m-instruct" / "q4_1.json"
    store.get(DEFAULT_MODEL)
    for content in ([], "{ truncated", {"name": 1}):
        _write_manifest(edgeinfer_home, "smollm2-135m-instruct", "q4_1", content)
        for argv in (["list"], ["show"], ["du"], ["gc", "--dry-run"]):
            assert main(argv) == 0, argv
            out, err = capsys.readouterr()
            assert "Traceback" not in err
        assert json.loads(path.read_text())["name"] == "smollm2-135m-instruct"  # registered again
    # nothing lost without a word: each damaged manifest was kept beside it, and said so
    kept = sorted(path.parent.glob("q4_1.json.damaged-*"))
    assert kept, list(path.parent.iterdir())


def test_a_manifest_is_never_followed_outside_the_store(edgeinfer_home, tmp_path, capsys):
    """`rm` with a manifest whose `file` points outside the store, whose name holds `../`, or whose
    folder is a link elsewhere: nothing outside is deleted."""
    store = Store()
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "important.gguf"
    victim.write_bytes(b"precious")
    (victim_dir / "x.json").write_text(json.dumps(_manifest(store, name="x", tag="x", owned=True, file=str(victim))))
    # 1. owned, but the file is outside the store
    _write_manifest(edgeinfer_home, "outside", "q4", _manifest(store, name="outside", tag="q4", owned=True,
                                                              file=str(victim)))
    # 2. owned, file is the victim's folder itself
    _write_manifest(edgeinfer_home, "folder", "q4", _manifest(store, name="folder", tag="q4", owned=True,
                                                             file=str(victim_dir)))
    # 3. a name that climbs out
    _write_manifest(edgeinfer_home, "climb", "q4", _manifest(store, name="../../victim", tag="q4", owned=True,
                                                            file=str(victim)))
    # 4. a file inside the store's models folder reached through a link to the outside
    link_dir = edgeinfer_home / "models" / "linked"
    link_dir.parent.mkdir(parents=True, exist_ok=True)
    link_dir.symlink_to(victim_dir)
    _write_manifest(edgeinfer_home, "linked", "q4", _manifest(store, name="linked", tag="q4", owned=True,
                                                             file=str(link_dir / "important.gguf")))
    # 5. the manifest folder itself is a link to the outside
    (edgeinfer_home / "manifests" / "x").symlink_to(victim_dir)
    # 6. the store's models folder itself
    _write_manifest(edgeinfer_home, "models", "q4", _manifest(store, name="models", tag="q4", owned=True,
                                                             file=str(edgeinfer_home / "models")))
    # 7. a model file in the store that is a link to the outside
    (edgeinfer_home / "models" / "a").mkdir()
    (edgeinfer_home / "models" / "a" / "a-q4.gguf").symlink_to(victim)
    _write_manifest(edgeinfer_home, "a", "q4", _manifest(store, name="a", tag="q4", owned=True,
                                                        file=str(edgeinfer_home / "models" / "a" / "a-q4.gguf")))

    for ref in ("outside:q4", "folder:q4", "climb:q4", "linked:q4", "x:x", "models:q4", "a:q4"):
        main(["rm", ref])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in victim_dir.iterdir()) == ["important.gguf", "x.json"]
    assert (edgeinfer_home / "models").is_dir()
    # a purge never follows them either
    main(["rm", "--purge", "x:x"])
    main(["gc"])
    capsys.readouterr()
    assert victim.read_bytes() == b"precious"


def test_a_file_two_manifests_name_is_kept_until_the_last(edgeinfer_home, default_model_path):
    import shutil

    store = Store()
    target = store.model_path("twin", "a")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(default_model_path, target)
    store.register(target, "twin", "a", sha256=store.get(DEFAULT_MODEL).sha256)  # a copy: the same bytes
    store.save(dataclasses.replace(store.get("twin:a"), tag="b"))
    store.remove("twin:a")
    assert target.exists()  # twin:b still names it
    store.remove("twin:b")
    assert not target.exists()


# -- the default model -------------------------------------------------------------------------------

def test_rm_default_model_refuses_and_keeps_metrics(capsys):
    store = Store()
    store.update_metrics(DEFAULT_MODEL, "bench", {"decode_tok_s": 99.0})
    assert main(["rm", DEFAULT_MODEL]) == 1
    one_line_error(capsys.readouterr().err, "the default model cannot be removed", "rm --purge")
    assert store.get(DEFAULT_MODEL).metrics["bench"]["decode_tok_s"] == 99.0
    assert main(["rm", "--purge", DEFAULT_MODEL]) == 0
    assert "forgot" in capsys.readouterr().out
    assert store.get(DEFAULT_MODEL).metrics == {}  # back, fresh
    with pytest.raises(StoreError, match="cannot be removed"):
        store.remove(DEFAULT_MODEL)


# -- convert -o --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_models import make_random_hf_model

    return make_random_hf_model(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama", hidden=64, layers=1,
                                heads=2, kv_heads=1, intermediate=128, dtype="float16")


def test_convert_output_refuses_what_is_not_a_new_or_regular_file(edgeinfer_home, tmp_path, tiny_hf, capsys):
    store = Store()
    d = tmp_path / "a-folder"
    d.mkdir()
    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(b"someone's file")
    link = tmp_path / "link.gguf"
    link.symlink_to(elsewhere)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    inside = store.model_path("mine", "f16")
    cases = {"/dev/null": "device", str(d): "directory", str(link): "symbolic link", str(fifo): "special file",
             str(inside): "inside the store"}
    for target, needle in cases.items():
        assert main(["convert", str(tiny_hf), "-o", target]) == 1, target
        one_line_error(capsys.readouterr().err, needle)
    assert elsewhere.read_bytes() == b"someone's file"
    assert Path("/dev/null").is_char_device() and d.is_dir() and link.is_symlink() and fifo.is_fifo()
    assert not inside.exists()
    with pytest.raises(InvalidOptionError):
        store.check_output("/dev/zero")


@pytest.mark.slow  # three conversions, each new file loaded once in a child process
def test_convert_output_onto_another_entrys_file_needs_force(edgeinfer_home, tmp_path, tiny_hf, capsys):
    store = Store()
    out = tmp_path / "out" / "model.gguf"
    assert main(["convert", str(tiny_hf), "-o", str(out), "--name", "first"]) == 0
    capsys.readouterr()
    first = store.get("first:f16")
    assert first.path == out.resolve() and not first.owned
    # another entry would take over that file behind first's manifest: refused
    assert main(["convert", str(tiny_hf), "-o", str(out), "--name", "second", "--outtype", "f32"]) == 1
    one_line_error(capsys.readouterr().err, "first:f16", "--force")
    assert store.get("first:f16").sha256 == first.sha256
    # --force replaces the file and drops the manifest that described the old one
    assert main(["convert", str(tiny_hf), "-o", str(out), "--name", "second", "--outtype", "f32", "--force"]) == 0
    err = capsys.readouterr().err
    assert "first:f16" in err and "dropped" in err
    assert store.find("first:f16") is None
    second = store.get("second:f32")
    assert second.path == out.resolve() and "F32" in str(second.quant)
    from edgeinfer.fsutil import sha256_file

    assert sha256_file(out) == second.sha256  # the manifest describes the bytes on disk


# -- leftovers: du lists them, gc removes them ---------------------------------------------------------

def _age(path: Path) -> Path:
    os.utime(path, (LONG_AGO, LONG_AGO))
    return path


def _leftover(path: Path, size: int) -> Path:
    """A file of `size` zero bytes, old enough that no running writer can own it."""
    path.write_bytes(b"\0" * size)
    return _age(path)


def test_du_and_gc_find_partials_and_orphans(edgeinfer_home, tmp_path, capsys):
    store = Store()
    models = store.models_dir
    (models / "x").mkdir()
    partial = _leftover(models / "x" / f".x-q4_k_m.gguf.abc123{PARTIAL_SUFFIX}", 4096)
    orphan = _leftover(models / "x" / "x-q8_0.gguf", 8192)
    manifest_partial = store.manifests_dir / "x" / f".q8_0.json.zz{PARTIAL_SUFFIX}"
    manifest_partial.parent.mkdir(parents=True)
    manifest_partial.write_text("{")
    _age(manifest_partial)
    fresh = models / "x" / f".x-new.gguf.fresh{PARTIAL_SUFFIX}"  # newer than this process: maybe in use
    fresh.write_bytes(b"1")
    notes = models / "x" / "notes.txt"
    notes.write_text("mine")
    _age(notes)
    outside = tmp_path / f".y.gguf.q{PARTIAL_SUFFIX}"
    outside.write_bytes(b"not the store's")
    _age(outside)

    assert main(["du"]) == 0
    out = capsys.readouterr().out
    assert "unused:" in out and "3 file(s)" in out, out
    for p in (partial, orphan, manifest_partial):
        assert str(p) in out
    assert str(fresh) not in out and "notes.txt" not in out

    assert main(["gc", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and partial.exists()
    assert main(["gc"]) == 0
    out = capsys.readouterr().out
    assert "removed 3 file(s)" in out, out
    assert not partial.exists() and not orphan.exists() and not manifest_partial.exists()
    assert fresh.exists() and notes.exists() and outside.exists()
    assert main(["gc"]) == 0 and "nothing to collect" in capsys.readouterr().out


def test_rm_purge_also_removes_that_models_leftovers(edgeinfer_home, capsys):
    store = Store()
    store.register(store.get(DEFAULT_MODEL).path, "x", "q4", owned=False)
    models = store.models_dir
    (models / "x").mkdir()
    (models / "y").mkdir()
    partial = _leftover(models / "x" / f".x-q8_0.gguf.abc{PARTIAL_SUFFIX}", 4096)
    orphan = _leftover(models / "x" / "x-q2_k.gguf", 8192)
    other = _leftover(models / "y" / f".y-q8_0.gguf.def{PARTIAL_SUFFIX}", 4096)  # another model's: not rm's business
    assert main(["rm", "--purge", "x:q4"]) == 0
    out = capsys.readouterr().out
    assert "removed x:q4" in out
    assert f"removed partial file {partial}" in out and f"removed orphan file {orphan}" in out, out
    assert not partial.exists() and not orphan.exists() and other.exists()
    assert store.get(DEFAULT_MODEL).path.exists()  # the file it named is not the store's


def test_gc_spares_live_writers_and_registered_files(edgeinfer_home, default_model_path):
    import shutil

    store = Store()
    # a registered model file, old
    target = store.model_path("kept", "q4_1")
    target.parent.mkdir(parents=True)
    shutil.copy(default_model_path, target)
    store.register(target, "kept", "q4_1", sha256=store.get(DEFAULT_MODEL).sha256)  # a copy: the same bytes
    _age(target)
    # a write in progress (atomic_path's flock), old-looking
    writing = store.model_path("busy", "q4_0")
    inside = threading.Event()
    release = threading.Event()
    seen: list[Path] = []

    class Abandoned(Exception):
        pass

    def writer() -> None:
        try:
            with atomic_path(writing) as tmp:
                tmp.write_bytes(b"half")
                _age(tmp)
                seen.append(tmp)
                inside.set()
                release.wait(30)
                raise Abandoned  # then given up: the temp file goes
        except Abandoned:
            pass

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert inside.wait(30)
        # an unregistered file of a name whose writer holds the lock (between rename and register)
        orphan_locked = store.model_path("locked", "q8_0")
        orphan_locked.parent.mkdir(parents=True)
        orphan_locked.write_bytes(b"done, not yet registered")
        _age(orphan_locked)
        holder = threading.Event()
        done = threading.Event()

        def hold() -> None:
            with store.writing("locked", "q8_0"):
                holder.set()
                done.wait(30)

        h = threading.Thread(target=hold)
        h.start()
        assert holder.wait(30)
        assert store.garbage() == [] and store.collect_garbage() == []
        done.set()
        h.join()
        assert [g.path for g in store.garbage()] == [orphan_locked]
        assert seen[0].exists() and target.exists()
    finally:
        release.set()
        t.join()
    assert not seen[0].exists()


# -- two writers of one name -----------------------------------------------------------------------------

def test_second_writer_of_a_name_fails_clearly():
    store = Store()
    with writer_elsewhere(store, "same", "q4_k_m"):
        with pytest.raises(StoreError, match="being written by another process"):
            with store.writing("same", "q4_k_m"):
                pass
        with store.writing("same", "q4_0"):  # another name is free
            pass
    with store.writing("same", "q4_k_m"):  # and the name is free again
        pass


@pytest.fixture(scope="module")
def big_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic F16 model large enough that quantizing it with one thread takes seconds."""
    from test_quantize import make_synthetic_gguf

    return make_synthetic_gguf(tmp_path_factory.mktemp("big") / "synthetic-big-f16.gguf", n_embd=512, n_ff=1536,
                               n_layer=6, n_head=8, n_head_kv=4)


def _partials(home: Path) -> list[Path]:
    return [p for p in (home / "models").rglob(f"*{PARTIAL_SUFFIX}")] if (home / "models").exists() else []


def _start_quantize(source: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgeinfer", "quantize", str(source), "--type", "Q4_K_M",
                             "--threads", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=os.environ.copy())


def _wait_for(predicate, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended first: {proc.communicate()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)  # polling a predicate (the child's file), not waiting for time to pass


def _open_by_a_process(path: Path) -> bool:
    """Whether any process has `path` open (Linux's /proc/PID/fd)."""
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == str(path) for fd in fds.iterdir()):
                return True
        except OSError:  # a process that ended, or one of another user
            continue
    return False


@pytest.mark.slow
def test_kill_during_quantize_leaves_a_partial_that_du_shows_and_gc_removes(edgeinfer_home, big_f16):
    proc = _start_quantize(big_f16)
    _wait_for(lambda: any(p.stat().st_size > 1 << 20 for p in _partials(edgeinfer_home)), proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    partials = _partials(edgeinfer_home)
    assert len(partials) == 1
    # The quantizer child dies with its parent, but a moment later on a loaded machine: until its
    # lock goes, the partial is a live writer's, which du rightly does not call unused.
    _wait_for(lambda: not being_written(partials[0]), timeout=30)
    # du counts only files older than itself, and a write of the dying child can land after the
    # lock has gone (once under load): wait until no process has the partial open, and its last
    # write is more than a clock tick (du's start time is in ticks) older than du will be.
    _wait_for(lambda: not _open_by_a_process(partials[0]), timeout=30)
    _wait_for(lambda: time.time() - partials[0].stat().st_mtime > 0.1, timeout=30)
    du = subprocess.run([sys.executable, "-m", "edgeinfer", "du"], capture_output=True, text=True, timeout=120)
    assert du.returncode == 0 and str(partials[0]) in du.stdout and "unused:" in du.stdout, du.stdout + du.stderr
    gc = subprocess.run([sys.executable, "-m", "edgeinfer", "gc"], capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0 and "removed 1 file(s)" in gc.stdout, gc.stdout + gc.stderr
    assert _partials(edgeinfer_home) == []
    assert [p for p in (edgeinfer_home / "models").rglob("*") if p.is_file()] == []


@pytest.mark.slow
def test_two_concurrent_quantize_runs_to_one_name_never_both_succeed(edgeinfer_home, big_f16):
    first = _start_quantize(big_f16)
    _wait_for(lambda: bool(_partials(edgeinfer_home)), proc=first)  # the first holds the name now
    second = _start_quantize(big_f16)
    out2, err2 = second.communicate(timeout=300)
    out1, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1
    assert second.returncode == 1, out2
    # while the first runs: "being written"; if the second came late: "already in the store"
    line = one_line_error(err2.decode())
    assert "being written by another process" in line or "already in the store" in line, line
    assert Store().get("synthetic-big:q4_k_m").quant == "Q4_K_M"
    assert _partials(edgeinfer_home) == []


@pytest.mark.slow
def test_quantize_to_a_name_another_process_is_writing_fails_at_once(edgeinfer_home, big_f16):
    store = Store()
    with writer_elsewhere(store, "synthetic-big", "q4_k_m"):
        r = subprocess.run([sys.executable, "-m", "edgeinfer", "quantize", str(big_f16), "--type", "Q4_K_M"],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    one_line_error(r.stderr, "synthetic-big:q4_k_m is being written by another process")
    assert _partials(edgeinfer_home) == [] and store.find("synthetic-big:q4_k_m") is None
