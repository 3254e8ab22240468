"""`edgeinfer import PATH [--name NAME]`: a GGUF file the user has, copied into the store and
registered; every command and front end sees it by name; hostile inputs are one line and touch
nothing outside the store."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.cli import main
from edgeinfer.gguf_import import default_import_name

from hostile._support import one_line_error
from hostile.gguf_samples import write_model

FILE_NAME = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture
def user_file(tmp_path: Path, default_model_path: Path) -> Path:
    """A copy of the default model in the user's own folder, as a downloaded file would be."""
    folder = tmp_path / "downloads"
    folder.mkdir()
    path = folder / FILE_NAME
    shutil.copyfile(default_model_path, path)
    return path


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and mtime: what "nothing touched" compares."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            st = os.lstat(Path(dirpath) / f)
            out[str(Path(dirpath, f).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_default_name_is_the_file_name_without_its_quant_and_the_quant_is_the_tag():
    assert default_import_name(Path("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"), "Q4_K_M") == \
        ("qwen2.5-coder-1.5b-instruct", "q4_k_m")
    assert default_import_name(Path("gemma-3-270m.f16.gguf"), "F16") == ("gemma-3-270m", "f16")
    assert default_import_name(Path("Llama-3.2-1B-IQ4_XS.gguf"), "IQ4_XS") == ("llama-3.2-1b", "iq4_xs")
    assert default_import_name(Path("my model.gguf"), None) == ("my-model", "latest")


def test_import_copies_the_file_and_every_command_sees_it(user_file, edgeinfer_home, capsys):
    assert main(["import", str(user_file), "--name", "my-smol"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "my-smol:q4_1"
    assert "imported" in err and "copied into the store" in err
    store = edgeinfer.Store()
    m = store.get("my-smol:q4_1")
    # a copy of its own inside the store: not a link, not the user's inode
    assert Path(m.file).is_relative_to(edgeinfer_home) and not os.path.islink(m.file)
    assert os.stat(m.file).st_ino != os.stat(user_file).st_ino and os.stat(m.file).st_nlink == 1
    assert m.owned and m.source == {"kind": "import", "path": str(user_file.resolve())}
    assert m.quant == "Q4_1" and m.size == user_file.stat().st_size
    user_file.unlink()  # the user's file may go: the store keeps its own
    assert main(["list"]) == 0
    assert "my-smol:q4_1" in capsys.readouterr().out
    assert main(["show", "my-smol"]) == 0
    shown = capsys.readouterr().out
    assert "name: my-smol\n" in shown and "tag: q4_1\n" in shown
    assert main(["fit", "my-smol:q4_1", "--ctx", "1024"]) == 0
    assert "fits        yes" in capsys.readouterr().out
    assert main(["recommend", "my-smol"]) == 0
    assert "my-smol:q4_1" in capsys.readouterr().out
    # the chat's model picker (the TUI's real backend) and the server's /v1/models list it
    pytest.importorskip("textual")
    from edgeinfer_tui.backend import LibraryBackend

    assert "my-smol:q4_1" in [e.ref for e in LibraryBackend().list_models()]
    from starlette.testclient import TestClient

    from edgeinfer_server import create_app

    with edgeinfer.ModelService(edgeinfer.ServiceOptions()) as service:
        with TestClient(create_app(service), base_url="http://127.0.0.1") as http:
            ids = [d["id"] for d in http.get("/v1/models").json()["data"]]
    assert "my-smol:q4_1" in ids
    assert main(["rm", "my-smol:q4_1"]) == 0  # the store owns its copy: rm deletes it
    assert not Path(m.file).exists()


@pytest.mark.slow
def test_an_imported_model_runs_and_evaluates(user_file, capsys):
    assert main(["import", str(user_file), "--name", "imported"]) == 0
    ref = capsys.readouterr().out.strip()
    assert main(["run", ref, "-p", "Say hi", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["eval", ref, "--ctx", "128", "--chunks", "1"]) == 0
    assert "PPL" in capsys.readouterr().out


def test_the_default_name_joins_the_models_ladder(user_file, capsys):
    """Imported without --name, the file joins the ladder of the same model (another quant of it)."""
    from edgeinfer.fit import ladder

    code = main(["import", str(user_file)])
    # the default model already holds smollm2-135m-instruct:q4_1: the same ref is refused, not replaced
    assert code == 1
    one_line_error(capsys.readouterr().err, "smollm2-135m-instruct:q4_1 is already in the store")
    assert main(["import", str(user_file), "--name", "smollm2-135m-instruct:mine"]) == 0
    assert capsys.readouterr().out.strip() == "smollm2-135m-instruct:mine"
    assert [m.tag for m in ladder("smollm2-135m-instruct")] == ["mine", "q4_1"]


def _fifo(folder: Path) -> Path:
    path = folder / "pipe.gguf"
    os.mkfifo(path)
    return path


def _truncated(folder: Path, user_file: Path) -> Path:
    path = folder / "truncated.gguf"
    path.write_bytes(user_file.read_bytes()[: 1 << 20])
    return path


def _not_gguf(folder: Path, user_file: Path) -> Path:
    path = folder / "notes.gguf"
    path.write_text("these are my notes, not a model\n" * 10)
    return path


HOSTILE = [
    ("not a GGUF", lambda d, f: (str(_not_gguf(d, f)),), "not a GGUF file"),
    ("truncated", lambda d, f: (str(_truncated(d, f)),), "not a valid GGUF file"),
    ("a directory", lambda d, f: (str(d),), "is a directory"),
    ("a FIFO", lambda d, f: (str(_fifo(d)),), "is a FIFO"),
    ("a missing file", lambda d, f: (str(d / "nothing.gguf"),), "no such file"),
    ("a name with traversal", lambda d, f: (str(f), "--name", "../../outside"), "invalid model name"),
    ("an absolute name", lambda d, f: (str(f), "--name", "/etc/x"), "invalid model name"),
    ("a name with a bad tag", lambda d, f: (str(f), "--name", "ok:../x"), "invalid tag"),
    ("an existing name", lambda d, f: (str(f), "--name", edgeinfer.DEFAULT_MODEL), "already in the store"),
    ("a file inside the store", lambda d, f: (str(_store_file()),), "already inside the store"),
]


def _store_file() -> Path:
    """A GGUF inside the store's own folders (the default model's file lives in its package)."""
    store = edgeinfer.Store()
    target = store.models_dir / "x" / "x-q4_1.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store.get(edgeinfer.DEFAULT_MODEL).file, target)
    return target


@pytest.mark.parametrize("what,args,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_inputs_are_one_line_and_touch_nothing(what, args, message, user_file, edgeinfer_home, tmp_path,
                                                       capsys):
    edgeinfer.Store().list()  # the store as it is before (the default model registered)
    argv = ["import", *args(user_file.parent, user_file)]
    before_store, before_user = _tree(edgeinfer_home), _tree(tmp_path / "downloads")
    code = main(argv)
    assert code == 1
    one_line_error(capsys.readouterr().err, message)
    after = _tree(edgeinfer_home)
    # nothing registered or left in the store (its small caches may note what was read), nothing elsewhere
    assert {k for k in after if not k.startswith(("cache/", "locks/"))} == \
        {k for k in before_store if not k.startswith(("cache/", "locks/"))}
    assert _tree(tmp_path / "downloads") == before_user
    assert not (tmp_path / "outside").exists() and not (tmp_path.parent / "outside").exists()


def test_a_split_gguf_is_refused_with_how_to_merge_it(tmp_path, capsys):
    from gguf import GGUFValueType as T

    part = write_model(tmp_path / "model-00001-of-00002.gguf", meta={"split.count": (2, T.UINT16)})
    assert main(["import", str(part)]) == 1
    one_line_error(capsys.readouterr().err, "split in 2", "llama-gguf-split --merge")


def test_a_file_that_changes_while_it_is_copied_is_refused_and_nothing_stays(user_file, edgeinfer_home, monkeypatch):
    """The copy is what the store keeps, so the copy is what is checked: a file truncated after its
    first 8 MiB were read is refused, and no partial file or manifest is left."""
    import edgeinfer.gguf_import as gi

    monkeypatch.setattr(gi, "_clone", lambda src, dst: False)  # the copy path, also on a file system with clones
    seen = []

    def shrink(p: edgeinfer.ImportProgress) -> None:
        seen.append(p.done)
        if len(seen) == 1:
            os.truncate(user_file, p.done + 100)

    with pytest.raises(edgeinfer.InvalidModelError, match="shrank while it was copied"):
        edgeinfer.import_gguf(user_file, "changing", on_progress=shrink)
    assert edgeinfer.Store().find("changing") is None
    assert not list((edgeinfer_home / "models").rglob("*changing*"))


def test_a_cancelled_import_leaves_nothing(user_file, edgeinfer_home, monkeypatch):
    import edgeinfer.gguf_import as gi

    monkeypatch.setattr(gi, "_clone", lambda src, dst: False)
    progress: list[int] = []
    with pytest.raises(edgeinfer.Cancelled):
        edgeinfer.import_gguf(user_file, "stopped", on_progress=lambda p: progress.append(p.done),
                              cancel=lambda: bool(progress))
    assert progress and progress[0] < user_file.stat().st_size  # cancelled mid-copy
    assert edgeinfer.Store().find("stopped") is None
    assert not list((edgeinfer_home / "models").rglob("*stopped*"))


@pytest.mark.parametrize("argv", [["pull", "{f}"], ["pull", "./model.gguf"], ["recommend", "{f}"],
                                  ["recommend", "/no/such/dir/model.gguf"]])
def test_pull_and_recommend_of_a_local_file_say_to_import_it(argv, user_file, capsys):
    argv = [a.format(f=user_file) for a in argv]
    assert main(argv) == 1
    one_line_error(capsys.readouterr().err, "is a file on this machine", f"edgeinfer import {argv[1]}")


def test_the_tui_import_task_registers_the_file(user_file):
    """The chat UI's manage screen runs the same import (its real backend)."""
    pytest.importorskip("textual")
    from edgeinfer_tui.backend import LibraryBackend, TaskProgress

    bars: list[TaskProgress] = []
    result = LibraryBackend().run_task("import", {"source": str(user_file), "name": "from-tui"}, bars.append, None)
    assert result == "import: done → from-tui:q4_1"
    assert bars and bars[-1].done == bars[-1].total == user_file.stat().st_size
    assert stat.S_ISREG(os.lstat(edgeinfer.Store().get("from-tui").file).st_mode)
