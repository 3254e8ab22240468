"""The opt-in stream extension that says which text was drafted (`stream_options.include_drafted`):
what the web page colours, as the terminal UI does. Pure: the Responder on hand-made events."""

from __future__ import annotations

import pytest

from edgeinfer import TokenEvent
from edgeinfer_server.errors import APIError
from edgeinfer_server.protocol import Responder, drafted_spans, parse_chat

MESSAGES = [{"role": "user", "content": "Hi"}]


def _responder(**stream_options) -> Responder:
    body = {"messages": MESSAGES, "stream": True}
    if stream_options:
        body["stream_options"] = stream_options
    return Responder(parse_chat(body, 1024), "m", lambda t: b"")


def test_spans_are_code_points_of_the_chunk_text_and_adjacent_drafts_merge():
    events = [TokenEvent(1, "Ça"), TokenEvent(2, " va", drafted=True), TokenEvent(3, " 🙂", drafted=True),
              TokenEvent(4, "!"), TokenEvent(5, "", drafted=True), TokenEvent(6, " ok", drafted=True)]
    text = "".join(e.text for e in events)
    spans = drafted_spans(events)
    assert spans == [[2, 7], [8, 11]]  # " va 🙂" (the emoji is one code point), then " ok"
    assert [text[a:b] for a, b in spans] == [" va 🙂", " ok"]


def test_chunks_carry_tokens_drafted_tokens_and_spans_only_when_asked():
    plain = _responder(include_usage=True).delta_chunks([TokenEvent(1, "a", drafted=True)])
    assert "edgeinfer" not in plain[0]["choices"][0]  # the OpenAI shape, untouched, unless opted in
    r = _responder(include_drafted=True)
    # a token whose text is still pending (a multi-byte character cut in two) makes no chunk; it is
    # counted in the next one, so the page's token count matches the server's
    assert r.delta_chunks([TokenEvent(1, "", drafted=True)]) == []
    chunk = r.delta_chunks([TokenEvent(2, "é", drafted=True), TokenEvent(3, "t")])[0]
    choice = chunk["choices"][0]
    assert choice["delta"]["content"] == "ét"
    assert choice["edgeinfer"] == {"tokens": 3, "drafted_tokens": 2, "drafted": [[0, 1]]}
    choice = r.delta_chunks([TokenEvent(4, " x")])[0]["choices"][0]
    assert choice["edgeinfer"] == {"tokens": 1, "drafted_tokens": 0, "drafted": []}


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_include_drafted_must_be_a_boolean(value):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": MESSAGES, "stream": True, "stream_options": {"include_drafted": value}}, 1024)
    assert e.value.status == 400 and "include_drafted" in str(e.value)
