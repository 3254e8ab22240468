"""Pull a model from the Hugging Face Hub (or a mirror) into the store.

    result = edgeinfer.pull("bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M")
    result.manifest.ref            # 'smollm2-360m-instruct:q4_k_m'

A GGUF repo: the quant's file(s) are downloaded verified into the standard Hugging Face cache
(`edgeinfer.hub`) and registered where they lie. A safetensors repo: its config, tokenizer and
weights are downloaded the same way, converted to an F16 GGUF (`edgeinfer.convert`), quantized per
a quant profile (`edgeinfer.quantize`) and registered. `plan` says beforehand what a pull will
fetch and write, and whether it fits the disk and the RAM; it writes nothing.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from .cancel import CancelToken, raise_if_cancelled
from .errors import ConversionError, DiskSpaceError, EdgeInferError, HubError, InvalidOptionError, OfflineError, StoreError
from .fit import FitReport, available_memory, fit
from .gguf_file import read_gguf
from .gguf_import import refuse_local_file
from .hub.cache import HubFile, Snapshot, cache_dir, endpoint, snapshot
from .hub.download import PARTIAL_SUFFIX, DownloadProgress, fetch_all
from .hub.spec import SOURCE_FILES, check_repo_id, check_revision, is_model_gguf, parse_spec, select_gguf
from .profiles import QuantProfile, get_profile
from .store import ModelManifest, Store, normalize_name, parse_ref
from .validate import LoadChecks, check_semantics

if TYPE_CHECKING:  # imported when a safetensors repo is converted: they bring gguf-py and ctypes bindings
    from .convert import ConvertProgress
    from .quantize import QuantizeProgress

__all__ = [
    "PullPlan",
    "PullResult",
    "PullStage",
    "PullEvent",
    "DEFAULT_PROFILE",
    "plan",
    "pull",
    "pull_source",
]

DEFAULT_PROFILE = "balanced"

# Nominal bits per weight of a quant type, to estimate sizes before a file exists.
_QUANT_BPW = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69, "Q5_K_S": 5.54,
    "Q5_0": 5.5, "Q5_1": 6.0, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_0": 4.5, "Q4_1": 5.0, "IQ4_XS": 4.25,
    "IQ4_NL": 4.5, "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.5, "Q2_K": 3.35, "IQ3_M": 3.7, "IQ2_M": 2.7,
}  # fmt: skip


# -- events and results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PullStage:
    """A step of a pull after the downloads: convert, quantize, register."""

    stage: str
    message: str


@dataclass(frozen=True)
class PullPlan:
    """What a pull will fetch and write, computed before anything is written."""

    repo: str
    revision: str  # as asked ('main' by default)
    commit: str
    kind: str  # 'gguf' | 'safetensors'
    quant: str  # GGUF: the quant picked; safetensors: the quant to make
    files: tuple[HubFile, ...]
    total_bytes: int
    cached_bytes: int  # verified-or-not blobs already in the HF cache
    partial_bytes: int  # bytes of interrupted downloads that will be resumed
    output_bytes: int  # estimate of what conversion and quantization write to the store
    weights_bytes: int  # estimate of the model file that will be loaded
    cache_dir: Path
    store_dir: Path
    free_cache_bytes: int
    free_store_bytes: int
    ram_available_bytes: int | None
    ram_needed_bytes: int
    endpoint: str
    offline: bool = False
    note: str = ""  # e.g. which quant was picked when the default was missing

    @property
    def download_bytes(self) -> int:
        return max(self.total_bytes - self.cached_bytes - self.partial_bytes, 0)

    @property
    def fits_ram(self) -> bool | None:
        if self.ram_available_bytes is None:
            return None
        return self.ram_needed_bytes <= self.ram_available_bytes

    def disk_shortfall(self) -> str | None:
        """None when both the cache and the store have room, else a one-line reason."""
        same = _same_device(self.cache_dir, self.store_dir)
        need_cache = self.download_bytes + (self.output_bytes if same else 0)
        if need_cache > self.free_cache_bytes:
            return (
                f"not enough disk space to pull {self.repo}: need {_gb(need_cache)}, "
                f"{_gb(self.free_cache_bytes)} free in {self.cache_dir}"
            )
        if not same and self.output_bytes > self.free_store_bytes:
            return (
                f"not enough disk space to pull {self.repo}: need {_gb(self.output_bytes)} for the converted "
                f"model, {_gb(self.free_store_bytes)} free in {self.store_dir}"
            )
        return None


# What `on_progress` receives: the plan first, then DownloadProgress per file, PullStage steps and,
# for safetensors repos, the converter's ConvertProgress and the quantizer's QuantizeProgress as is.
PullEvent: TypeAlias = "DownloadProgress | PullStage | PullPlan | ConvertProgress | QuantizeProgress"
ProgressCallback: TypeAlias = Callable[[PullEvent], None] | None


@dataclass
class PullResult:
    manifest: ModelManifest  # the model to run
    plan: PullPlan
    paths: list[Path]  # snapshot paths of the files fetched
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    f16_manifest: ModelManifest | None = None  # the F16 GGUF, when kept (--keep-f16 or kept earlier)
    fit: FitReport | None = None  # the model at its default context, when the estimate could be made


# -- small helpers ---------------------------------------------------------------------------------


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def _same_device(a: Path, b: Path) -> bool:
    try:
        return _existing(a).stat().st_dev == _existing(b).stat().st_dev
    except OSError:
        return True


def _existing(p: Path) -> Path:
    p = Path(p)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _free(p: Path) -> int:
    return shutil.disk_usage(_existing(p)).free


def _emit(cb: ProgressCallback, event: PullEvent) -> None:
    if cb is not None:
        cb(event)


# -- planning --------------------------------------------------------------------------------------


def _ram_needed(weights_bytes: int) -> int:
    """Before the file exists: weights plus a margin for the KV cache and compute buffers of a
    default context. After the pull, PullResult.fit has edgeinfer.fit's estimate from the file."""
    return int(weights_bytes * 1.1) + (256 << 20)


