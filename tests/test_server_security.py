"""`edgeinfer serve` against what a web page, a careless client and an attacker send: the real
HTTP requests a browser makes (simple text/plain POSTs, CORS preflights, a rebound Host), slow
and vanishing clients on raw sockets, a full queue, malformed text, API keys kept out of the
process list, and SIGTERM. The servers are the real CLI in a subprocess (tests/test_server.py's
Server) on an F16 copy of the default model; every new flag is given a non-default value."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx2 as httpx
import pytest

import edgeinfer
from edgeinfer_server import APIError, ServerConfig
from test_batch_engine import f16_path  # noqa: F401  (the session fixture: the default model as F16)
from test_server import KEY, MODEL_FILE, Server, chat

GOOD_HOST = "good.example"  # --allowed-hosts
APP_ORIGIN = "http://app.example:3000"  # --cors-origins
EVIL = "evil.example"
CHAT = {"model": MODEL_FILE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0.0}
JSON = {"Content-Type": "application/json"}


# -- helpers ------------------------------------------------------------------------------------------


def base(server: Server) -> str:
    return server.url.removesuffix("/v1")


def address(server: Server) -> tuple[str, int]:
    host, port = base(server).removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def wait_for_line(server: Server, pattern: str, timeout: float = 60) -> str:
    """The next server log line matching `pattern` (earlier lines of the queue are consumed)."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        line = server.lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if line is None:
            raise AssertionError("the server exited:\n" + "".join(server.log))
        if rx.search(line):
            return line


def drain(server: Server) -> None:
    """Forget the log lines so far (the next waits look at what follows)."""
    while not server.lines.empty():
        server.lines.get_nowait()


def submitted(server: Server, headers: dict | None = None) -> int:
    m = re.search(r"^edgeinfer_requests_submitted_total\{[^}]*\} (\d+)", server.metrics(headers), re.M)
    assert m, "no submitted counter in /metrics"
    return int(m.group(1))


def cancelled(server: Server) -> int:
    m = re.search(r'^edgeinfer_requests_finished_total\{[^}]*reason="cancelled"\} (\d+)', server.metrics(), re.M)
    return int(m.group(1)) if m else 0


def closed_within(sock: socket.socket, seconds: float, trickle: bytes | None = None, every: float = 0.2) -> float:
    """Seconds until the server closes `sock` (EOF or reset), sending `trickle` every `every`
    seconds meanwhile (the wait between them is the recv: it returns as soon as the server closes).
    Fails if it stays open for `seconds`."""
    start = time.monotonic()
    sock.settimeout(every)
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            if trickle is not None:
                try:
                    sock.sendall(trickle)
                except (BrokenPipeError, ConnectionResetError):
                    return time.monotonic() - start
        except ConnectionResetError:
            return time.monotonic() - start
    raise AssertionError(f"the server kept the connection open for {seconds} s")


