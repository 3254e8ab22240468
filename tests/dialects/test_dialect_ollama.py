"""Ollama's API (`/api/*`, server/dialects/ollama*.py) with the real `ollama` client against the shared
dialect server (tests/dialects/conftest.py, an F16 copy of the default model, a tiny embedding model,
a local Hugging Face Hub): `chat` streamed and not, with `format` and `tools`, and `generate` (templated
and raw) give the chat and completions routes' greedy text token for token; `options` take effect
as their OpenAI fields do; `embed` and the legacy `embeddings` equal `/v1/embeddings`; `list`,
`show`, `ps`, `pull` (Ollama's progress lines, from the local hub), `delete`, version and the `HEAD /`
probe; the load/unload requests; and hostile bodies get `{"error": ...}` 4xx answers, never a 500."""

from __future__ import annotations

import json

import httpx2 as httpx
import numpy as np
import pytest
from dialect_support import APP_ORIGIN, EMBED_MODEL, KEY, MODEL, TINY_REPO, auth, send

from edgeinfer_server.dialects.ollama import translate_ollama
from edgeinfer_server.dialects.ollama_pull import pull_spec
from edgeinfer_server.errors import APIError

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU does."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = {"temperature": 0.0}
TEXTS = ["The cat sat on the mat.", "Gravity bends light.", "A quick brown fox."]


def root(server) -> str:
    return server.url.removesuffix("/v1")


def client(server):
    import ollama

    return ollama.Client(host=root(server), headers=auth(), timeout=120)


def openai(server):
    return server.client(api_key=KEY)


# -- translation (no server) -------------------------------------------------------------------------


