"""The service's threads cannot die silently (issue 45): durations too long for Python's waits,
a janitor round that fails, a janitor thread that ends, an unload that does not end, and a `stop`
that must not wait for ever. The library's rules on scripted engines (tests/test_service.py's
Loader: a load or a close held open on a gate), then the same through the real HTTP app."""

from __future__ import annotations

import logging
import threading

import httpx2 as httpx
import pytest

import edgeinfer
from edgeinfer import ModelService, ServiceOptions, Store
from edgeinfer.service import MAX_DURATION, ModelSettings, janitor as janitor_module, parse_duration
from edgeinfer.service import service as service_module
from edgeinfer.service.registry import Registry
from test_batch_engine import f16_path  # noqa: F401  (the session fixture: the default model as F16)
from test_service import DEFAULT, F16, FakeEngine, Loader, held, q8_path, register_copies, wait_until  # noqa: F401


@pytest.fixture
def store(f16_path, q8_path) -> Store:  # noqa: F811
    s = Store()
    register_copies(s, f16_path, q8_path)
    return s


class StuckEngine(FakeEngine):
    """An engine whose close waits for `release` (a scheduler thread inside a long llama.cpp call)."""

    release = threading.Event()

    def close(self, grace: float = 0.0) -> None:
        assert self.release.wait(60), "the test never let the close end"
        super().close(grace)


class StuckLoader(Loader):
    def __call__(self, plan, progress, cancel=None):
        engine = StuckEngine(plan)
        self.engines.append(engine)
        return engine


def test_durations_beyond_a_year_are_clamped_everywhere():
    """Python cannot wait ~9.2e9 s (OverflowError): every duration a person writes is clamped to
    MAX_DURATION — the request field, serve.toml, --keep-alive (all parse_duration) and the
    library's options; NaN and infinity are refused, a negative one is for ever."""
    assert MAX_DURATION == 365 * 86400
    for text in ("1e10", 1e10, "99999999999999h", 2**70, str(MAX_DURATION + 1)):
        assert parse_duration(text) == MAX_DURATION, text
    assert parse_duration("1e300") == MAX_DURATION and parse_duration(-1e300) == -1
    for bad in ("1e400", float("inf"), float("nan"), "nan"):
        with pytest.raises(edgeinfer.InvalidOptionError, match="finite"):
            parse_duration(bad)
    options = ServiceOptions(keep_alive=1e10, defaults=ModelSettings(keep_alive=5e9)).validate()
    assert options.keep_alive == MAX_DURATION and options.defaults.keep_alive == MAX_DURATION
    table = ModelSettings.from_table({"keep_alive": "1e10"}, "serve.toml: [defaults]")
    assert table.keep_alive == MAX_DURATION


def test_a_keep_alive_of_1e10_then_0_unloads_and_the_janitor_lives(store):
    """The issue's case on the library: a lease released with keep_alive 1e10 (the janitor's wait
    would overflow) and then one with 0: the model is unloaded at once and loads again."""
    loader = Loader()
    with ModelService(ServiceOptions(keep_alive=1e10), store=store, loader=loader) as service:
        with service.acquire(DEFAULT, keep_alive="1e10"):
            pass
        (s,) = service.ps()
        assert s.keep_alive == MAX_DURATION and MAX_DURATION - 60 < s.expires_in_s <= MAX_DURATION
        with service.acquire(DEFAULT, keep_alive=0):
            pass
        wait_until(lambda: not service.ps(), what="the keep_alive 0 unload")
        assert loader.engines[0].closed and service.health().ok and service.health().janitor_restarts == 0
        with service.acquire(DEFAULT):
            assert held(service) == {DEFAULT: "ready"} and len(loader.engines) == 2


