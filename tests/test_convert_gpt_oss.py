"""OpenAI gpt-oss checkpoints convert to llama.cpp's `gpt-oss`, their MXFP4 experts kept bit for bit.

The checkpoint is tiny and random, written here in the published layout (openai/gpt-oss-20b's
config keys and tensor names, without edgeinfer): experts as `*_blocks` uint8 [E, rows, in/32, 16]
(element 2i in the low nibble) with `*_scales` uint8 E8M0 exponents, gate and up rows interleaved,
everything else BF16, a byte-level BPE tokenizer with the o200k pre-tokenizer and harmony's special
tokens, the chat template in chat_template.jinja. Checked:
- (fast) outtype "auto" writes every expert stack as MXFP4 whose blocks are the checkpoint's bytes
  (scale byte, then codes j and j+16 per byte: ggml's block_mxfp4, built here from the published
  layout) and whose values, as llama.cpp's own dequantize_row_mxfp4 computes them, equal the
  published formula E2M1 code x 2^(scale - 127) computed here in numpy;
- (fast) the GGUF has the keys llama.cpp's loader reads for gpt-oss, the tokenizer is "gpt-4o";
- (fast) hostile packings are one-line ConversionErrors;
- (slow: loads the model) llama.cpp's logits match a numpy forward pass of the published formula's
  weights written here from llama.cpp's graph (models/openai-moe.cpp): RMSNorm, attention with a
  per-head sink logit in the softmax, a 4-token sliding window on even layers, NEOX rope with yarn
  (gpt-oss's own factor 32 and original context 4096, applied as ggml does: corrections dims
  floored/ceiled, magnitude 1 + 0.1 ln 32), top-k routing then a softmax over the k, and the
  clamped SwiGLU (gate <= 7, |up| <= 7, alpha 1.702, (up + 1)). For the same weights in the BF16
  release layout (unquantized, transposed stacks) too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeinfer.convert import convert_model
from edgeinfer.errors import ConversionError
from edgeinfer.gguf_file import read_gguf

from checkpoint_io import ggml_dequantize
from fp4_checkpoints import E2M1
from hf_models import _bf16_bits
from quant_checkpoints import write_raw_safetensors

H, LAYERS, E, K, HD, NH, NKV, FF, WINDOW = 64, 2, 4, 2, 16, 4, 2, 64, 4
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>"]
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant"


# -- the checkpoint, in the published layout ---------------------------------------------------------
def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tokenizer(folder: Path) -> int:
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["i", "n"], ["Ġ", "a"]]
    tokens = _byte_tokens() + ["".join(m) for m in merges]
    added = [{"id": len(tokens) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
               {"type": "Split", "pattern": {"Regex": O200K}, "behavior": "Isolated", "invert": False}, byte_level]},
           "post_processor": None, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return len(tokens) + len(SPECIALS)


VOCAB = 272  # the tokenizer's 270 ids, padded (as gpt-oss pads 200019 to 201088)
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H, "num_hidden_layers": LAYERS,
    "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "intermediate_size": FF,
    "num_local_experts": E, "num_experts_per_tok": K, "experts_per_token": K, "vocab_size": VOCAB,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0, "attention_bias": True,
    "hidden_act": "silu", "tie_word_embeddings": False, "initial_context_length": 4096,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The published formula: [..., G, 16] bytes (element 2i low nibble, 2i+1 high) and [..., G]
    E8M0 exponents -> float64 [..., G * 32], code x 2^(scale - 127)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    x = E2M1[codes] * np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    return x.reshape(*blocks.shape[:-2], -1)


def make_checkpoint(folder: Path, seed: int = 0, edit=None) -> dict[str, np.ndarray]:
    """Write the MXFP4 checkpoint (its {name: (dtype, array)} changed by `edit` first, if given);
    returns every weight as float64 (the experts by the formula)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    stored: dict[str, tuple[str, np.ndarray]] = {}
    w: dict[str, np.ndarray] = {}

    def bf16(name: str, x: np.ndarray) -> None:
        bits = _bf16_bits(x.astype(np.float32))
        stored[name] = ("BF16", bits)
        w[name] = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def experts(name: str, rows: int, cols: int) -> None:
        blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
        scales = rng.integers(119, 124, (E, rows, cols // 32), dtype=np.uint8)  # steps 2^-8 .. 2^-4
        stored[name + "_blocks"], stored[name + "_scales"] = ("U8", blocks), ("U8", scales)
        w[name] = mxfp4_values(blocks, scales)  # [E, rows, cols]

    bf16("model.embed_tokens.weight", rng.standard_normal((VOCAB, H)))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        bf16(p + "input_layernorm.weight", 1 + 0.1 * rng.standard_normal(H))
        for proj, rows, cols in (("q_proj", NH * HD, H), ("k_proj", NKV * HD, H), ("v_proj", NKV * HD, H),
                                 ("o_proj", H, NH * HD)):
            bf16(p + f"self_attn.{proj}.weight", rng.standard_normal((rows, cols)) / math.sqrt(cols))
            bf16(p + f"self_attn.{proj}.bias", 0.1 * rng.standard_normal(rows))
        bf16(p + "self_attn.sinks", rng.standard_normal(NH))
        bf16(p + "post_attention_layernorm.weight", 1 + 0.1 * rng.standard_normal(H))
        bf16(p + "mlp.router.weight", rng.standard_normal((E, H)))
        bf16(p + "mlp.router.bias", 0.1 * rng.standard_normal(E))
        experts(p + "mlp.experts.gate_up_proj", 2 * FF, H)
        bf16(p + "mlp.experts.gate_up_proj_bias", 4 * rng.standard_normal((E, 2 * FF)))  # some past the clamp of 7
        experts(p + "mlp.experts.down_proj", H, FF)
        bf16(p + "mlp.experts.down_proj_bias", 0.1 * rng.standard_normal((E, H)))
    bf16("model.norm.weight", 1 + 0.1 * rng.standard_normal(H))
    bf16("lm_head.weight", rng.standard_normal((VOCAB, H)) / math.sqrt(H))
    if edit is not None:
        edit(stored)
    write_raw_safetensors(folder / "model.safetensors", stored)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    assert write_tokenizer(folder) == 270
    return w


def bf16_release(folder: Path, w: dict[str, np.ndarray]) -> Path:
    """The same weights in the BF16 releases' layout (unsloth): no quantization_config, experts as
    input-major float stacks gate_up_proj [E, H, 2I] and down_proj [E, I, H], here F32 (exact)."""
    folder.mkdir()
    stored = {}
    for name, x in w.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            stored[name] = ("F32", np.ascontiguousarray(x.transpose(0, 2, 1)).astype(np.float32))
        else:
            stored[name] = ("F32", x.astype(np.float32))
    write_raw_safetensors(folder / "model.safetensors", stored)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "quantization_config"}))
    write_tokenizer(folder)
    return folder