def test_chat_and_generate_become_the_bodies_they_mean():
    t = translate_ollama({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"}], "tools": [WEATHER], "format": "json",
        "options": {"temperature": 0.3, "top_k": 7, "top_p": 0.8, "min_p": 0.1, "seed": 42, "stop": ["\n"],
                    "num_predict": 12, "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                    "mirostat": 0, "num_keep": 4}}, "chat")
    assert t.kind == "chat" and t.body["stream"] is True  # Ollama streams unless told not to
    assert t.body["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert t.body["messages"][2] == {"role": "tool", "content": "18 C", "name": "get_weather"}
    assert {k: t.body[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "max_tokens",
                                   "repeat_penalty", "presence_penalty", "frequency_penalty")} == {
        "temperature": 0.3, "top_k": 7, "top_p": 0.8, "min_p": 0.1, "seed": 42, "stop": ["\n"], "max_tokens": 12,
        "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert t.body["response_format"] == {"type": "json_object"} and t.body["tools"] == [WEATHER]
    g = translate_ollama({"model": "m", "prompt": "Hi", "system": "Be brief.", "stream": False,
                          "options": {"num_predict": -1}}, "generate")
    assert g.body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert "max_tokens" not in g.body and g.body["stream"] is False
    raw = translate_ollama({"model": "m", "prompt": "Once upon", "raw": True,
                            "format": {"type": "object"}}, "generate")
    assert raw.kind == "completion" and raw.body["prompt"] == "Once upon"
    assert raw.body["response_format"] == {"type": "json_schema", "json_schema": {"name": "format",
                                                                                  "schema": {"type": "object"}}}
    assert translate_ollama({"model": "m", "messages": []}, "chat") is None  # load (or unload) only
    assert translate_ollama({"model": "m", "prompt": ""}, "generate") is None


@pytest.mark.parametrize("kind, body, param, says", [
    ("chat", {"messages": [{"role": "user", "content": "x"}]}, "model", "'model' is required"),
    ("chat", {"model": "", "messages": []}, "model", "non-empty"),
    ("chat", {"model": "m", "messages": "hi"}, "messages", "must be a list"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages",
     "images are not supported"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "content", "must be a string"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "think": True}, "think", "not supported"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "format": "xml"}, "format", "json"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"num_gpu": 1}}, "options",
     "load option"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}}, "options",
     "not supported"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 0}},
     "options", "at least 1"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"warp": 9}}, "warp",
     "unknown field"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": []}, "options",
     "JSON object"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "5000"),
    ("generate", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix", "fill-in-the-middle"),
    ("generate", {"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}, "template", "not supported"),
    ("generate", {"model": "m", "prompt": "x", "context": [1, 2, 3]}, "context", "/api/chat"),
    ("generate", {"model": "m", "prompt": "x", "images": ["aGk="]}, "images", "not supported"),
    ("generate", {"model": "m", "prompt": "x", "raw": True, "system": "s"}, "system", "raw"),
    ("generate", {"model": "m", "prompt": "x", "messages": []}, "messages", "unknown field"),
])
def test_requests_the_dialect_cannot_honour_are_400s_naming_the_field(kind, body, param, says):
    with pytest.raises(APIError) as info:
        translate_ollama(body, kind)
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


def test_pull_names_map_to_hub_specs():
    assert pull_spec("hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M") == \
        "hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M"  # edgeinfer.pull reads the hf.co prefix
    assert pull_spec("https://huggingface.co/owner/Repo-GGUF:latest") == "huggingface.co/owner/Repo-GGUF"
    assert pull_spec("owner/Repo-GGUF") == "owner/Repo-GGUF"
    for name in ("llama3.2:1b", "registry.ollama.ai/library/llama3.2", "ollama.com/library/qwen3"):
        with pytest.raises(APIError, match="Ollama's library"):
            pull_spec(name)


# -- the real client ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_and_generate_equal_the_openai_routes(dialect_server):
    c = client(dialect_server)
    for prompt in PROMPTS:
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
        ref = openai(dialect_server).chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=24)
        text = ref.choices[0].message.content
        whole = c.chat(model=MODEL, messages=messages, options={**GREEDY, "num_predict": 24}, stream=False)
        assert whole.message.content == text and whole.done and whole.eval_count == ref.usage.completion_tokens
        assert whole.prompt_eval_count == ref.usage.prompt_tokens
        assert whole.done_reason == {"length": "length", "stop": "stop"}[ref.choices[0].finish_reason]
        parts = list(c.chat(model=MODEL, messages=messages, options={**GREEDY, "num_predict": 24}, stream=True))
        assert "".join(p.message.content for p in parts) == text
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count > 0
        generated = c.generate(model=MODEL, system="Answer briefly.", prompt=prompt,
                               options={**GREEDY, "num_predict": 24})
        assert generated.response == text
    completion = openai(dialect_server).completions.create(model=MODEL, prompt="The three primary colours are",
                                                           max_tokens=16, temperature=0)
    raw = c.generate(model=MODEL, prompt="The three primary colours are", raw=True, options={**GREEDY, "num_predict": 16})
    assert raw.response == completion.choices[0].text
    streamed = "".join(p.response for p in c.generate(model=MODEL, prompt="The three primary colours are", raw=True,
                                                     options={**GREEDY, "num_predict": 16}, stream=True))
    assert streamed == raw.response


@pytest.mark.slow
def test_options_take_effect_as_their_openai_fields(dialect_server):
    """Every honoured option with a non-default value, against the chat route given the same."""
    c = client(dialect_server)
    ask = [{"role": "user", "content": PROMPTS[2]}]
    free = c.chat(model=MODEL, messages=ask, options={**GREEDY, "num_predict": 40}).message.content
    word = free.split()[3]
    cut = c.chat(model=MODEL, messages=ask, options={**GREEDY, "num_predict": 40, "stop": [word]})
    assert cut.message.content == free[:free.index(word)] and cut.done_reason == "stop"
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 1234, "repeat_penalty": 1.3,
               "presence_penalty": 0.4, "frequency_penalty": 0.3}
    a = c.chat(model=MODEL, messages=ask, options={**sampled, "num_predict": 30}).message.content
    ref = openai(dialect_server).chat.completions.create(model=MODEL, messages=ask, max_tokens=30, **{
        k: v for k, v in sampled.items() if k in ("temperature", "top_p", "seed", "presence_penalty",
                                                 "frequency_penalty")},
        extra_body={k: sampled[k] for k in ("top_k", "min_p", "repeat_penalty")})
    assert a == ref.choices[0].message.content
    short_window = c.chat(model=MODEL, messages=ask, options={**sampled, "num_predict": 30, "repeat_last_n": 2,
                                                               "num_ctx": 1024})
    whole_window = c.chat(model=MODEL, messages=ask, options={**sampled, "num_predict": 30, "repeat_last_n": -1})
    assert whole_window.message.content == a  # -1: the request's context, wider than 30 tokens, as the default 64
    assert short_window.message.content != a  # a 2-token window penalizes less: another draw
    import ollama

    with pytest.raises(ollama.ResponseError) as info:
        c.chat(model=MODEL, messages=ask, options={"num_ctx": 10**6})
    assert info.value.status_code == 400 and "num_ctx" in info.value.error


