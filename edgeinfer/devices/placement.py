"""Where a model's layers land over the host and the devices: pure arithmetic (nothing here calls llama.cpp).

Placement (`LoadOptions.n_gpu_layers`, `.rpc`, `.tensor_split`) follows llama.cpp's rule: of the
model's n_layer + 1 layers (the output layer counts as the last), the first ones stay on the host and
the last `n_gpu_layers` go to the devices, split between them in proportion to their free memory or
to `tensor_split`. Devices come in llama.cpp's order: RPC workers first (in `rpc` order), then local
GPUs. Our `tensor_split` has one more entry than llama.cpp's: the host's share comes first, so
`(1, 1, 1)` with two workers puts a third of the layers on each machine. `n_gpu_layers="auto"` puts
on the devices as many layers as fit in the memory they report, 0 where there is no device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOptionError
from .registry import DeviceInfo
from .rpc_client import parse_endpoints

__all__ = ["ModelSizes", "Part", "Placement", "PlacementError", "check_placement", "host_only", "plan_placement"]

# Kept free on every device when "auto" decides how many layers fit (drivers, fragmentation,
# what our estimate of compute buffers misses).
_DEVICE_MARGIN = 256 << 20


class PlacementError(InvalidOptionError):
    """A placement that does not fit the memory the devices report, refused before loading."""


def _check_gpu_layers(name: str, value: object) -> None:
    if value in ("all", "auto"):
        return
    if isinstance(value, str) or not isinstance(value, int) or isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be a number of layers, 'all' or 'auto', got {value!r}")
    if not 0 <= value <= 2**31 - 1:
        raise InvalidOptionError(f"{name} must be in [0, {2**31 - 1}], got {value}")


def check_placement(n_gpu_layers: object = "auto", rpc: object = (), tensor_split: object = (),
                    draft_gpu_layers: object = None) -> None:
    """Refuse placement options of the wrong type or range with one InvalidOptionError line (the
    LoadOptions fields of the same names)."""
    _check_gpu_layers("n_gpu_layers", n_gpu_layers)
    if draft_gpu_layers is not None:
        _check_gpu_layers("draft_gpu_layers", draft_gpu_layers)
    if isinstance(rpc, str) or not isinstance(rpc, (tuple, list)):
        raise InvalidOptionError(f"rpc must be a tuple of 'host:port' strings, got {type(rpc).__name__} {rpc!r}")
    parse_endpoints(rpc)
    if isinstance(tensor_split, str) or not isinstance(tensor_split, (tuple, list)):
        raise InvalidOptionError(f"tensor_split must be a tuple of numbers, got {type(tensor_split).__name__} "
                                 f"{tensor_split!r}")
    for share in tensor_split:
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not math.isfinite(share):
            raise InvalidOptionError(f"a tensor_split share must be a finite number, got {share!r}")
        if share < 0:
            raise InvalidOptionError(f"tensor_split shares must be >= 0, got {share}")
    if tensor_split and not sum(tensor_split) > 0:
        raise InvalidOptionError("tensor_split needs at least one share above 0")
    if tensor_split and isinstance(n_gpu_layers, int) and not isinstance(n_gpu_layers, bool):
        raise InvalidOptionError("give a number of GPU layers or a tensor split, not both (the split's first "
                                 "share, the host's, sets how many layers stay on the CPU)")


@dataclass(frozen=True)
class Part:
    """What one machine or device holds under a placement (bytes; compute is an estimate)."""

    name: str  # "host" or a device name (RPC0, CUDA0)
    where: str  # "this machine (CPU)", an RPC worker's host:port, a GPU's description
    layers: tuple[int, int]  # [first, end) over 0..n_layer (index n_layer is the output layer)
    weights: int
    kv_cache: int
    compute: int
    memory_free: int | None  # what the device reports (None: not reported)
    memory_total: int | None

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute

    @property
    def fits(self) -> bool | None:
        """None when the device reports no memory."""
        return None if self.memory_free is None else self.total <= self.memory_free


@dataclass(frozen=True)
class Placement:
    """Where each part of a model lands: the host first, then the devices in llama.cpp's order."""

    parts: tuple[Part, ...]
    n_layer: int  # repeating layers (the output layer is one more)
    n_gpu_layers: int  # layers (of n_layer + 1) on the devices
    tensor_split: tuple[float, ...]  # llama.cpp's, one per device; () = in proportion to free memory
    note: str | None = None  # e.g. why --gpu-layers was ignored

    @property
    def devices(self) -> tuple[Part, ...]:
        return self.parts[1:]

    @property
    def host(self) -> Part:
        return self.parts[0]

    @property
    def fits(self) -> bool:
        """Every device that reports memory holds its part (the host's is fit.py's business: mapped
        weights may page)."""
        return all(p.fits is not False for p in self.devices)

    def summary(self) -> str:
        """One line: 'CPU' or 'CPU 10 layers + RPC0 127.0.0.1:50052 11 + RPC1 ... 10'."""
        used = [p for p in self.devices if p.n_layers]
        if not used:
            return "CPU"
        parts = [f"CPU {self.host.n_layers}"] if self.host.n_layers else ["CPU (input)"]
        parts += [f"{p.name} {p.where} {p.n_layers}" if p.where.count(":") == 1 else f"{p.name} {p.n_layers}"
                  for p in used]
        return " + ".join(parts) + f" (of {self.n_layer + 1} layers)"