def test_a_failed_janitor_round_is_logged_and_the_next_one_unloads(store, monkeypatch, caplog):
    """A round that fails (here: the OS gives no thread for the unload) is logged, the janitor goes
    on, and the model is unloaded by a later round."""
    loader = Loader()
    real = Registry.unload_in_background
    calls: list[str] = []

    def no_thread_the_first_time(self, entry, grace):
        calls.append(entry.plan.name)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        return real(self, entry, grace)

    monkeypatch.setattr(Registry, "unload_in_background", no_thread_the_first_time)
    monkeypatch.setattr(janitor_module, "_FIRST_PAUSE", 0.05)
    with caplog.at_level(logging.ERROR, logger="edgeinfer.service.janitor"):
        with ModelService(store=store, loader=loader) as service:
            with service.acquire(DEFAULT, keep_alive=0):
                pass
            wait_until(lambda: not service.ps(), what="the unload after a failed round")
            assert calls == [DEFAULT, DEFAULT] and loader.engines[0].closed
            assert service.health().janitor_restarts == 0  # it never stopped
    assert any("can't start new thread" in r.getMessage() or "can't start new thread" in (r.exc_text or "")
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_janitor_thread_that_ended_is_started_again_and_does_its_work(store, monkeypatch, caplog):
    """Should the janitor thread end all the same (here: an exception no round catches), the next
    health check or lease starts it again (logged, counted), and the model released with
    keep_alive 0 meanwhile is unloaded."""
    loader = Loader()
    real = janitor_module.Janitor._wait_for_due
    ended = threading.Event()

    def end_once(self):
        if not ended.is_set():
            ended.set()
            raise SystemExit("ended")  # a BaseException: not a round's failure
        return real(self)

    monkeypatch.setattr(janitor_module.Janitor, "_wait_for_due", end_once)
    with caplog.at_level(logging.ERROR, logger="edgeinfer.service.janitor"):
        with ModelService(store=store, loader=loader) as service:
            assert ended.wait(10)
            with service.acquire(DEFAULT, keep_alive=0):  # (acquire starts it again already)
                pass
            wait_until(lambda: not service.ps(), what="the unload by the restarted janitor")
            assert service.health().janitor_restarts == 1 and service.health().ok
    assert any("janitor thread had stopped" in r.getMessage() for r in caplog.records)


def test_a_stuck_unload_is_reported_stop_returns_and_it_recovers(store, monkeypatch):
    """An engine whose close does not end: `stop` returns after its timeout (stopped False) instead
    of holding its thread, `health()` names the model once the unload is past its grace and
    UNLOAD_STUCK_AFTER, a second stop returns too; when the close ends, the model is gone, health
    is ok and the model loads again."""
    monkeypatch.setattr(service_module, "UNLOAD_STUCK_AFTER", 0.2)
    StuckEngine.release.clear()
    loader = StuckLoader()
    try:
        with ModelService(store=store, loader=loader) as service:
            with service.acquire(DEFAULT):
                pass
            result = service.stop(DEFAULT, timeout=0.3)
            assert result.name == DEFAULT and result.stopped is False
            assert held(service) == {DEFAULT: "unloading"}
            wait_until(lambda: not service.health().ok, what="the stuck unload in health()")
            (problem,) = service.health().problems
            assert DEFAULT in problem and "unloading for" in problem
            (status,) = service.ps()
            assert status.unloading_s is not None and status.unloading_s > 0.2
            assert service.stop(DEFAULT, timeout=0.1).stopped is False  # someone else's unload: bounded too
            StuckEngine.release.set()
            wait_until(lambda: not service.ps(), what="the unload's end")
            assert service.health().ok and loader.engines[0].closed
            with service.acquire(DEFAULT):
                assert held(service) == {DEFAULT: "ready"}
    finally:
        StuckEngine.release.set()


def test_health_and_stop_over_http_while_an_unload_is_stuck(store, monkeypatch):
    """The same through the real HTTP app (uvicorn in a thread): /health is 503 "degraded" (and
    says only that without the key), /edgeinfer/stop answers 202 with "stopped": false within its
    timeout, `edgeinfer stop` says so with exit status 1, and all is ok again once the close ends."""
    from test_server_slots import LiveApp

    from edgeinfer.cli import main
    from edgeinfer_server import ServerConfig

    monkeypatch.setattr(service_module, "UNLOAD_STUCK_AFTER", 0.2)
    monkeypatch.setattr(service_module, "DEFAULT_STOP_TIMEOUT", 0.3)
    StuckEngine.release.clear()
    service = ModelService(store=store, loader=StuckLoader())
    app = LiveApp(service, ServerConfig(port=0, api_key="k-1"))
    auth = {"Authorization": "Bearer k-1"}
    try:
        service.preload(DEFAULT)
        assert httpx.get(app.url + "/health", headers=auth).json()["status"] == "ok"
        r = app.post("/edgeinfer/stop", {"model": DEFAULT}, headers=auth)
        assert r.status_code == 202 and r.json()["stopped"] is False and "still unloading" in r.json()["message"]
        wait_until(lambda: httpx.get(app.url + "/health").status_code == 503, what="/health saying degraded")
        assert httpx.get(app.url + "/health").json() == {"status": "degraded"}
        body = httpx.get(app.url + "/health", headers=auth).json()
        assert body["status"] == "degraded" and DEFAULT in body["problems"][0]
        assert main(["stop", DEFAULT, "--url", app.url, "--api-key", "k-1"]) == 1
        StuckEngine.release.set()
        wait_until(lambda: httpx.get(app.url + "/health").status_code == 200, what="/health ok again")
        assert not service.ps()
    finally:
        StuckEngine.release.set()
        app.stop()
        service.close()