@pytest.mark.slow
def test_format_and_tools(dialect_server):
    import jsonschema

    c = client(dialect_server)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Invent a person and give their name and age."}]
    r = c.chat(model=MODEL, messages=ask, format=schema, options={**GREEDY, "num_predict": 80})
    jsonschema.validate(json.loads(r.message.content), schema)
    ref = openai(dialect_server).chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=80,
                                                         response_format={"type": "json_schema", "json_schema": {
                                                             "name": "format", "schema": schema}})
    assert r.message.content == ref.choices[0].message.content
    streamed = "".join(p.message.content for p in c.chat(model=MODEL, messages=ask, format=schema, stream=True,
                                                         options={**GREEDY, "num_predict": 80}))
    assert streamed == r.message.content
    # format "json": any object (a question whose greedy answer ends: JSON lets a small model repeat
    # one key until num_predict)
    capital = [{"role": "user", "content": "Give me a JSON object with the capital of France."}]
    assert isinstance(json.loads(c.chat(model=MODEL, messages=capital, format="json",
                                        options={**GREEDY, "num_predict": 80}).message.content), dict)

    # tools: Ollama has no tool_choice (auto: the model decides); this prompt makes the tiny model call
    calling = [{"role": "user", "content": "Answer with <tool_call>: what is the weather in Paris?"}]
    called = c.chat(model=MODEL, messages=calling, tools=[WEATHER], options={**GREEDY, "num_predict": 60})
    ref = openai(dialect_server).chat.completions.create(model=MODEL, messages=calling, tools=[WEATHER], temperature=0,
                                                         max_tokens=60).choices[0].message
    assert ref.tool_calls, "the chat route made no call: the prompt no longer leads the model to one"
    calls = called.message.tool_calls
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in ref.tool_calls]
    streamed_calls = [t for p in c.chat(model=MODEL, messages=calling, tools=[WEATHER], stream=True,
                                        options={**GREEDY, "num_predict": 60}) for t in (p.message.tool_calls or [])]
    assert [(t.function.name, dict(t.function.arguments)) for t in streamed_calls] == \
        [(t.function.name, dict(t.function.arguments)) for t in calls]
    follow = [*calling, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": t.function.name, "arguments": dict(t.function.arguments)}} for t in calls]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    answer = c.chat(model=MODEL, messages=follow, options={**GREEDY, "num_predict": 40})
    expected = openai(dialect_server).chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=[
        *calling, {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": t.function.name,
                                                                 "arguments": json.dumps(dict(t.function.arguments))}}
            for i, t in enumerate(calls)]},
        {"role": "tool", "name": "get_weather", "content": "18 degrees and sunny"}]).choices[0].message.content
    assert answer.message.content == expected