def _fit_report(manifest: ModelManifest) -> FitReport | None:
    try:
        return fit(manifest.file)
    except (EdgeInferError, OSError):
        return None


def _source_files(snap: Snapshot) -> list[HubFile]:
    """What conversion needs: config, tokenizer files, the safetensors (those the index names)."""
    top = {p: f for p, f in snap.files.items() if "/" not in p}
    wanted = [top[n] for n in SOURCE_FILES if n in top]
    from .convert.embedding import embedding_files  # sentence-transformers: pooling, prompts, the card

    wanted += [snap.files[p] for p in embedding_files(snap.files) if snap.files[p] not in wanted]
    index = top.get("model.safetensors.index.json")
    shards: list[str]
    if index is not None and snap.offline:
        blob = snap.storage / "blobs" / index.etag
        weight_map = json.loads(blob.read_text()).get("weight_map", {}) if blob.is_file() else {}
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p for p in top if p.endswith(".safetensors"))
    missing = [s for s in shards if s not in top]
    if missing:
        raise (OfflineError if snap.offline else HubError)(f"{snap.repo}: missing weight files {', '.join(missing)}")
    wanted += [top[s] for s in shards]
    if not shards or "config.json" not in top:
        raise HubError(f"{snap.repo} has no config.json and *.safetensors to convert")
    return wanted


def _kind(snap: Snapshot) -> str:
    if any(is_model_gguf(p) for p in snap.files):
        return "gguf"
    if any(p.endswith(".safetensors") and "/" not in p for p in snap.files):
        return "safetensors"
    raise HubError(f"{snap.repo} has neither GGUF files nor safetensors weights")


def _model_name(repo: str) -> str:
    name = repo.split("/", 1)[1]
    name = re.sub(r"[-_.]gguf$", "", name, flags=re.IGNORECASE)
    return normalize_name(name)


