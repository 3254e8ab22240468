"""One request cannot kill or freeze `edgeinfer serve` (issue 45, all but grammars): durations too
long for Python's waits, embeddings and tokenizing off the event loop in bounded pools, names and
parameters in errors, and JSON that never carries NaN. Each case goes through the real CLI server
in a subprocess (tests/test_server.py's Server) on an F16 copy of the default model, with every new
flag at a non-default value; each failed before its fix (the issue's probe)."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

from edgeinfer.service import MAX_DURATION
from test_batch_engine import f16_path  # noqa: F401  (the session fixture: the default model as F16)
from test_server import MODEL_FILE, Server
from test_server_security import assert_no_traceback
from test_service import wait_until

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.0}


def base(server: Server) -> str:
    return server.url.removesuffix("/v1")


def post(server: Server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(base(server) + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def get(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.get(base(server) + path, timeout=kw.pop("timeout", 60), **kw)


@pytest.fixture(scope="module")
def server(f16_path, tmp_path_factory):  # noqa: F811
    s = Server(f16_path, tmp_path_factory.mktemp("serve-limits"), "--parallel", "2", "--ctx", "2048",
               "--keep-alive", "1e10")
    yield s
    assert s.stop() == 0
    assert_no_traceback(s)


def test_a_keep_alive_too_long_for_python_then_zero_unloads_and_the_model_comes_back(server):
    """`--keep-alive 1e10` and a request's `"keep_alive": "1e10"` (OpenAI's extension field, and
    Ollama's) used to kill the janitor thread (OverflowError: Python cannot wait ~9.2e9 s); a
    `"keep_alive": 0` after it then left the model "unloading" for good, every request for it
    waiting 60 s for a 503 while /health said ok. Clamped to a year, the model unloads at once and
    the next request loads it again."""
    assert get(server, "/edgeinfer/ps").json()["keep_alive"] == MAX_DURATION
    assert post(server, "/v1/chat/completions", {**CHAT, "keep_alive": "1e10"}).status_code == 200
    r = post(server, "/api/generate", {"model": MODEL_FILE, "prompt": "Hi", "stream": False, "keep_alive": 1e10,
                                       "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    (model,) = get(server, "/edgeinfer/ps").json()["models"]
    assert model["keep_alive"] == MAX_DURATION and MAX_DURATION - 600 < model["expires_in_s"] <= MAX_DURATION
    assert post(server, "/v1/chat/completions", {**CHAT, "keep_alive": 0}).status_code == 200
    wait_until(lambda: not get(server, "/edgeinfer/ps").json()["models"], 60, "the keep_alive 0 unload")
    assert get(server, "/health").json()["status"] == "ok"
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200  # loaded again (not a 503 after 60 s)
    assert_no_traceback(server)