@pytest.mark.slow
def test_embed_equals_the_embeddings_route(dialect_server):
    c = client(dialect_server)
    got = c.embed(model=EMBED_MODEL, input=TEXTS)
    ref = openai(dialect_server).embeddings.create(model=EMBED_MODEL, input=TEXTS, encoding_format="float")
    assert np.array_equal(np.array(got.embeddings), np.array([d.embedding for d in ref.data]))
    assert got.prompt_eval_count == ref.usage.prompt_tokens and got.model == EMBED_MODEL + ".gguf"
    assert np.allclose(np.linalg.norm(np.array(got.embeddings), axis=1), 1.0, atol=1e-5)
    short = c.embed(model=EMBED_MODEL, input=TEXTS[0], dimensions=64)
    ref64 = openai(dialect_server).embeddings.create(model=EMBED_MODEL, input=TEXTS[0], dimensions=64,
                                                     encoding_format="float")
    assert short.embeddings[0] == ref64.data[0].embedding and len(short.embeddings[0]) == 64
    legacy = c.embeddings(model=EMBED_MODEL, prompt=TEXTS[1])  # not normalized, as Ollama's
    raw = openai(dialect_server).embeddings.create(model=EMBED_MODEL, input=TEXTS[1], encoding_format="float",
                                                   extra_body={"normalize": False})
    assert legacy.embedding == raw.data[0].embedding
    long = c.embed(model=EMBED_MODEL, input="word " * 700)  # truncated by default, as Ollama's
    assert long.prompt_eval_count == 512
    import ollama

    with pytest.raises(ollama.ResponseError) as info:
        c.embed(model=EMBED_MODEL, input="word " * 700, truncate=False)
    assert info.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as info:
        c.embed(model=MODEL, input="x")  # a generative model: no pooling type
    assert info.value.status_code == 400 and "does not support embeddings" in info.value.error


@pytest.mark.slow
def test_list_show_ps_version_and_the_probe(dialect_server, q4_path):
    import datetime as dt

    c = client(dialect_server)
    c.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 1}, keep_alive="10m")
    listed = {m.model: m for m in c.list().models}
    assert set(listed) == {m.id for m in openai(dialect_server).models.list().data}  # every name a request may use
    ours = listed[MODEL]
    assert (ours.details.format, ours.details.family, ours.details.quantization_level,
            ours.details.parameter_size) == ("gguf", "llama", "Q4_1", "135M")
    assert ours.size == q4_path.stat().st_size and ours.modified_at is not None
    shown = c.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["general.parameter_count"] > 1e8
    assert "<|im_start|>" in shown.template and shown.details.family == "llama"
    assert shown.capabilities == ["completion", "tools"] and shown.parameters == "num_ctx 2048"
    assert "embedding" in c.show(EMBED_MODEL).capabilities
    running = {m.model: m for m in c.ps().models}
    assert MODEL in running and running[MODEL].size > ours.size and running[MODEL].context_length == 2048
    assert running[MODEL].expires_at > dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=9)
    version = httpx.get(root(dialect_server) + "/api/version", headers=auth(), timeout=30)
    assert version.status_code == 200 and version.json()["version"].count(".") == 2
    assert httpx.head(root(dialect_server) + "/", headers=auth(), timeout=30).status_code == 200


