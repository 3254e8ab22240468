"""A real trained model survives GGUF -> HF -> GGUF: same tokenization, (almost) the same logits.

The default model (SmolLM2-135M-Instruct, Q4_1) is exported back to an HF folder by the test
helper (dequantized weights, q/k rope permutation undone, tokenizer.json with SmolLM's
pre-tokenizer, tokenizer_config.json with the chat template), converted with `convert_model`,
and compared with the original in llama.cpp.

Measured: the Q4_1 original and an F32 GGUF of exactly its (dequantized) weights already differ by
a mean KL of ~3e-3, because llama.cpp multiplies Q4_1 weights by Q8_1-quantized activations. So
logits are compared with that exact-weights GGUF (bound 1e-3), and against the original the round
trip may add at most 1e-3 on top of that floor. The exact-weights GGUF is llama.cpp's own F32
requantization of the original (metadata copied; its weights are bit-identical to gguf-py's
dequantization, which the export uses). An f32 conversion of a float32 export gives
logits bit-identical to the exact-weights GGUF (checked by hand; see the issue note).
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp  # noqa: F401 - a hard dependency: missing, these tests fail (never skip)
import numpy as np
import pytest

import edgeinfer
from edgeinfer.convert import convert_model

from hf_models import cached_default_export


STRINGS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * 12345); }",
    "3.14159265358979 and 1,000,000 and 0x7fff and 2024-11-29T13:15:00Z",
    "naïve café, Straße, Ærøskøbing, São Paulo, Ελληνικά, русский, עברית, العربية",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "runs   of    spaces\t\ttabs\n\n\nnewlines\r\n  \n    indented",
    "   leading and trailing spaces   ",
    "I'm sure they'll say it's fine, don't you think? We've seen it. YOU'RE RIGHT'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>edgeinfer<file_sep>README.md",
    "",
]

KL_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by wiring "
    "plugboards; later, stored programs let the same hardware run many tasks. Compilers turned "
    "human-readable code into machine instructions, and operating systems shared one computer among "
    "many users.\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([1, 2, 3, 4]))  # 2.5\n\n"
    "Q: What is the capital of France?\nA: Paris. It has about 2.1 million inhabitants, and the "
    "river Seine runs through it. Q: And of Japan?\nA: Tokyo, on the island of Honshu.\n\n"
    "| name  | size | speed |\n|-------|------|-------|\n| q4_0  | 4.5  | fast  |\n| q8_0  | 8.5  | ok    |\n"
)


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory) -> Path:
    folder = cached_default_export(tmp_path_factory, "bfloat16")
    out = tmp_path_factory.mktemp("roundtrip") / "smollm2-roundtrip-f16.gguf"
    result = convert_model(folder, "f16", out, register=False)
    return result.path


@pytest.mark.slow
def test_roundtrip_metadata(roundtrip, default_model_path):
    a, b = edgeinfer.read_gguf(default_model_path).metadata, edgeinfer.read_gguf(roundtrip).metadata
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                "tokenizer.chat_template", "llama.rope.freq_base", "llama.attention.head_count_kv",
                "llama.context_length", "llama.vocab_size"):
        assert b[key] == a[key], key
    assert b["general.license"] == "apache-2.0"


@pytest.mark.slow
def test_roundtrip_tokenization_matches_original(roundtrip, default_engine):
    with edgeinfer.load(roundtrip, n_ctx=512) as rt:
        for text in STRINGS:
            for add_special in (True, False):
                want = default_engine.tokenize(text, add_special=add_special, parse_special=True)
                got = rt.tokenize(text, add_special=add_special, parse_special=True)
                assert got == want, f"{text!r}: {got} != {want}"
            assert rt.detokenize(rt.tokenize(text, add_special=False)) == text


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def _kl(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, from log-probabilities."""
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


@pytest.mark.slow
def test_roundtrip_logits_kl_divergence(roundtrip, default_engine, default_model_copy):
    """Mean KL < 1e-3 against the original's exact weights; and the round trip adds < 1e-3 on top
    of what the Q4_1 original's own compute path (Q8_1 activations) already differs by."""
    tokens = default_engine.tokenize(KL_TEXT, add_special=True)
    assert 150 <= len(tokens) <= 600
    original = default_engine.logits(tokens)
    with edgeinfer.load(default_model_copy("F32"), n_ctx=1024) as e:
        exact_logits = e.logits(tokens)
    with edgeinfer.load(roundtrip, n_ctx=1024) as rt:
        rt_logits = rt.logits(tokens)

    lp_original, lp_exact, lp_rt = (_log_softmax(x) for x in (original, exact_logits, rt_logits))
    kl_exact = _kl(lp_exact, lp_rt)
    kl_orig = _kl(lp_original, lp_rt)
    floor = _kl(lp_original, lp_exact)  # the Q4_1 file vs its own weights in f32: not conversion's doing
    top1 = (original.argmax(1) == rt_logits.argmax(1)).mean()
    print(
        f"round trip (bf16 export -> f16) over {len(tokens)} tokens: mean KL vs exact weights {kl_exact.mean():.2e}; "
        f"vs Q4_1 original {kl_orig.mean():.2e} (Q4_1 vs its exact weights: {floor.mean():.2e}); "
        f"top-1 agreement with the original {top1:.3f}"
    )
    assert kl_exact.mean() < 1e-3
    assert kl_orig.mean() < floor.mean() + 1e-3
    assert top1 > 0.95
