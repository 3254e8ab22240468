"""Flash attention on or off for one user's engine, chosen by timing both on this machine.

llama.cpp's `auto` turns flash attention on wherever the backend has it, the CPU included. On the
2-core AVX2 machines here that is not always faster (`llama-bench -fa 0,1`, benchmarks/RESULTS.md):
SmolLM2-135M decodes 114 vs 100 tok/s with it on at an empty context but 51 vs 83 at 512 tokens of
context and 22 vs 50 at 2048; Qwen2.5-Coder-1.5B prefills 25 % faster with it on and decodes 14 %
faster at depth 0, 17 % slower at depth 2048. So the choice is a fact of the model and the machine:
`measure_flash_attn` times both settings on two scratch contexts over the loaded weights (a prompt
of `depth` tokens, then one-token decodes after it, alternating), and the store keeps the verdict
for the model file, placement, threads and KV-cache types. An `Engine` whose `flash_attn` is left
to edgeinfer (None) loads with the verdict when there is one, else with llama.cpp's choice; so does
a `BatchEngine` with a KV stream per slot (the default), whose rows each attend over their own
slot's cells as one sequence's do: on the 135M flash attention off decodes 1.58–1.70x faster there
too at 1, 4 and 8 slots after 512 tokens, on the 1.5B (verdict: on) on is 3–7 % faster at 4–8.

The verdict weighs a chat turn, not one kernel: the prompt's prefill plus `TURN_TOKENS` decoded
tokens at that depth, and flash attention goes off only when that turn is clearly faster without
it (`MARGIN`): otherwise llama.cpp's default stands. A `BatchEngine` with one KV cache for every
slot (kv_unified, a drafting head) keeps llama.cpp's choice: there each row attends over every
slot's cells, a case the verdict does not measure.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InvalidModelError, InvalidOptionError
from ...kv_types import KV_CACHE_TYPES
from .context import DecodeRows, LlamaContext, context_params
from .runtime import LlamaRuntime
from ..core.options import LoadOptions

if TYPE_CHECKING:
    from ...store import Store

__all__ = ["FlashAttnChoice", "measure_flash_attn", "with_measured_flash_attn", "remember_flash_attn",
           "verdict_key", "TURN_TOKENS", "MARGIN"]

log = logging.getLogger(__name__)

TURN_TOKENS = 256  # tokens decoded after the prompt in the turn the verdict weighs
MARGIN = 0.03  # flash attention goes off only when that saves more than this share of the turn
_CACHE_KIND = "flash-attn"


@dataclass(frozen=True)
class FlashAttnChoice:
    """Both settings timed at one context depth: a prefill of `depth` tokens and the median
    one-token decode after it, in seconds."""

    depth: int
    prefill_on_s: float
    prefill_off_s: float
    decode_on_s: float
    decode_off_s: float

    def turn_s(self, on: bool) -> float:
        """A turn's time with the setting: its prompt's prefill and TURN_TOKENS decoded tokens."""
        if on:
            return self.prefill_on_s + TURN_TOKENS * self.decode_on_s
        return self.prefill_off_s + TURN_TOKENS * self.decode_off_s

    @property
    def flash_attn(self) -> bool:
        """The verdict: off only where the turn is more than MARGIN faster without it."""
        return not self.turn_s(False) < self.turn_s(True) * (1 - MARGIN)

    def summary(self) -> str:
        def rate(s: float) -> str:
            return f"{1 / s:.1f}" if s > 0 else "?"

        return (f"flash attention {'on' if self.flash_attn else 'off'} (at {self.depth} tokens of context, "
                f"decode {rate(self.decode_on_s)} tok/s on vs {rate(self.decode_off_s)} off, prefill "
                f"{self.depth / self.prefill_on_s:.0f} vs {self.depth / self.prefill_off_s:.0f} tok/s; "
                f"a {self.depth}+{TURN_TOKENS}-token turn {self.turn_s(True):.1f} s vs {self.turn_s(False):.1f} s)")

    def to_dict(self) -> dict[str, float]:
        return {"depth": self.depth, "prefill_on_s": self.prefill_on_s, "prefill_off_s": self.prefill_off_s,
                "decode_on_s": self.decode_on_s, "decode_off_s": self.decode_off_s}

    @classmethod
    def from_dict(cls, data: object) -> FlashAttnChoice:
        """From the store; ValueError for anything but positive finite timings."""
        if not isinstance(data, Mapping):
            raise ValueError("not a mapping")
        depth = data.get("depth")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"bad depth {depth!r}")
        times = {}
        for name in ("prefill_on_s", "prefill_off_s", "decode_on_s", "decode_off_s"):
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ValueError(f"bad {name} {v!r}")
            times[name] = float(v)
        return cls(depth=depth, **times)


# -- the store ---------------------------------------------------------------------------------


def verdict_key(path: Path, options: LoadOptions) -> str:
    """The store key of a verdict: it holds for one model file, placement, thread count and pair of KV-cache types."""
    return (f"v1|{path.resolve()}|{path.stat().st_size}|t{options.threads}|{'/'.join(options.kv_types)}"
            f"|gpu{options.n_gpu_layers}|rpc{','.join(options.rpc)}")


def _decides(options: LoadOptions) -> bool:
    """Whether flash attention is ours to choose: not set by the user, and not needed by a
    quantized V cache."""
    return options.flash_attn is None and not KV_CACHE_TYPES[options.kv_types[1]].quantized


def with_measured_flash_attn(path: Path, options: LoadOptions, store: Store) -> LoadOptions:
    """`options` with flash_attn set from the store's verdict where edgeinfer decides it (see
    the module); unchanged where there is no usable verdict."""
    if not _decides(options):
        return options
    try:
        known = store.read_cache(_CACHE_KIND, verdict_key(path, options))
    except OSError:
        return options
    if known is None:
        return options
    try:
        choice = FlashAttnChoice.from_dict(known)
    except ValueError as e:
        log.debug("ignoring an unusable flash-attention verdict for %s: %s", path.name, e)
        return options
    return replace(options, flash_attn=choice.flash_attn)


def remember_flash_attn(path: Path, options: LoadOptions, store: Store, choice: FlashAttnChoice) -> None:
    """Keep a verdict for loads with these options (those that leave flash attention to us)."""
    try:
        store.write_cache(_CACHE_KIND, verdict_key(path, replace(options, flash_attn=None)), choice.to_dict())
    except OSError as e:
        log.debug("flash-attention verdict not remembered: %s", e)


# -- the measurement -----------------------------------------------------------------------------


def measure_flash_attn(rt: LlamaRuntime, tokens: Sequence[int], steps: int = 8) -> FlashAttnChoice:
    """Time a prefill of `tokens` and `steps` one-token decodes after it with flash attention on
    and off, each on a scratch context of its own over `rt`'s weights (the settings alternate;
    medians). `tokens`: any text's tokens, as many as the depth to measure at."""
    if rt.closed:
        raise InvalidOptionError(f"{rt.path.name}: this model was closed")
    if not 1 <= len(tokens) <= rt.n_ctx - steps - 1:
        raise InvalidOptionError(f"a flash-attention measurement needs 1..{rt.n_ctx - steps - 1} prompt tokens, "
                                 f"got {len(tokens)}")
    tokens = [rt.check_token(t) for t in tokens]
    scratch: dict[bool, _Scratch] = {}
    try:
        for on in (True, False):
            scratch[on] = _Scratch(rt, on, len(tokens) + steps + 1)
        prefill = {on: s.prefill(tokens) for on, s in scratch.items()}
        decode: dict[bool, list[float]] = {True: [], False: []}
        last = tokens[-1]
        for i in range(steps):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                decode[on].append(scratch[on].step(last, len(tokens) + i))
    finally:
        for s in scratch.values():
            s.close()
    return FlashAttnChoice(depth=len(tokens), prefill_on_s=prefill[True], prefill_off_s=prefill[False],
                           decode_on_s=statistics.median(decode[True]), decode_off_s=statistics.median(decode[False]))