def connect(server: Server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(address(server))
    return s


def own_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def assert_no_traceback(server: Server) -> None:
    log = "".join(server.log)
    assert "Traceback" not in log and " failed" not in log and "Exception in ASGI" not in log, log


# -- servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(f16_path, tmp_path_factory):  # noqa: F811
    """No key, one slot, one waiting place, short timeouts, one allowed extra host, one origin."""
    # (the F16 copy: its stories at seed 4 run long enough to fill a stalled reader's buffers)
    s = Server(f16_path, tmp_path_factory.mktemp("serve-guarded"), "--parallel", "1", "--ctx", "2048",
               "--max-queue", "1", "--allowed-hosts", f"{GOOD_HOST},.lan.example", "--cors-origins", APP_ORIGIN,
               "--header-timeout", "1", "--body-timeout", "1", "--stall-timeout", "2", "--grace", "1")
    yield s
    assert s.stop() == 0
    assert_no_traceback(s)


@pytest.fixture(scope="module")
def keyed(q4_path, tmp_path_factory):
    """The key from --api-key-file; at most 2 connections."""
    home = tmp_path_factory.mktemp("serve-keyed")
    key_file = home / "key.txt"
    key_file.write_text(KEY + "\n")
    s = Server(q4_path, home, "--parallel", "1", "--ctx", "1024", "--api-key-file", str(key_file),
               "--max-connections", "2")
    yield s
    assert s.stop() == 0
    assert_no_traceback(s)


# -- fast: configuration, the rules themselves ---------------------------------------------------------


def test_host_rule():
    from edgeinfer_server.config import host_allowed

    c = ServerConfig(host="127.0.0.1", allowed_hosts=(GOOD_HOST, ".lan.example"))
    for ok in ("127.0.0.1:8080", "[::1]:8080", "localhost", "LOCALHOST.:80", "app.localhost:5", "10.0.0.7:8080",
               f"{GOOD_HOST}:8080", "box.lan.example", "lan.example", None):
        assert host_allowed(c, ok), ok
    for bad in (EVIL, f"{EVIL}:8080", "localhost.evil.example", "good.example.evil", "xlan.example", "127.0.0.1.nip.io"):
        assert not host_allowed(c, bad), bad
    assert host_allowed(ServerConfig(allowed_hosts=("*",)), EVIL)
    assert host_allowed(ServerConfig(host="myhost.lan", api_key="k"), "myhost.lan:8080")  # the bound name


def test_config_refuses_bad_limits_and_origins():
    for bad in ({"max_queue": -1}, {"max_connections": 0}, {"header_timeout_s": 0}, {"body_timeout_s": float("inf")},
                {"stall_timeout_s": -1}, {"cors_origins": ("app.example",)}, {"cors_origins": ("http://a.example/path",)},
                {"allowed_hosts": ("http://a.example",)}, {"api_key": "two words"}, {"api_key": ""}):
        with pytest.raises(edgeinfer.InvalidOptionError):
            ServerConfig(**bad).validate()
    ServerConfig(cors_origins=("*", "null", "https://a.example:8443"), max_queue=0).validate()


def test_json_checks_are_iterative_and_name_the_field():
    from edgeinfer_server.app import MAX_JSON_DEPTH, check_json

    with pytest.raises(APIError) as e:
        check_json({"messages": [{"role": "user", "content": "ok \ud800"}]})
    assert e.value.status == 400 and e.value.param == "messages" and "messages[0].content" in e.value.message
    with pytest.raises(APIError):
        check_json({"stop": ["\udfff"]})
    with pytest.raises(APIError):
        check_json({"\ud800": 1})  # a key too
    deep: object = "x"
    for _ in range(100_000):  # far deeper than the recursion limit: the walk has no recursion
        deep = [deep]
    with pytest.raises(APIError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json(deep)
    check_json({"messages": [{"role": "user", "content": "héllo 🙂"}], "nested": [[[[{"a": 1}]]]]})


def _serve_args(*argv: str):
    from edgeinfer.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_api_key_sources(tmp_path, monkeypatch):
    from edgeinfer.cli.serve import API_KEY_ENV, api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(_serve_args()) == "from-env"
    f = tmp_path / "key"
    f.write_text("  from-file \n\n")
    assert api_key(_serve_args("--api-key-file", str(f))) == "from-file"  # a file beats the environment
    assert api_key(_serve_args("--api-key", "flag")) == "flag"
    for content, message in (("", "empty"), ("a\nb\n", "holds more")):
        f.write_text(content)
        with pytest.raises(edgeinfer.InvalidOptionError, match=message):
            api_key(_serve_args("--api-key-file", str(f)))
    with pytest.raises(edgeinfer.InvalidOptionError, match="cannot read"):
        api_key(_serve_args("--api-key-file", str(tmp_path / "missing")))
    with pytest.raises(edgeinfer.InvalidOptionError, match="not both"):
        api_key(_serve_args("--api-key", "x", "--api-key-file", str(f)))


def test_a_public_address_takes_the_key_from_the_environment(monkeypatch, capsys):
    """EDGEINFER_API_KEY satisfies 'a key is required off localhost' (nothing is bound here: the
    bind is replaced by one that records the address and stops)."""
    import edgeinfer_server
    from edgeinfer.cli import main

    monkeypatch.delenv("EDGEINFER_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "API key" in capsys.readouterr().err
    seen = []

    def stop_here(host: str, port: int):
        seen.append((host, port))
        raise edgeinfer_server.ListenError("stopped by the test")

    monkeypatch.setenv("EDGEINFER_API_KEY", "k")
    monkeypatch.setattr(edgeinfer_server, "bind", stop_here)
    monkeypatch.setattr(edgeinfer.BatchEngine, "load", _no_load)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 1
    assert seen == [("0.0.0.0", 0)] and "stopped by the test" in capsys.readouterr().err


def _no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the port was checked")


def test_a_port_in_use_fails_before_the_model_loads(monkeypatch, capsys):
    from edgeinfer.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    monkeypatch.setattr(edgeinfer.BatchEngine, "load", _no_load)
    try:
        assert main(["serve", "--port", str(port)]) == 1
    finally:
        busy.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"edgeinfer: error: cannot listen on 127.0.0.1:{port}:"), err
    assert "--port" in err[0]


@pytest.mark.slow
def test_the_context_split_error_names_the_flags(default_model_path, capsys):
    from edgeinfer.cli import main

    assert main(["serve", str(default_model_path), "--port", "0", "--ctx", "256", "--parallel", "64"]) == 1
    err = capsys.readouterr().err
    assert "--ctx" in err and "--parallel" in err and "Traceback" not in err


# -- the browser next door ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_simple_cross_site_post_is_refused(guarded):
    """What a web page's fetch(url, {method: "POST", body}) or a <form enctype="text/plain"> sends:
    no preflight, a text/plain (or form) body that happens to be JSON. Nothing reaches the engine."""
    before = submitted(guarded)
    url = guarded.url + "/chat/completions"
    browser = {"Origin": f"https://{EVIL}", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(url, content=json.dumps(CHAT), headers={**browser, "Content-Type": ctype})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert "access-control-allow-origin" not in r.headers
        # the same body without Origin (a non-browser client): the media type alone refuses it
        r = httpx.post(url, content=json.dumps(CHAT), headers={"Content-Type": ctype})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    r = httpx.post(url, content=json.dumps(CHAT))  # no Content-Type at all
    assert r.status_code == 415
    assert submitted(guarded) == before
    ok = httpx.post(url, content=json.dumps(CHAT), headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and submitted(guarded) == before + 1


@pytest.mark.slow
def test_a_rebound_host_is_refused_on_every_route(guarded):
    """DNS rebinding: evil.example now resolves to 127.0.0.1, so the page is 'same-origin' with
    the server, and sends its own name as Host (and as Origin)."""
    _, port = address(guarded)
    evil = {"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}"}
    b = base(guarded)
    for path in ("/v1/models", "/metrics", "/health", "/nope"):
        r = httpx.get(b + path, headers=evil)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)
        assert "--allowed-hosts" in r.json()["error"]["message"]
    r = httpx.post(b + "/v1/chat/completions", json=CHAT, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"{GOOD_HOST}:{port}", f"box.lan.example:{port}"):
        r = httpx.get(b + "/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
        assert r.json()["data"][0]["id"]
    # the server's own page (same origin) is not cross-origin
    same = httpx.post(b + "/v1/chat/completions", json=CHAT, headers={"Origin": f"http://{GOOD_HOST}:{port}",
                                                                     "Host": f"{GOOD_HOST}:{port}"})
    assert same.status_code == 200 and "access-control-allow-origin" not in same.headers


@pytest.mark.slow
def test_cors_for_the_allowed_origin_only(guarded):
    url = guarded.url + "/chat/completions"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}
    r = httpx.options(url, headers={"Origin": f"https://{EVIL}", **preflight})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers

    r = httpx.options(url, headers={"Origin": APP_ORIGIN, **preflight, "Access-Control-Request-Private-Network": "true"})
    assert r.status_code == 204, r.text
    h = r.headers
    assert h["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in h["access-control-allow-methods"]
    assert {"authorization", "content-type", "x-stainless-os"} <= {x.strip() for x in
                                                                    h["access-control-allow-headers"].split(",")}
    assert h["access-control-allow-private-network"] == "true"
    assert "Origin" in h["vary"] and int(h["access-control-max-age"]) > 0

    ok = httpx.post(url, json=CHAT, headers={"Origin": APP_ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "Origin" in ok.headers["vary"]
    # a streamed answer carries the header too, and an error does
    with httpx.stream("POST", url, json={**CHAT, "stream": True}, headers={"Origin": APP_ORIGIN}) as s:
        assert s.status_code == 200 and s.headers["access-control-allow-origin"] == APP_ORIGIN
        assert any(line == "data: [DONE]" for line in s.iter_lines())
    bad = httpx.post(url, json={**CHAT, "temperature": "hot"}, headers={"Origin": APP_ORIGIN})
    assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == APP_ORIGIN
    models = httpx.get(base(guarded) + "/v1/models", headers={"Origin": f"http://{EVIL}"})
    assert models.status_code == 403


# -- clean errors ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lone_surrogates_and_deep_nesting_are_400(guarded):
    url = guarded.url
    ok = json.dumps(CHAT)
    cases = [
        ("/chat/completions", ok.replace('"Hi"', '"Hi \\ud800"'), "messages"),
        ("/chat/completions", ok.replace('"user"', '"\\udc00"'), "messages"),
        ("/chat/completions", ok[:-1] + ', "stop": ["\\ud83d"]}', "stop"),
        ("/chat/completions", ok.replace(f'"{MODEL_FILE}"', '"m\\ud800"'), "model"),
        ("/completions", '{"prompt": "Once \\ud800 upon", "max_tokens": 2}', "prompt"),
    ]
    for path, body, param in cases:
        r = httpx.post(url + path, content=body, headers=JSON)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "surrogate" in err["message"]
    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"messages": ' + deep + "}", '{"messages": [' + '{"a": ' * 80 + "1" + "}" * 80 + "]}"):
        r = httpx.post(url + "/chat/completions", content=body, headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text[:300]
    assert httpx.post(url + "/chat/completions", json=CHAT).status_code == 200
    assert_no_traceback(guarded)


@pytest.mark.slow
def test_a_client_gone_during_the_body_upload_is_not_an_error(guarded):
    s = connect(guarded)
    port = own_port(s)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 5000\r\n\r\n" + json.dumps(CHAT).encode()[:20])
    s.close()
    line = wait_for_line(guarded, rf"127\.0\.0\.1:{port} POST /v1/chat/completions ")
    assert " 499 " in line
    assert_no_traceback(guarded)


# -- slow and vanishing clients -----------------------------------------------------------------------


@pytest.mark.slow
def test_trickled_headers_and_silent_connections_are_closed(guarded):
    """Slowloris: a head trickled one header line every 0.2 s is closed at --header-timeout (1 s)
    from its start, not kept alive by its trickle; a connection that sends nothing likewise."""
    s = connect(guarded)
    port = own_port(s)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    t = closed_within(s, 15, trickle=b"X-Slow: 1\r\n")
    s.close()
    assert 0.8 < t < 6, t
    wait_for_line(guarded, rf"127\.0\.0\.1:{port} sent no complete request head within 1 s \(--header-timeout\)")
    silent = connect(guarded)
    t = closed_within(silent, 15)
    silent.close()
    assert 0.8 < t < 6, t
    print(f"trickled head closed after {t:.2f} s")


@pytest.mark.slow
def test_a_body_never_sent_is_closed(guarded):
    s = connect(guarded)
    port = own_port(s)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{")
    t = closed_within(s, 15, trickle=b" ", every=0.3)  # a byte now and then does not keep it open
    s.close()
    assert 0.8 < t < 6, t
    wait_for_line(guarded, rf"127\.0\.0\.1:{port} sent no complete request body within 1 s \(--body-timeout\)")
    assert httpx.post(guarded.url + "/chat/completions", json=CHAT).status_code == 200
    assert_no_traceback(guarded)


@pytest.mark.slow
def test_a_full_queue_answers_503_with_retry_after(guarded):
    """One slot, one waiting place (--max-queue 1): a third request is refused at once, and once
    the first two are gone a client that honours Retry-After gets in."""
    url = guarded.url + "/chat/completions"
    long = {**CHAT, "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
            "max_tokens": 1500, "temperature": 0.8, "seed": 3, "stream": True}
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", url, json=long) as running, b.stream("POST", url, json=long) as waiting:
            assert running.status_code == 200 and waiting.status_code == 200
            r = httpx.post(url, json=CHAT, timeout=10)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_full" and "--max-queue" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 60
    while True:  # the two cancelled requests leave at the server's next look: retry as told
        r = httpx.post(url, json=CHAT, timeout=60)
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_a_reader_that_stops_reading_loses_its_slot(guarded):
    """A stream whose client stops reading (its receive buffer full) is paused by the engine
    with its slot held; after --stall-timeout (2 s) of writing nothing the server drops the
    connection and cancels the request, so the one slot serves the next request."""
    before = cancelled(guarded)
    s = connect(guarded, rcvbuf=4096)  # a small window: the server's buffers fill after ~100 chunks
    port = own_port(s)
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
                       "max_tokens": 1500, "temperature": 0.8, "seed": 4, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()  # ~1.5 KB per token
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.settimeout(30)
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    # ... and reads nothing more.
    start = time.monotonic()
    wait_for_line(guarded, rf"127\.0\.0\.1:{port} read nothing of its response for 2 s \(--stall-timeout\)")
    line = wait_for_line(guarded, rf"127\.0\.0\.1:{port} POST /v1/chat/completions 200 cancelled ")
    print(f"stalled stream dropped {time.monotonic() - start:.1f} s after its head: {line.strip()}")
    assert cancelled(guarded) == before + 1
    nxt = httpx.post(guarded.url + "/chat/completions", json=CHAT, timeout=60)  # the one slot is free
    assert nxt.status_code == 200 and nxt.json()["choices"][0]["finish_reason"] in ("stop", "length")
    closed_within(s, 30)  # the connection is gone (reset, or EOF after what was buffered)
    s.close()


@pytest.mark.slow
def test_a_slow_reader_that_keeps_reading_keeps_its_stream(guarded):
    """A client reading ~50 KB/s of a stream produced faster (~1.5 KB per token: 150 tokens take it
    5-8 s) keeps the server's writes paused for seconds at a time, longer than --stall-timeout (2 s);
    it keeps taking bytes, so it is not stalled and gets the whole answer."""
    s = connect(guarded, rcvbuf=4096)
    port = own_port(s)
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
                       "max_tokens": 150, "temperature": 0.8, "seed": 5, "stream": True, "logprobs": True,
                       "top_logprobs": 20, "stop": []}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.settimeout(30)
    received = bytearray()
    start = time.monotonic()
    while not received.endswith(b"\r\n0\r\n\r\n"):  # the end of the chunked body
        chunk = s.recv(8192)
        assert chunk, "the server closed the stream: " + "".join(guarded.log[-3:])
        received += chunk
        time.sleep(0.15)  # the slow reader under test: at most ~55 KB/s
    s.close()
    took = time.monotonic() - start
    print(f"slow reader: {len(received) / 1024:.0f} KiB in {took:.1f} s")
    assert b"data: [DONE]" in received and b'"finish_reason": "length"' in received
    wait_for_line(guarded, rf"127\.0\.0\.1:{port} POST /v1/chat/completions 200 length prompt=\d+ completion=150 ")
    assert not any(f"127.0.0.1:{port} read nothing" in line for line in guarded.log)


@pytest.mark.slow
def test_connection_limit(keyed):
    """--max-connections 2: while two connections are open, a request on a third gets 503 with
    Retry-After; when they close, requests are served again."""
    held = [connect(keyed), connect(keyed)]
    try:
        r = httpx.get(base(keyed) + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert "--max-connections" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 30
    while (r := httpx.get(base(keyed) + "/health", timeout=30)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200


# -- keys ------------------------------------------------------------------------------------------------


def cmdline(server: Server) -> str:
    return Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_key_from_a_file_stays_out_of_the_process_list_and_health_says_only_ok(keyed):
    assert "--api-key-file" in cmdline(keyed) and KEY not in cmdline(keyed)
    b = base(keyed)
    assert httpx.get(b + "/v1/models").status_code == 401
    assert httpx.get(b + "/metrics").status_code == 401
    assert httpx.get(b + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(b + "/health").json() == {"status": "ok"}  # liveness only, nothing about the model
    assert httpx.get(b + "/health", headers={"Authorization": "Bearer wrong"}).json() == {"status": "ok"}
    full = httpx.get(b + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert full["status"] == "ok" and full["slots"] == 1 and "model" in full
    assert chat(keyed.client(api_key=KEY), "Hi", max_tokens=2).choices[0].message.role == "assistant"


@pytest.mark.slow
def test_sigterm_shuts_down_like_ctrl_c(q4_path, tmp_path, monkeypatch):
    """SIGTERM (what `kill`, systemd and docker send): running streams end as cancelled after
    --grace, the engine is closed, exit 0. The key comes from EDGEINFER_API_KEY."""
    monkeypatch.setenv("EDGEINFER_API_KEY", KEY)
    s = Server(q4_path, tmp_path / "home", "--parallel", "1", "--ctx", "2048", "--grace", "1")
    try:
        assert KEY not in cmdline(s)
        import openai

        with pytest.raises(openai.AuthenticationError):
            chat(s.client(api_key="wrong"), "Hi", max_tokens=2)
        stream = chat(s.client(api_key=KEY), "Tell me a very long story about dragons.", max_tokens=2000,
                      temperature=0.8, seed=9, stream=True)
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
        assert finishes == ["cancelled"], finishes
        assert s.proc.wait(timeout=60) == 0, "".join(s.log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    wait_for_line(s, r"^edgeinfer: server stopped$")
    assert_no_traceback(s)


# -- what a request may say ------------------------------------------------------------------------------


@pytest.mark.slow
def test_seeds_are_not_wrapped_and_penalties_are_accepted(guarded):
    client = guarded.client()
    story = "Write one sentence about a cat."

    def text(**kw) -> str:
        return chat(client, story, max_tokens=24, temperature=1.0, **kw).choices[0].message.content

    assert text(seed=7) == text(seed=7)
    assert text(seed=7) != text(seed=7 + 2**32)  # was the same request: the seed was taken mod 2**32
    for seed in (2**63 - 1, -(2**63), -1):
        assert text(seed=seed)
    url = guarded.url + "/chat/completions"
    r = httpx.post(url, json={**CHAT, "seed": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    for name in ("presence_penalty", "frequency_penalty"):
        assert httpx.post(url, json={**CHAT, name: 1.5}).status_code == 200
        r = httpx.post(url, json={**CHAT, name: 2.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    # ... and reach the sampler: greedy text that repeats its own tokens repeats fewer with them
    def repeats(**kw) -> int:
        tokens = client.completions.create(model=MODEL_FILE, prompt="cat cat cat cat cat cat cat cat", max_tokens=16,
                                           temperature=0.0, logprobs=0, **kw).choices[0].logprobs.tokens
        return len(tokens) - len(set(tokens))

    assert repeats() > repeats(frequency_penalty=2.0, presence_penalty=2.0)


@pytest.mark.slow
def test_one_access_log_line_per_request(guarded):
    client = guarded.client()
    long = "Tell me a very long story about dragons."
    drain(guarded)
    chat(client, long, max_tokens=7)
    line = wait_for_line(guarded, r"POST /v1/chat/completions 200 \w+ prompt=\d+ completion=7 ")
    assert re.search(r"^edgeinfer: 127\.0\.0\.1:\d+ POST /v1/chat/completions 200 length prompt=\d+ "
                     r"completion=7 ttft=\d+\.\d{3}s \d+\.\d tok/s \d+\.\d{3}s$", line.strip()), line
    assert list(chat(client, long, max_tokens=6, stream=True))
    wait_for_line(guarded, r"POST /v1/chat/completions 200 length prompt=\d+ completion=6 ttft=\d+\.\d{3}s ")
    httpx.get(base(guarded) + "/health")
    assert re.search(r" GET /health 200 \d+\.\d{3}s$", wait_for_line(guarded, r"GET /health ").strip())
    httpx.get(base(guarded) + "/a%0aforged%20line")
    line = wait_for_line(guarded, r"GET /a")
    assert "\\x0aforged\\x20line 404" in line  # a path cannot forge log lines
