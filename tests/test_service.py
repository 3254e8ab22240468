"""Models served by name (edgeinfer.ModelService, `edgeinfer serve`, `edgeinfer ps` / `stop`).

Two tiers. The library's rules run on scripted engines (a loader that returns fakes, so a load
can be held open or counted) over real GGUF headers: loads of different models do not wait for
each other, only idle models are evicted (least recently used first), a model larger than the
budget is refused before anything is evicted, keep-alive, settings files and names. Then a real
`edgeinfer serve` subprocess with three models in its store (the default model, and F16 and Q8_0
copies made by llama.cpp's quantizer) and `--max-loaded 2`: each answer is compared, token for
token and logprob for logprob, with an in-process engine of that model alone."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest

import edgeinfer
from edgeinfer import (GenerateOptions, LoadOptions, ModelService, ModelSettings, SamplingOptions, ServiceOptions,
                       Store)
from edgeinfer.service import (ModelNotLoadedError, ModelTooLargeError, NoRoomError, parse_duration, parse_size,
                               read_settings_file)
from test_batch_engine import f16_path  # noqa: F401  (the session fixture: the default model as F16)
from test_server import MODEL_FILE, Server

DEFAULT = edgeinfer.DEFAULT_MODEL  # smollm2-135m-instruct:q4_1
NAME = DEFAULT.split(":")[0]
F16, Q8 = f"{NAME}:f16", f"{NAME}:q8_0"
KEY = "service-key-7"


@pytest.fixture(scope="session")
def q8_path(default_model_copy) -> Path:
    return default_model_copy("Q8_0")


def register_copies(store: Store, f16: Path, q8: Path) -> None:
    """The F16 and Q8_0 copies as tags of the default model's name (made from it: the bare name
    still means the default model's q4_1)."""
    store.ensure_default_model()
    store.register(f16, NAME, "f16", derived_from=DEFAULT, owned=False)
    store.register(q8, NAME, "q8_0", derived_from=DEFAULT, owned=False)


# -- scripted engines ----------------------------------------------------------------------------------


class FakeEngine:
    """What the service reads of a BatchEngine."""

    def __init__(self, plan):
        self.name, self.path, self.info = plan.name, plan.path, plan.info
        self.options, self.batch_options, self.speculation, self.n_ctx = plan.load, plan.batch, plan.speculation, plan.n_ctx
        self.closed = False
        self.close_grace: float | None = None

    def metrics(self):
        return SimpleNamespace(active=0, queue_depth=0, calibrating=False)

    def cancel_all(self) -> None:
        pass

    def close(self, grace: float = 0.0) -> None:
        self.close_grace = grace
        self.closed = True


class Loader:
    """Loads fakes; `gates[name]` (an Event) holds that model's load open until set (or until the
    service cancels it)."""

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.loads: list[str] = []
        self.engines: list[FakeEngine] = []
        self.lock = threading.Lock()

    def __call__(self, plan, progress, cancel=None):
        with self.lock:
            self.loads.append(plan.name)
            self.started.setdefault(plan.name, threading.Event()).set()
        gate = self.gates.get(plan.name)
        if gate is not None:
            deadline = time.monotonic() + 30
            while not gate.wait(0.02):
                if cancel is not None and cancel():
                    raise edgeinfer.Cancelled(f"loading {plan.name}")
                assert time.monotonic() < deadline, "a test gate was never opened"
        engine = FakeEngine(plan)
        self.engines.append(engine)
        return engine