def _pick_name(store: Store, repo: str, tags: Sequence[str]) -> str:
    """The store name for `repo`: its name (`smollm2-360m-instruct`), or `owner-name` when a model
    from another source already holds one of the refs this pull writes (never clobber it)."""
    base = _model_name(repo)
    qualified = normalize_name(f"{repo.split('/')[0]}-{base}")
    for name in (base, qualified):
        taken = [
            m for t in tags if (m := store.find(f"{name}:{t}")) is not None and (m.source or {}).get("repo") != repo
        ]
        if not taken:
            return name
    raise StoreError(
        f"{qualified}:{tags[-1]} is already in the store from another source; remove it first (edgeinfer rm)"
    )


def _resolve_profile(profile: str | None, quant: str | None) -> tuple[str, QuantProfile | None]:
    """(quant type to make, QuantProfile or None) for a safetensors pull."""
    prof = None
    if profile or not quant:
        prof = get_profile(profile or DEFAULT_PROFILE)
    q = (quant or prof.weights).upper()  # type: ignore[union-attr]
    if prof is not None and quant and quant.upper() != prof.weights.upper():
        prof = replace(prof, weights=q)
    return q, prof


def _make_plan(
    snap: Snapshot, files: list[HubFile], kind: str, quant: str, note: str, keep_f16: bool, store_dir: Path
) -> PullPlan:
    total = sum(f.size for f in files)
    cached = partial = 0
    for f in files:
        blob = snap.storage / "blobs" / f.etag
        if blob.is_file():
            cached += f.size
        elif (p := blob.with_name(blob.name + PARTIAL_SUFFIX)).is_file():
            partial += min(p.stat().st_size, f.size)
    if kind == "gguf":
        output = 0
        weights = total
    else:
        weights_in = sum(f.size for f in files if f.path.endswith(".safetensors"))
        bytes_per = 2
        cfg = next((f for f in files if f.path == "config.json"), None)
        blob = snap.storage / "blobs" / cfg.etag if cfg else None
        if blob is not None and blob.is_file():
            with contextlib.suppress(ValueError, OSError):
                dtype = str(json.loads(blob.read_text()).get("torch_dtype", "")).lower()
                bytes_per = 4 if dtype in ("float32", "fp32") else 2
        params = weights_in // bytes_per
        f16 = params * 2
        weights = int(params * _QUANT_BPW.get(quant, 5.0) / 8)
        output = f16 + weights  # the f16 exists until the quant is written, kept or not
    store_dir.mkdir(parents=True, exist_ok=True)
    cdir = cache_dir()
    return PullPlan(
        repo=snap.repo,
        revision=snap.revision,
        commit=snap.commit,
        kind=kind,
        quant=quant,
        files=tuple(files),
        total_bytes=total,
        cached_bytes=cached,
        partial_bytes=partial,
        output_bytes=output,
        weights_bytes=weights,
        cache_dir=cdir,
        store_dir=store_dir,
        free_cache_bytes=_free(cdir),
        free_store_bytes=_free(store_dir),
        ram_available_bytes=available_memory() or None,
        ram_needed_bytes=_ram_needed(weights),
        endpoint=endpoint(),
        offline=snap.offline,
        note=note,
    )


def _prepare(
    spec: str,
    revision: str | None,
    token: str | None,
    profile: str | None,
    quant: str | None,
    keep_f16: bool,
    store: Store | None,
) -> tuple[Snapshot, PullPlan, QuantProfile | None]:
    refuse_local_file(spec, "pull takes a Hugging Face repo (owner/name)")
    repo, tag = parse_spec(spec)
    rev = check_revision(revision or "main")
    snap = snapshot(repo, rev, token)
    kind = _kind(snap)
    prof = None
    if kind == "gguf":
        names, qtag, note = select_gguf(list(snap.files), quant or tag)
        files = [snap.files[n] for n in names]
    else:
        if tag and quant and tag.upper() != quant.upper():
            raise InvalidOptionError(f"two quants asked for: {tag} in the name and --quant {quant}")
        qtag, prof = _resolve_profile(profile, quant or tag)
        note = f"profile {prof.name}" if prof is not None else ""
        files = _source_files(snap)
    store = store or Store()
    return snap, _make_plan(snap, files, kind, qtag, note, keep_f16, store.models_dir), prof


