"""`POST /slots/{id}?action=save|restore|erase` (server/slots.py) over real HTTP: the app under
uvicorn in this process (so the test can see the engine's slots), driven by the HTTP client the
openai package ships with. A slot's cache saved, erased and restored; the next request on it reads
only what is new; names that could leave the store, hostile files, a busy slot and a missing key
are refused, and nothing is written outside the store's slots folder."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import uvicorn

import edgeinfer
from edgeinfer_server import ServerConfig, create_app
from edgeinfer_server.run import bind

pytestmark = pytest.mark.slow

KEY = "slot-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


class LiveApp:
    """The app on a free port of 127.0.0.1, served by uvicorn from a thread of this process."""

    def __init__(self, engine: edgeinfer.BatchEngine, config: ServerConfig):
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, config), log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def post(self, path: str, body: object = None, *, headers: dict | None = None, **kw) -> httpx.Response:
        headers = dict(AUTH if headers is None else headers)
        if body is not None:
            kw["json"] = body
        return httpx.post(self.url + path, headers=headers, timeout=120, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slots-store") / "home"


@pytest.fixture(scope="module")
def engine(default_model_copy, store_root) -> Iterator[edgeinfer.BatchEngine]:
    batch = edgeinfer.BatchOptions(parallel=2, cost_curve={1: 0.01, 2: 0.015}, calibrate_when_idle=False)
    with edgeinfer.BatchEngine.load(default_model_copy("F16"), batch=batch, store=edgeinfer.Store(store_root),
                                    n_ctx=4096) as e:
        yield e


@pytest.fixture(scope="module")
def app(engine) -> Iterator[LiveApp]:
    live = LiveApp(engine, ServerConfig(port=0, api_key=KEY))
    yield live
    live.stop()


PROMPT = "Here is a list of fruits: " + ", ".join(f"fruit number {i} is a {c}" for i, c in enumerate(
    ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "grape"] * 8)) + ". Which fruit is number 3?"


def _chat(app: LiveApp, max_tokens: int = 16) -> dict:
    r = app.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _slot_with(engine: edgeinfer.BatchEngine, n_min: int) -> int:
    return next(s.index for s in engine.metrics().slots if s.cached_tokens >= n_min)


def test_save_erase_restore_and_the_next_request_reads_only_what_is_new(app, engine, store_root):
    first = _chat(app)
    prompt_tokens = first["usage"]["prompt_tokens"]
    slot = _slot_with(engine, prompt_tokens)
    held = engine.metrics().slots[slot].cached_tokens

    r = app.post(f"/slots/{slot}?action=save", {"filename": "fruit.bin"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id_slot"] == slot and body["filename"] == "fruit.bin" and body["n_saved"] == held
    saved = store_root / "slots" / "fruit.bin"
    assert body["n_written"] == saved.stat().st_size and body["timings"]["save_ms"] >= 0

    r = app.post(f"/slots/{slot}?action=erase", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json() == {"id_slot": slot, "n_erased": held}
    assert all(s.cached_tokens == 0 for s in engine.metrics().slots if s.index == slot)

    other = 1 - slot  # restore into the other slot: the request follows its cache there
    engine.erase_slot(other)
    r = app.post(f"/slots/{other}?action=restore", {"filename": "fruit.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == held and r.json()["n_read"] == saved.stat().st_size
    again = _chat(app)
    assert again["edgeinfer"]["cached_tokens"] >= prompt_tokens - 1  # all but the last prompt token, decoded for its logits
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert sorted(p.name for p in (store_root / "slots").iterdir()) == ["fruit.bin"]  # no temporary file left


def test_the_key_is_required_when_one_is_configured(app):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = app.post("/slots/0?action=save", {"filename": "x.bin"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


BAD_NAMES = ["../x", "/etc/passwd", "a/b", "..", ".hidden", "x\u0000y", "a\\b", "", "a" * 129, "a" * 1_000_000,
             "é.bin", "x..y", " x", 7, None, ["x"]]


@pytest.mark.parametrize("action", ["save", "restore"])
def test_names_that_could_leave_the_store_are_refused(app, store_root, action):
    outside = sorted(os.listdir(store_root.parent))
    for name in BAD_NAMES:
        r = app.post(f"/slots/0?action={action}", {"filename": name})
        assert r.status_code == 400, (name if not isinstance(name, str) else name[:20], r.status_code, r.text[:200])
        assert len(r.content) < 2000  # a 1 MB name is not echoed back
    r = app.post(f"/slots/0?action={action}", {})
    assert r.status_code == 400  # no filename at all
    assert sorted(os.listdir(store_root.parent)) == outside
    assert not (store_root / "slots" / "x").exists() and not Path("/x").exists()


def test_bad_requests_are_one_clear_error(app, store_root):
    assert app.post("/slots/0?action=restore", {"filename": "never-saved.bin"}).status_code == 404
    assert app.post("/slots/0?action=fly", {"filename": "a.bin"}).status_code == 400
    assert app.post("/slots/0", {"filename": "a.bin"}).status_code == 400
    for slot in ("2", "-1", "abc", "99999", "1e3"):
        r = app.post(f"/slots/{slot}?action=save", {"filename": "a.bin"})
        assert r.status_code == 400 and "slot" in r.json()["error"]["message"].lower(), (slot, r.text)
    r = app.post("/slots/0?action=save", content=b'{"filename": "a.bin"}',
                 headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415
    assert app.post("/slots/0?action=erase", headers=AUTH).status_code == 415  # a page's form POST
    assert app.post("/slots/0?action=save", {"filename": "a.bin", "path": "/tmp"}).status_code == 400
    assert app.post("/slots/0?action=save", {"filename": "a.bin", "model": "no-such-model"}).status_code == 404
    assert app.post("/slots/0?action=save", [1, 2]).status_code == 400


def test_hostile_slot_files_are_refused_and_the_slot_keeps_its_cache(app, engine, store_root):
    _chat(app)
    slot = _slot_with(engine, 100)
    assert app.post(f"/slots/{slot}?action=save", {"filename": "good.bin"}).status_code == 200
    folder = store_root / "slots"
    data = (folder / "good.bin").read_bytes()
    (folder / "flipped.bin").write_bytes(data[:5000] + bytes([data[5000] ^ 1]) + data[5001:])
    (folder / "short.bin").write_bytes(data[: len(data) // 2])
    (folder / "noise.bin").write_bytes(hashlib.sha256(b"x").digest() * 1000)
    secret = store_root.parent / "outside.bin"
    secret.write_bytes(data)
    (folder / "link.bin").symlink_to(secret)
    held = engine.metrics().slots[slot].cached_tokens
    for name, why in (("flipped.bin", "sha256"), ("short.bin", "trailer"), ("noise.bin", "not an edgeinfer state"),
                      ("link.bin", "not a plain file")):
        r = app.post(f"/slots/{slot}?action=restore", {"filename": name})
        assert r.status_code == 400 and why in r.json()["error"]["message"], (name, r.text)
        assert engine.metrics().slots[slot].cached_tokens == held
    r = app.post(f"/slots/{slot}?action=save", {"filename": "link.bin"})  # nor is it written through
    assert r.status_code == 400 and secret.read_bytes() == data


def test_a_busy_slot_is_409(app, engine):
    for s in engine.metrics().slots:
        assert app.post(f"/slots/{s.index}?action=save", {"filename": f"idle-{s.index}.bin"}).status_code == 200

    # A request nobody reads: it pauses in its slot once its unread events reach the engine's
    # max_backlog, and holds the slot until it is cancelled, however fast or slow the machine is
    # (a request read as it streams could end, at its EOS or max_tokens, before the actions run).
    held = engine.generate("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", edgeinfer.GenerateOptions(
        max_tokens=1500, sampling=edgeinfer.SamplingOptions(temperature=0.0)))
    deadline = time.monotonic() + 60
    while not any(s.busy for s in engine.metrics().slots):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    busy = next(s.index for s in engine.metrics().slots if s.busy)
    for action, body in (("save", {"filename": "busy.bin"}), ("restore", {"filename": f"idle-{busy}.bin"}),
                         ("erase", {})):
        r = app.post(f"/slots/{busy}?action={action}", body)
        assert r.status_code == 409 and r.json()["error"]["code"] == "slot_busy", (action, r.text)
    assert engine.metrics().slots[busy].busy
    held.cancel()
    assert held.result().finish_reason == "cancelled"  # it was still running: the 409s were for a busy slot
