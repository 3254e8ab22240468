"""The smaller frictions a new user met in one run (issue 44), each as the user meets it: flags
before the prompt, a base model without a chat template, a keep-alive unload nobody was told of,
`bench` naming the default model "None", and `embed` naming a flag without its dashes."""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.cli import build_parser, main

from hostile.gguf_samples import DROP, write_model

GREEDY = ["--temperature", "0", "-n", "6"]


def test_run_takes_its_flags_before_the_prompt():
    """`run MODEL --temperature 0 "prompt"` used to fail with "unrecognized arguments: prompt"."""
    parser = build_parser()
    for argv in (["run", "m:q4", "--temperature", "0", "Say hi"], ["run", "--temperature", "0", "m:q4", "Say hi"],
                 ["run", "m:q4", "Say hi", "--temperature", "0"]):
        args = parser.parse_args(argv)
        assert (args.args, args.temperature) == (["m:q4", "Say hi"], 0.0), argv
    args = parser.parse_args(["run", "m:q4", "-n", "3", "--", "-a prompt with a dash"])
    assert (args.args, args.max_tokens) == (["m:q4", "-a prompt with a dash"], 3)
    with pytest.raises(SystemExit):  # an unknown flag is still an error
        parser.parse_args(["run", "m:q4", "--bogus", "1", "Say hi"])


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A real GGUF llama.cpp loads (random weights) whose metadata has no chat template."""
    return write_model(tmp_path_factory.mktemp("base") / "base-model.gguf", meta={"tokenizer.chat_template": DROP})


def _run_json(capsys, *argv: str) -> tuple[dict, str]:
    assert main(["run", *argv, *GREEDY, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


@pytest.mark.slow
def test_a_model_without_a_chat_template_is_said_and_run_raw(base_model, capsys):
    with edgeinfer.load(base_model, n_ctx=128) as engine:
        assert not engine.has_chat_template
        raw_prompt = len(engine.tokenize("Hello world"))
        engine.chat_template = "chatml"
        assert engine.has_chat_template  # chosen: it has one now
    got, err = _run_json(capsys, str(base_model), "Hello world")
    assert "has no chat template" in err and "completed as raw text" in err and "--chatml" in err
    raw, raw_err = _run_json(capsys, str(base_model), "--raw", "Hello world")
    assert "no chat template" not in raw_err  # asked for: nothing to say
    assert got["tokens"] == raw["tokens"] and got["stats"]["prompt_tokens"] == raw_prompt  # the text alone
    chatml, chatml_err = _run_json(capsys, str(base_model), "--chatml", "Hello world")
    assert "no chat template" not in chatml_err and chatml["stats"]["prompt_tokens"] > raw_prompt + 5  # its markers


@pytest.mark.slow
def test_the_line_chat_of_a_base_model_continues_the_text(base_model):
    from edgeinfer.cli._interactive import line_chat

    options = edgeinfer.GenerateOptions(max_tokens=5, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    lines = iter(["Hello world", "the a is", "/bye"])
    out = io.StringIO()
    with edgeinfer.load(base_model, n_ctx=128) as engine:
        assert line_chat(engine, options, None, read=lambda _prompt: next(lines), out=out, err=io.StringIO(),
                         raw=True) == 0
        first = "".join(e.text for e in engine.generate("Hello world", options) if isinstance(e, edgeinfer.TokenEvent))
        second = "".join(e.text for e in engine.generate(f"Hello world\n{first}\nthe a is", options)
                         if isinstance(e, edgeinfer.TokenEvent))
    assert out.getvalue() == f"{first}\n{second}\n"


def test_a_model_with_a_template_has_one(default_engine):
    assert default_engine.has_chat_template


@pytest.mark.slow
def test_serve_says_when_a_keep_alive_unloads_a_model(tmp_path, default_model_path):
    """`--keep-alive 1s`: the model loaded at start is unloaded a second later, and the server's
    log says so (it used to unload silently)."""
    env = dict(os.environ, EDGEINFER_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", "--port", "0", "--keep-alive", "1s",
                             "--parallel", "1", "--ctx", "512"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    got: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [got.put(line) for line in proc.stderr], daemon=True).start()
    lines = []
    try:
        deadline = time.monotonic() + 120
        while not any("unloaded" in line for line in lines):  # (a server that never says it: fails at the deadline)
            try:
                lines.append(got.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = "".join(lines)
    assert "edgeinfer: unloading smollm2-135m-instruct:q4_1 (keep_alive 1 s ran out)\n" in text, text
    assert "edgeinfer: unloaded smollm2-135m-instruct:q4_1\n" in text, text


def test_bench_progress_names_the_default_model(monkeypatch):
    """`edgeinfer bench` without a model printed "… prefill+decode None"."""
    import edgeinfer.bench as bench

    seen = []
    monkeypatch.setattr(bench, "measure_bandwidth", lambda: 1e9)
    monkeypatch.setattr(bench, "bench", lambda m, **kw: m)  # the measuring itself is tested elsewhere
    bench.bench_many([None], on_progress=seen.append)
    assert [(p.phase, p.model) for p in seen] == [("bandwidth", ""), ("prefill+decode", edgeinfer.DEFAULT_MODEL)]


@pytest.mark.slow
def test_embed_names_the_pooling_flag_as_it_is_typed(tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("hello\n")
    assert main(["embed", "-f", str(texts)]) == 1  # the default model is a chat model: no pooling of its own
    err = capsys.readouterr().err
    assert "`--pooling mean`" in err and err.count("\n") == 1, err
