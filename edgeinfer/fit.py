"""Will a model fit in this machine's memory, and which quant of a ladder to pick.

Memory needed = weights (tensor bytes of the file; llama.cpp maps them) + KV cache
(n_layer × n_ctx × n_head_kv × (head_dim_k × bytes of the K type + head_dim_v × bytes of the V type),
block overhead included: see edgeinfer.kv_types)
+ an estimate of llama.cpp's compute buffers (activations of one n_batch-token batch, the logits
buffer, and the attention scores when flash attention is off). It is compared with MemAvailable
from /proc/meminfo (and the cgroup's memory limit when one is set).

Where GPUs or RPC workers take layers, `plan` splits the same estimate by layer over this machine
and each device (edgeinfer.devices has the rules and the devices): weights and KV cache where their
layer lands, compute buffers on every part that computes; `load_placement` is that plan as the
llama_model_params fields of a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import InvalidOptionError, ModelNotFoundError
from .gguf_file import GGUFInfo, read_gguf
from .kv_types import KV_CACHE_TYPES, flash_attn_for, kv_cache_type

if TYPE_CHECKING:
    from .devices import ModelSizes, Placement
    from .store import ModelManifest, Store

__all__ = [
    "KV_BYTES_PER_ELEMENT",
    "MemoryEstimate",
    "FitReport",
    "Candidate",
    "Recommendation",
    "estimate_memory",
    "kv_cache_sizes",
    "available_memory",
    "model_sizes",
    "plan",
    "load_placement",
    "fit",
    "ladder",
    "recommend",
]

# Bytes per cached element, block overhead included (q8_0: 34 bytes per 32), for every KV-cache type.
KV_BYTES_PER_ELEMENT: dict[str, float] = {name: t.bytes_per_element for name, t in KV_CACHE_TYPES.items()}
_OVERHEAD = 16 << 20  # context and graph metadata, vocabulary tables, output buffer


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    compute: int
    total: int
    n_ctx: int
    kv_type: str  # "q8_0", or "K/V" (e.g. "q8_0/f16") when they differ
    n_layer: int
    n_head_kv: int
    head_dim: int


@dataclass(frozen=True)
class FitReport:
    model: str
    estimate: MemoryEstimate
    available: int  # bytes available now
    fits: bool
    kv_by_type: dict[str, int] = field(default_factory=dict)  # KV-cache bytes at n_ctx for every type (K = V)
    # Where each part lands when GPUs or RPC workers take layers (None: everything on this machine).
    placement: Placement | None = None

    @property
    def host_total(self) -> int:
        """Bytes this machine must hold: everything, or the host's part of a placement."""
        return self.placement.host.total if self.placement is not None else self.estimate.total

    @property
    def headroom(self) -> int:
        return self.available - self.host_total


def _meta(info: GGUFInfo, key: str, default: Any = None) -> Any:
    value = info.metadata.get(f"{info.architecture}.{key}", default)
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv on some models): take the max
        value = max(value) if value else default
    return value


@dataclass(frozen=True)
class _KVShape:
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int

    def bytes(self, n_ctx: int, type_k: str, type_v: str) -> int:
        k, v = kv_cache_type(type_k), kv_cache_type(type_v)
        per_token = self.n_head_kv * (self.head_dim_k * k.bytes_per_element + self.head_dim_v * v.bytes_per_element)
        return int(self.n_layer * n_ctx * per_token)


