"""Memory estimates, recommend, bandwidth roofline and bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_quantize import make_synthetic_gguf, synthetic_f16  # noqa: F401 (session fixture)


def test_kv_cache_and_weights_from_metadata(default_model_path: Path):
    from edgeinfer import read_gguf
    from edgeinfer.fit import estimate_memory

    info = read_gguf(default_model_path)
    md = info.metadata
    head_dim = md["llama.embedding_length"] // md["llama.attention.head_count"]
    e = estimate_memory(info, 4096, "f16")
    assert e.weights == sum(t.n_bytes for t in info.tensors)
    assert e.kv_cache == md["llama.block_count"] * 4096 * md["llama.attention.head_count_kv"] * head_dim * 2 * 2
    q8 = estimate_memory(info, 4096, "q8_0")
    assert q8.kv_cache == pytest.approx(e.kv_cache * 34 / 64)
    assert estimate_memory(info, 8192, "f16").kv_cache == 2 * e.kv_cache
    assert e.total == e.weights + e.kv_cache + e.compute and e.compute > 0


def test_available_memory_is_plausible():
    from edgeinfer.fit import available_memory

    total = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < available_memory() <= total


def test_fit_cli_exit_codes(capsys: pytest.CaptureFixture[str]):
    from edgeinfer.cli import main

    assert main(["fit", "--ctx", "2048"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out and "fits        yes" in out
    assert main(["fit", "--ctx", "2048", "--kv-type", "q9"]) == 1


@pytest.mark.slow
def test_recommend_picks_by_measured_quality(synthetic_f16: Path, capsys: pytest.CaptureFixture[str]):
    from edgeinfer import Store
    from edgeinfer.cli import main
    from edgeinfer.fit import recommend
    from edgeinfer.quantize import quantize_model

    store = Store()
    refs = {q: quantize_model(synthetic_f16, q, embedding_type="F16", output_type="F16", tag=q.lower(),
                              n_threads=2).manifest.ref for q in ("Q8_0", "Q4_K_M", "Q2_K")}
    measured = {"Q8_0": (0.004, 90.0), "Q4_K_M": (0.06, 150.0), "Q2_K": (0.4, 200.0)}
    for q, (kld, speed) in measured.items():
        store.update_metrics(refs[q], "eval", {"kld": kld, "ppl": 10.0, "same_top": 0.9})
        store.update_metrics(refs[q], "bench", {"decode_tok_s": speed})
    assert recommend("synthetic-llama").choice.ref == refs["Q8_0"]
    assert recommend("synthetic-llama", min_quality=0.1).choice.ref == refs["Q4_K_M"]  # fastest good enough
    # memory that only the Q2_K file fits in
    need = {c.ref: c.fit.estimate.total for c in recommend("synthetic-llama").candidates}
    only_q2 = (need[refs["Q2_K"]] + min(need[refs["Q4_K_M"]], need[refs["Q8_0"]])) // 2
    assert recommend("synthetic-llama", available=only_q2).choice.ref == refs["Q2_K"]
    assert recommend("synthetic-llama", available=only_q2, min_quality=0.1).choice is None
    assert recommend("synthetic-llama", available=1).choice is None
    assert main(["recommend", "synthetic-llama", "--ctx", "1024"]) == 0
    assert f"recommended: {refs['Q8_0']}" in capsys.readouterr().out


@pytest.mark.slow
def test_bandwidth_and_bytes_per_token(default_model_path: Path, tmp_path: Path):
    from edgeinfer import read_gguf
    from edgeinfer.bench import bytes_per_token, measure_bandwidth

    bw = measure_bandwidth(64 << 20, repeats=3)
    assert 0.5e9 < bw < 1e12
    tied = read_gguf(default_model_path)  # SmolLM2 ties output to token_embd: the whole table is read
    assert "output.weight" not in {t.name for t in tied.tensors}
    assert bytes_per_token(tied) == tied.tensor_bytes
    untied = read_gguf(make_synthetic_gguf(tmp_path / "s.gguf"))
    emb = next(t for t in untied.tensors if t.name == "token_embd.weight")
    assert bytes_per_token(untied) == untied.tensor_bytes - emb.n_bytes + emb.n_bytes // emb.shape[1]


@pytest.mark.slow
def test_bench_default_model(capsys: pytest.CaptureFixture[str]):
    import json

    import edgeinfer
    from edgeinfer import Store
    from edgeinfer.cli import main

    # --save-busy: this machine may be shared right now; the figures are then saved marked busy.
    assert main(["bench", "--prompt-tokens", "32", "--decode-tokens", "8", "--repeats", "1", "--json",
                 "--save-busy", "--flash-depth", "64"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["model"] == "smollm2-135m-instruct:q4_1"
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["prompt_tokens"] == 32
    assert r["roofline_tok_s"] == pytest.approx(r["bandwidth_bytes_s"] / r["bytes_per_token"])
    assert 0 < r["roofline_fraction"] < 3  # decode cannot be far beyond the memory roofline
    saved = Store().get("smollm2-135m-instruct:q4_1").metrics["bench"]
    assert saved["decode_tok_s"] == r["decode_tok_s"] and saved["busy"] == r["busy"]
    assert r["load"]["before"] >= 0 and r["load"]["threads"] >= 1
    # flash attention timed on and off after 64 tokens; the next load that leaves it unset takes the verdict
    fa = r["flash_attn"]
    assert fa["depth"] == 64 and min(fa["decode_on_s"], fa["decode_off_s"], fa["prefill_on_s"]) > 0
    verdict = edgeinfer.FlashAttnChoice.from_dict(fa).flash_attn
    with edgeinfer.load(n_ctx=256) as engine:
        assert engine.options.flash_attn is verdict


@pytest.mark.slow
def test_bench_on_a_busy_machine_saves_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    import json

    import edgeinfer
    import edgeinfer.bench
    from edgeinfer import Store
    from edgeinfer.cli import main

    monkeypatch.setattr(edgeinfer.bench.MachineLoad, "now", staticmethod(lambda: 40.0))  # 40 runnable processes
    assert main(["bench", "--prompt-tokens", "16", "--decode-tokens", "4", "--repeats", "1", "--json",
                 "--flash-depth", "32"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["busy"] is True
    assert "bench" not in Store().get("smollm2-135m-instruct:q4_1").metrics
    assert r["flash_attn"]["depth"] == 32
    with edgeinfer.load(n_ctx=256) as engine:  # the verdict of a busy machine is not kept either
        assert engine.options.flash_attn is None
    assert main(["bench", "--prompt-tokens", "16", "--decode-tokens", "4", "--repeats", "1", "--json",
                 "--flash-depth", "0"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["flash_attn"] is None


@pytest.mark.slow
@pytest.mark.parametrize(("ctx", "kv"), [(1024, "f16"), (4096, "q8_0")])
def test_estimate_against_llama_cpp_buffers(default_model_path: Path, ctx: int, kv: str):
    """KV cache exactly, compute buffer within 25 %, as llama.cpp itself reports them when loading."""
    import re

    import edgeinfer
    from edgeinfer import read_gguf
    from edgeinfer.engine.llama.runtime import log_capture
    from edgeinfer.fit import estimate_memory

    lines: list[str] = []
    with log_capture(lambda level, text: lines.append(text)):
        edgeinfer.load(default_model_path, edgeinfer.LoadOptions(n_ctx=ctx, kv_type=kv, n_threads=2)).close()
    log = "".join(lines)
    kv_mib = float(re.search(r"CPU KV buffer size =\s*([\d.]+) MiB", log).group(1))
    compute_mib = float(re.search(r"CPU compute buffer size =\s*([\d.]+) MiB", log).group(1))
    est = estimate_memory(read_gguf(default_model_path), ctx, kv)
    assert est.kv_cache / 2**20 == pytest.approx(kv_mib, abs=0.01)
    assert est.compute / 2**20 == pytest.approx(compute_mib, rel=0.25)


def test_ladder_names_a_member_by_its_tag_where_that_says_more():
    from edgeinfer.fit import member_label

    assert member_label("Q4_K_M", "q4_k_m") == "Q4_K_M"
    assert member_label("IQ3_S", "iq3_s-noimat") == "IQ3_S-NOIMAT"  # the same type made without the imatrix
    assert member_label("MXFP4_MOE", "mxfp4") == "MXFP4"  # llama.cpp's only MXFP4 file type
    assert member_label(None, "custom") == "CUSTOM"
