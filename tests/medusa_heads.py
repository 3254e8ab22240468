"""Medusa heads for tests: tiny checkpoints in the published layouts (FasterDecoding/Medusa), an
independent numpy pass over them, and heads constructed to agree with a target.

Layouts: "medusa1" is the heads alone as Medusa-1's trainer saves `self.medusa_head.state_dict()`
(`{i}.{l}.linear.weight|bias`, `{i}.{L}.weight`) beside a config.json naming the base model;
"medusa2" is Medusa-2's whole model, the target's own weights and config with `medusa_head.{i}.*`
and `medusa_num_heads` / `medusa_num_layers` added. `shared_block=True` writes block 0 only (the
published code repeats one ResBlock object `medusa_num_layers` times).

Agreeing heads (`fit_heads_to`): on a fixed text (token ids) and the target's final hidden states
there (post-norm, from the numpy reference), head i's projection W is solved (pseudo-inverse) so
that W r(h_t) is exactly `margin` at the token the text has at t + 2 + i and 0 elsewhere, r being
the head's residual blocks: with fewer positions than hidden dimensions (and the states linearly
independent) the solution is exact, so the head's top token at every position of the text is the
text's. A text the target generated greedily makes heads that agree with the target there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from hf_models import write_safetensors
from numpy_reference import forward_logits, load_hf_weights

__all__ = ["make_random_medusa_heads", "medusa_reference", "target_hidden", "fit_heads_to"]


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def make_random_medusa_heads(folder: Path, target: Path, *, n_heads: int = 3, n_layers: int = 1,
                             layout: str = "medusa1", dtype: str = "float32", shared_block: bool = False,
                             seed: int = 5) -> Path:
    """Random heads for the HF model in `target` (its width and vocabulary) in `layout`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    rng = np.random.default_rng(seed)
    heads: dict[str, np.ndarray] = {}
    for i in range(n_heads):
        for l in range(1 if shared_block else n_layers):
            heads[f"{i}.{l}.linear.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32) / np.float32(
                math.sqrt(hidden))
            heads[f"{i}.{l}.linear.bias"] = rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1)
        heads[f"{i}.{n_layers}.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(
            4.0 / math.sqrt(hidden))
    meta = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers}
    if layout == "medusa1":
        (folder / "config.json").write_text(json.dumps({**meta, "base_model_name_or_path": "tiny/target"}))
        write_safetensors(folder / "medusa_lm_head.safetensors", heads, dtype)
    else:
        assert layout == "medusa2"
        (folder / "config.json").write_text(json.dumps({**tcfg, **meta}))
        _, tw = load_hf_weights(Path(target))
        write_safetensors(folder / "model.safetensors",
                          {**{k: v.astype(np.float32) for k, v in tw.items()},
                           **{f"medusa_head.{k}": v for k, v in heads.items()}}, dtype)
    return folder


def _heads(folder: Path) -> tuple[dict, dict[str, np.ndarray], str]:
    config, w = load_hf_weights(Path(folder))
    prefix = "medusa_head." if any(k.startswith("medusa_head.") for k in w) else ""
    return config, w, prefix


def _blocks(config: dict, w: dict[str, np.ndarray], prefix: str, i: int, h: np.ndarray) -> np.ndarray:
    x = np.asarray(h, dtype=np.float64)
    for l in range(config["medusa_num_layers"]):
        k = l if f"{prefix}{i}.{l}.linear.weight" in w else 0  # one shared block
        x = x + _silu(x @ w[f"{prefix}{i}.{k}.linear.weight"].T + w[f"{prefix}{i}.{k}.linear.bias"])
    return x


def medusa_reference(folder: Path, h: np.ndarray) -> np.ndarray:
    """float64 [heads, T, vocab]: every head's logits on hidden states h [T, hidden]."""
    config, w, prefix = _heads(folder)
    n, L = config["medusa_num_heads"], config["medusa_num_layers"]
    return np.stack([_blocks(config, w, prefix, i, h) @ w[f"{prefix}{i}.{L}.weight"].T for i in range(n)])


def target_hidden(target: Path, tokens: list[int]) -> np.ndarray:
    """float64 [T, hidden]: the target's final hidden state after its final norm (what Medusa reads)."""
    config, w = load_hf_weights(Path(target))
    layer_inputs: list[np.ndarray] = []
    forward_logits(Path(target), tokens, layer_inputs=layer_inputs)
    x = layer_inputs[-1]  # the last layer's output
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config["rms_norm_eps"]) * w["model.norm.weight"]


def fit_heads_to(folder: Path, target: Path, texts: list[list[int]], start: list[int], margin: float) -> int:
    """Rewrite the projections of the Medusa-1 heads in `folder` (float32) so that head i's top
    token on the target's hidden state at position t of each text is text[t + 2 + i], for t from
    start[j] - 1 on (see the module); returns how many positions each head was fitted on."""
    config, w, prefix = _heads(folder)
    assert prefix == "", "fits Medusa-1 files"
    n, L = config["medusa_num_heads"], config["medusa_num_layers"]
    vocab = w[f"0.{L}.weight"].shape[0]
    states = [target_hidden(target, text) for text in texts]
    out = {k: v.astype(np.float32) for k, v in w.items()}
    fitted = 0
    for i in range(n):
        rows, labels = [], []
        for text, s, h in zip(texts, start, states):
            for t in range(s - 1, len(text) - 2 - i):
                rows.append(h[t])
                labels.append(text[t + 2 + i])
        r = _blocks(config, w, prefix, i, np.stack(rows))  # [N, hidden], N < hidden
        inv = np.linalg.pinv(r)  # [hidden, N]: r @ inv == I where r has full row rank
        assert np.abs(r @ inv - np.eye(len(rows))).max() < 1e-6, "more positions than the heads can fit exactly"
        sol = np.zeros((r.shape[1], vocab))  # [hidden, vocab]: r @ sol is margin at each label, else 0
        np.add.at(sol.T, np.asarray(labels), margin * inv.T)
        out[f"{i}.{L}.weight"] = sol.T.astype(np.float32)
        fitted = len(labels)
    write_safetensors(folder / "medusa_lm_head.safetensors", out)
    return fitted