def _kv_shape(info: GGUFInfo) -> _KVShape:
    n_embd = int(_meta(info, "embedding_length", 0))
    n_head = int(_meta(info, "attention.head_count", 1)) or 1
    n_head_kv = int(_meta(info, "attention.head_count_kv", n_head)) or n_head
    head_dim_k = int(_meta(info, "attention.key_length", n_embd // n_head if n_head else 0))
    head_dim_v = int(_meta(info, "attention.value_length", head_dim_k))
    return _KVShape(int(_meta(info, "block_count", 0)), n_head_kv, head_dim_k, head_dim_v)


def _context(info: GGUFInfo, n_ctx: int | None) -> int:
    n_ctx = n_ctx or min(info.context_length or 4096, 4096)
    if n_ctx < 16:
        raise InvalidOptionError(f"context size must be at least 16, got {n_ctx}")
    return n_ctx


def kv_cache_sizes(info: GGUFInfo, n_ctx: int | None = None) -> dict[str, int]:
    """Bytes of the KV cache at n_ctx tokens for every KV-cache type (the same type for K and V)."""
    shape, n_ctx = _kv_shape(info), _context(info, n_ctx)
    return {name: shape.bytes(n_ctx, name, name) for name in KV_CACHE_TYPES}


def estimate_memory(info: GGUFInfo, n_ctx: int | None = None, kv_type: str = "f16", n_batch: int = 512,
                    flash_attn: bool | None = None, *, kv_type_k: str | None = None,
                    kv_type_v: str | None = None) -> MemoryEstimate:
    """Memory to run `info`'s model with an n_ctx-token context (None: min(trained, 4096), like the engine).
    `kv_type` sets both caches; `kv_type_k`/`kv_type_v` override one of them."""
    type_k, type_v = (kv_type_k or kv_type).lower(), (kv_type_v or kv_type).lower()
    # llama.cpp's "auto" flash attention is on for CPU; only an explicit False adds the KQ scores.
    fa = flash_attn_for(type_k, type_v, flash_attn) is not False  # also checks both names
    n_ctx = _context(info, n_ctx)
    kv = _kv_shape(info)
    n_layer = kv.n_layer
    n_embd = int(_meta(info, "embedding_length", 0))
    n_head = int(_meta(info, "attention.head_count", 1)) or 1
    n_ff = int(_meta(info, "feed_forward_length", 4 * n_embd))
    vocab = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = getattr(vocab, "length", None) or (len(vocab) if isinstance(vocab, list) else 32000)

    kv_cache = kv.bytes(n_ctx, type_k, type_v)
    n_ub = min(n_batch, n_ctx)
    # f32 buffers of one micro-batch, reused across layers by ggml's graph allocator: the logits of the
    # batch dominate (n_vocab), plus the residual stream and the FFN activations. Checked against
    # llama.cpp's "CPU compute buffer size" for SmolLM2-135M: 98.3 MiB at n_batch 512, estimated 101.
    activations = 4 * n_ub * (n_vocab + 2 * n_embd + n_ff)
    scores = 0 if fa else 4 * n_ub * n_ctx * n_head
    compute = activations + scores + _OVERHEAD
    weights = info.tensor_bytes
    label = type_k if type_k == type_v else f"{type_k}/{type_v}"
    return MemoryEstimate(weights, kv_cache, compute, weights + kv_cache + compute, n_ctx, label, n_layer,
                          kv.n_head_kv, kv.head_dim_k)


def available_memory() -> int:
    """Bytes of RAM available now: /proc/meminfo MemAvailable, capped by a cgroup v2/v1 limit."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        import os

        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 0
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            avail = min(avail, max(int(limit) - usage, 0))
        break
    return avail


def model_sizes(info: GGUFInfo, n_ctx: int | None = None, kv_type: str = "f16", n_batch: int = 512,
                flash_attn: bool | None = None, *, kv_type_k: str | None = None,
                kv_type_v: str | None = None) -> ModelSizes:
    """What each layer of `info`'s model weighs, with its KV cache and compute buffers, for a
    placement over devices (edgeinfer.devices.plan_placement); the same estimate as estimate_memory."""
    from .devices import ModelSizes

    est = estimate_memory(info, n_ctx, kv_type, n_batch, flash_attn, kv_type_k=kv_type_k, kv_type_v=kv_type_v)
    n_layer = est.n_layer
    layers = [0] * n_layer
    output = inputs = embedding = 0
    has_output = False
    for t in info.tensors:
        if t.name.startswith("blk."):
            idx = t.name.split(".", 2)[1]
            if idx.isdigit() and int(idx) < n_layer:
                layers[int(idx)] += t.n_bytes
                continue
        if t.name.startswith("output"):
            output += t.n_bytes
            has_output = has_output or t.name == "output.weight"
            continue
        if t.name == "token_embd.weight":
            embedding = t.n_bytes
        inputs += t.n_bytes
    tied = 0 if has_output else embedding  # a tied output: llama.cpp copies the embedding to the output's device
    vocab = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = getattr(vocab, "length", None) or (len(vocab) if isinstance(vocab, list) else 32000)
    logits = 4 * min(n_batch, est.n_ctx) * n_vocab
    return ModelSizes(n_layer, tuple(layers), output + tied, tied, inputs, est.kv_cache // max(n_layer, 1),
                      max(est.compute - logits - _OVERHEAD, 0), logits, _OVERHEAD)


def plan(path: str | Path, info: GGUFInfo | None = None, *, n_ctx: int | None = None, kv_type: str = "f16",
         kv_type_k: str | None = None, kv_type_v: str | None = None, n_batch: int = 512,
         flash_attn: bool | None = None, n_gpu_layers: int | str = "auto", rpc: tuple[str, ...] = (),
         tensor_split: tuple[float, ...] = (), host_free: int | None = None, strict: bool = True,
         detail: bool = False) -> tuple[Placement, list[tuple[int, Any]]]:
    """Where each part of the model at `path` would land now over this machine, its GPUs and the RPC
    workers `rpc` (probed), and the offload targets (ggml device, DeviceInfo) it uses; see
    edgeinfer.devices for the rules. Without any device the file is not read (everything is the
    host's) unless `detail` asks for the host's sizes."""
    from .devices import check_placement, host_only, offload_targets, plan_placement

    check_placement(n_gpu_layers, rpc, tensor_split)
    targets = offload_targets(rpc)
    if not targets and not tensor_split and not detail:
        return host_only(n_gpu_layers), targets
    sizes = model_sizes(info or read_gguf(path), n_ctx, kv_type, n_batch, flash_attn, kv_type_k=kv_type_k,
                        kv_type_v=kv_type_v)
    placement = plan_placement(sizes, [d for _h, d in targets], n_gpu_layers=n_gpu_layers, tensor_split=tensor_split,
                               host_free=available_memory() if host_free is None else host_free, strict=strict)
    return placement, targets


def load_placement(ll: Any, path: str | Path, options: Any) -> dict[str, Any]:
    """The llama_model_params fields that place one load of `path` with LoadOptions `options`
    (LoadOptions.placement_fields): RPC workers are probed (RpcWorkerError) and a placement a device
    cannot hold is refused (PlacementError) before any weight moves."""
    from .devices import placement_fields

    type_k, type_v = options.kv_types
    placement, targets = plan(path, n_ctx=options.n_ctx, kv_type_k=type_k, kv_type_v=type_v, n_batch=options.n_batch,
                              flash_attn=options.flash_attn, n_gpu_layers=options.n_gpu_layers, rpc=tuple(options.rpc),
                              tensor_split=tuple(options.tensor_split))
    return placement_fields(ll, path, placement, targets)


def fit(model: str | Path | None, n_ctx: int | None = None, kv_type: str = "f16", *, store: Store | None = None,
        available: int | None = None, kv_type_k: str | None = None, kv_type_v: str | None = None,
        placement: Mapping[str, Any] | None = None) -> FitReport:
    """Estimate the memory a model needs and compare it with what is available. `placement`
    (LoadOptions fields n_gpu_layers, rpc, tensor_split) plans the layers over this machine, its
    GPUs and RPC workers (edgeinfer.devices, which probes the workers): then the model fits when
    every device holds its part and this machine holds the rest."""
    from .store import Store

    store = store or Store()
    path, manifest = store.resolve(model)
    info = read_gguf(path)
    est = estimate_memory(info, n_ctx, kv_type, kv_type_k=kv_type_k, kv_type_v=kv_type_v)
    avail = available_memory() if available is None else available
    placed, _targets = plan(path, info, n_ctx=est.n_ctx, kv_type=kv_type, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
                            host_free=avail, strict=False, detail=True, **dict(placement or {}))
    plan_shown = placed if placed.devices or placed.note else None  # else the plain estimate says it all
    fits = est.total <= avail if plan_shown is None else placed.fits and placed.host.total <= avail
    return FitReport(manifest.ref if manifest else str(path), est, avail, fits, kv_cache_sizes(info, est.n_ctx),
                     plan_shown)


@dataclass(frozen=True)
class Candidate:
    manifest: ModelManifest
    fit: FitReport
    kld: float | None  # measured (metrics["eval"]), None if not evaluated
    ppl: float | None
    same_top: float | None
    decode_tok_s: float | None  # measured (metrics["bench"])
    # The lowest-precision model it was made from, when that has fewer bits per weight than it (a
    # dequantized F16 copy of a Q4_1): it keeps that model's error whatever it measures against
    # itself, so it ranks no better than that model (quality_kld, quality_bits).
    inherits_from: ModelManifest | None = None

    @property
    def ref(self) -> str:
        return self.manifest.ref

    @property
    def quality_bits(self) -> float:
        """Bits per weight its quality can reflect: its own, or fewer when inherited."""
        own = self.manifest.bits_per_weight
        return min(own, self.inherits_from.bits_per_weight) if self.inherits_from is not None else own

    def quality_kld(self, measured: dict[str, float | None]) -> float | None:
        """Its KLD for ranking: the measured one, but never below the model it inherits from (None
        when that one is not measured: the copy's own KLD, against itself or its like, says nothing)."""
        if self.inherits_from is None:
            return self.kld
        floor = measured.get(self.inherits_from.ref)
        if floor is None:
            return None
        return max(floor, self.kld) if self.kld is not None else floor


@dataclass(frozen=True)
class Recommendation:
    choice: Candidate | None
    candidates: tuple[Candidate, ...]  # every member of the ladder, largest first
    reason: str


def ladder(name: str, *, store: Store | None = None) -> list[ModelManifest]:
    """Every store model named `name` (all its tags), largest file first."""
    from .gguf_import import refuse_local_file
    from .store import Store, parse_ref

    refuse_local_file(name, "recommend takes the name of a store model")
    store = store or Store()
    base, _ = parse_ref(name)
    members = [m for m in store.list() if m.name == base and Path(m.file).exists()]
    if not members:
        raise ModelNotFoundError(f"no model named {base} in the store (see `edgeinfer list`)")
    return sorted(members, key=lambda m: (-m.size, m.tag))


def _lowest_precision_ancestor(m: ModelManifest, store: Store) -> ModelManifest | None:
    """The ancestor (derived_from, followed through the store) with the fewest bits per weight, if
    it has fewer than `m`: `m` was made from a lower-precision model and cannot be better than it."""
    seen, lowest, current = {m.ref}, None, m
    while current.derived_from and current.derived_from not in seen:
        seen.add(current.derived_from)
        ref = current.derived_from
        parent = store.find(ref) if ":" in ref and "/" not in ref else None
        if parent is None:
            break
        if parent.bits_per_weight < (lowest or m).bits_per_weight:
            lowest = parent
        current = parent
    return lowest


def recommend(name: str, n_ctx: int | None = None, kv_type: str = "f16", *, min_quality: float | None = None,
              store: Store | None = None, available: int | None = None, kv_type_k: str | None = None,
              kv_type_v: str | None = None, placement: Mapping[str, Any] | None = None) -> Recommendation:
    """The quant of ladder `name` to use on this machine.

    Without `min_quality`: the highest-quality member that fits (lowest measured KLD; members not
    evaluated rank by bits per weight). With `min_quality` (a maximum mean KLD): the fastest member
    that fits and whose measured KLD is at most that (decode tok/s if benchmarked, else the smallest).
    A member made from a lower-precision one (an F16 copy of a Q4_1: the ladder's reference, KLD 0
    against itself) inherits that one's error and bits; at equal quality the member that inherits
    nothing, then the smaller file, wins.
    `placement` as in `fit`: device memory counts where the devices report it.
    """
    from .store import Store

    store = store or Store()
    avail = available_memory() if available is None else available
    cands = []
    for m in ladder(name, store=store):
        ev = m.metrics.get("eval") or {}
        bench = m.metrics.get("bench") or {}
        report = fit(m.ref, n_ctx, kv_type, store=store, available=avail, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
                     placement=placement)
        cands.append(Candidate(m, report, ev.get("kld"), ev.get("ppl"), ev.get("same_top"), bench.get("decode_tok_s"),
                               _lowest_precision_ancestor(m, store)))
    measured = {c.ref: c.kld for c in cands}
    for c in cands:  # an ancestor outside the ladder (another name) has its own measured KLD, if any
        if c.inherits_from is not None and c.inherits_from.ref not in measured:
            ev = c.inherits_from.metrics.get("eval")
            measured[c.inherits_from.ref] = ev.get("kld") if isinstance(ev, dict) else None
    quality = {c.ref: c.quality_kld(measured) for c in cands}
    fitting = [c for c in cands if c.fit.fits]
    if not fitting:
        smallest = min(cands, key=lambda c: c.fit.estimate.total)
        return Recommendation(None, tuple(cands), f"nothing fits: the smallest, {smallest.ref}, needs "
                              f"{smallest.fit.estimate.total / 1e9:.2f} GB, {avail / 1e9:.2f} GB available")
    if min_quality is not None:
        good = [c for c in fitting if quality[c.ref] is not None and quality[c.ref] <= min_quality]
        if not good:
            measured = [c for c in fitting if c.kld is not None]
            hint = "" if measured else " (none is evaluated yet: run `edgeinfer eval --ladder NAME`)"
            return Recommendation(None, tuple(cands), f"no member that fits has KLD <= {min_quality}{hint}")
        choice = max(good, key=lambda c: (c.decode_tok_s or 0.0, -c.manifest.size))
        why = "fastest" if any(c.decode_tok_s for c in good) else "smallest"
        return Recommendation(choice, tuple(cands), f"the {why} that fits with KLD <= {min_quality}")
    choice = min(fitting, key=lambda c: (quality[c.ref] if quality[c.ref] is not None else float("inf"), -c.quality_bits,
                                         c.inherits_from is not None, c.manifest.size))
    why = "lowest measured KLD" if quality[choice.ref] is not None else "most bits per weight (not evaluated yet)"
    return Recommendation(choice, tuple(cands), f"the best quality that fits: {why}")
