"""Tools and structured output through `edgeinfer serve`: the request fields parsed into edgeinfer's
types (400s for malformed ones), the response shapes (message.tool_calls, finish_reason
"tool_calls", streamed OpenAI tool-call deltas), the real `openai` client against a server on the
default model's F16 copy, and tool round trips on the real Qwen2.5-Coder-1.5B (tests marked real).

The engine faces take `tools=` in `chat_tokens` once the lead wires them (see engine/chat/tools.py):
until then the tests that offer tools to a running server fail with a 500."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

import edgeinfer
from edgeinfer import DoneEvent, GenerationStats, TokenEvent, ToolCall, ToolCallEvent
from edgeinfer_server.errors import APIError
from edgeinfer_server.protocol import Responder, parse_chat, parse_completion
from test_batch_engine import f16_path  # noqa: F401  (the session fixture shared with the engine tests)
from test_server import MODEL_FILE, Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def body(**kw):
    return {"messages": ASK, **kw}


# -- parsing (no server) ---------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, message", [
    ({"tools": "get_weather"}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "name must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [WEATHER["function"]]}, "functions", "use 'tools'"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format",
     "strict must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}},
     "response_format", "not"),
    ({"grammar": 5}, "grammar", "GBNF text"),
    ({"grammar": "root ::= undefined-rule"}, "grammar", "invalid grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", "not both"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"),
    ({"messages": [*ASK, {"role": "user", "content": "x", "tool_calls": []}]}, "messages", "assistant message"),
    ({"messages": [{"role": "tool", "content": "18 C", "tool_call_id": 7}]}, "messages", "tool_call_id must be a string"),
])
def test_malformed_fields_are_400s_naming_them(fields, param, message):
    with pytest.raises(APIError) as info:
        parse_chat(body(**fields), 1024)
    assert info.value.status == 400 and info.value.param == param
    assert re.search(message, info.value.message), info.value.message
    assert "\n" not in info.value.message


def test_tools_belong_to_chat_completions():
    with pytest.raises(APIError, match="chat/completions"):
        parse_completion({"prompt": "x", "tools": [WEATHER]}, 1024)


def test_fields_become_edgeinfer_types():
    req = parse_chat(body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                          parallel_tool_calls=False), 1024)
    assert req.tools.tools[0]["function"]["name"] == "get_weather" and req.tools.active
    assert req.tools.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert req.tools.parallel_tool_calls is False
    assert not parse_chat(body(tools=[WEATHER], tool_choice="none"), 1024).tools.active
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse_chat(body(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                                  "strict": True}}), 1024)
    assert req.options.json_schema == schema
    assert parse_chat(body(response_format={"type": "json_object"}), 1024).options.json_schema == {"type": "object"}
    assert parse_chat(body(grammar='root ::= "yes"'), 1024).options.grammar == 'root ::= "yes"'
    assert parse_chat(body(response_format={"type": "text"}), 1024).options.resolved_grammar() is None
    # a conversation with calls and results keeps their fields
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}]
    msgs = parse_chat({"messages": history, "tools": [WEATHER]}, 1024).messages
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "get_weather" and msgs[1]["content"] == ""
    assert msgs[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


def test_responses_carry_tool_calls():
    req = parse_chat(body(tools=[WEATHER]), 1024)
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    done = DoneEvent("", [1, 2], "tool_calls", GenerationStats(), tool_calls=(call,))
    out = Responder(req, "m", lambda t: b"x").complete([TokenEvent(1, ""), TokenEvent(2, "")], done)
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    # streamed: content deltas and tool-call deltas in order, the name and id once per call
    r = Responder(req, "m", lambda t: b"x")
    events = [TokenEvent(1, "Sure."), ToolCallEvent(0, "call_1", "get_weather"),
              ToolCallEvent(0, "call_1", "get_weather", '{"city"'), TokenEvent(2, ""),
              ToolCallEvent(0, "call_1", "get_weather", ': "Paris"}', call=call),
              ToolCallEvent(1, "call_2", "get_weather", "{}", call=ToolCall("call_2", "get_weather", "{}"))]
    deltas = [c["choices"][0]["delta"] for c in r.delta_chunks(events)]
    assert deltas == [
        {"content": "Sure."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}},
                        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                                      "arguments": "{}"}}]},
    ]
    assert r.last_chunks(done)[0]["choices"][0]["finish_reason"] == "tool_calls"


# -- the server, on the default model's F16 copy --------------------------------------------------

@pytest.fixture(scope="module")
def server(f16_path, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    s = Server(f16_path, tmp_path_factory.mktemp("serve-tools"), "--parallel", "2", "--ctx", "4096",
               "--max-tokens-limit", "512")
    yield s
    assert s.stop() == 0


def chat(client, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 48)
    kw.setdefault("model", MODEL_FILE)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(**kw)


@pytest.mark.slow
def test_bad_requests_are_400s_and_the_server_keeps_serving(server):
    import openai

    client = server.client()
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(5000)}}
    for kw in ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}}},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": big}}},
               {"extra_body": {"grammar": "root ::= ("}},
               {"extra_body": {"grammar": 'root ::= "a" root'}},  # matches no finite text
               {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}):
        with pytest.raises((openai.BadRequestError, openai.APIStatusError)) as info:
            chat(client, **kw)
        assert info.value.status_code in (400, 413)
    assert chat(client, max_tokens=4).choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_grammar_and_json_response_formats(server):
    client = server.client()
    yes_no = chat(client, messages=[{"role": "user", "content": "Is the sky blue?"}],
                  extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert yes_no.choices[0].message.content in ("yes", "no")
    obj = chat(client, messages=[{"role": "user", "content": "Give me a JSON object with the capital of France."}],
               response_format={"type": "json_object"}, max_tokens=200)
    assert obj.choices[0].finish_reason == "stop"  # (a reply cut by max_tokens is cut JSON)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population: int

    parsed = client.chat.completions.parse(model=MODEL_FILE, messages=[{"role": "user", "content": "Describe Paris."}],
                                           response_format=City, max_tokens=120, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, City)


@pytest.mark.slow
def test_tool_choice_none_and_a_conversation_with_results(server):
    client = server.client()
    none = chat(client, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    answer = chat(client, messages=history)
    assert answer.choices[0].message.content


def _streamed_calls(stream) -> tuple[dict[int, dict], str, str | None]:
    """The tool calls a stream's deltas add up to (as the openai client's helpers accumulate them)."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name  # the first delta of a call names it
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, content, reason


