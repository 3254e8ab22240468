"""Pulls that end in a model that answers: a GGUF repo holding the real default model, a safetensors
repo exported from it (converted and quantized on the way), and a sharded one (keeping the F16)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_server import HubServer, point_client_at, tiny_gguf

import edgeinfer
from edgeinfer import hub as hubmod
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
    server = HubServer().start()
    point_client_at(monkeypatch, server.url, tmp_path / "hf-cache")
    yield server
    server.stop()


def test_gguf_repo_pull_answers_like_the_file_it_came_from(hub, tmp_path, default_model_path):
    hub.add_repo(
        "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
        {
            "SmolLM2-135M-Instruct-Q4_1.gguf": default_model_path,
            "SmolLM2-135M-Instruct-Q8_0.gguf": tiny_gguf(tmp_path / "q8.gguf", "Q8_0"),
            "README.md": "# SmolLM2\n",
        },
    )
    result = hubmod.pull("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1")
    m = result.manifest
    assert m.ref == "smollm2-135m-instruct:q4_1" and m.source["kind"] == "hub" and not m.owned
    assert result.fit is not None and result.fit.fits and result.fit.estimate.weights < m.size
    tokens, text = _greedy(m.ref)
    assert text.strip()
    assert tokens == _greedy(default_model_path)[0]  # the same bytes answer the same way


def test_safetensors_repo_pull_converts_quantizes_and_answers(hub, tmp_path_factory):
    from hf_models import cached_default_export

    folder = cached_default_export(tmp_path_factory, "bfloat16")
    commit = hub.add_repo("HuggingFaceTB/SmolLM2-135M-Instruct", _folder_files(folder))
    events: list[object] = []
    result = hubmod.pull("HuggingFaceTB/SmolLM2-135M-Instruct", profile="balanced", on_progress=events.append)
    m = result.manifest
    assert (m.name, m.quant, m.owned) == ("smollm2-135m-instruct", "Q4_K_M", True)
    assert m.source["repo"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and m.source["revision"] == commit
    assert m.source["profile"] == "balanced" and "model.safetensors" in m.source["files"]
    assert Store().find("smollm2-135m-instruct:f16") is None  # not kept
    stages = [e.stage for e in events if isinstance(e, hubmod.PullStage)]
    assert stages[:2] == ["convert", "quantize"]
    tokens, text = _greedy(m.ref)
    assert text.strip()


def test_sharded_repo_keeps_f16_and_reuses_it(hub, tmp_path):
    from hf_models import export_default_model_to_hf

    folder = export_default_model_to_hf(tmp_path / "sharded", "bfloat16", shards=2)
    files = _folder_files(folder)
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) == 2
    hub.add_repo("tester/SmolLM2-sharded", files)
    r1 = hubmod.pull("tester/SmolLM2-sharded", quant="Q8_0", keep_f16=True)
    assert r1.manifest.tag == "q8_0" and r1.f16_manifest is not None
    assert r1.manifest.derived_from == r1.f16_manifest.ref
    tokens, text = _greedy(r1.manifest.ref)
    assert text.strip()
    # a later quant starts from the kept F16: no conversion, no download
    events: list[object] = []
    r2 = hubmod.pull("tester/SmolLM2-sharded", quant="Q4_0", on_progress=events.append)
    assert r2.downloaded_bytes == 0 and r2.manifest.tag == "q4_0"
    assert "convert" not in [e.stage for e in events if isinstance(e, hubmod.PullStage)]