def plan(
    spec: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    quant: str | None = None,
    keep_f16: bool = False,
    store: Store | None = None,
) -> PullPlan:
    """What `pull` would fetch and write, its size, free disk and the RAM estimate; writes nothing."""
    return _prepare(spec, revision, token, profile, quant, keep_f16, store)[1]


# -- pulling ---------------------------------------------------------------------------------------


def pull_source(
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    on_progress: Callable[[DownloadProgress], None] | None = None,
    cancel: CancelToken = None,
) -> Path:
    """Download (or reuse) only what conversion needs; return the local snapshot folder."""
    rev = check_revision(revision or "main")
    snap = snapshot(check_repo_id(repo_id), rev, token)
    files = _source_files(snap)
    p = replace(_make_plan(snap, files, "safetensors", "F16", "", False, cache_dir()), output_bytes=0)
    if (why := p.disk_shortfall()) is not None:
        raise DiskSpaceError(why)
    fetch_all(snap, files, token, on_progress, cancel)
    return snap.storage / "snapshots" / snap.commit


def pull(
    spec: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    profile: str | None = None,
    quant: str | None = None,
    keep_f16: bool = False,
    store: Store | None = None,
    on_progress: ProgressCallback = None,
    cancel: CancelToken = None,
) -> PullResult:
    """Pull `owner/name[:QUANT]` and register it in the store; see the module docstring.

    The model is named after the repo (`owner/SmolLM2-360M-Instruct-GGUF` → `smollm2-360m-instruct`),
    or `owner-name` when that ref already holds a model from another source; the tag is the quant.
    `on_progress` receives the PullPlan, then DownloadProgress / PullStage events (see PullEvent);
    `cancel` (threading.Event or a callable) stops between chunks and keeps the partial file.
    Raises ModelNotFoundError (no such repo, revision or quant), AuthenticationError (401/403),
    OfflineError (offline or unreachable and nothing cached, or a download cut off: run again to
    resume), IntegrityError (hash mismatch; the bad file is deleted), DiskSpaceError, Cancelled.
    """
    from .quantize import default_tag

    t0 = time.monotonic()
    store = store or Store()
    snap, pl, prof = _prepare(spec, revision, token, profile, quant, keep_f16, store)
    _emit(on_progress, pl)
    if (why := pl.disk_shortfall()) is not None:
        raise DiskSpaceError(why)
    paths, downloaded, reused = fetch_all(snap, pl.files, token, on_progress, cancel)
    source = {
        "kind": "hub",
        "repo": snap.repo,
        "revision": snap.commit,
        "ref": snap.revision,
        "endpoint": pl.endpoint,
        "files": [f.path for f in pl.files],
        "sha256": {f.path: f.sha256 or "" for f in pl.files},
        "git_sha1": {f.path: f.blob_id for f in pl.files if not f.sha256 and f.blob_id},
    }
    if pl.kind == "gguf":
        tags = [(pl.quant or "latest").lower()]
    else:
        tags = ["f16", default_tag(pl.quant, prof)]
    name = _pick_name(store, snap.repo, tags)
    f16_manifest = None
    if pl.kind == "gguf":
        manifest = _register_gguf(store, name, pl, paths, source, on_progress)
    else:
        manifest, f16_manifest = _convert_and_quantize(
            store, name, pl, prof, snap, source, keep_f16, on_progress, cancel
        )
    _emit(on_progress, PullStage("done", f"{manifest.ref} ready"))
    fit_report = _fit_report(manifest)
    return PullResult(manifest, pl, paths, downloaded, reused, time.monotonic() - t0, f16_manifest, fit_report)


