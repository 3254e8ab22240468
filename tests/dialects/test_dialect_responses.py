"""OpenAI's Responses API (`POST /v1/responses`, server/dialects/responses.py) with the real `openai`
client against the shared dialect server (tests/dialects/conftest.py, an F16 copy of the default
model): `responses.create` streamed and not gives the chat route's greedy text token for token
(same text, same token counts), the streamed semantic events come in OpenAI's order, a function
call goes round (the call, its output, the answer: equal to the same conversation on the chat
route, and again through `previous_response_id`), `text.format` json_schema validates
(`responses.parse` too), and hostile bodies get OpenAI-shaped 4xx errors, never a 500."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from dialect_support import KEY, MODEL, auth, send

from edgeinfer_server.dialects.response_store import ResponseStore
from edgeinfer_server.dialects.responses import translate_responses
from edgeinfer_server.errors import APIError

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colours."]
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
ASK = "What is the weather like in Paris right now?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def client(server):
    return server.client(api_key=KEY)


def chat_text(server, messages, **kw):
    r = client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kw)
    return r.choices[0].message, r.usage


# -- translation (no server) -------------------------------------------------------------------------


def test_items_become_the_chat_messages_they_mean():
    t = translate_responses({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "input": [
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Warm.", "annotations": []}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}}})
    assert t.kind == "chat" and t.body["max_tokens"] == 9
    assert t.body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "tool", "tool_call_id": "c2",
                                                                     "content": "20 C"},
        {"role": "assistant", "content": "Warm."}]
    assert t.body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["parameters"]}}]
    assert t.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert t.body["response_format"] == {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                                "strict": True}}
    assert t.extra["echo"]["instructions"] == "Be brief." and t.extra["store"] is True


@pytest.mark.parametrize("body, param, says", [
    ({"input": "x"}, "model", "'model' is required"),
    ({"model": "m"}, "input", "'input' is required"),
    ({"model": "m", "input": 5}, "input", "string or a list"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input_image is not supported"),
    ({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning items"),
    ({"model": "m", "input": [{"type": "web_search_call"}]}, "input", "not supported"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"model": "m", "input": "x", "background": True}, "background", "not supported"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text", "json_schema"),
    ({"model": "m", "input": "x", "colour": "red"}, "colour", "unknown field 'colour'"),
    ({"model": "m", "input": "x", "max_output_tokens": "9"}, "max_output_tokens", "integer"),
    ({"model": "m", "input": [{"role": "user", "content": "x"}] * 5000}, "input", "5000 items"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
])
def test_requests_the_dialect_cannot_honour_are_400s_naming_the_field(body, param, says):
    with pytest.raises(APIError) as info:
        translate_responses(body)
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


def test_the_response_store_is_bounded_and_per_key():
    store = ResponseStore(max_entries=3, max_bytes=400)
    convo = [{"role": "user", "content": "x" * 50}]
    for i in range(4):
        assert store.put(f"r{i}", "alice", convo)
    assert store.get("r0", "alice") is None and store.get("r3", "alice") == convo  # the oldest went first
    assert store.get("r3", "bob") is None  # another key never reads it
    assert not store.put("big", "alice", [{"role": "user", "content": "x" * 500}])  # larger than the store
    for i in range(4, 8):
        store.put(f"r{i}", "alice", convo)
    assert len(store) == 3 and store.bytes <= 400
    store.get("r7", "alice")[0]["content"] = "changed"  # a copy: the stored one stays
    assert store.get("r7", "alice") == convo


# -- the real client ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_responses_equal_the_chat_route_streamed_and_not(dialect_server):
    c = client(dialect_server)
    for prompt in PROMPTS:
        message, usage = chat_text(dialect_server, [{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": prompt}], max_tokens=24)
        whole = c.responses.create(model=MODEL, instructions="Answer briefly.", input=prompt, max_output_tokens=24,
                                   temperature=0.0)
        assert whole.output_text == message.content
        assert (whole.usage.output_tokens, whole.usage.input_tokens) == (usage.completion_tokens, usage.prompt_tokens)
        assert whole.status == ("incomplete" if usage.completion_tokens == 24 else "completed")
        events = list(c.responses.create(model=MODEL, instructions="Answer briefly.", input=prompt,
                                         max_output_tokens=24, temperature=0.0, stream=True))
        kinds = [e.type for e in events]
        last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              last]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == message.content
        assert events[-1].response.output_text == message.content
        assert events[-1].response.usage.output_tokens == usage.completion_tokens


@pytest.mark.slow
def test_sampling_fields_and_echoed_fields(dialect_server):
    """temperature 1 with top_p 1e-6 keeps only the likeliest token: the greedy text; with a seed
    (the chat route's extra field) a sampled answer is the chat route's for the same settings."""
    c = client(dialect_server)
    ask = [{"role": "user", "content": PROMPTS[1]}]
    greedy, _ = chat_text(dialect_server, ask, max_tokens=24)
    narrow = c.responses.create(model=MODEL, input=PROMPTS[1], max_output_tokens=24, temperature=1.0, top_p=1e-6,
                                metadata={"run": "7"}, user="tester")
    assert narrow.output_text == greedy.content
    assert (narrow.temperature, narrow.top_p, narrow.metadata, narrow.user) == (1.0, 1e-6, {"run": "7"}, "tester")
    sampled = c.responses.create(model=MODEL, input=PROMPTS[1], max_output_tokens=24, temperature=0.9, top_p=0.9,
                                 extra_body={"seed": 7, "top_k": 20})
    ref = client(dialect_server).chat.completions.create(model=MODEL, messages=ask, max_tokens=24, temperature=0.9,
                                                          top_p=0.9, seed=7, extra_body={"top_k": 20})
    assert sampled.output_text == ref.choices[0].message.content


@pytest.mark.slow
def test_a_function_call_round_trip(dialect_server):
    c = client(dialect_server)
    first = c.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=60,
                               temperature=0.0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    one = c.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice={"type": "function",
                             "name": "get_weather"}, parallel_tool_calls=False, max_output_tokens=60, temperature=0.0)
    assert [(i.type, i.arguments) for i in one.output] == [("function_call", calls[0].arguments)]
    assert one.status == "completed" and one.parallel_tool_calls is False  # one call, then the model stopped
    stream = list(c.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=60, temperature=0.0, stream=True))
    done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta"
                     and e.item_id == done[0].item_id)
    assert deltas == done[0].arguments == calls[0].arguments
    added = [e.item.id for e in stream if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in stream if e.type == "response.output_item.done"]  # every item closed
    call = calls[0]
    follow = [{"role": "user", "content": ASK},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    answer = c.responses.create(model=MODEL, input=follow, tools=[WEATHER], max_output_tokens=40, temperature=0.0)
    expected, _ = chat_text(dialect_server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        max_tokens=40)
    assert answer.output_text == (expected.content or "") and answer.output_text
    # the same turn through previous_response_id: the stored conversation continues
    again = c.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=40,
                               temperature=0.0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                        "output": "18 degrees and sunny"}])
    assert again.output_text == answer.output_text and again.previous_response_id == first.id
    import openai

    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, previous_response_id=unstored.id, input="And?", max_output_tokens=2)


@pytest.mark.slow
def test_text_format_json_schema(dialect_server):
    import jsonschema
    from pydantic import BaseModel

    c = client(dialect_server)
    ask = "Invent a person and give their name and age."
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = c.responses.create(model=MODEL, input=ask, text=fmt, max_output_tokens=80, temperature=0.0)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    expected, _ = chat_text(dialect_server, [{"role": "user", "content": ask}], max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.output_text == expected.content and r.text.format.type == "json_schema"

    class Person(BaseModel):
        name: str
        age: int

    parsed = c.responses.parse(model=MODEL, input=ask, text_format=Person, max_output_tokens=80, temperature=0.0)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.slow
def test_hostile_bodies_get_openai_errors_never_a_500(dialect_server):
    url = dialect_server.url + "/responses"
    ok = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}

    def post(body, status: int, headers=None) -> dict:
        err = send("POST", url, body, status, headers)["error"]
        assert err["message"] and err["type"]
        return err

    assert post(b"{not json", 400)["code"] == "invalid_json"
    post(b"[1, 2]", 400)
    post({"input": "Hi"}, 400)
    assert post({**ok, "model": "no-such-model"}, 404)["param"] == "model"
    assert post({**ok, "max_output_tokens": 10**6}, 400)["param"] == "max_output_tokens"
    assert post({**ok, "temperature": "hot"}, 400)["param"] == "temperature"
    assert post({**ok, "input": [{"role": "user", "content": "word " * 9000}]}, 400)["code"] == \
        "context_length_exceeded"
    assert post({**ok, "input": [{"role": "user", "content": "x"}] * 20_000}, 400)["param"] == "input"
    assert post({**ok, "tools": [{"type": "function", "name": "bad name"}]}, 400)["param"] == "tools"
    assert post({**ok, "text": {"format": {"type": "json_schema", "name": "s", "schema": {"not": {}}}}},
                400)["param"] == "text.format"
    assert post({**ok, "previous_response_id": "resp_nope"}, 404)["param"] == "previous_response_id"
    assert post({**ok, "nonsense": 1}, 400)["param"] == "nonsense"
    assert post(b"{" + b" " * (2 << 20) + b"}", 413)["code"] == "request_too_large"
    assert post(ok, 401, headers={"Authorization": "Bearer wrong"})["code"] == "invalid_api_key"
    assert client(dialect_server).responses.create(model=MODEL, input="Hi", max_output_tokens=3).status in (
        "completed", "incomplete")


@pytest.mark.slow
def test_a_stream_the_server_cuts_ends_with_each_dialects_error(dialect_server):
    """`edgeinfer stop` while a stream of each dialect runs: each ends with its own terminal error
    (Responses `response.failed`, Anthropic an `error` event, Ollama an `{"error"}` line)."""
    import threading

    base = dialect_server.url.removesuffix("/v1")
    story = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]
    streams = {  # path, body, what shows the stream has begun
        "responses": ("/v1/responses", {"model": MODEL, "input": story, "max_output_tokens": 500, "stream": True},
                      "response.output_text.delta"),
        "anthropic": ("/v1/messages", {"model": MODEL, "messages": story, "max_tokens": 500, "stream": True},
                      "content_block_delta"),
        "ollama": ("/api/chat", {"model": MODEL, "messages": story, "options": {"num_predict": 500}}, '"done": false'),
    }
    begun = {name: threading.Event() for name in streams}
    bodies: dict[str, str] = {}

    def read(name: str) -> None:
        path, body, mark = streams[name]
        text = ""
        with httpx.stream("POST", base + path, json=body, headers=auth(), timeout=120) as r:
            for piece in r.iter_text():
                text += piece
                if mark in text:
                    begun[name].set()
        bodies[name] = text

    threads = [threading.Thread(target=read, args=(name,)) for name in streams]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in begun.values())
    stop = httpx.post(base + "/edgeinfer/stop", json={"model": MODEL}, headers=auth(), timeout=60)
    assert stop.status_code == 200 and stop.json()["cancelled"] >= 3
    for t in threads:
        t.join(120)
    last = [line for line in bodies["responses"].splitlines() if line.startswith("data: ")][-1]
    failed = json.loads(last.removeprefix("data: "))
    assert failed["type"] == "response.failed" and "cancelled" in failed["response"]["error"]["message"]
    events = [line for line in bodies["anthropic"].splitlines() if line.startswith("event: ")]
    assert events[-1] == "event: error" and '"overloaded_error"' in bodies["anthropic"] and \
        "event: message_stop" not in events
    assert "cancelled" in json.loads(bodies["ollama"].splitlines()[-1])["error"]
    # the model loads again for the next request
    assert client(dialect_server).responses.create(model=MODEL, input="Hi", max_output_tokens=2).output_text
