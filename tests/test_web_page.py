"""The web chat page at `/`, in a real browser: the system's headless Chromium driven by Playwright
against `edgeinfer serve` (a subprocess of the real CLI, with an API key) on an F16 copy of the
default model. The page loads and asks for the key, a message streams to completion with drafted
tokens marked and the stats line filled, chats survive a reload, Stop stops a reply (and frees the
server's one slot), a wrong key shows an error; the key is only ever sent as a header."""

from __future__ import annotations

import os
import re

import httpx2 as httpx
import pytest

from test_batch_engine import f16_path  # noqa: F401  (a session fixture: the default model as F16)
from test_server import KEY, MODEL_FILE, one_slot  # noqa: F401  (one slot, an API key: its module's fixture)
from test_service import wait_until

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"  # the system's (apt-get install -y chromium; .ci/run installs it)
# Headless, and nothing that would reach the network by itself (no update checks, no sync, no QUIC).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
REPEAT = f"Repeat this code exactly:\n\n{CODE}".strip()  # (the page trims what is typed)
STATS = re.compile(r"^\d+ tokens · [\d.]+ tok/s · lookup \d+% accepted, mean [\d.]+ · ttft [\d.]+ m?s · "
                   r"(done|max tokens) · " + re.escape(MODEL_FILE) + "$")


@pytest.fixture(scope="module")
def server(one_slot):  # noqa: F811
    """One slot: a reply that Stop did not end would keep the next message waiting."""
    return one_slot


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        message = (f"{CHROMIUM} is missing: the web page's tests drive the system's Chromium "
                   "(apt-get install -y chromium; .ci/run installs it)")
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser profile (empty storage) on the server's page; every request it makes is kept."""
    context = browser.new_context(base_url=server.url.removesuffix("/v1"))
    page = context.new_page()
    page.set_default_timeout(30_000)  # (waits for replies use expect's longer timeout)
    page.requests = []
    page.on("request", lambda r: page.requests.append(r))
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(e))
    yield page
    context.close()
    assert not page.errors  # no script error on the page


def base(server) -> str:
    return server.url.removesuffix("/v1")


def enter_key(page, key: str, remember: bool = False) -> None:
    page.locator("#key-dialog[open]").wait_for()
    page.fill("#key-input", key)
    page.set_checked("#key-remember", remember)
    page.click("#key-save")


def settings(page, **values: str | bool) -> None:
    page.click("#settings summary")
    for field, value in values.items():
        if isinstance(value, bool):
            page.set_checked(f"#{field}", value)
        elif field == "speculation":
            page.select_option("#speculation", value)
        else:
            page.fill(f"#{field}", value)
            page.locator(f"#{field}").dispatch_event("change")
    page.click("#settings summary")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_the_page_is_served_to_anyone_and_the_api_still_needs_the_key(server):
    url = base(server)
    page = httpx.get(url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/web/app.js"' in page.text and "http" not in page.text.split("<body>", 1)[1]  # nothing remote
    head = httpx.head(url + "/", timeout=30)  # how Ollama's clients probe a server
    assert head.status_code == 200 and head.content == b""
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        r = httpx.get(f"{url}/web/{name}", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "http://" not in r.text and "https://" not in r.text  # no CDN, no other site
    auth = {"Authorization": f"Bearer {KEY}"}
    for other in ("/web/index.html", "/web/..%2Fapp.py", "/web/webpage.py"):  # only the page's own files are open
        assert httpx.get(url + other, timeout=30).status_code in (401, 404)
        assert httpx.get(url + other, headers=auth, timeout=30).status_code == 404
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    # a page of another site may not use the API through the user's browser
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"},
                  timeout=30)
    assert r.status_code == 403


def test_a_message_streams_with_drafted_tokens_marked_and_the_chat_is_kept(page, server):
    page.goto("/")
    enter_key(page, KEY)
    page.locator("#model option[value='" + MODEL_FILE + "']").wait_for(state="attached")
    assert page.locator("#model").input_value() == MODEL_FILE  # the model the server has loaded
    settings(page, speculation="lookup-fixed", temperature="0", **{"max-tokens": "60"})
    send(page, REPEAT)
    expect(page.locator("#stop")).to_be_enabled()
    expect(page.locator("#send")).to_be_enabled()  # the reply is over
    stats = page.text_content("#stats")
    assert STATS.match(stats), stats
    reply = page.locator(".message.assistant .body")
    text = reply.text_content()
    # greedy with prompt lookup is lossless: the same text as the API gives without speculation
    plain = httpx.post(server.url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"model": MODEL_FILE, "messages": [{"role": "user", "content": REPEAT}],
                             "temperature": 0, "max_tokens": 60, "speculation": "off"}).json()
    assert text == plain["choices"][0]["message"]["content"]
    drafted = [d.text_content() for d in reply.locator(".drafted").all()]
    assert drafted and all(d and d in text for d in drafted)
    colour = page.locator(".message.assistant .drafted").first.evaluate("e => getComputedStyle(e).fontWeight")
    assert int(colour) >= 600  # bold (and magenta), as the terminal UI marks them
    settings(page, **{"show-drafted": False})  # ... and plain once switched off
    assert int(page.locator(".message.assistant .drafted").first.evaluate("e => getComputedStyle(e).fontWeight")) < 600
    # the chat is kept in the browser: a reload shows it again, drafted marks and stats line included
    page.reload()
    expect(page.locator("#chats li")).to_have_text(["Repeat this code exactly: def add(a, b):"])
    expect(page.locator(".message.assistant .body")).to_have_text(text)
    assert page.locator(".message.assistant .drafted").count() == len(drafted)
    assert page.text_content("#stats") == stats
    # the key went in a header and nowhere else: no URL holds it, it is not kept beyond the session
    api = [r for r in page.requests if "/v1/" in r.url]
    assert api and all(KEY not in r.url for r in page.requests)
    assert all(r.headers.get("authorization") == f"Bearer {KEY}" for r in api if r.url.endswith("/chat/completions"))
    assert page.evaluate("localStorage.getItem('edgeinfer.apiKey')") is None
    assert page.evaluate("sessionStorage.getItem('edgeinfer.apiKey')") == KEY