def _split_points(shares: Sequence[float]) -> list[Any]:
    import numpy as np

    cum = np.cumsum(np.asarray(shares, dtype=np.float32), dtype=np.float32)
    return list(cum / cum[-1]) if len(cum) and cum[-1] > 0 else []


def _assign_layers(n_layer: int, n_gpu: int, shares: Sequence[float]) -> list[int]:
    """llama.cpp's layer assignment (llama-model.cpp load_tensors): for each of the n_layer + 1
    layers, -1 for the host or the index of its device. Float32, as llama.cpp computes it."""
    import bisect

    import numpy as np

    total = n_layer + 1
    n_gpu = min(max(n_gpu, 0), total) if shares else 0
    start = total - n_gpu
    points = _split_points(shares)
    out = []
    for il in range(total):
        if il < start:
            out.append(-1)
        else:
            x = np.float32(il - start) / np.float32(n_gpu)
            out.append(min(bisect.bisect_right(points, x), len(shares) - 1))
    return out


@dataclass(frozen=True)
class ModelSizes:
    """What a placement moves, per layer (edgeinfer.fit.model_sizes reads it from a GGUF)."""

    n_layer: int
    layer_weights: tuple[int, ...]  # per repeating layer
    output_weights: int  # the output layer (output norm and matrix, or the tied embedding it copies)
    tied_output: int  # bytes of output_weights that are the token embedding (no copy on the host)
    input_weights: int  # the token embedding and anything outside the layers (always on the host)
    kv_per_layer: int
    activations: int  # f32 activations of one ubatch, without the logits
    logits: int  # f32 logits of one ubatch
    host_extra: int  # llama.cpp's fixed overhead (context, output buffer)


def _parts(sizes: ModelSizes, owner: list[int], devices: Sequence[DeviceInfo], host_free: int | None) -> tuple[Part, ...]:
    n = sizes.n_layer
    weights = [0] * (len(devices) + 1)
    kv = [0] * (len(devices) + 1)
    span: list[list[int]] = [[n + 1, 0] for _ in range(len(devices) + 1)]
    for il, d in enumerate(owner):
        k = d + 1
        weights[k] += sizes.layer_weights[il] if il < n else sizes.output_weights - (sizes.tied_output if k == 0 else 0)
        kv[k] += sizes.kv_per_layer if il < n else 0
        span[k] = [min(span[k][0], il), max(span[k][1], il + 1)]
    weights[0] += sizes.input_weights
    holds_output = owner[n] + 1 if owner else 0
    parts = []
    for k in range(len(devices) + 1):
        lo, hi = span[k] if span[k][1] else (0, 0)
        used = bool(hi) or k == 0
        compute = (sizes.activations + (sizes.logits if k == holds_output else 0)) if used else 0
        if k == 0:
            compute += sizes.host_extra
            parts.append(Part("host", "this machine (CPU)", (lo, hi), weights[0], kv[0], compute, host_free, None))
        else:
            dev = devices[k - 1]
            reported = dev.memory_free or dev.memory_total
            parts.append(Part(dev.name, dev.endpoint or dev.description or dev.name, (lo, hi), weights[k], kv[k], compute,
                              dev.memory_free if reported else None, dev.memory_total if reported else None))
    return tuple(parts)


