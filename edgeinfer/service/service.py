"""ModelService: every model of the store served by name, each by its own engine core (the package's
docstring says how); names, plans, leases, unloading and what is held, over the registry."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine.core.options import LoadOptions, SpeculationOptions
from ..engine.faces.batch import BatchEngine
from ..engine.faces.speculation_setup import ProgressCallback
from ..cancel import CancelToken, raise_if_cancelled
from ..errors import Cancelled, EdgeInferError, InvalidOptionError, ModelNotFoundError
from ..fit import available_memory
from ..store import ModelManifest, Store
from ..validate import admit, validate_file
from .janitor import Janitor
from .leases import Lease
from .memory import ModelPlan, expected_ctx, gb_text, model_memory
from .names import ModelNames, model_key
from .registry import HeldModel, Registry
from .settings import ModelSettings, ServiceOptions
from .status import CatalogEntry, ModelStatus, StopResult
from .units import parse_duration

__all__ = ["Loader", "ModelNotLoadedError", "ModelService", "ModelTooLargeError"]

log = logging.getLogger(__name__)


class ModelTooLargeError(EdgeInferError, MemoryError):
    """A model whose estimated memory exceeds the service's whole budget: it can never be loaded."""


class ModelNotLoadedError(ModelNotFoundError):
    """`stop` of a model that is not loaded."""


# (plan, progress, cancel): a BatchEngine of the plan; `cancel()` says nobody waits for it any more
Loader = Callable[[ModelPlan, "ProgressCallback | None", CancelToken], BatchEngine]


def _load_engine(store: Store) -> Loader:
    def load(plan: ModelPlan, progress: ProgressCallback | None, cancel: CancelToken = None) -> BatchEngine:
        info = admit(plan.path, store, plan.manifest)  # validated, and loaded once in a child process
        raise_if_cancelled(cancel, f"loading {plan.name}")
        return BatchEngine(plan.path, info, plan.load, plan.batch, manifest=plan.manifest, store=store,
                           speculation=plan.speculation, progress=progress, cancel=cancel)

    return load