def _register_gguf(
    store: Store, name: str, pl: PullPlan, paths: list[Path], source: dict[str, Any], on_progress: ProgressCallback
) -> ModelManifest:
    _emit(on_progress, PullStage("validate", f"checking {len(paths)} GGUF file(s)"))
    infos = [read_gguf(p) for p in paths]  # each split on its own: every part is bounds-checked
    check_semantics(infos[0])  # what llama.cpp would abort on, refused first
    sha256 = LoadChecks(store).ensure_loads(paths[0], pl.files[0].sha256)  # llama.cpp loads it, once
    tag = (pl.quant or infos[0].file_type or "latest").lower()
    _emit(on_progress, PullStage("register", f"registering {name}:{tag}"))
    # Not store.register(): it records the resolved path, and llama.cpp finds the other parts of a
    # split GGUF by name next to the first one (a blob's hash name has none); keep the snapshot path.
    parse_ref(f"{name}:{tag}")
    info = infos[0]
    manifest = ModelManifest(
        name=name,
        tag=tag,
        file=str(paths[0].absolute()),
        sha256=sha256,
        load_checked=sha256,
        size=sum(f.size for f in pl.files),
        architecture=info.architecture,
        parameters=sum(i.parameter_count for i in infos),
        context_length=info.context_length,
        quant=info.file_type,
        bits_per_weight=round(8.0 * sum(i.tensor_bytes for i in infos) / max(sum(i.parameter_count for i in infos), 1), 4),
        source=source,
        created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        owned=False,
    )
    return store.save(manifest)


def _convert_and_quantize(
    store: Store,
    name: str,
    pl: PullPlan,
    prof: QuantProfile | None,
    snap: Snapshot,
    source: dict[str, Any],
    keep_f16: bool,
    on_progress: ProgressCallback,
    cancel: CancelToken,
) -> tuple[ModelManifest, ModelManifest | None]:
    """safetensors → F16 GGUF (edgeinfer.convert) → the profile's quant (edgeinfer.quantize)."""
    from .convert import convert_model
    from .quantize import quantize_model

    folder = snap.storage / "snapshots" / snap.commit
    f16_ref = f"{name}:f16"
    existing = store.find(f16_ref)
    # An F16 kept by an earlier pull of the same commit is reused: "keep the f16 for later quants".
    reuse = existing is not None and (existing.source or {}).get("revision") == snap.commit and existing.path.exists()
    if reuse:
        f16 = existing
    else:
        _emit(on_progress, PullStage("convert", f"converting {snap.repo} to GGUF (F16)"))
        conv = convert_model(
            folder, "f16", store=store, name=name, repo_id=snap.repo, on_progress=on_progress, cancel=cancel
        )
        if conv.manifest is None:
            raise ConversionError(f"converting {snap.repo} registered no model")
        f16 = conv.manifest
        f16.source = {**source, "converted": "f16"}
        store.save(f16)
    keep = keep_f16 or reuse or existing is not None
    try:
        raise_if_cancelled(cancel, "pull cancelled")
        what = pl.quant + (f" (profile {prof.name})" if prof is not None else "")
        _emit(on_progress, PullStage("quantize", f"quantizing to {what}"))
        q = quantize_model(
            f16.ref, pl.quant, store=store, profile=prof, name=name, overwrite=True, on_progress=on_progress
        )
    except BaseException:
        if not keep:
            with contextlib.suppress(EdgeInferError, OSError):
                store.remove(f16.ref)
        raise
    manifest = q.manifest
    manifest.source = {**source, "converted": "f16", **({"profile": prof.name} if prof is not None else {})}
    manifest.derived_from = f16.ref if keep else None
    _emit(on_progress, PullStage("register", f"registered {manifest.ref}"))
    store.save(manifest)
    if not keep:
        store.remove(f16.ref)
        return manifest, None
    return manifest, f16
