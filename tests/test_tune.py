"""`edgeinfer tune` on the real default model, as a user runs it: a subprocess, a real store, the
profile it keeps used by run, chat, serve and show; Ctrl-C, a changed file, a bound nothing meets.

Speeds are never asserted (they are measured in benchmarks/bench_tune.py); what is asserted is what
the program does with them. The workload is two short requests so that a search fits in seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import edgeinfer

pytestmark = pytest.mark.slow

EDGEINFER = [sys.executable, "-m", "edgeinfer"]
WORKLOAD = ('{"name": "hello", "prompt": "Say hello in one short sentence.", "max_tokens": 8}\n'
            '{"name": "copy", "prompt": "Repeat exactly: def add(a, b):\\n    return a + b", "max_tokens": 16}\n')


def cli(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGEINFER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "EDGEINFER_HOME": str(home)})


def one_line_error(r: subprocess.CompletedProcess, pattern: str) -> str:
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("edgeinfer: tune: ")]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), r.stderr
    assert pattern in lines[0] and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("workload") / "small.jsonl"
    path.write_text(WORKLOAD)
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, workload) -> tuple[Path, dict, Path]:
    """One tune of the default model in a store of its own: (home, its --json result, the --plot file).
    Its space holds only prompt lookup with q8_0 caches, so its choice is never the untuned defaults
    and `run` shows whether it used it."""
    home = tmp_path_factory.mktemp("tuned") / "home"
    plot = home.parent / "frontier.svg"
    r = cli(home, "tune", "--workload", str(workload), "--budget", "12s", "--methods", "lookup", "--kv-types", "q8_0",
            "--quality-chunks", "1",
            "--json", "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    return home, json.loads(r.stdout), plot


def test_tune_keeps_a_profile_that_run_uses_and_untuned_does_not(tuned):
    home, result, plot = tuned
    choice = result["choice"]["setup"]
    assert choice["speculate"] == "lookup" and choice["kv_type_k"] == choice["kv_type_v"] == "q8_0"
    assert result["choice"]["kld"] + 2 * result["choice"]["kld_err"] <= result["max_kld"] and result["choice"]["chosen"]
    assert result["choice"]["kld_err"] > 0  # measured by tune (a q8_0 cache): its standard error comes with it
    assert Path(result["profile"]).is_file() and Path(result["plot"]).is_file()
    for picture in (Path(result["plot"]), plot):  # the store's copy and --plot's
        assert len(ET.parse(picture).getroot().findall("{http://www.w3.org/2000/svg}circle")) >= 1

    used = cli(home, "run", "Say hi", "-n", "6", "--temperature", "0", "--json")
    assert used.returncode == 0, used.stderr
    out = json.loads(used.stdout)
    assert out["tuned"] == choice and out["model"] == choice["model"]
    assert out["stats"]["speculation"]["method"] == "lookup"  # the profile's, not the default (off)
    assert "edgeinfer: tuned: " in used.stderr

    untuned = cli(home, "run", "Say hi", "-n", "6", "--temperature", "0", "--json", "--untuned")
    assert untuned.returncode == 0, untuned.stderr
    out = json.loads(untuned.stdout)
    assert out["tuned"] is None and "speculation" not in out["stats"] and "tuned" not in untuned.stderr

    flag = cli(home, "run", "Say hi", "-n", "6", "--temperature", "0", "--json", "--speculate", "off")
    assert "speculation" not in json.loads(flag.stdout)["stats"]  # a flag overrides its field


def test_show_reports_the_profile_and_its_frontier(tuned):
    home, result, _plot = tuned
    shown = json.loads(cli(home, "show", "--json").stdout)["tuned"]
    assert shown["status"].startswith("used by run, chat and serve")
    assert shown["setup"] == result["choice"]["label"].replace("q4_1", "smollm2-135m-instruct:q4_1", 1)
    text = cli(home, "show").stdout
    assert "tuned frontier" in text and re.search(r"^\*\s+q4_1 kv q8_0", text, re.M), text


def test_the_tuis_model_rows_carry_the_profile_as_a_character_plot(tuned, monkeypatch):
    from edgeinfer_tui.backend import entry_from_manifest

    home, result, _plot = tuned
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    store = edgeinfer.Store()
    entry = entry_from_manifest(store.get(result["model"]), store=store)
    assert entry.tuned.startswith(f"tuned: {result['model']} kv q8_0") and "*" in entry.tuned
    assert entry.tuned.splitlines()[-1].startswith("tok/s up, KLD across")


def test_chat_and_serve_take_the_profile_under_their_flags(tuned, monkeypatch):
    import edgeinfer_tui

    from edgeinfer.cli import build_parser, main
    from edgeinfer.cli.serve import _service_options

    home, result, _plot = tuned
    choice = result["choice"]["setup"]
    monkeypatch.setenv("EDGEINFER_HOME", str(home))
    seen = []
    monkeypatch.setattr(edgeinfer_tui, "run", lambda model, **kw: seen.append((model, kw)) or 0)
    assert main(["chat"]) == 0 and main(["chat", "--untuned"]) == 0 and main(["chat", "--kv-type", "f16"]) == 0
    (model, kw), (plain_model, plain), (_m, flagged) = seen
    assert model == choice["model"] and kw["kv_types"] == ("q8_0", "q8_0") and kw["speculation"] == "lookup"
    assert kw["load_options"].kv_types == ("q8_0", "q8_0")
    assert plain_model is None and plain["kv_types"] is None and plain["speculation"] is None
    assert flagged["kv_types"] == ("f16", "f16") and flagged["speculation"] == "lookup"

    store = edgeinfer.Store()
    options = _service_options(build_parser().parse_args(["serve"]), store)
    assert options.default_model == choice["model"]
    table = options.models[choice["model"]]
    assert (table.speculate, table.kv_type_k, table.kv_type_v) == ("lookup", "q8_0", "q8_0")
    flagged = _service_options(build_parser().parse_args(["serve", "--speculate", "off"]), store)
    assert flagged.default_settings.speculate == "off"  # the flag, over the profile's table
    plain = _service_options(build_parser().parse_args(["serve", "--untuned"]), store)
    assert plain.default_model is None and not plain.models

    # a profile with slots for serve (tune --serve) gives them to the default model, under --parallel
    from dataclasses import replace

    from edgeinfer.tune.profile import profile_path, save_profile

    target = store.get(result["model"])
    saved = profile_path(store, target).read_bytes()
    try:
        profile = edgeinfer.tuned_status(store, target).profile
        save_profile(store, target, replace(profile, serve={"parallel": 3, "ctx": 3 * 2048}))
        table = _service_options(build_parser().parse_args(["serve"]), store).models[choice["model"]]
        assert (table.parallel, table.ctx) == (3, 6144)
        flagged = _service_options(build_parser().parse_args(["serve", "--parallel", "2"]), store)
        assert flagged.default_settings.parallel == 2
    finally:
        profile_path(store, target).write_bytes(saved)


def test_a_changed_model_file_invalidates_the_profile(tmp_path, default_model_path, workload):
    home = tmp_path / "home"
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(default_model_path.read_bytes())
    edgeinfer.Store(home).register(copy, "mine", "q4_1", owned=False)
    r = cli(home, "tune", "mine", "--workload", str(workload), "--budget", "6s", "--methods", "off", "--kv-types", "f16")
    assert r.returncode == 0, r.stderr
    assert "chose  mine:q4_1" in r.stdout and "edgeinfer: tuned: " in cli(home, "run", "mine", "hi", "-n", "2").stderr
    copy.write_bytes(default_model_path.read_bytes())  # the same bytes, written again: another file now
    r = cli(home, "run", "mine", "hi", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tuned"] is None
    assert "not using the tuned profile of mine:q4_1: the model file of mine:q4_1 changed" in r.stderr
    assert "not used: the model file" in json.loads(cli(home, "show", "mine", "--json").stdout)["tuned"]["status"]


def test_a_quality_bound_nothing_meets_is_a_clear_error(tuned, workload):
    # the tuned store knows the KLD of the q8_0 cache already: nothing is measured before the answer
    home, result, _plot = tuned
    profile = Path(result["profile"])
    before = profile.read_bytes()
    r = cli(home, "tune", "--workload", str(workload), "--budget", "40s", "--methods", "off", "--kv-types", "q8_0",
            "--quality-chunks", "1", "--max-kld", "0")
    line = one_line_error(r, "no setup of smollm2-135m-instruct within")
    assert re.search(r"meets --max-kld 0: the closest is smollm2-135m-instruct:q4_1 with a q8_0 cache, KLD 0\.\d{4}", line)
    assert "screen:" not in r.stderr  # known KLDs: no speed was measured for nothing
    assert profile.read_bytes() == before  # no silent fallback: the old choice stays as it was
    one_line_error(cli(home, "tune", "--memory", "1M", "--workload", str(workload)), "fits in 0.00 GiB")
    one_line_error(cli(home, "tune", "--plot", "x.png"), "written as SVG")
    r = cli(home, "tune", "--quality-chunks", "0")
    assert r.returncode == 2 and "--quality-chunks: must be between 1 and 64, got 0" in r.stderr, r.stderr
    long = home.parent / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 6000, "max_tokens": 4}) + "\n")
    one_line_error(cli(home, "tune", "--workload", str(long), "--methods", "off", "--kv-types", "f16", "--no-save"),
                   "a workload request does not fit in smollm2-135m-instruct:q4_1's context")


def test_ctrl_c_mid_tune_keeps_the_measurements(tmp_path, workload):
    home = tmp_path / "home"
    proc = subprocess.Popen([*EDGEINFER, "tune", "--workload", str(workload), "--budget", "10m", "--methods",
                             "off,lookup", "--kv-types", "f16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "EDGEINFER_HOME": str(home)})
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # progress lines; "best:" once a measurement is in
        seen.append(line)
        if "| best: " in line:
            break
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err
    kept = re.search(r"edgeinfer: interrupted: (\d+) measurements? kept in the store; `edgeinfer tune` goes on", err)
    assert kept and int(kept.group(1)) >= 1 and "Traceback" not in err, err
    assert not list(home.glob("manifests/*/*.tuned"))

    again = cli(home, "tune", "--workload", str(workload), "--budget", "5s", "--methods", "off,lookup", "--kv-types",
                "f16", "--json", "--no-save")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused"] >= int(kept.group(1))
    assert not list(home.glob("manifests/*/*.tuned"))  # --no-save

    fresh = cli(home, "tune", "--workload", str(workload), "--methods", "off", "--kv-types", "f16", "--exhaustive",
                "--fresh", "--serve", "--json", "--no-save")
    assert fresh.returncode == 0, fresh.stderr
    data = json.loads(fresh.stdout)
    assert data["reused"] == 0 and data["exhaustive"]
    setups = {(r["setup"]["flash_attn"], r["setup"]["threads"]) for r in data["rows"]}
    assert all(r["measurement"]["level"] == 2 for r in data["rows"]) and len(setups) == len(data["rows"]) >= 2
    # --serve: the choice with 2 and 4 slots, each the context `run` gets, split within the 8192 trained
    assert [(r["parallel"], r["ctx"]) for r in data["serve_runs"]] == [(2, 8192), (4, 8192)]
    assert data["serve"] is None or data["serve"] in data["serve_runs"]


def test_make_quantizes_rungs_and_measures_against_the_f16_copy(tmp_path, workload):
    home = tmp_path / "home"
    # --make's F16 copy and Q8_0 count against the budget: 6 s left no time to measure one setup whole
    # on a slow, busy machine (a clean-clone run, 2026-12-05: "raise --budget").
    r = cli(home, "tune", "--workload", str(workload), "--budget", "15s", "--make", "Q8_0", "--methods", "off",
            "--quality-chunks", "1", "--kv-types", "f16", "--json", "--no-save")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["reference"] == "smollm2-135m-instruct:f16"
    assert not any(n.startswith("no full-precision") for n in data["notes"])
    refs = {m.ref for m in edgeinfer.Store(home).list()}
    assert {"smollm2-135m-instruct:f16", "smollm2-135m-instruct:q8_0"} <= refs
    assert "making Q8_0 from smollm2-135m-instruct:f16" in r.stderr


def test_the_library_reports_progress_and_promotes_only_the_contenders(edgeinfer_home, workload):
    """edgeinfer.tune() in-process: the progress callback sees the stages in order with the best so
    far, and successive halving measures only its finalists on the whole workload (level 2)."""
    from edgeinfer.tune.search import _FINALISTS

    events: list[edgeinfer.TuneProgress] = []
    result = edgeinfer.tune(None, workload=workload, budget=300, methods=("off", "lookup"),
                            kv_pairs=(("f16", "f16"),), save=False, progress=events.append)
    stages = [e.stage for e in events]
    order = ["screen", "combine", "halve", "final", "done"]
    seen = [s for s in dict.fromkeys(stages) if s in order]
    assert seen == [s for s in order if s in seen] and seen[0] == "screen" and seen[-1] == "done", stages
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(events, events[1:]))
    assert all(e.budget_s == 300 for e in events) and any(e.best for e in events if e.stage == "final"), events
    assert result.choice.chosen and result.choice in result.rows and result.profile_path is None
    assert events[-1].stage == "done" and result.choice.setup.label() in events[-1].message

    # 2 fa values x 2 thread counts x (off, lookup, lookup capped at 6): 12 setups of one rung. The
    # screen takes the defaults and the 4 setups one knob away, the combination at most 2 more: not all
    levels = [(r.setup.label(), r.level) for r in result.rows]
    assert 3 <= len(result.rows) < 12, levels
    at = {lvl: [r for r in result.rows if r.level == lvl] for lvl in (0, 1, 2)}
    assert result.baseline is not None and result.baseline.level == 2  # the defaults, for the speed-up
    finalists = [r for r in at[2] if r.setup != result.baseline.setup]
    assert len(finalists) <= _FINALISTS and at[0], levels
    assert result.choice.level == 2 and result.choice.setup.label() in (r.setup.label() for r in at[2])
    assert result.choice.measurement.tok_s == max(r.measurement.tok_s for r in at[2])


def test_each_measured_run_of_suffix_drafts_from_a_fresh_memory(edgeinfer_home, workload, monkeypatch):
    """`suffix` and `auto` remember answers: measured on one loaded engine one after the other (as a
    load key's setups are), a run must not draft from an earlier run's answer to the same prompt.
    In-process, one load of the default model, two short requests per run: a few seconds."""
    from edgeinfer.engine.faces.engine import Engine
    from edgeinfer.tune.measure import LEVELS, Measurer
    from edgeinfer.tune.space import METHODS, Setup
    from edgeinfer.tune.workload import load_workload

    assert "suffix" in METHODS
    seen: list = []
    chat = Engine.chat

    def recording(self, *args, **kwargs):
        gen = chat(self, *args, **kwargs)
        seen.append(gen)
        return gen

    monkeypatch.setattr(Engine, "chat", recording)
    store = edgeinfer.Store()
    model = store.resolve(None)[1].ref
    # the same speculation twice (draft_max 32 is the default), then auto: three runs on one engine
    setups = [Setup(model, speculate="suffix"), Setup(model, speculate="suffix", draft_max=32),
              Setup(model, speculate="auto")]
    results = []
    Measurer(store, load_workload(workload)).measure(setups, LEVELS[2], lambda s, m, why: results.append((s, m, why)))
    assert [why for _s, _m, why in results] == ["", "", ""], results
    speculating = [g for g in seen if g.options.speculation.method != "off"]  # item by item, each run's
    # no accepted token of any run came from an earlier answer (its drafts: the prompt and its own text;
    # how many it drafts varies a little with the cost curve the engine learns as it goes)
    remembered = [g.done.stats.speculation.remembered for g in speculating]
    assert remembered == [0] * 6, remembered
    runs: dict[str, list] = {}  # scope -> the run's requests (the items in order)
    for g in speculating:
        runs.setdefault(g.options.speculation.memory_scope, []).append(g)
    assert [len(r) for r in runs.values()] == [2, 2, 2], runs  # a scope per run, both its requests in it
    first, again, _auto = runs.values()
    assert [g.done.tokens for g in again] == [g.done.tokens for g in first]

    # The control: on one scope, the same request's second answer does draft from the first's.
    item = load_workload(workload).items[1]
    options = item.options(edgeinfer.SpeculationOptions(method="suffix", memory_scope="one"))
    with edgeinfer.load(model, store=store) as engine:
        answers = [engine.chat(item.chat_messages(model), options).result() for _ in range(2)]
    assert answers[0].stats.speculation.remembered == 0 < answers[1].stats.speculation.remembered