class ModelService:
    """Models loaded on demand by name, kept warm, evicted by memory (see the package's docstring).

    Thread safety: every public method may be called from any thread."""

    def __init__(self, options: ServiceOptions | None = None, *, store: Store | None = None,
                 loader: Loader | None = None, progress: ProgressCallback | None = None):
        self.options = (options or ServiceOptions()).validate()
        self.store = store or Store()
        self.budget = self.options.max_memory or available_memory()
        self._loader = loader or _load_engine(self.store)
        self._progress = progress
        self._held = Registry(self.options.max_loaded, self.budget)
        self._plans: dict[str, tuple[tuple[Any, ...], ModelPlan]] = {}
        self.loads = 0
        self._names = ModelNames(self.store, self.options)
        self._janitor = Janitor(self._held)

    @classmethod
    def adopt(cls, engine: BatchEngine, options: ServiceOptions | None = None) -> ModelService:
        """A service over an engine its caller loaded and keeps (and closes): it is the default
        model, never unloaded; other models load on demand beside it."""
        base = options or ServiceOptions()
        default = engine.manifest.ref if engine.manifest is not None else engine.path
        service = cls(replace(base, default_model=default), store=engine.store)
        plan = service._plan_for(engine.path, engine.manifest, settings=ModelSettings(), engine=engine)
        entry = HeldModel(plan, -1.0, pinned=True)
        entry.engine, entry.state, entry.loaded_at, entry.load_s = engine, "ready", time.time(), 0.0
        entry.done.set()
        with service._held.cond:
            service._held.entries[plan.key] = entry
        return service

    # -- names and plans -------------------------------------------------------------------------
    def resolve(self, model: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A model as a request names it. A str is a name — a store name (`name:tag`, a name with
        one or a default tag), an alias, or the file name of a model the operator configured or
        the store holds — never a path (the server's disk is not a client's to choose); a Path is
        a file (the caller's choice); None or "" is the default model."""
        return self._names.resolve(model)

    def plan(self, model: str | Path | None) -> ModelPlan:
        """The model a request names, sized with its settings (reads only its header)."""
        path, manifest = self.resolve(model)
        return self._plan_for(path, manifest)

    def _plan_for(self, path: Path, manifest: ModelManifest | None, *, settings: ModelSettings | None = None,
                  engine: BatchEngine | None = None) -> ModelPlan:
        key = model_key(path)
        with self._held.cond:
            entry = self._held.entries.get(key)
            if entry is not None and engine is None:
                return entry.plan  # what is loaded (or loading) is what a request gets
        st = path.stat()
        identity = (st.st_size, st.st_mtime_ns, st.st_ino, manifest.ref if manifest else None)
        cached = self._plans.get(key)
        if cached is not None and cached[0] == identity and engine is None:
            return cached[1]
        settings = settings if settings is not None else self._names.settings(key)
        if engine is not None:
            load, batch, spec, info = engine.options, engine.batch_options, engine.speculation, engine.info
            n_ctx = engine.n_ctx
        else:
            load, batch, spec = settings.load_options(), settings.batch_options(), settings.speculation()
            info = validate_file(path, self.store)
            n_ctx = expected_ctx(info, load, batch.parallel)
        memory = model_memory(info, load, n_ctx, self._draft_bytes(spec, load, n_ctx))
        plan = ModelPlan(key, manifest.ref if manifest else path.name, path, manifest, info, load, batch, spec,
                         settings.keep_alive, settings.alias, n_ctx, memory)
        if engine is None:
            self._plans[key] = (identity, plan)
        return plan

    def _draft_bytes(self, spec: SpeculationOptions, load: LoadOptions, n_ctx: int) -> int:
        """The draft model's estimate, where the speculation names one (a self-draft's file may not
        exist yet: not counted)."""
        if not spec.draft_model or spec.method not in ("draft", "auto"):
            return 0
        try:
            path, _ = self.store.resolve(spec.draft_model)
            info = validate_file(path, self.store)
        except (EdgeInferError, OSError) as e:
            log.debug("draft model %s not sized: %s", spec.draft_model, e)
            return 0
        return model_memory(info, load.draft_options(n_ctx), n_ctx).total

    # -- leases ----------------------------------------------------------------------------------
    def acquire(self, model: str | Path | None = None, *, keep_alive: float | None = None,
                cancel: threading.Event | None = None, evict: bool = True) -> Lease:
        """A lease on the model `model` names, loaded now if it is not (see `resolve` for names).

        `keep_alive` (seconds; 0, or negative for ever): how long the model stays once idle after
        this lease, None for its own (serve.toml) or the service's. ModelTooLargeError when it can
        never fit; NoRoomError when every model that would have to go stays busy for room_wait_s
        (or at once with evict=False, which never unloads another model); the load's own error.
        `cancel` (set when the request's client has gone): Cancelled instead of waiting on, nothing
        evicted for it, and the load it started or waits for cancelled once no request waits for it."""
        if keep_alive is not None:
            keep_alive = parse_duration(keep_alive)
        plan = self.plan(model)
        if plan.memory.total > self.budget:
            raise ModelTooLargeError(
                f"{plan.name} needs about {gb_text(plan.memory.total)} (weights {gb_text(plan.memory.weights)}, KV cache "
                f"{gb_text(plan.memory.kv_cache)}, compute {gb_text(plan.memory.compute)}"
                f"{', repacked weights ' + gb_text(plan.memory.repack) if plan.memory.repack else ''}"
                f"{', draft ' + gb_text(plan.memory.draft) if plan.memory.draft else ''}) but the memory budget is "
                f"{gb_text(self.budget)} (--max-memory): lower its ctx or parallel, or pick a smaller quant")
        deadline = time.monotonic() + (self.options.room_wait_s if evict else 0.0)
        while True:
            victims: list[HeldModel] = []
            wait_load: HeldModel | None = None
            with self._held.cond:
                self._check_open()
                entry = self._held.entries.get(plan.key)
                dead = None
                if entry is not None and entry.state == "ready" and entry.leases == 0 and \
                        getattr(entry.engine, "failure", None) is not None:
                    log.warning("the engine of %s stopped (%s): loading it again", plan.name, entry.engine.failure)
                    entry.state, dead = "unloading", entry
                elif entry is not None and entry.state == "ready":
                    entry.leases += 1
                    entry.expires = None
                    entry.last_used = time.monotonic()
                    return Lease(self._held, entry, keep_alive)
                if dead is not None:
                    pass  # closed below, outside the lock; then loaded again
                elif entry is not None and entry.state == "loading":
                    wait_load = entry
                elif entry is not None:  # unloading: wait until it is gone, then load it again
                    self._held.wait(deadline, cancel, plan)
                    continue
                else:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled(f"the request for {plan.name} was cancelled")  # no eviction for nobody
                    victims_or_none = self._held.make_room(plan, evict)
                    if victims_or_none is None:
                        self._held.wait(deadline, cancel, plan)
                        continue
                    victims = victims_or_none
                    entry = HeldModel(plan, self._keep_alive_of(plan))
                    entry.leases = 1  # the loader's own lease: nothing unloads it before its request runs
                    entry.wanted.append(cancel)
                    self._held.entries[plan.key] = entry
                if wait_load is not None:
                    wait_load.wanted.append(cancel)
            if dead is not None:
                self._held.unload(dead, 0.0)
                continue
            if wait_load is not None:
                self._wait_for_load(wait_load, cancel)
                continue
            return self._load(entry, victims, keep_alive)

    def _wait_for_load(self, entry: HeldModel, cancel: threading.Event | None) -> None:
        """Wait for another request's load of the model (this request's `cancel` counted among
        those who want it); its error, unless the load was cancelled for lack of anyone waiting
        while this request still does (then the caller loads it again)."""
        while not entry.done.wait(0.1):
            if cancel is not None and cancel.is_set():
                break
        with self._held.cond:
            entry.wanted.remove(cancel)
            self._held.cond.notify_all()
        if not entry.done.is_set():
            raise Cancelled(f"the request for {entry.plan.name} was cancelled while it loaded")
        if entry.error is not None and not (isinstance(entry.error, Cancelled) and
                                            not (cancel is not None and cancel.is_set())):
            raise _copy_error(entry.error)

    def _abandoned(self, entry: HeldModel) -> bool:
        with self._held.cond:
            return entry.abandoned

    def _load(self, entry: HeldModel, victims: list[HeldModel], keep_alive: float | None) -> Lease:
        plan = entry.plan
        started = time.perf_counter()
        try:
            for v in victims:
                raise_if_cancelled(lambda: self._abandoned(entry), f"loading {plan.name}")
                log.info("unloading %s to make room for %s (idle %.1f s)", v.plan.name, plan.name,
                         time.monotonic() - v.last_used)
                self._held.unload(v, 0.0)
                victims = victims[1:]
            engine = self._loader(plan, self._progress, lambda: self._abandoned(entry))
        except BaseException as e:
            with self._held.cond:
                for v in victims:  # not unloaded after all: idle again
                    v.state = "ready"
                self._held.evictions -= len(victims)
                entry.error = e
                if self._held.entries.get(plan.key) is entry:
                    del self._held.entries[plan.key]
                entry.done.set()
                self._held.cond.notify_all()
            if isinstance(e, Cancelled):
                log.info("loading %s cancelled: no request waits for it any more", plan.name)
            else:
                log.info("loading %s failed: %s", plan.name, e)
            raise
        load_s = time.perf_counter() - started
        exact = self._plan_for(plan.path, plan.manifest, settings=self._names.settings(plan.key), engine=engine)
        exact = replace(exact, keep_alive=plan.keep_alive, aliases=plan.aliases)
        with self._held.cond:
            closed = self._held.closed
            entry.plan, entry.engine, entry.state = exact, engine, "unloading" if closed else "ready"
            entry.loaded_at, entry.load_s = time.time(), load_s
            entry.last_used = time.monotonic()
            self.loads += 1
            entry.done.set()
            self._held.cond.notify_all()
        log.info("loaded %s in %.2f s (%d slots of %d tokens, ~%s)", plan.name, load_s, exact.parallel,
                 exact.n_ctx_per_request, gb_text(exact.memory.total))
        if closed:  # the service closed while this loaded: nobody will unload it
            self._held.unload(entry, 0.0)
            raise _closed_error()
        return Lease(self._held, entry, keep_alive)

    def _keep_alive_of(self, plan: ModelPlan) -> float:
        return plan.keep_alive if plan.keep_alive is not None else self.options.keep_alive

    def preload(self, model: str | Path | None) -> ModelStatus:
        """Load `model` now, without unloading any other (NoRoomError instead); its keep-alive
        countdown starts at once."""
        with self.acquire(model, evict=False) as lease:
            return next(s for s in self.ps() if s.path == lease.plan.key)

    # -- unloading -------------------------------------------------------------------------------
    def stop(self, model: str | Path, *, grace: float = 0.0) -> StopResult:
        """Unload `model` now; its running and queued requests are cancelled after `grace`
        seconds (each ends with finish_reason "cancelled"). ModelNotLoadedError if it is not loaded."""
        key = self._loaded_key(model)
        while True:
            with self._held.cond:
                entry = self._held.entries.get(key) if key is not None else None
                if entry is None:
                    raise ModelNotLoadedError(f"model {str(model)[:200]!r} is not loaded")
                if entry.pinned:
                    raise InvalidOptionError(f"{entry.plan.name} was given to this server by its caller and stays")
                if entry.state == "loading":
                    pass
                elif entry.state == "unloading":
                    self._held.cond.wait(timeout=0.5)
                    continue
                else:
                    entry.state = "unloading"
                    busy = entry.leases
                    break
            entry.done.wait()
        log.info("stopping %s (%d request(s) running or waiting)", entry.plan.name, busy)
        self._held.unload(entry, grace)
        return StopResult(entry.plan.name, busy)

    def _loaded_key(self, model: str | Path) -> str | None:
        """The key of a held model by any name a request may use, by its file name or alias as
        loaded (also after its store entry is gone)."""
        with self._held.cond:
            for key, e in self._held.entries.items():
                if isinstance(model, str) and model in (e.plan.name, e.plan.path.name, *e.plan.aliases):
                    return key
        try:
            path, _ = self.resolve(model)
        except ModelNotFoundError:
            return None
        return model_key(path)

    # -- what is held ----------------------------------------------------------------------------
    def ps(self) -> list[ModelStatus]:
        """Every model held (loading, ready, unloading), most recently used first."""
        with self._held.cond:
            entries = sorted(self._held.entries.values(), key=lambda e: -e.last_used)
            snapshot = [(e, e.state, e.leases, e.last_used, e.expires, e.keep_alive) for e in entries]
        now, wall = time.monotonic(), time.time()
        out = []
        for e, state, leases, last_used, expires, keep in snapshot:
            engine, plan = e.engine, e.plan
            busy = queued = 0
            calibrating = False
            if engine is not None and state == "ready":
                m = engine.metrics()
                busy, queued, calibrating = m.active, m.queue_depth, m.calibrating
            expires_in = None if expires is None or leases else max(0.0, expires - now)
            out.append(ModelStatus(
                name=plan.name, path=plan.key, state=state, memory=plan.memory, parallel=plan.parallel,
                n_ctx=plan.n_ctx, n_ctx_per_request=plan.n_ctx_per_request, speculation=plan.speculation.method,
                requests=leases, slots_busy=busy, queue_depth=queued, calibrating=calibrating,
                idle_s=None if leases else max(0.0, now - last_used), keep_alive=-1.0 if e.pinned else keep,
                expires_in_s=expires_in, expires_at=None if expires_in is None else wall + expires_in,
                loaded_at=e.loaded_at, load_s=e.load_s, pinned=e.pinned, aliases=plan.aliases,
                kv_unified=plan.batch.kv_unified))
        return out

    def catalog(self) -> list[CatalogEntry]:
        """Every model a request may name: the store's, and the files the operator configured,
        with the status of those held; the default model first, then the loaded ones."""
        held = {s.path: s for s in self.ps()}
        out: list[CatalogEntry] = []
        seen: set[str] = set()
        tables = self._names.tables
        for m in self.store.list():
            key = str(m.path.resolve())
            seen.add(key)
            out.append(CatalogEntry(m.ref, m, held.get(key), tables.get(key, ModelSettings()).alias))
        for target in self._names.configured_files():
            key = str(target.resolve())
            if key not in seen and target.exists():
                seen.add(key)
                out.append(CatalogEntry(target.name, None, held.get(key), tables.get(key, ModelSettings()).alias))
        for key, s in held.items():
            if key not in seen:
                out.append(CatalogEntry(s.name, None, s, s.aliases))
        default = self.default_name
        # the default model first, then the loaded ones (most recently used first), then the rest
        order = {s.name: i for i, s in enumerate(held.values())}
        return sorted(out, key=lambda e: (e.name != default, e.status is None, order.get(e.name, 0)))

    @property
    def default_name(self) -> str | None:
        """The name of the model a request without `model` gets (None: no default model)."""
        if self._names.default_key is None:
            return None
        try:
            return self.plan(None).name
        except EdgeInferError:
            return None

    @property
    def reserved(self) -> int:
        """Estimated bytes of the models held (loading and unloading ones too)."""
        with self._held.cond:
            return self._held.reserved()

    @property
    def evictions(self) -> int:
        """Idle models unloaded to make room for others."""
        return self._held.evictions

    @property
    def expirations(self) -> int:
        """Models unloaded because their keep-alive ran out."""
        return self._held.expirations

    def engines(self) -> list[BatchEngine]:
        """The engines loaded now."""
        with self._held.cond:
            return [e.engine for e in self._held.entries.values() if e.engine is not None and e.state == "ready"]

    # -- lifecycle -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._held.closed:
            raise _closed_error()

    @property
    def closed(self) -> bool:
        return self._held.closed

    def cancel_all(self) -> None:
        """Cancel every running and queued request of every loaded model."""
        for engine in self.engines():
            engine.cancel_all()

    def close(self, grace: float = 0.0) -> None:
        """Refuse new leases, let running requests finish for `grace` seconds, then unload every
        model the service loaded (an adopted engine stays its caller's; a load under way is
        unloaded by its loader when it ends)."""
        with self._held.cond:
            if self._held.closed:
                return
            self._held.closed = True
            entries = [e for e in self._held.entries.values() if e.state == "ready"]
            for e in entries:
                e.state = "unloading"
            self._held.cond.notify_all()
        closers = [threading.Thread(target=self._held.unload, args=(e, grace), daemon=True) for e in entries]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        self._janitor.join(timeout=5)

    def __enter__(self) -> ModelService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed_error() -> EdgeInferError:
    from ..errors import EngineClosedError

    return EngineClosedError("the model service is shutting down")


def _copy_error(error: BaseException) -> BaseException:
    """The error of a load another request started, for this request to raise (a copy: one
    exception object raised in several threads would share one traceback)."""
    try:
        return copy.copy(error)
    except Exception:  # pragma: no cover
        return EdgeInferError(str(error))