def test_stop_stops_the_reply_and_frees_the_slot(page, server):
    page.goto("/")
    enter_key(page, KEY, remember=True)
    page.locator("#model option").first.wait_for(state="attached")
    settings(page, speculation="off", temperature="0.8", **{"max-tokens": "1500"})
    send(page, "Tell me a very long story about dragons.")
    reply = page.locator(".message.assistant .body")
    expect(reply).to_have_text(re.compile(r"\S+\s+\S+\s+\S+"))  # a few words came
    page.click("#stop")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator(".message.assistant .note")).to_have_text("(stopped)")
    assert page.text_content("#stats").endswith("· stopped")
    kept = reply.text_content()
    # the server ends it as cancelled (at its next step after the page's fetch is aborted: the page
    # shows "stopped" first); with its one slot free, the next message is answered
    wait_until(lambda: re.search(r'reason="cancelled"\} [1-9]', httpx.get(
        base(server) + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text), 30,
        "the server to count the stopped reply as cancelled")
    settings(page, temperature="0", system="Answer in one word.", **{"max-tokens": "8"})
    send(page, "Say hi.")
    expect(page.locator(".message.assistant")).to_have_count(2)
    expect(page.locator("#send")).to_be_enabled()
    assert re.search(r"· (done|max tokens) · ", page.text_content("#stats"))
    sent = [r.post_data_json for r in page.requests if r.url.endswith("/chat/completions")][-1]
    assert sent["messages"][0] == {"role": "system", "content": "Answer in one word."}
    assert (sent["temperature"], sent["max_tokens"], sent["speculation"]) == (0, 8, "off")
    assert sent["messages"][-1] == {"role": "user", "content": "Say hi."} and len(sent["messages"]) == 4
    assert reply.first.text_content() == kept  # the stopped reply stays as it was
    assert page.evaluate("localStorage.getItem('edgeinfer.apiKey')") == KEY  # "remember" keeps it


def test_a_wrong_key_shows_an_error(page, server):
    page.goto("/")
    enter_key(page, "not-the-key")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("401")
    expect(page.locator("#key-dialog")).to_have_attribute("open", "")  # asked again
    enter_key(page, KEY)
    page.locator("#model option").first.wait_for(state="attached")
    expect(error).to_be_hidden()
    # a key that stops working mid-session (the server's key changed) is said on the next message
    page.evaluate("sessionStorage.setItem('edgeinfer.apiKey', 'revoked')")
    send(page, "Hi")
    expect(error).to_contain_text("refused the API key")
    expect(page.locator(".message.assistant")).to_have_count(0)  # nothing came: nothing kept
    assert page.locator(".message.user").count() == 1


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    playwright_expect.set_options(timeout=180_000)  # a reply on a busy 2-core machine
    return playwright_expect(locator)