@pytest.mark.slow
def test_required_forces_a_call_streamed_and_not(server):
    """The default model would answer in prose; `required` makes it call, with arguments that
    parse and match the schema (needs the face's chat_tokens(tools=))."""
    client = server.client()
    prose = chat(client, tools=[WEATHER])
    assert prose.choices[0].message.tool_calls is None
    whole = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    calls, content, reason = _streamed_calls(chat(client, tools=[WEATHER], tool_choice="required",
                                                  parallel_tool_calls=False, stream=True))
    assert reason == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    # the client's own stream helper accumulates the same call
    with client.chat.completions.stream(model=MODEL_FILE, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=48, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
        "additionalProperties": False}}}
    named = chat(client, tools=[WEATHER, clock], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parallel_tool_calls=False)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"timezone"}


# -- the library face (the API the lead wires: Engine.chat(..., tools=, tool_choice=)) ------------

@pytest.mark.slow
def test_engine_chat_with_tools_yields_tool_call_events(default_engine):
    events = list(default_engine.chat(ASK, edgeinfer.GenerateOptions(
        max_tokens=48, sampling=edgeinfer.SamplingOptions(temperature=0)), tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "tool_calls"
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert calls[0].name == "get_weather" and calls[0].arguments == "" and calls[-1].call == done.tool_calls[0]
    assert "".join(e.arguments for e in calls) == done.tool_calls[0].arguments
    json.loads(done.tool_calls[0].arguments)


# -- the real Qwen2.5-Coder-1.5B ------------------------------------------------------------------

# qwen_server: the real 1.5B's server, shared with the other files that use it (tests/conftest.py)


WEATHER_REPORT = "14 degrees Celsius, light rain, wind 20 km/h"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen_weather_round_trip(qwen_server, stream):
    """The model calls get_weather with valid arguments, the result goes back, the answer uses it.
    (Qwen2.5-Coder-1.5B writes its call as a ```json block, which the Hermes format reads. Offered
    the tools again after the result it calls again, copying its template's `{{"name": …}}` example:
    the answer is asked for with tool_choice "none", as an agent does when it wants the reply.)"""
    client = qwen_server.client()
    first = dict(model=MODEL_FILE, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=128)
    if stream:
        calls, content, reason = _streamed_calls(client.chat.completions.create(stream=True, **first))
        assert reason == "tool_calls" and len(calls) == 1 and not content
        call = calls[0]
    else:
        choice = client.chat.completions.create(**first).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        c = choice.message.tool_calls[0]
        call = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_REPORT}]
    second = dict(model=MODEL_FILE, messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
                  max_tokens=128)
    if stream:
        calls, answer, reason = _streamed_calls(client.chat.completions.create(stream=True, **second))
        assert not calls
    else:
        choice = client.chat.completions.create(**second).choices[0]
        answer, reason = choice.message.content, choice.finish_reason
        assert choice.message.tool_calls is None
    assert reason == "stop" and "14" in answer and "rain" in answer.lower()


@pytest.mark.real
@pytest.mark.slow
def test_qwen_required_calls_and_none_never_does(qwen_server):
    client = qwen_server.client()
    code = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prose = client.chat.completions.create(model=MODEL_FILE, messages=code, tools=[WEATHER], temperature=0,
                                           max_tokens=64).choices[0]
    assert prose.message.tool_calls is None and "def " in prose.message.content  # a prompt that makes no call...
    forced = client.chat.completions.create(model=MODEL_FILE, messages=code, tools=[WEATHER], temperature=0,
                                            max_tokens=64, tool_choice="required").choices[0]
    assert forced.finish_reason == "tool_calls" and not forced.message.content  # ...calls when it must
    assert set(json.loads(forced.message.tool_calls[0].function.arguments)) == {"city"}
    none = client.chat.completions.create(model=MODEL_FILE, messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=96, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop" and none.message.content
    assert "<tool_call>" not in none.message.content and '"name"' not in none.message.content