# -- the numpy forward pass, from llama.cpp's graph ---------------------------------------------------
def _rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG["rms_norm_eps"]) * g


def _yarn_rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """ggml's NEOX rope with yarn (ext_factor 1): dims i and i + HD/2 rotate together."""
    s, base = CONFIG["rope_scaling"], float(CONFIG["rope_theta"])
    factor, orig = s["factor"], s["original_max_position_embeddings"]

    def corr_dim(beta: float) -> float:
        return HD * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0.0, math.floor(corr_dim(s["beta_fast"]))), min(HD - 1.0, math.ceil(corr_dim(s["beta_slow"])))
    i = np.arange(HD // 2)
    extrap = pos[:, None] * base ** (-2.0 * i / HD)[None, :]
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
    theta = extrap / factor * (1 - ramp) + extrap * ramp
    mscale = 1 + 0.1 * math.log(factor)
    cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    x0, x1 = x[..., : HD // 2], x[..., HD // 2 :]
    return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def forward(w: dict[str, np.ndarray], tokens: list[int]) -> tuple[np.ndarray, float]:
    """float64 logits [T, vocab], and the smallest gap between the k-th and (k+1)-th router logit
    (a near-tie would let float32 rounding pick other experts)."""
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    gap = math.inf
    for il in range(LAYERS):
        p = f"model.layers.{il}."
        a = p + "self_attn."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[a + f"{n}_proj.weight"].T + w[a + f"{n}_proj.bias"] for n in "qkv")
        q = _yarn_rope(q.reshape(T, NH, HD), pos)
        k = _yarn_rope(k.reshape(T, NKV, HD), pos)
        v = v.reshape(T, NKV, HD)
        kv = np.arange(NH) // (NH // NKV)
        scores = np.einsum("thd,shd->hts", q, k[:, kv]) / math.sqrt(HD)
        qi, kj = np.arange(T)[:, None], np.arange(T)[None, :]
        visible = (kj <= qi) & ((qi - kj < WINDOW) if il % 2 == 0 else True)  # layer 0 sliding, then alternating
        scores = np.where(visible[None], scores, -np.inf)
        sink = w[a + "sinks"][:, None, None]
        m = np.maximum(scores.max(axis=-1, keepdims=True), sink)
        e = np.exp(scores - m)
        probs = e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - m))  # the sink's share is dropped
        o = np.einsum("hts,shd->thd", probs, v[:, kv]).reshape(T, NH * HD)
        x = x + o @ w[a + "o_proj.weight"].T + w[a + "o_proj.bias"]

        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        x_ = p + "mlp.experts."
        logits = h @ w[p + "mlp.router.weight"].T + w[p + "mlp.router.bias"]
        order = np.argsort(-logits, axis=1)
        srt = np.take_along_axis(logits, order, axis=1)
        gap = min(gap, float((srt[:, K - 1] - srt[:, K]).min()))
        moe = np.zeros_like(x)
        for t in range(T):
            sel = order[t, :K]
            wt = np.exp(logits[t, sel] - logits[t, sel].max())
            wt /= wt.sum()  # softmax over the selected k
            for ex, weight in zip(sel, wt):
                gu = w[x_ + "gate_up_proj"][ex] @ h[t] + w[x_ + "gate_up_proj_bias"][ex]
                gate, up = np.minimum(gu[0::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
                act = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
                moe[t] += weight * (w[x_ + "down_proj"][ex] @ act + w[x_ + "down_proj_bias"][ex])
        x = x + moe
    x = _rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T, gap


# -- tests ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("gptoss")
    return root / "gpt-oss-tiny", make_checkpoint(root / "gpt-oss-tiny")


@pytest.fixture(scope="module")
def auto(ckpt, tmp_path_factory) -> Path:
    r = convert_model(ckpt[0], "auto", tmp_path_factory.mktemp("auto") / "auto.gguf", register=False)
    assert r.architecture == "gpt-oss" and r.quantization == "mxfp4"
    assert {d.name for d in r.direct} == {f"blk.{i}.ffn_{k}_exps.weight" for i in range(LAYERS) for k in ("gate", "up", "down")}
    assert all(d.qtype == "MXFP4" and d.max_error == 0.0 for d in r.direct)
    return r.path


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """{name: (type, numpy shape, raw bytes)} of a GGUF."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    return {t.name: (t.type_name, tuple(reversed(t.shape)), np.asarray(raw[t.offset : t.offset + t.n_bytes]))
            for t in read_gguf(path).tensors}


def test_mxfp4_experts_are_the_checkpoints_bytes_and_numbers(ckpt, auto):
    src, w = ckpt
    from edgeinfer.convert.safetensors import open_checkpoint

    got = _tensors(auto)
    with open_checkpoint(src) as c:
        for i in range(LAYERS):
            x = f"model.layers.{i}.mlp.experts."
            gu_b, gu_s = c.where[x + "gate_up_proj_blocks"].array(x + "gate_up_proj_blocks"), \
                c.where[x + "gate_up_proj_scales"].array(x + "gate_up_proj_scales")
            dn_b, dn_s = c.where[x + "down_proj_blocks"].array(x + "down_proj_blocks"), \
                c.where[x + "down_proj_scales"].array(x + "down_proj_scales")
            for kind, blocks, scales, want in (
                ("gate", gu_b[:, 0::2], gu_s[:, 0::2], w[x + "gate_up_proj"][:, 0::2]),
                ("up", gu_b[:, 1::2], gu_s[:, 1::2], w[x + "gate_up_proj"][:, 1::2]),
                ("down", dn_b, dn_s, w[x + "down_proj"]),
            ):
                qtype, shape, data = got[f"blk.{i}.ffn_{kind}_exps.weight"]
                assert qtype == "MXFP4" and shape == want.shape, (kind, qtype, shape)
                # ggml's block_mxfp4 from the published layout: the E8M0 byte, then element j | element j+16 << 4
                codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
                expect = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
                assert np.array_equal(data, expect.reshape(-1)), f"blk.{i} {kind}: not the checkpoint's bytes"
                held = ggml_dequantize(data, gguf.GGMLQuantizationType.MXFP4, want.size).reshape(want.shape)  # GGML_TYPE_MXFP4
                assert np.array_equal(held.astype(np.float64), want), f"blk.{i} {kind}: values differ"  # 2^-127 .. 6: exact
            for kind, bias in (("gate", w[x + "gate_up_proj_bias"][:, 0::2]), ("up", w[x + "gate_up_proj_bias"][:, 1::2]),
                               ("down", w[x + "down_proj_bias"])):
                qtype, shape, data = got[f"blk.{i}.ffn_{kind}_exps.bias"]
                assert qtype == "F32" and np.array_equal(data.view(np.float32).reshape(shape), bias)


def test_gguf_has_what_llama_cpp_reads_for_gpt_oss(auto):
    info = read_gguf(auto)
    m = info.metadata
    assert m["general.architecture"] == "gpt-oss"
    for key, want in (("expert_count", E), ("expert_used_count", K), ("expert_feed_forward_length", FF),
                      ("attention.sliding_window", WINDOW), ("block_count", LAYERS), ("attention.head_count", NH),
                      ("attention.head_count_kv", NKV), ("attention.key_length", HD), ("rope.dimension_count", HD),
                      ("rope.scaling.type", "yarn"), ("rope.scaling.factor", 32.0),
                      ("rope.scaling.original_context_length", 4096), ("rope.freq_base", 150000.0)):
        assert m[f"gpt-oss.{key}"] == want, key
    assert m["tokenizer.ggml.pre"] == "gpt-4o" and m["tokenizer.ggml.model"] == "gpt2"
    assert m["tokenizer.chat_template"] == TEMPLATE
    assert m["tokenizer.ggml.tokens"].length == VOCAB
    t = {x.name: x for x in info.tensors}
    for name in ("blk.1.attn_sinks.weight", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.bias",
                 "blk.1.post_attention_norm.weight", "blk.1.attn_output.bias", "output.weight"):
        assert name in t, name
    assert t["blk.0.ffn_gate_inp.weight"].type_name == "F32"  # the router stays F32, as llama.cpp's converter keeps it
    assert t["blk.0.ffn_down_exps.weight"].shape == (FF, H, E)  # ggml order: {n_ff_exp, n_embd, n_expert}
    from edgeinfer.validate import check_semantics, validate_file

    check_semantics(validate_file(auto))  # what the store checks before it registers a file


GU = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda t: t.update({GU + "_scales": ("U8", t[GU + "_scales"][1][:, :, :1])}),
         rf"^mxfp4 tensor {GU}: {GU}_scales is U8\[4, 128, 1\], expected uint8 \[4, 128, 2\]"),
        (lambda t: t.pop(GU + "_scales"), rf"^mxfp4 tensor {GU}: {GU}_blocks without {GU}_scales$"),
        (lambda t: t.update({GU + "_blocks": ("F32", t[GU + "_blocks"][1].astype(np.float32))}),
         rf"^mxfp4 tensor {GU}: {GU}_blocks must be uint8 \[\.\.\., rows, in/32, 16\], got F32\[4, 128, 2, 16\]$"),
        (lambda t: t.update({GU + "_blocks": ("U8", t[GU + "_blocks"][1][:3]), GU + "_scales": ("U8", t[GU + "_scales"][1][:3])}),
         rf"^tensor {GU}_blocks has shape \[3, 128, 2, 16\] but config.json implies \[4, 128, 2, 16\]$"),
        (lambda t: t.pop(GU + "_bias"), rf"^missing tensor {GU}_bias$"),
        (lambda t: t.update({GU + "_bias": ("U8", np.zeros((4, 128), np.uint8))}),
         rf"^tensor {GU}_bias is U8\[4, 128\]; expected a 2-D F32, F16 or BF16 tensor$"),
    ],
)
def test_bad_gpt_oss_packings_are_one_line_errors(corrupt, match, tmp_path):
    make_checkpoint(tmp_path / "m", edit=corrupt)
    with pytest.raises(ConversionError, match=match) as e:
        convert_model(tmp_path / "m", "auto", tmp_path / "x.gguf", register=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(("change", "match"), [
    ({"swiglu_limit": 10.0}, r"swiglu_limit 10.0 is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types must alternate"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings is not supported for gpt-oss"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, r"yarn rope_scaling needs a positive original_max_position_embeddings"),
])
def test_configs_llama_cpp_would_run_differently_are_refused(change, match, tmp_path):
    make_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**CONFIG, **change}))
    with pytest.raises(ConversionError, match=match):
        convert_model(tmp_path / "m", "auto", tmp_path / "x.gguf", register=False)


@pytest.mark.slow
def test_logits_match_the_numpy_forward_pass(ckpt, auto, tmp_path):
    from hf_models import llama_cpp_logits

    src, w = ckpt
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 261, 10)]  # > WINDOW: the window counts
    ref, gap = forward(w, tokens)
    assert gap > 1e-3, "a near-tie in the routing: pick another seed"
    # f32: the published numbers through llama.cpp's float path; float32 sums of <= 128 terms of
    # magnitude ~1 are good to ~1e-5, two layers and the head amplify that to well under 1e-3
    f32 = llama_cpp_logits(convert_model(src, "f32", tmp_path / "f32.gguf", register=False).path, tokens, n_threads=1)
    err = float(np.abs(f32 - ref).max())
    # the BF16 release layout (float, transposed stacks) of the same weights: the same model
    plain = bf16_release(tmp_path / "bf16", w)
    f32b = llama_cpp_logits(convert_model(plain, "f32", tmp_path / "b.gguf", register=False).path, tokens, n_threads=1)
    # auto: MXFP4 experts, which llama.cpp multiplies with Q8_0-rounded activations (its vec_dot
    # type for MXFP4), the rest Q8_0. A Q8_0 file of the same weights shares that activation
    # rounding and adds its own weight rounding: the MXFP4 file may be no further from the reference
    q = llama_cpp_logits(auto, tokens, n_threads=1)
    q8 = llama_cpp_logits(convert_model(plain, "q8_0", tmp_path / "q8.gguf", register=False).path, tokens, n_threads=1)
    err_q, err_q8 = float(np.abs(q - ref).max()), float(np.abs(q8 - ref).max())
    print(f"gpt-oss: max|Δ logits| f32 {err:.3g}, bf16 layout {float(np.abs(f32b - ref).max()):.3g}, auto (MXFP4 "
          f"experts) {err_q:.3g}, q8_0 of the same weights {err_q8:.3g}; logits up to {float(np.abs(ref).max()):.3g}")
    assert err < 1e-3
    assert np.array_equal(f32b, f32)
    assert err_q <= err_q8
    assert (q.argmax(1) == ref.argmax(1)).all()
    assert (f32.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("behavior", ["Isolated", "Removed"])
def test_o200k_pre_tokenizer_is_llama_cpps_gpt_4o(behavior):
    """The Isolated split of the o200k regex, or the matches an inverted Removed split keeps (a form
    some tokenizer exports use): the same pieces, as the regex matches every character."""
    from edgeinfer.convert.tokenizer import identify_pre_tokenizer

    split = {"type": "Split", "pattern": {"Regex": O200K}, "behavior": behavior, "invert": behavior == "Removed"}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    assert identify_pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]}}) == "gpt-4o"
