"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`,
server/dialects/anthropic.py) with the real `anthropic` client against the shared dialect server
(tests/dialects/conftest.py, an F16 copy of the default model): `messages.create` and
`messages.stream` give the chat route's greedy text token for token, the streamed events come in
Anthropic's order (with `ping`), a `tool_use` round trip (the call, its `tool_result`, the answer:
equal to the same conversation on the chat route), `stop_sequences` report the one that matched,
`count_tokens` counts what the model reads, `output_config.format` validates, the key is read from
`x-api-key` too, and hostile bodies get Anthropic-shaped 4xx errors, never a 500.

This client has no `temperature` argument any more (the API still takes it): greedy requests send
it with `extra_body`."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from dialect_support import KEY, MODEL, auth, send

from edgeinfer_server.dialects.anthropic import translate_messages
from edgeinfer_server.errors import APIError

GREEDY = {"temperature": 0.0}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU does."]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}
ASK = "What is the weather like in Paris right now?"


def client(server, **kw):
    import anthropic

    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=120,
                               **kw)


def chat(server, messages, **kw):
    r = server.client(api_key=KEY).chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kw)
    return r.choices[0], r.usage


# -- translation (no server) -------------------------------------------------------------------------


def test_blocks_become_the_chat_messages_they_mean():
    t = translate_messages({
        "model": "m", "max_tokens": 7, "stop_sequences": ["\n\n"], "top_k": 5,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "down",
                                          "is_error": True}]}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert t.body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18 C"}, {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: down"}]
    assert t.body["tools"] == [CHAT_WEATHER] and t.body["tool_choice"] == "required"
    assert t.body["parallel_tool_calls"] is False and t.body["stop"] == ["\n\n"] and t.body["top_k"] == 5
    for choice, chat_choice in (({"type": "tool", "name": "get_weather"},
                                 {"type": "function", "function": {"name": "get_weather"}}),
                                ({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        assert translate_messages({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                   "tools": [WEATHER], "tool_choice": choice}).body["tool_choice"] == chat_choice


@pytest.mark.parametrize("body, param, says", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model", "'model' is required"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "'max_tokens' is required"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages", "non-empty"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "integer"),
    ({"model": "m", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     "temperature", "[0, 1]"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages", "'user' or"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages", "images are not supported"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking":
      {"type": "enabled", "budget_tokens": 1024}}, "thinking", "not supported"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools", "function tools only"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
     "tool_choice", "needs 'tools'"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "tool_choice", "must be a JSON object"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences", "non-empty"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
     "mcp_servers", "unknown field"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "messages", "belong to user messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "output_config": {"effort": "high"}}, "output_config", "not supported"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "5000"),
])
def test_requests_the_dialect_cannot_honour_are_400s_naming_the_field(body, param, says):
    with pytest.raises(APIError) as info:
        translate_messages(body)
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


# -- the real client ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_messages_equal_the_chat_route_created_and_streamed(dialect_server):
    c = client(dialect_server)
    for prompt in PROMPTS:
        choice, usage = chat(dialect_server, [{"role": "system", "content": "Answer briefly."},
                                              {"role": "user", "content": prompt}], max_tokens=24)
        kw = {"model": MODEL, "system": "Answer briefly.", "max_tokens": 24,
              "messages": [{"role": "user", "content": prompt}], "extra_body": GREEDY}
        whole = c.messages.create(**kw)
        assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == choice.message.content
        assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
        assert whole.usage.output_tokens == usage.completion_tokens
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == usage.prompt_tokens
        with c.messages.stream(**kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == choice.message.content == final.content[0].text and final.stop_reason == whole.stop_reason
        events = [e.type for e in c.messages.create(**kw, stream=True)]
        assert events[:2] == ["message_start", "content_block_start"]
        assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(events[2:-3]) == {"content_block_delta"}
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    raw = httpx.post(dialect_server.url + "/messages", json={**body, **GREEDY, "stream": True}, timeout=60,
                     headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert raw.status_code == 200 and names[:2] == ["message_start", "ping"]  # the wire carries the ping too


@pytest.mark.slow
def test_top_k_and_top_p_narrow_the_draw(dialect_server):
    """At temperature 1, top_k 1 (or a tiny top_p) leaves only the likeliest token: the greedy text."""
    c = client(dialect_server)
    ask = [{"role": "user", "content": PROMPTS[1]}]
    greedy = chat(dialect_server, ask, max_tokens=24)[0].message.content
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}):
        r = c.messages.create(model=MODEL, max_tokens=24, messages=ask, extra_body={"temperature": 1.0, **narrow})
        assert r.content[0].text == greedy, narrow


@pytest.mark.slow
def test_stop_sequences_report_the_one_that_matched(dialect_server):
    c = client(dialect_server)
    free = chat(dialect_server, [{"role": "user", "content": PROMPTS[2]}], max_tokens=40)[0].message.content
    word = free.split()[3]
    cut, _ = chat(dialect_server, [{"role": "user", "content": PROMPTS[2]}], max_tokens=40, stop=["zebra", word])
    r = c.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": PROMPTS[2]}],
                          stop_sequences=["zebra", word], extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", word)
    assert r.content[0].text == cut.message.content == free[:free.index(word)]


@pytest.mark.slow
def test_a_tool_use_round_trip(dialect_server):
    c = client(dialect_server)
    kw = {"model": MODEL, "max_tokens": 60, "tools": [WEATHER], "extra_body": GREEDY}
    one = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = c.messages.create(messages=[{"role": "user", "content": ASK}], tool_choice=one, **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str)
    with c.messages.stream(messages=[{"role": "user", "content": ASK}], tool_choice=one, **kw) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta" and e.index == 0]
        final = stream.get_final_message()
    assert json.loads("".join(pieces)) == final.content[0].input == uses[0].input
    use = uses[0]
    follow = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 degrees and sunny"}]}]
    answer = c.messages.create(messages=follow, **kw)
    expected, _ = chat(dialect_server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees and sunny"}], tools=[CHAT_WEATHER],
        max_tokens=60)
    assert answer.content and answer.content[0].text == expected.message.content


@pytest.mark.slow
def test_count_tokens_is_what_the_model_reads(dialect_server):
    c = client(dialect_server)
    messages = [{"role": "user", "content": ASK}]
    plain = c.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=messages)
    _, usage = chat(dialect_server, [{"role": "system", "content": "Answer briefly."}, *messages], max_tokens=1)
    assert plain.input_tokens == usage.prompt_tokens
    with_tools = c.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    _, tool_usage = chat(dialect_server, messages, tools=[CHAT_WEATHER], max_tokens=1)
    assert with_tools.input_tokens == tool_usage.prompt_tokens > plain.input_tokens


@pytest.mark.slow
def test_output_config_json_schema(dialect_server):
    import jsonschema
    from pydantic import BaseModel

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    c = client(dialect_server)
    ask = [{"role": "user", "content": "Invent a person and give their name and age."}]
    r = c.messages.create(model=MODEL, max_tokens=80, messages=ask, extra_body=GREEDY,
                          output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(r.content[0].text), schema)

    class Person(BaseModel):
        name: str
        age: int

    parsed = c.messages.parse(model=MODEL, max_tokens=80, messages=ask, output_format=Person, extra_body=GREEDY)
    assert isinstance(parsed.parsed_output, Person)


@pytest.mark.slow
def test_hostile_bodies_get_anthropic_errors_never_a_500(dialect_server):
    url = dialect_server.url + "/messages"
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}

    def post(body, status: int, kind: str, headers=None, path: str = "") -> str:
        err = send("POST", url + path, body, status, headers or {"x-api-key": KEY})
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
        return err["error"]["message"]

    post(b"{not json", 400, "invalid_request_error")
    post(b"[1, 2]", 400, "invalid_request_error")
    post({"messages": ok["messages"], "max_tokens": 2}, 400, "invalid_request_error")
    assert "no-such-model" in post({**ok, "model": "no-such-model"}, 404, "not_found_error")
    assert "max_tokens" in post({**ok, "max_tokens": 10**6}, 400, "invalid_request_error")
    post({**ok, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "invalid_request_error")
    post({**ok, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 20_000}]}, 400,
         "invalid_request_error")
    post({**ok, "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error")
    post({**ok, "top_k": "many"}, 400, "invalid_request_error")
    post({**ok, "surprise": True}, 400, "invalid_request_error")
    post(b"{" + b" " * (2 << 20) + b"}", 413, "request_too_large")
    post(ok, 401, "authentication_error", headers={"x-api-key": "wrong"})
    post(ok, 401, "authentication_error", headers={"anthropic-version": "2023-06-01"})
    post(ok, 403, "permission_error", headers={"x-api-key": KEY, "Host": "evil.example:8080"})  # DNS rebinding
    post(ok, 403, "permission_error", headers={"x-api-key": KEY, "Origin": "http://evil.example"})  # CSRF
    post({"model": MODEL}, 400, "invalid_request_error", path="/count_tokens")
    post({**ok, "max_tokens": 3}, 400, "invalid_request_error", path="/count_tokens")  # not a count_tokens field
    r = httpx.post(url, json=ok, headers=auth(), timeout=60)  # the key as a Bearer token works too
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert httpx.get(dialect_server.url + "/messages/nope", headers=auth()).json()["error"]["type"] == \
        "not_found_error"
