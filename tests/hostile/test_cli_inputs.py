"""Hostile command lines: numbers that would wrap through ctypes or start 9,999 threads, bytes
that are not UTF-8, model names that are misspelled, a disk that fills up mid-write.

Every case must end in one clear line (argparse's exit 2 or our exit 1), never a traceback, and
leave no file behind.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edgeinfer import DEFAULT_MODEL, Store
from edgeinfer.cli import main
from edgeinfer.errors import DiskSpaceError, InvalidOptionError

from ._support import one_line_error

MAX_THREADS = 4 * (os.cpu_count() or 1)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return one_line_error(capsys.readouterr().err, *needles)


# -- numbers --------------------------------------------------------------------------------------------

BAD_NUMBERS = [
    (["run", "hi", "--threads", "9999"], f"between 1 and {MAX_THREADS}"),
    (["run", "hi", "--threads", "2147483648"], "--threads"),
    (["run", "hi", "--threads", "0"], "--threads"),
    (["run", "hi", "--threads", "-1"], "--threads"),
    (["run", "hi", "--threads", "abc"], "expected an integer"),
    (["run", "hi", "--threads", "1e3"], "expected an integer"),
    (["run", "hi", "--threads", ""], "expected an integer"),
    (["run", "hi", "--top-k", "1099511627776"], "--top-k"),
    (["run", "hi", "--top-k", "-1"], "--top-k"),
    (["run", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["run", "hi", "-n", "2147483648"], "--max-tokens"),
    (["run", "hi", "--seed", "9223372036854775808"], "--seed"),  # int64, as OpenAI
    (["run", "hi", "--seed", "-9223372036854775809"], "--seed"),
    (["run", "hi", "--ctx", "2147483648"], "--ctx"),
    (["run", "hi", "--ctx", "0"], "--ctx"),
    (["run", "hi", "--draft-max", "1099511627776"], "--draft-max"),
    (["run", "hi", "--draft-min", "-5"], "--draft-min"),
    (["quantize", DEFAULT_MODEL, "--type", "Q4_K_M", "--threads", "9999"], "--threads"),
    (["bench", "--threads", "9999"], "--threads"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--flash-depth", "-1"], "--flash-depth"),
    (["bench", "--prompt-tokens", "2147483648"], "--prompt-tokens"),
    (["eval", DEFAULT_MODEL, "--ctx", "2147483648"], "--ctx"),
    (["eval", DEFAULT_MODEL, "--chunks", "0"], "--chunks"),
    (["eval", DEFAULT_MODEL, "--threads", "0"], "--threads"),
    (["fit", "--ctx", "99999999999"], "--ctx"),
    (["recommend", "x", "--ctx", "-3"], "--ctx"),
    (["chat", "--threads", "9999"], "--threads"),
    (["chat", "--ctx", "2147483648"], "--ctx"),
]


@pytest.mark.parametrize("argv,needle", BAD_NUMBERS, ids=[" ".join(a) for a, _ in BAD_NUMBERS])
def test_out_of_range_numbers_are_one_line_usage_errors(argv, needle, capsys, edgeinfer_home):
    _usage_error(argv, capsys, needle)
    assert not (edgeinfer_home / "models").exists() or not any((edgeinfer_home / "models").rglob("*.gguf"))


def test_quantize_api_bounds_threads(default_model_path):
    from edgeinfer.quantize import quantize_model

    for bad in (9999, 2**31, 0, -1, True, "2"):
        with pytest.raises(InvalidOptionError, match="threads"):
            quantize_model(DEFAULT_MODEL, "F16", n_threads=bad)  # type: ignore[arg-type]
    assert not any(Store().models_dir.rglob("*"))


def test_context_below_the_minimum_states_it(capsys):
    _usage_error(["run", "hi", "--ctx", "10"], capsys, "at least 16", "the smallest real one is 256")


# -- misspelled models ------------------------------------------------------------------------------------

def test_a_misspelled_model_is_not_taken_as_the_prompt(capsys):
    assert main(["run", "smolm2-135m-instruct:q4_1", "-n", "10"]) == 1
    line = one_line_error(capsys.readouterr().err, "no model smolm2-135m-instruct:q4_1",
                           f"did you mean {DEFAULT_MODEL}?", "-p")
    assert "—" in line
    # uppercase, as people type it
    assert main(["run", "SmolLM2-135M-Instruct:Q4_1"]) == 1
    one_line_error(capsys.readouterr().err, f"did you mean {DEFAULT_MODEL}?")
    # nothing close: still not a prompt
    assert main(["run", "hello:world"]) == 1
    one_line_error(capsys.readouterr().err, "no model hello:world", "edgeinfer list")
    assert main(["run", "nothing-here.gguf"]) == 1
    one_line_error(capsys.readouterr().err, "no model nothing-here.gguf", "no such file")
    # the two-argument form names the closest model too
    assert main(["run", "smollm2-135m-instruct:q4_0", "hi"]) == 1
    one_line_error(capsys.readouterr().err, "not in the store", f"did you mean {DEFAULT_MODEL}")
    assert main(["show", "smollm2-135m-instruct:q8"]) == 1
    one_line_error(capsys.readouterr().err, f"did you mean {DEFAULT_MODEL}")


@pytest.mark.slow
def test_a_prompt_that_looks_like_a_model_name_goes_through_p(capsys):
    assert main(["run", "-p", "smolm2-135m-instruct:q4_1", "-n", "2", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "Traceback" not in err
    assert main(["run", DEFAULT_MODEL, "-p", "hello:world", "-n", "2", "--temperature", "0"]) == 0


# -- text that is not UTF-8 -------------------------------------------------------------------------------

def test_prompt_file_that_is_not_utf8(tmp_path, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café au lait".encode("latin-1"))
    assert main(["run", "-f", str(f)]) == 1
    one_line_error(capsys.readouterr().err, f"prompt file {f} is not UTF-8", "0xe9 at offset 3",
                    "--encoding-errors replace")


@pytest.mark.parametrize("argv", [
    ["run", "-p", "\udcff"],
    ["run", "ab\udcffcd"],
    ["run", DEFAULT_MODEL, "\udcfe"],
    ["run", "hi", "--system", "\udcff"],
    ["run", "hi", "--stop", "x\udcff"],
    ["run", "-p", "\ud800"],  # a surrogate no byte made
])
def test_command_line_text_that_is_not_utf8(argv, capsys):
    assert main(argv) == 1
    one_line_error(capsys.readouterr().err, "--encoding-errors replace")


def test_stdin_that_is_not_utf8(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\x80\x81 hello")))
    assert main(["run", "-f", "-"]) == 1
    one_line_error(capsys.readouterr().err, "standard input is not UTF-8", "0x80 at offset 0")


def test_a_prompt_file_that_never_ends_is_refused(capsys):
    assert main(["run", "-f", "/dev/zero"]) == 1
    one_line_error(capsys.readouterr().err, "larger than")
    assert main(["run", "-f", "/"]) == 1
    one_line_error(capsys.readouterr().err, "cannot read prompt file /")


@pytest.mark.slow
def test_encoding_errors_replace_reads_it_anyway(tmp_path, capsys):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"Say \xff hello.")
    assert main(["run", "-f", str(f), "--encoding-errors", "replace", "-n", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_real_argv_bytes_that_are_not_utf8():
    r = subprocess.run([sys.executable.encode(), b"-m", b"edgeinfer", b"run", b"\xff\xfe"], capture_output=True,
                       timeout=120)
    assert r.returncode == 1
    one_line_error(r.stderr.decode(), "the prompt argument is not UTF-8", "0xff at offset 0")


# -- a full disk ------------------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 100 MB tmpfs of our own (needs root; CI runs as root): a disk that can really fill up."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path) -> None:
    """Take every free byte of the file system (as another process writing would)."""
    with open(mnt / "filler", "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while f.write(b"\0" * chunk):
                    pass
            except OSError:
                pass


def _filler(mnt: Path) -> tuple[Callable[[object], None], list[bool]]:
    """A progress callback that fills the disk at the first event: the write fails mid-way."""
    filled: list[bool] = []

    def fill_once(_ev: object) -> None:
        if not filled:
            filled.append(True)
            _fill(mnt)

    return fill_once, filled


def test_full_disk_writing_a_manifest(small_fs, monkeypatch, capsys):
    monkeypatch.setenv("EDGEINFER_HOME", str(small_fs / "home"))
    store = Store()
    store.get(DEFAULT_MODEL)
    _fill(small_fs)
    with pytest.raises(DiskSpaceError, match=f"no space left on {small_fs} while writing .*q4_1.json"):
        store.update_metrics(DEFAULT_MODEL, "bench", {"decode_tok_s": 1.0})
    assert [p.name for p in (small_fs / "home" / "manifests" / "smollm2-135m-instruct").iterdir()] == ["q4_1.json"]


@pytest.mark.slow  # makes and converts a model
def test_full_disk_during_convert(small_fs, tmp_path):
    from edgeinfer.convert import convert_model
    from hf_models import make_random_hf_model

    src = make_random_hf_model(tmp_path / "tiny", "llama", hidden=64, layers=1, heads=2, kv_heads=1,
                               intermediate=128, dtype="float16")
    target = small_fs / "out" / "tiny.gguf"
    fill_once, filled = _filler(small_fs)
    with pytest.raises(DiskSpaceError, match=f"no space left on {small_fs} while writing {target}"):
        convert_model(src, "f32", target, on_progress=fill_once)
    assert filled and list((small_fs / "out").iterdir()) == []  # no partial left


@pytest.mark.slow
def test_full_disk_during_quantize_reads_no_space_left(small_fs, tmp_path, monkeypatch):
    """llama.cpp reports only `basic_ios::clear: iostream error`; the user reads which disk is full."""
    from edgeinfer.quantize import quantize_model
    from test_quantize import make_synthetic_gguf

    src = make_synthetic_gguf(tmp_path / "synthetic-f16.gguf", n_embd=256, n_layer=1)
    monkeypatch.setenv("EDGEINFER_HOME", str(small_fs / "home"))
    # Another process takes the disk right after the free-space check: llama.cpp's own writes fail.
    # (Filling it from the progress callback would race: the quantizer runs in a child process and
    # a model this small is written before the parent reads its first progress line.)
    import edgeinfer.quantize as quantize_module

    checked = []
    real_check = quantize_module.ensure_free_space

    def check_then_fill(*args, **kwargs):
        real_check(*args, **kwargs)
        checked.append(True)
        _fill(small_fs)

    monkeypatch.setattr(quantize_module, "ensure_free_space", check_then_fill)
    with pytest.raises(DiskSpaceError, match=f"no space left on {small_fs} while writing .*q8_0.gguf"):
        quantize_model(src, "Q8_0", n_threads=2)
    assert checked
    models = small_fs / "home" / "models"
    assert not models.exists() or [p for p in models.rglob("*") if p.is_file()] == []
    (small_fs / "filler").unlink()
    assert Store().find("synthetic-llama:q8_0") is None


# -- what the CLI prints ------------------------------------------------------------------------------------

def test_progress_bar_shows_no_rate_until_it_is_known():
    from edgeinfer.cli._common import ProgressBar

    out = io.StringIO()
    bar = ProgressBar("quantizing", 30, stream=out)
    start = bar.start
    bar.done = 0
    assert "/s" not in bar._line(start + 0.1) and "ETA" not in bar._line(start + 0.1)
    bar.done = 1
    assert "/s" not in bar._line(start + 0.2)  # too early to say
    bar.done = 3
    line = bar._line(start + 10.0)
    assert "0.3/s" in line and "0/s" not in line.replace("0.3/s", "") and "ETA" in line
    bytes_bar = ProgressBar("pulling", None, unit="B", stream=out)
    bytes_bar.done = 0
    assert "/s" not in bytes_bar._line(bytes_bar.start + 5)


def test_show_leaves_out_empty_fields(capsys):
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert "derived_from" not in out and "None" not in out
    assert "metrics:" not in out  # nothing measured yet
    assert "gguf:" in out and "file_type: Q4_1" in out
    Store().update_metrics(DEFAULT_MODEL, "bench", {"decode_tok_s": 50.0})
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert "metrics:" in out and "decode_tok_s: 50.0" in out


@pytest.mark.slow
def test_a_rounded_context_is_said(capsys):
    assert main(["run", "hi", "--ctx", "64", "-n", "1", "--temperature", "0"]) == 0
    assert "context of 64 tokens rounded to 256 by llama.cpp" in capsys.readouterr().err


@pytest.mark.slow
def test_top_k_above_the_vocabulary_is_refused(capsys):
    """--top-k fits a C int at the CLI; the engine then bounds it by the model's vocabulary."""
    assert main(["run", "hi", "--top-k", "2147483647", "-n", "1"]) == 1
    one_line_error(capsys.readouterr().err, "top_k must be at most the vocabulary size")