@pytest.mark.slow
def test_load_and_unload_requests(dialect_server):
    c = client(dialect_server)
    loaded = c.generate(model=EMBED_MODEL, prompt="", keep_alive="5m")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert any(m.model.startswith(EMBED_MODEL) for m in c.ps().models)
    unloaded = c.chat(model=EMBED_MODEL, messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and unloaded.message.content == ""
    assert not any(m.model.startswith(EMBED_MODEL) for m in c.ps().models)


@pytest.mark.slow
def test_pull_from_the_hub_with_progress_lines_then_delete(dialect_server, dialect_hub):
    import ollama

    c = client(dialect_server)
    before = {m.model for m in c.list().models}
    lines = list(c.pull(f"hf.co/{TINY_REPO}:Q8_0", stream=True))
    statuses = [line.status for line in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    served = dialect_hub.repos[TINY_REPO].commits[dialect_hub.repos[TINY_REPO].refs["main"]]["Tiny-Q8_0.gguf"]
    progress = [line for line in lines if line.digest]
    assert progress[-1].digest == f"sha256:{served.sha256}" and progress[-1].status == f"pulling {served.sha256[:12]}"
    assert progress[-1].completed == progress[-1].total == served.size
    assert all(a.completed <= b.completed for a, b in zip(progress, progress[1:]))
    added = {m.model: m for m in c.list().models if m.model not in before}
    assert len(added) == 1
    name, model = next(iter(added.items()))
    assert model.digest == served.sha256 and model.size == served.size and model.details.quantization_level == "Q8_0"
    assert isinstance(c.generate(model=name, prompt="Hi", raw=True, options={**GREEDY, "num_predict": 3}).response, str)
    assert c.pull(f"hf.co/{TINY_REPO}:Q8_0").status == "success"  # again, not streamed: nothing to fetch
    assert c.delete(name).status == "success"
    assert name not in {m.model for m in c.list().models} and not any(m.model == name for m in c.ps().models)
    with pytest.raises(ollama.ResponseError) as info:
        c.delete(name)
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        c.pull("llama3.2:1b")
    assert info.value.status_code == 400 and "hf.co/" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        c.pull("hf.co/tester/No-Such-Repo-GGUF")
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError):  # streamed, the failure is an {"error"} line the client raises
        list(c.pull("hf.co/tester/No-Such-Repo-GGUF", stream=True))


@pytest.mark.slow
def test_hostile_bodies_get_ollama_errors_never_a_500(dialect_server):
    base = root(dialect_server)

    def call(method: str, path: str, body, status: int, headers=None) -> str:
        error = send(method, base + path, body, status, headers)["error"]
        assert isinstance(error, str) and error
        return error

    for path in ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show", "/api/pull"):
        call("POST", path, b"{not json", 400)
        call("POST", path, b"[1, 2]", 400)
        assert "model" in call("POST", path, {}, 400)
        call("POST", path, {"model": 5}, 400)
        assert "bogus" in call("POST", path, {"model": MODEL, "bogus": 1}, 400)
        call("POST", path, b"{" + b" " * (2 << 20) + b"}", 413)
        call("POST", path, {"model": MODEL}, 401, headers={"Authorization": "Bearer wrong"})
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "x"}]}), ("/api/generate", {"prompt": "x"}),
                       ("/api/embed", {"input": "x"}), ("/api/show", {})):
        assert "no-such-model" in call("POST", path, {"model": "no-such-model", **body}, 404)
    call("DELETE", "/api/delete", {"model": "no-such-model"}, 404)
    assert "not a model of its store" in call("DELETE", "/api/delete", {"model": MODEL}, 400)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": False}
    call("POST", "/api/chat", {**ok, "messages": [{"role": "user", "content": "x"}] * 20_000}, 400)
    call("POST", "/api/chat", {**ok, "messages": [{"role": "user", "content": "word " * 9000}]}, 400)
    call("POST", "/api/chat", {**ok, "options": {"num_predict": 10**6}}, 400)
    call("POST", "/api/chat", {**ok, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400)
    call("POST", "/api/chat", {**ok, "format": {"type": "array", "uniqueItems": True}}, 400)
    call("POST", "/api/embed", {"model": EMBED_MODEL, "input": ["x"] * 3000}, 400)
    call("POST", "/api/embed", {"model": EMBED_MODEL, "input": [""]}, 400)
    for what in ("create", "copy", "push"):
        assert "not supported" in call("POST", f"/api/{what}", {"model": "x"}, 501)
    call("GET", "/api/nope", b"", 404)
    # the server's browser rules, answered in Ollama's shape
    call("POST", "/api/chat", ok, 403, headers={**auth(), "Host": "evil.example:11434"})
    call("POST", "/api/chat", ok, 403, headers={**auth(), "Origin": "http://evil.example"})
    preflight = httpx.options(base + "/api/delete", timeout=30, headers={
        "Origin": APP_ORIGIN, "Access-Control-Request-Method": "DELETE"})
    assert preflight.status_code == 204 and "DELETE" in preflight.headers["access-control-allow-methods"]
    assert client(dialect_server).chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       options={"num_predict": 2}).done