def _no_gpu_note(asked: int | str) -> str | None:
    if asked in ("auto", 0):
        return None
    return (f"this llama.cpp build has no GPU backend: --gpu-layers {asked} has nothing to offload to, so every layer "
            "runs on the CPU (`edgeinfer doctor` shows the build and how to build for Metal, CUDA or Vulkan)")


def _gpu_layers_value(value: int | str, n_layer: int) -> int | None:
    """An explicit n_gpu_layers as a count of the n_layer + 1 layers; None for auto."""
    if value == "auto":
        return None
    if value == "all":
        return n_layer + 1
    return min(int(value), n_layer + 1)


def plan_placement(sizes: ModelSizes, devices: Sequence[DeviceInfo], *, n_gpu_layers: int | str = "auto",
                   tensor_split: Sequence[float] = (), host_free: int | None = None, strict: bool = True) -> Placement:
    """Where each layer lands over these offload devices (in llama.cpp's order); pure arithmetic.
    `n_gpu_layers` and `tensor_split` as in LoadOptions. With `strict`, an explicit placement that a
    device cannot hold raises PlacementError (else `fits` says so)."""
    n = sizes.n_layer
    total = n + 1
    if not devices:
        if tensor_split:
            raise InvalidOptionError("--tensor-split: nothing to split over (this build has no GPU backend and no RPC "
                                     "workers were given; see `edgeinfer doctor`)")
        return Placement(_parts(sizes, [-1] * total, [], host_free), n, 0, (), _no_gpu_note(n_gpu_layers))
    shares: list[float]
    if tensor_split:
        split = list(tensor_split)
        if len(split) != len(devices) + 1:
            names = ", ".join(["host"] + [d.label for d in devices])
            raise InvalidOptionError(f"--tensor-split has {len(split)} values for {len(devices) + 1} parts ({names})")
        host_share, shares = split[0], split[1:]
        n_gpu = 0 if sum(shares) <= 0 else total - int(total * host_share / sum(split) + 0.5)
        if n_gpu_layers == "all" and n_gpu != total:
            raise InvalidOptionError("--gpu-layers all and a host share in --tensor-split contradict each other")
        explicit = True
    else:
        # llama.cpp's own default: in proportion to the memory each device has free
        shares = [float(d.memory_free or d.memory_total or (host_free or 0) or 1) for d in devices]
        asked = _gpu_layers_value(n_gpu_layers, n)
        explicit = asked is not None
        n_gpu = asked if asked is not None else total
    owner = _assign_layers(n, n_gpu, shares)
    parts = _parts(sizes, owner, devices, host_free)
    if not explicit:  # auto: the most layers the devices hold, with a margin
        while n_gpu > 0 and any(p.memory_free is not None and p.total + _DEVICE_MARGIN > p.memory_free
                                for p in parts[1:]):
            n_gpu -= 1
            owner = _assign_layers(n, n_gpu, shares)
            parts = _parts(sizes, owner, devices, host_free)
    counts = tuple(float(owner.count(k)) for k in range(len(devices)))
    placement = Placement(parts, n, n_gpu, counts, None)
    if strict and explicit and not placement.fits:
        p = next(p for p in placement.devices if p.fits is False)
        raise PlacementError(
            f"{p.name} ({p.where}) would hold {_gb(p.total)} (weights {_gb(p.weights)}, KV cache {_gb(p.kv_cache)}, "
            f"compute {_gb(p.compute)}) but reports {_gb(p.memory_free or 0)} free: give it a smaller share "
            "(--tensor-split), fewer --gpu-layers, or more workers"
        )
    return placement


def host_only(n_gpu_layers: int | str = "auto") -> Placement:
    """The placement of a load with no device to offload to (nothing to plan: the file is not read)."""
    return Placement((Part("host", "this machine (CPU)", (0, 0), 0, 0, 0, None, None),), 0, 0, (),
                     _no_gpu_note(n_gpu_layers))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
