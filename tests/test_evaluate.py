"""Evaluation agrees with an independent numpy computation from the raw llama.cpp logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
CTX, CHUNKS = 64, 2  # two chunks: what is per chunk and what is summed over them


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """float64 log-softmax via logaddexp (a different formula from edgeinfer.evaluate's max-shift)."""
    return x - np.logaddexp.reduce(x, axis=axis, keepdims=True)


@pytest.fixture(scope="module")
def q4_0_copy(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A requantized Q4_0 copy of the default model, kept outside the per-test stores."""
    import warnings

    from edgeinfer import Store
    from edgeinfer.quantize import quantize_model

    store = Store(tmp_path_factory.mktemp("eval-store"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = quantize_model(default_model_path, "Q4_0", store=store, allow_requantize=True, n_threads=2)
    return r.path


def _numpy_reference(model: Path, reference: Path, text: str, kv: str = "f16") -> dict[str, float]:
    """PPL, KLD, same-top and Δp written from the definitions, on logits of whole chunks (start=0);
    `kv`: the model's KV-cache type (the reference's is f16)."""
    import edgeinfer

    with edgeinfer.load(reference, edgeinfer.LoadOptions(n_ctx=CTX)) as ref, \
            edgeinfer.load(model, edgeinfer.LoadOptions(n_ctx=CTX, kv_type=kv)) as q:
        tokens = ref.tokenize(text, add_special=True)
        nll, ref_nll, kld, same, dp = [], [], [], [], []
        for c in range(CHUNKS):
            chunk = tokens[c * CTX : (c + 1) * CTX]  # SmolLM2 adds no BOS, so no replacement
            lq = log_softmax(q.logits(chunk).astype(np.float64), axis=-1)
            lr = log_softmax(ref.logits(chunk).astype(np.float64), axis=-1)
            for j in range(CTX // 2, CTX - 1):
                t = chunk[j + 1]
                nll.append(-lq[j, t])
                ref_nll.append(-lr[j, t])
                kld.append(float(np.sum(np.exp(lr[j]) * (lr[j] - lq[j]))))
                same.append(int(np.argmax(lq[j]) == np.argmax(lr[j])))
                dp.append(np.exp(lq[j, t]) - np.exp(lr[j, t]))
    return {
        "positions": len(nll),
        "ppl": float(np.exp(np.mean(nll))),
        "ref_ppl": float(np.exp(np.mean(ref_nll))),
        "kld": float(np.mean(kld)),
        "same_top": float(np.mean(same)),
        "delta_p": float(np.mean(dp)),
    }


@pytest.mark.slow
def test_eval_matches_numpy(q4_0_copy: Path, default_model_path: Path):
    from edgeinfer.evaluate import default_eval_text, evaluate

    text = default_eval_text()
    r = evaluate(q4_0_copy, default_model_path, text=text, ctx=CTX, chunks=CHUNKS)
    ref = _numpy_reference(q4_0_copy, default_model_path, text)
    assert r.positions == ref["positions"] == CHUNKS * (CTX - 1 - CTX // 2)
    assert r.ppl == pytest.approx(ref["ppl"], rel=1e-5)
    assert r.ref_ppl == pytest.approx(ref["ref_ppl"], rel=1e-5)
    assert r.kld == pytest.approx(ref["kld"], rel=1e-4, abs=1e-7)
    assert r.same_top == pytest.approx(ref["same_top"], abs=1.5 / r.positions)
    assert r.delta_p == pytest.approx(ref["delta_p"], rel=1e-4, abs=1e-7)
    assert 0 < r.kld < 1 and 0.5 < r.same_top < 1  # a real, small quantization loss
    assert r.ppl_ratio == pytest.approx(r.ppl / r.ref_ppl)


@pytest.mark.slow
def test_a_cache_pair_per_model_matches_numpy_with_that_cache(q4_0_copy: Path, default_model_path: Path):
    """model_kv_types: one model twice, with an f16 and a q8_0 cache, against one reference pass (what
    tune measures a ladder's cache types with); each result is the numpy one with that cache."""
    import edgeinfer
    from edgeinfer.evaluate import default_eval_text, evaluate_many

    text = default_eval_text()
    plain, q8 = evaluate_many([q4_0_copy, q4_0_copy], default_model_path, text=text, ctx=CTX, chunks=CHUNKS,
                              save=False, model_kv_types=[("f16", "f16"), ("q8_0", "q8_0")])
    assert (plain.kv_types, q8.kv_types) == ("f16/f16", "q8_0/q8_0")
    for result, kv in ((plain, "f16"), (q8, "q8_0")):
        ref = _numpy_reference(q4_0_copy, default_model_path, text, kv)
        assert result.kld == pytest.approx(ref["kld"], rel=1e-4, abs=1e-7)
        assert result.ppl == pytest.approx(ref["ppl"], rel=1e-5)
    assert q8.kld != plain.kld  # the quantized cache is measured, not the f16 one twice
    with pytest.raises(edgeinfer.InvalidOptionError, match="model_kv_types has 1 pairs for 2 models"):
        evaluate_many([q4_0_copy, q4_0_copy], default_model_path, text=text, ctx=CTX, chunks=1,
                      model_kv_types=[("f16", "f16")])


def test_chunks_replace_first_token_with_bos():
    from edgeinfer import ContextLengthError
    from edgeinfer.evaluate import make_chunks

    toks = list(range(10, 30))
    assert make_chunks(toks, 8, None, 1) == [[1, *range(11, 18)], [1, *range(19, 26)]]
    assert make_chunks(toks, 8, 1, None) == [list(range(10, 18))]
    with pytest.raises(ContextLengthError):
        make_chunks(toks, 64, None, None)


@pytest.mark.slow
def test_eval_saves_metrics_and_ladder_table(default_model_path: Path, capsys: pytest.CaptureFixture[str]):
    import warnings

    from edgeinfer import Store
    from edgeinfer.cli import main
    from edgeinfer.quantize import quantize_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model("smollm2-135m-instruct:q4_1", "Q8_0", allow_requantize=True, n_threads=2)
    # default reference: the model it was derived from
    assert main(["eval", "smollm2-135m-instruct:q8_0", "--ctx", "64", "--chunks", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "reference  smollm2-135m-instruct:q4_1" in out and "KLD" in out
    ev = Store().get("smollm2-135m-instruct:q8_0").metrics["eval"]
    assert ev["reference"] == "smollm2-135m-instruct:q4_1" and ev["chunks"] == 2 and ev["ctx"] == 64
    assert Store().get("smollm2-135m-instruct:q4_1").metrics["eval"]["kld"] == 0.0

    assert main(["eval", "--ladder", "smollm2-135m-instruct", "--ctx", "64", "--chunks", "2", "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "PPL ratio" in out and "Q8_0" in out and "Q4_1 (ref)" in out


@pytest.mark.slow
@pytest.mark.parametrize("as_callable", [False, True], ids=["event", "callable"])
def test_a_cancel_stops_the_evaluation_between_chunks(default_model_path: Path, as_callable: bool):
    """The same cancel protocol as pull/convert/quantize: a token set after the first chunk stops
    the evaluation before the second with Cancelled."""
    import threading

    from edgeinfer import Cancelled
    from edgeinfer.evaluate import EvalProgress, evaluate

    stop = threading.Event()
    seen: list[EvalProgress] = []

    def on_progress(p: EvalProgress) -> None:
        seen.append(p)
        stop.set()

    with pytest.raises(Cancelled, match="evaluation cancelled"):
        evaluate(default_model_path, None, ctx=CTX, chunks=CHUNKS, on_progress=on_progress,
                 cancel=stop.is_set if as_callable else stop)
    assert [(p.chunk, p.n_chunks) for p in seen] == [(1, CHUNKS)]  # stopped early: 1 of the chunks