def _inside(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is running `function` (a qualified name) now, somewhere in its stack."""
    import sys

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_qualname == function:
            return True
        frame = frame.f_back
    return False


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def store(f16_path, q8_path) -> Store:  # noqa: F811
    s = Store()
    register_copies(s, f16_path, q8_path)
    return s


def held(service: ModelService) -> dict[str, str]:
    return {s.name: s.state for s in service.ps()}


# -- the library: loading, eviction, keep-alive ---------------------------------------------------------


def test_a_load_never_waits_for_another_models_load(store):
    """While F16's load is held open, Q8_0 loads and is leased at once; a second request for F16
    waits for that one load (no second load), and both F16 requests get its engine."""
    loader = Loader()
    loader.gates[F16] = threading.Event()
    with ModelService(ServiceOptions(max_loaded=3), store=store, loader=loader) as service:
        got: dict[str, object] = {}
        first = threading.Thread(target=lambda: got.setdefault("a", service.acquire(F16)))
        second = threading.Thread(target=lambda: got.setdefault("b", service.acquire(F16)))
        first.start()
        assert loader.started.setdefault(F16, threading.Event()).wait(10)
        second.start()
        t = time.perf_counter()
        other = service.acquire(Q8)
        assert time.perf_counter() - t < 2 and other.engine.name == Q8
        assert held(service) == {F16: "loading", Q8: "ready"} and "b" not in got
        loader.gates[F16].set()
        first.join(10)
        second.join(10)
        assert got["a"].engine is got["b"].engine and loader.loads.count(F16) == 1
        for lease in (got["a"], got["b"], other):
            lease.release()


def test_a_cancelled_request_stops_waiting_evicts_nothing_and_a_load_nobody_wants_stops(store):
    """A request cancelled (its client gone) while it waits for another request's load of its
    model stops waiting at once, and that load goes on for the one still waiting; when that one
    is cancelled too, the load stops. One cancelled while it waits for room gets Cancelled, not a
    load or an eviction for nobody."""
    loader = Loader()
    loader.gates[F16] = threading.Event()
    with ModelService(ServiceOptions(max_loaded=1, room_wait_s=30), store=store, loader=loader) as service:
        first, second = threading.Event(), threading.Event()
        got: dict[str, BaseException] = {}

        def acquire(key: str, cancel: threading.Event) -> None:
            try:
                service.acquire(F16, cancel=cancel)
            except BaseException as e:  # noqa: BLE001 - what each gets
                got[key] = e

        loading = threading.Thread(target=acquire, args=("first", first))
        loading.start()
        assert loader.started.setdefault(F16, threading.Event()).wait(10)
        waiting = threading.Thread(target=acquire, args=("second", second))
        waiting.start()
        wait_until(lambda: held(service) == {F16: "loading"} and "second" not in got, what="the second request to wait")
        second.set()
        waiting.join(5)
        assert isinstance(got["second"], edgeinfer.Cancelled) and held(service) == {F16: "loading"}
        first.set()
        loading.join(5)
        assert isinstance(got["first"], edgeinfer.Cancelled) and held(service) == {} and loader.loads == [F16]
        with service.acquire(DEFAULT):  # busy: Q8_0 must wait for room (one model at a time)
            gone = threading.Event()
            room: dict[str, BaseException] = {}
            waiter = threading.Thread(target=lambda: room.setdefault("e", pytest.raises(
                edgeinfer.Cancelled, service.acquire, Q8, cancel=gone).value))
            waiter.start()
            wait_until(lambda: _inside(waiter, "Registry.wait"), what="the request to wait for room")
            gone.set()
            waiter.join(5)
            assert "cancelled" in str(room["e"])
            assert held(service) == {DEFAULT: "ready"} and service.evictions == 0 and loader.loads == [F16, DEFAULT]


def test_only_idle_models_are_evicted_least_recently_used_first(store):
    loader = Loader()
    with ModelService(ServiceOptions(max_loaded=2, room_wait_s=1.0), store=store, loader=loader) as service:
        busy = service.acquire(DEFAULT)  # held: never evicted
        service.acquire(F16).release()
        q8 = service.acquire(Q8)  # room: F16 goes (idle), not the older but busy default
        assert held(service) == {DEFAULT: "ready", Q8: "ready"}
        assert [e.name for e in loader.engines if e.closed] == [F16]
        # both held now: a third model waits room_wait_s, then is refused, and nothing was unloaded
        t = time.monotonic()
        with pytest.raises(NoRoomError, match="busy") as e:
            service.acquire(F16)
        assert time.monotonic() - t >= 1.0 and "\n" not in str(e.value)
        assert held(service) == {DEFAULT: "ready", Q8: "ready"} and service.evictions == 1
        # a waiting request gets in once a model becomes idle: the idle one goes, never the busy one
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.setdefault("lease", service.acquire(F16)))
        waiter.start()
        q8.release()
        waiter.join(10)
        assert got["lease"].engine.name == F16 and held(service) == {DEFAULT: "ready", F16: "ready"}
        busy.release()
        got["lease"].release()
        # of the two idle ones now, the default was released first: it goes
        with service.acquire(Q8):
            assert held(service) == {F16: "ready", Q8: "ready"} and service.evictions == 3


def test_memory_budget_evicts_by_estimate(store):
    """With room for the two smaller models only, loading the F16 copy unloads both idle others
    only as far as needed (least recently used first)."""
    loader = Loader()
    probe = ModelService(store=store, loader=loader)
    sizes = {m: probe.plan(m).memory.total for m in (DEFAULT, F16, Q8)}
    probe.close()
    budget = sizes[DEFAULT] + sizes[Q8] + 1
    assert sizes[F16] + sizes[Q8] > budget and sizes[F16] + sizes[DEFAULT] > budget and sizes[F16] < budget
    with ModelService(ServiceOptions(max_loaded=3, max_memory=budget), store=store, loader=loader) as service:
        service.acquire(DEFAULT).release()
        service.acquire(Q8).release()
        assert service.reserved == sizes[DEFAULT] + sizes[Q8]
        service.acquire(F16).release()
        assert held(service) == {F16: "ready"} and service.evictions == 2


def test_a_model_larger_than_the_budget_is_refused_before_anything_is_evicted(store):
    loader = Loader()
    with ModelService(ServiceOptions(max_loaded=2), store=store, loader=loader) as service:
        small = service.plan(DEFAULT).memory.total
    with ModelService(ServiceOptions(max_loaded=1, max_memory=small + 1), store=store, loader=loader) as service:
        service.acquire(DEFAULT).release()
        before = [(s.name, s.state, s.loaded_at) for s in service.ps()]
        with pytest.raises(ModelTooLargeError, match=r"needs about .* budget is .*--max-memory") as e:
            service.acquire(F16)
        assert isinstance(e.value, MemoryError) and "\n" not in str(e.value)
        assert [(s.name, s.state, s.loaded_at) for s in service.ps()] == before
        assert loader.loads == [DEFAULT] and service.evictions == 0 and not loader.engines[0].closed


def test_keep_alive_zero_unloads_after_the_request_and_negative_keeps(store):
    loader = Loader()
    with ModelService(ServiceOptions(keep_alive=3600), store=store, loader=loader) as service:
        with service.acquire(DEFAULT, keep_alive=0):
            assert held(service) == {DEFAULT: "ready"}  # never while the request runs
        wait_until(lambda: not service.ps(), what="the keep_alive 0 unload")
        assert loader.engines[0].closed
        with service.acquire(F16, keep_alive="-1"):
            pass
        with service.acquire(Q8, keep_alive="50ms"):
            pass
        (s,) = [s for s in service.ps() if s.name == F16]
        assert s.expires_in_s is None and s.keep_alive == -1 and s.idle_s is not None
        wait_until(lambda: Q8 not in held(service), what="the 50 ms keep-alive")
        assert held(service) == {F16: "ready"} and service.expirations == 1
        # the service's own keep-alive, and the last request's wins
        with service.acquire(DEFAULT):
            assert [s.expires_in_s for s in service.ps() if s.name == DEFAULT] == [None]  # busy
        (s,) = [s for s in service.ps() if s.name == DEFAULT]
        assert 3590 < s.expires_in_s <= 3600 and s.keep_alive == 3600


def test_stop_unloads_at_once_and_refuses_what_is_not_loaded(store):
    loader = Loader()
    with ModelService(store=store, loader=loader) as service:
        lease = service.acquire("smollm2-135m-instruct-f16.gguf")  # a store model's file name
        result = service.stop(F16, grace=0.5)
        assert result.name == F16 and result.cancelled == 1 and held(service) == {}
        assert loader.engines[0].closed and loader.engines[0].close_grace == 0.5
        lease.release()  # after the stop: nothing happens
        with pytest.raises(ModelNotLoadedError, match="not loaded"):
            service.stop(F16)
        with pytest.raises(edgeinfer.ModelNotFoundError):
            service.stop("no-such-model:q4")


def test_a_lease_dropped_without_release_is_reported_and_keeps_its_model():
    """Releasing a lease is explicit (release() or `with`): one the program drops is a
    ResourceWarning when it is collected, and the collector does not release it — the model stays
    leased (busy: never evicted, no keep-alive countdown) until it is stopped."""
    import gc
    import warnings

    loader = Loader()
    with ModelService(ServiceOptions(keep_alive=0), store=Store(), loader=loader) as service:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            service.acquire(DEFAULT)  # the lease is dropped at once
            gc.collect()
        said = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(said) == 1 and f"lease on {DEFAULT} was never released" in said[0], said
        (status,) = service.ps()
        assert status.state == "ready" and status.requests == 1 and status.expires_in_s is None
        assert not loader.engines[0].closed
        assert service.stop(DEFAULT).cancelled == 1 and loader.engines[0].closed


def test_names_requests_may_use_and_paths_they_may_not(store, tmp_path, f16_path):  # noqa: F811
    loader = Loader()
    (store.root / "serve.toml").write_text(f'[models."{F16}"]\nalias = ["sixteen", "f"]\n')
    _, tables = read_settings_file(store.root / "serve.toml")
    with ModelService(ServiceOptions(models=tables, default_model=Q8), store=store, loader=loader) as service:
        assert service.plan("sixteen").name == F16 and service.plan("f").name == F16
        assert service.plan(NAME).name == DEFAULT  # the bare name: the tag the others were made from
        assert service.plan(None).name == Q8 and service.plan("").name == Q8 and service.default_name == Q8
        for bad in (str(f16_path), "../x.gguf", "~/m.gguf", "./model"):
            with pytest.raises(edgeinfer.ModelNotFoundError, match="looks like a path"):
                service.plan(bad)
        with pytest.raises(edgeinfer.ModelNotFoundError, match="no model file named"):
            service.plan("other.gguf")
        with pytest.raises(edgeinfer.ModelNotFoundError, match="did you mean"):
            service.plan("smollm2-135m-instruct:q9")
        assert service.plan(Path(f16_path)).name == F16  # a path (the caller's, never a request's) to a store model
        entries = {e.name: e for e in service.catalog()}
        assert {DEFAULT, F16, Q8} <= entries.keys() and entries[F16].aliases == ("sixteen", "f")


def test_settings_file_tables_flags_and_one_line_errors(store, tmp_path):
    path = store.root / "serve.toml"
    path.write_text(
        '[defaults]\nparallel = 3\nctx = 1536\nkeep_alive = "90s"\n'
        f'[models."{Q8}"]\nparallel = 1\nkv_type = "Q8_0"\nspeculate = "lookup"\nkeep_alive = -1\nbatch = 256\n'
        f'threads = 1\nflash_attn = true\ngpu_layers = 0\nkv_unified = true\n')
    defaults, tables = read_settings_file(path)
    options = ServiceOptions(defaults=defaults, models=tables, default_model=DEFAULT,
                             default_settings=ModelSettings(parallel=2, ctx=1024))
    with ModelService(options, store=store, loader=Loader()) as service:
        q8, f16, default = service.plan(Q8), service.plan(F16), service.plan(None)
    assert (q8.parallel, q8.load.kv_types, q8.speculation.method, q8.keep_alive, q8.load.n_batch) == \
        (1, ("q8_0", "q8_0"), "lookup", -1, 256)
    assert (q8.load.n_threads, q8.load.flash_attn, q8.load.n_gpu_layers, q8.n_ctx) == (1, True, 0, 1536)
    assert (q8.batch.kv_unified, f16.batch.kv_unified) == (True, False)
    assert (f16.parallel, f16.n_ctx, f16.keep_alive, f16.speculation.method) == (3, 1536, 90, "off")
    assert (default.parallel, default.n_ctx, default.n_ctx_per_request) == (2, 1024, 512)  # flags over [defaults]
    assert q8.memory.kv_cache < f16.memory.kv_cache  # q8_0 cache
    for text, message in (
        ("[defaults]\nslots = 2\n", "unknown setting 'slots'"),
        ("[defaults]\nparallel = '2'\n", "parallel must be an integer"),
        ("[defaults]\nparallel = 99\n", "parallel must be in"),
        ("[defaults]\nkv_type = 'q3'\n", "q3"),
        ("[defaults]\nkeep_alive = 'soon'\n", "keep_alive must be"),
        ("[defaults]\nspeculate = 'magic'\n", "magic"),
        ("[defaults]\nalias = [1]\n", "alias must be"),
        ("[defaults]\nkv_unified = 1\n", "kv_unified must be true or false"),
        ("[server]\nport = 1\n", "unknown table or key 'server'"),
        ("[models]\nx = 1\n", "must be a table"),
        ("parallel = [\n", "not valid TOML"),
    ):
        path.write_text(text)
        with pytest.raises(edgeinfer.InvalidOptionError, match=message) as e:
            read_settings_file(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_durations_and_sizes():
    assert [parse_duration(v) for v in (0, 30, "30", "30s", "5m", "1h30m", "1.5h", "250ms", "-1", -5, "-1m")] == \
        [0, 30, 30, 30, 300, 5400, 5400, 0.25, -1, -1, -1]
    for bad in ("soon", "5 minutes", "", "m", True, None, float("nan"), float("inf")):
        with pytest.raises(edgeinfer.InvalidOptionError):
            parse_duration(bad)
    assert [parse_size(v) for v in ("8G", "8GB", "7.5GiB", "512MiB", "1000", 12345)] == \
        [8_000_000_000, 8_000_000_000, int(7.5 * 2**30), 512 * 2**20, 1000, 12345]
    for bad in ("8 parsecs", "-1G", "0", "G"):
        with pytest.raises(edgeinfer.InvalidOptionError):
            parse_size(bad)


@pytest.mark.slow
def test_the_estimate_counts_the_weights_llama_cpp_repacks(store, default_model_copy):
    """A Q4_0 model: llama.cpp's CPU backend keeps an interleaved copy of its Q4_0 matrices
    (the CPU_REPACK buffer it logs when loading) where the CPU has those kernels; the plan counts
    exactly that, and nothing for a Q8_0 model (not copied)."""
    import re

    from edgeinfer.llama_backend import log_capture

    q4_0 = default_model_copy("Q4_0")
    said: list[str] = []
    with ModelService(ServiceOptions(defaults=ModelSettings(parallel=1, ctx=512, threads=1)), store=store) as service:
        plan, q8 = service.plan(q4_0), service.plan(Q8)
        with log_capture(lambda _level, text: said.append(text)), service.acquire(q4_0):
            pass
    logged = re.search(r"CPU_REPACK model buffer size =\s*([\d.]+) MiB", "".join(said))
    from edgeinfer.devices import build_info

    if build_info().cpu_features.get("REPACK") != "1":  # no repacking kernels: nothing copied, nothing counted
        assert plan.memory.repack == 0 and logged is None
    else:
        assert logged is not None, "".join(said)[-2000:]
        assert abs(plan.memory.repack - float(logged.group(1)) * 2**20) < 2**20 * 0.01 and plan.memory.repack > 0
    assert q8.memory.repack == 0 and plan.memory.total == plan.memory.weights + plan.memory.kv_cache + \
        plan.memory.compute + plan.memory.repack


@pytest.mark.slow
def test_real_engines_stop_cancels_a_running_request(store):
    """With real BatchEngines: a request running when its model is stopped ends "cancelled",
    and the model loads again on the next request."""
    with ModelService(ServiceOptions(defaults=ModelSettings(parallel=1, ctx=512, threads=1)), store=store) as service:
        lease = service.acquire(F16)
        gen = lease.engine.generate("1, 2, 3, 4, 5, 6,", GenerateOptions(max_tokens=400))
        next(gen)  # running
        assert service.stop(F16).cancelled == 1
        assert gen.result().finish_reason == "cancelled" and lease.engine.closed
        lease.release()
        with service.acquire(F16) as again:
            assert again.engine is not lease.engine
            assert again.engine.generate("Hi", GenerateOptions(max_tokens=2)).result().finish_reason in ("length", "eos")


def test_a_model_whose_engine_died_is_loaded_again(store, monkeypatch):
    """A BatchEngine whose scheduler thread died says so (`failure`); the next request for its model
    gets a new engine instead of an error from the dead one."""
    from edgeinfer.engine.core.scheduler import Scheduler

    with ModelService(ServiceOptions(defaults=ModelSettings(parallel=1, ctx=512, threads=1)), store=store) as service:
        with service.acquire(F16) as lease:
            broken = lease.engine
            with monkeypatch.context() as m:
                m.setattr(Scheduler, "step", lambda self: (_ for _ in ()).throw(SystemError("broken")))
                with pytest.raises(edgeinfer.EngineClosedError):
                    broken.generate("Hi", GenerateOptions(max_tokens=2)).result()
            assert isinstance(broken.failure, SystemError)
        with service.acquire(F16) as again:
            assert again.engine is not broken and again.engine.failure is None
            assert again.engine.generate("Hi", GenerateOptions(max_tokens=2)).result().finish_reason in ("length", "eos")


# -- the server ------------------------------------------------------------------------------------------

PROMPT = "The capital of France is"
COUNT = "1, 2, 3, 4, 5, 6,"
BIG = "big"  # an alias of a hard link of the F16 file with a context that cannot fit the budget
SLOW = "slow"  # an alias of another such link, whose load first quantizes its self-draft (seconds)
SERVER_FLAGS = {"parallel": 2, "ctx": 1024, "threads": 1}  # the default model's flags
SERVE_TOML = f"""
[defaults]
parallel = 1
ctx = 512
threads = 1

[models."{Q8}"]
kv_type = "q8_0"
keep_alive = "5m"
alias = ["eight"]
"""


class ServeProcess(Server):
    """`edgeinfer serve` in a subprocess (tests/test_server.py's), with the default model given as
    its file (a store model's file is that model, by its store name) and this file's key."""

    def __init__(self, home: Path, *args: str):
        from edgeinfer.default_model import default_model_file

        super().__init__(default_model_file(), home, *args)
        self.base = self.url.removesuffix("/v1")

    def post(self, route: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.base + route, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, **kw)

    def ps(self) -> dict:
        r = httpx.get(self.base + "/edgeinfer/ps", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def held(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.ps()["models"]}


@pytest.fixture(scope="module")
def served(f16_path, q8_path, tmp_path_factory):  # noqa: F811
    """The server, its store, its budget, and the answers each model gives alone."""
    home = tmp_path_factory.mktemp("service-home")
    store = Store(home)
    register_copies(store, f16_path, q8_path)
    big, slow = home / "big-f16.gguf", home / "slow-f16.gguf"
    for link in (big, slow):
        try:
            os.link(f16_path, link)  # another file for the service (another path), no more disk
        except OSError:
            import shutil

            shutil.copyfile(f16_path, link)
    (home / "serve.toml").write_text(SERVE_TOML + f'\n[models."{big}"]\nctx = 8192\nkv_type = "f32"\nalias = ["{BIG}"]\n'
                                     f'\n[models."{slow}"]\nspeculate = "self=Q4_K_M"\nalias = ["{SLOW}"]\n')
    key_file = home / "key"
    key_file.write_text(KEY + "\n")
    # The budget: the two largest of the three fit together, the big one alone does not.
    defaults, tables = read_settings_file(home / "serve.toml")
    options = ServiceOptions(defaults=defaults, models=tables, default_model=DEFAULT,
                             default_settings=ModelSettings(**SERVER_FLAGS))
    with ModelService(options, store=store, loader=Loader()) as probe:
        plans = {m: probe.plan(m) for m in (DEFAULT, F16, Q8, BIG)}
    sizes = sorted(plans[m].memory.total for m in (DEFAULT, F16, Q8))
    budget = sizes[-1] + sizes[-2] + (1 << 20)
    assert plans[BIG].memory.total > budget
    # What each model answers alone: an in-process engine with that model's settings.
    answers = {}
    for m, plan in plans.items():
        if m == BIG:
            continue
        load = LoadOptions(n_ctx=plan.load.n_ctx, n_threads=1, kv_type=plan.load.kv_type)
        with edgeinfer.BatchEngine.load(plan.path, load, edgeinfer.BatchOptions(parallel=plan.parallel,
                                                                                calibrate_when_idle=False)) as engine:
            gen = engine.generate(PROMPT, GenerateOptions(max_tokens=12, sampling=SamplingOptions(temperature=0.0)),
                                  logprobs=0)
            events = [e for e in gen if isinstance(e, edgeinfer.TokenEvent)]
            answers[m] = ("".join(e.text for e in events), [e.logprob for e in events])
            vectors = engine.embed(["a red apple"], edgeinfer.EmbedOptions(pooling="mean")).vectors
            answers[m + "#embed"] = vectors[0].tolist()
    server = ServeProcess(home, *(f"--{k}={v}" for k, v in SERVER_FLAGS.items()), "--max-loaded", "2",
                          "--max-memory", str(budget), "--keep-alive", "10m", "--preload", "eight",
                          "--api-key-file", str(key_file), "--grace", "1")
    server.home, server.budget, server.plans, server.answers, server.big, server.slow = home, budget, plans, answers, big, slow
    yield server
    assert server.stop() == 0, "".join(server.log)
    assert "Traceback" not in "".join(server.log), "".join(server.log)


def complete(server: ServeProcess, model: str | None, **kw) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 1, **kw}
    if model is not None:
        body["model"] = model
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text + "\n" + "".join(server.log[-30:])
    return r.json()


def matches(answer: dict, expected: tuple[str, list[float]]) -> bool:
    choice = answer["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    return choice["text"] == expected[0] and len(lps) == len(expected[1]) and \
        all(abs(a - b) < 1e-4 for a, b in zip(lps, expected[1]))


@pytest.mark.slow
def test_the_server_starts_with_its_default_and_preloaded_models(served):
    """--preload (by an alias), the flags for the default model, serve.toml for the others,
    --keep-alive for models without their own, and /health, /v1/models, /metrics on all of them."""
    ps = served.ps()
    models = {m["name"]: m for m in ps["models"]}
    assert models.keys() == {DEFAULT, Q8} and ps["max_loaded"] == 2 and ps["budget"] == served.budget
    assert (models[DEFAULT]["parallel"], models[DEFAULT]["n_ctx"], models[DEFAULT]["keep_alive"]) == (2, 1024, 600)
    assert (models[Q8]["parallel"], models[Q8]["n_ctx"], models[Q8]["keep_alive"]) == (1, 512, 300)
    assert models[Q8]["aliases"] == ["eight"]
    assert ps["reserved"] == sum(m["memory"]["total"] for m in ps["models"])
    for m in ps["models"]:
        parts = m["memory"]
        assert parts["total"] == parts["weights"] + parts["kv_cache"] + parts["compute"] + parts["repack"]
        assert parts["repack"] == 0  # Q4_1, Q8_0: not copied by llama.cpp's CPU backend
        assert m["memory"] == served.plans[m["name"]].memory.to_dict()  # the estimate, for the context it got
    listed = httpx.get(served.url + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["data"]
    assert [d["id"] for d in listed[:2]] == [DEFAULT, Q8]  # the default model first, then the loaded ones
    by_id = {d["id"]: d["edgeinfer"] for d in listed}
    assert {DEFAULT, F16, Q8, served.big.name} <= by_id.keys()
    assert by_id[DEFAULT]["loaded"] and by_id[DEFAULT]["parallel"] == 2 and by_id[DEFAULT]["n_ctx_per_request"] == 512
    assert by_id[Q8]["loaded"] and by_id[Q8]["aliases"] == ["eight"] and not by_id[F16]["loaded"]
    assert by_id[served.big.name]["aliases"] == [BIG] and not by_id[served.big.name]["loaded"]
    health = httpx.get(served.base + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert health["model"] == DEFAULT and health["slots"] == 2 and {h["model"] for h in health["models"]} == {DEFAULT, Q8}
    metrics = httpx.get(served.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert f'edgeinfer_slots_busy{{model="{Q8}"}} 0' in metrics and "edgeinfer_models_loaded 2" in metrics
    assert metrics.count("# TYPE edgeinfer_slots_busy ") == 1


@pytest.mark.slow
def test_requests_alternate_between_three_models_and_the_right_one_answers(served):
    """Seven requests over three models with room for two: each answer (its text and every
    logprob) is that model's alone, by every name a request may use (a store name, none, an
    alias, the bare name, a store file's name, the file name the server was given), and the
    responses name it."""
    answers = served.answers
    for a in (DEFAULT, F16, Q8):  # the comparison can tell the models apart
        for b in (DEFAULT, F16, Q8):
            if a != b:
                assert answers[a][1] != answers[b][1]
    for asked, model in ((F16, F16), (None, DEFAULT), ("eight", Q8), (NAME, DEFAULT),
                         ("smollm2-135m-instruct-f16.gguf", F16), (MODEL_FILE, DEFAULT), (Q8, Q8)):
        got = complete(served, asked)
        assert got["model"] == model
        assert matches(got, answers[model]), (asked, got["choices"][0], answers[model])
        assert not any(matches(got, answers[other]) for other in (DEFAULT, F16, Q8) if other != model)
        held = served.held()
        assert len(held) <= 2 and held.get(model) == "ready", held
    r = served.post("/v1/completions", {"model": "smollm2-135m-instruct:q9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = served.post("/v1/completions", {"model": str(served.big), "prompt": "x"})
    assert r.status_code == 404 and "looks like a path" in r.json()["error"]["message"]


@pytest.mark.slow
def test_two_models_stream_at_once_and_a_third_waits_for_one_to_be_idle(served):
    """Streams on two models run at the same time; a request for a third waits (both are busy),
    and once they have ended it evicts one of them — both streams ran to their full length."""
    for m in (DEFAULT, F16):
        complete(served, m, max_tokens=1)  # both loaded (Q8_0 evicted)
    assert set(served.held()) == {DEFAULT, F16}
    times: dict[str, list[float]] = {DEFAULT: [], F16: []}
    finish: dict[str, str] = {}
    started = threading.Barrier(3)

    def stream(model: str) -> None:
        body = {"model": model, "prompt": COUNT, "max_tokens": 160, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            first = True
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"][0]["text"]:
                    times[model].append(time.monotonic())
                    if first:
                        first = False
                        started.wait(30)
                if chunk["choices"][0]["finish_reason"]:
                    finish[model] = chunk["choices"][0]["finish_reason"]

    threads = [threading.Thread(target=stream, args=(m,)) for m in (DEFAULT, F16)]
    for t in threads:
        t.start()
    started.wait(60)
    third: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: third.setdefault("r", complete(served, Q8, max_tokens=2)))
    waiter.start()
    time.sleep(0.5)  # the third request is in; while both stream it may not evict either
    busy = served.ps()["models"]
    assert {m["name"] for m in busy} == {DEFAULT, F16} and all(m["requests"] >= 1 for m in busy), busy
    for t in threads:
        t.join(120)
    waiter.join(120)
    assert finish == {DEFAULT: "length", F16: "length"}
    for a, b in ((DEFAULT, F16), (F16, DEFAULT)):  # each stream's tokens kept arriving during the other's
        during = [t for t in times[a] if times[b][0] < t < times[b][-1]]
        assert len(during) >= 10, (a, len(during), len(times[a]))
    assert third["r"]["model"] == Q8
    held = served.held()
    assert Q8 in held and len(held) == 2


@pytest.mark.slow
def test_keep_alive_field_and_embeddings_route_by_model(served):
    got = complete(served, F16, max_tokens=2, keep_alive=0)
    assert got["model"] == F16
    deadline = time.monotonic() + 20
    while F16 in served.held():
        assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.05)
    complete(served, DEFAULT, max_tokens=2, keep_alive="-1")
    complete(served, Q8, max_tokens=2, keep_alive=90)
    models = {m["name"]: m for m in served.ps()["models"]}
    assert models[DEFAULT]["keep_alive"] == -1 and models[DEFAULT]["expires_in_s"] is None
    assert 80 < models[Q8]["expires_in_s"] <= 90 and models[Q8]["keep_alive"] == 90
    r = served.post("/v1/completions", {"model": Q8, "prompt": "x", "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    r = served.post("/v1/embeddings", {"model": F16, "input": "a red apple", "pooling": "mean", "keep_alive": "2m"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == F16
    vector = r.json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(vector, served.answers[F16 + "#embed"])) < 1e-5
    models = {m["name"]: m for m in served.ps()["models"]}
    assert F16 in models and 100 < models[F16]["expires_in_s"] <= 120
    r = served.post("/v1/embeddings", {"model": "nope:q1", "input": "x"})
    assert r.status_code == 404


@pytest.mark.slow
def test_a_model_larger_than_the_budget_is_refused_with_nothing_evicted(served):
    before = served.ps()["models"]
    r = served.post("/v1/chat/completions", {"model": BIG, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_too_large", r.text
    assert "--max-memory" in r.json()["error"]["message"]
    after = served.ps()["models"]
    assert [(m["name"], m["loaded_at"]) for m in after] == [(m["name"], m["loaded_at"]) for m in before]


@pytest.mark.slow
def test_ps_against_the_server_process_memory_and_the_cli(served, capsys, monkeypatch):
    """`edgeinfer ps` (--url, the key from --api-key-file or the environment, --json) shows what
    the server holds; its estimates are compared with the server's resident memory: the RSS a
    model adds when it loads, measured from outside through /proc."""
    from edgeinfer.cli import main

    def rss() -> int:
        for line in Path(f"/proc/{served.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    monkeypatch.delenv("EDGEINFER_API_KEY", raising=False)
    assert main(["ps", "--url", served.url]) == 1
    assert "needs its API key" in capsys.readouterr().err
    key_file = served.home / "key"
    assert main(["ps", "--url", served.url, "--api-key-file", str(key_file), "--json", "--timeout", "20"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["process"]["pid"] == served.proc.pid and data["process"]["rss"] > 0
    for m in [m["name"] for m in data["models"]]:
        assert main(["stop", m, "--url", served.base, "--api-key", KEY]) == 0
        assert f"stopped {m}" in capsys.readouterr().err
    assert served.held() == {}
    empty = rss()
    for m in (DEFAULT, F16):
        complete(served, m, max_tokens=8)
    loaded = rss()
    parts = [served.plans[m].memory for m in (DEFAULT, F16)]
    estimates = sum(p.total for p in parts)
    resident = sum(p.weights + p.kv_cache for p in parts)  # mapped and touched, allocated and cleared
    monkeypatch.setenv("EDGEINFER_API_KEY", KEY)
    assert main(["ps", "--url", served.base]) == 0
    out = capsys.readouterr().out
    assert DEFAULT in out and F16 in out and "resident" in out and "KV CACHE" in out
    grew = loaded - empty
    print(f"ps estimates {estimates / 1e6:.0f} MB for two models ({resident / 1e6:.0f} MB weights and KV cache); "
          f"the server's RSS grew {grew / 1e6:.0f} MB ({grew / estimates:.2f} of the estimate)")
    # The weights (every page is read for a token) and the KV cache (cleared at load) are resident;
    # the compute buffers only as far as a step has used them (short requests: a row of logits).
    assert 0.9 * resident < grew < 1.1 * estimates, (grew, resident, estimates)


@pytest.mark.slow
def test_stop_cancels_a_running_stream_and_the_model_loads_again(served, capsys):
    from edgeinfer.cli import main

    complete(served, Q8, max_tokens=1)
    body = {"model": "eight", "prompt": COUNT, "max_tokens": 400, "temperature": 0.0, "stream": True}
    reasons = []
    with httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        stopped = False
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not stopped and chunk["choices"][0]["text"]:
                stopped = True
                assert main(["stop", "eight", "--url", served.base, "--api-key", KEY]) == 0
                assert "1 request cancelled" in capsys.readouterr().err
            if chunk["choices"][0]["finish_reason"]:
                reasons.append(chunk["choices"][0]["finish_reason"])
    assert reasons == ["cancelled"]
    assert Q8 not in served.held()
    assert main(["stop", Q8, "--url", served.base, "--api-key", KEY]) == 1
    assert "is not loaded" in capsys.readouterr().err
    assert matches(complete(served, Q8), served.answers[Q8])


@pytest.mark.slow
def test_a_client_gone_while_its_model_loads_cancels_the_load(served):
    """A client asks for a model whose load first makes its self-draft (seconds of quantizing) and
    disconnects while it loads: the load is cancelled (the quantizer's child stopped), and nothing
    of it stays — no engine held, no self-draft in the store; the server goes on serving."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(served.base)
    body = json.dumps({"model": SLOW, "prompt": PROMPT, "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    def loads() -> int:
        text = httpx.get(served.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        return int(next(line for line in text.splitlines() if line.startswith("edgeinfer_model_loads_total ")).split()[1])

    said, loaded = len(served.log), loads()
    with socket.create_connection((url.hostname, url.port), timeout=30) as client:
        client.sendall(head + body)
        wait_until(lambda: any("self-draft" in line for line in served.log[said:]), timeout=120,
                   what="the self-draft's quantization to start")
        assert served.held().get(served.slow.name) == "loading"
    # the client is gone
    wait_until(lambda: served.slow.name not in served.held(), timeout=60, what="the load to be abandoned")
    assert loads() == loaded  # it never finished loading
    assert any("POST /v1/completions 499" in line for line in served.log[said:])  # nobody was answered
    assert not [m for m in Store(served.home).list() if (m.quant or "").upper() == "Q4_K_M"]
    assert matches(complete(served, Q8), served.answers[Q8])


def test_serve_refuses_bad_settings_before_binding(tmp_path, monkeypatch, capsys):
    """A bad serve.toml, flag or preload count is one line, before the port or a model is touched."""
    from edgeinfer.cli import main

    home = Path(os.environ["EDGEINFER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "serve.toml").write_text('[models."x:y"]\nctx = "big"\n')
    assert main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serve.toml" in err[0] and "ctx must be an integer" in err[0], err
    (home / "serve.toml").unlink()
    assert main(["serve", "--port", "0", "--max-loaded", "1", "--preload", F16]) == 1
    assert "--max-loaded is 1" in capsys.readouterr().err
    for flag, value in (("--keep-alive", "soon"), ("--max-memory", "8 parsecs"), ("--max-loaded", "0")):
        with pytest.raises(SystemExit):
            main(["serve", flag, value])
        assert flag in capsys.readouterr().err