class _Scratch:
    """A one-sequence context over a runtime's weights with flash attention forced on or off."""

    def __init__(self, rt: LlamaRuntime, flash: bool, n_ctx: int):
        self.n_batch = min(rt.n_batch, n_ctx)
        cparams = context_params(replace(rt.options, flash_attn=flash), n_ctx=n_ctx, n_batch=self.n_batch,
                                 threads=rt.threads)
        self.context = LlamaContext(rt.model, cparams, f"{rt.path.name}: llama.cpp could not create a scratch "
                                                       f"context (flash attention {'on' if flash else 'off'})")

    def _decode(self, tokens: Sequence[int], pos0: int) -> None:
        rows = DecodeRows()
        rows.extend(tokens, pos0, 0, len(tokens) - 1)
        rc = self.context.decode(rows)
        if rc != 0:
            raise InvalidModelError(f"llama_decode failed while measuring flash attention (rc={rc})")

    def prefill(self, tokens: Sequence[int]) -> float:
        t0 = time.perf_counter()
        for start in range(0, len(tokens), self.n_batch):
            self._decode(tokens[start : start + self.n_batch], start)
        return time.perf_counter() - t0

    def step(self, token: int, pos: int) -> float:
        t0 = time.perf_counter()
        self._decode([token], pos)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.context.close()
