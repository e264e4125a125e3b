"""Requests mean what they say: every field of OpenAI's chat-completions and completions requests takes
effect, is accepted without effect, or is refused with a 400 naming it, and what takes effect reaches
the engine as the engine's parameters (serve_app.config.SamplingParams).

Runs without Ray: the real FastAPI app of the ingress (routing, validation, error handlers, SSE)
through Starlette's TestClient and the real openai client on top of it, with a scripted Router that
records each request's engine parameters and answers with given text. The same field walk through
the live service: tests/test_serve.py. Tool-calling logic as pure functions: the end of this file.
"""

import json
import typing
from types import SimpleNamespace

import pytest
import ray.serve
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from conftest import CHAT_TEMPLATE, make_tokenizer
from deployments import openai_fields
from serve_app import tools as toolcalls
from serve_app.config import SamplingParams
from serve_app.prompts import encode_chat

MODEL = "m"
USER = [{"role": "user", "content": "the cat"}]

# A value per refused field that asks for something this server does not do, and values that ask
# for nothing (accepted). tests/test_serve.py walks the same tables through the live service.
REFUSED_SAMPLES = {
    "audio": ({"voice": "alloy", "format": "wav"}, [None]),
    "modalities": (["text", "audio"], [None, ["text"]]),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], [None, []]),
    "function_call": ({"name": "f"}, [None, "none", "auto"]),
    "reasoning_effort": ("high", [None, "none"]),
    "verbosity": ("low", [None, "medium"]),
    "web_search_options": ({}, [None]),
    "moderation": ({"model": "omni-moderation-latest"}, [None]),
    "suffix": ("the end", [None, ""]),
    "best_of": (3, [None, 1]),
    "use_beam_search": (True, [None, False]),
    "spaces_between_special_tokens": (False, [None, True]),
}
NO_EFFECT_SAMPLES = {
    "user": "user-1", "safety_identifier": "hashed-7", "metadata": {"team": "a"}, "store": True,
    "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "prompt_cache_retention": "24h", "length_penalty": 0.8,
}


def openai_request_keys(module) -> set[str]:
    """Every key of the openai package's request TypedDicts for one endpoint, streaming or not."""
    keys = set()
    for cls in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming):
        for klass in cls.__mro__:
            keys |= set(getattr(klass, "__annotations__", {}))
        keys |= set(typing.get_type_hints(cls))
    return keys


ENDPOINTS = {"chat": ("/v1/chat/completions", chat_params), "completions": ("/v1/completions", completion_params)}


def base(endpoint: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"messages": USER} if endpoint == "chat" else {"prompt": "the cat"})
    return body | fields


# ---- a scripted Router and the ingress's app -----------------------------------------------------------

class Events:
    def __init__(self, events):
        self.events = events

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        pass


class ScriptedRouter:
    """The Router as the ingress sees it: records (prompt ids, params) of each request, checks the
    params against the engine's SamplingParams, and answers with `pieces` of text, one token each."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], dict]] = []
        self.pieces, self.reason = [" sat", " on"], "stop"

    def options(self, stream):
        return SimpleNamespace(generate=SimpleNamespace(remote=self.remote))

    def remote(self, ids, params, rid, stream, resume=None):
        self.calls.append((list(ids), params))
        SamplingParams(**params)  # what the Router does first: the params must be the engine's
        tid = self.tokenizer.convert_tokens_to_ids("cat")
        events = [{"text": piece, "token_ids": [tid], "finished": False, "finish_reason": None} for piece in self.pieces]
        events[-1].update(finished=True, finish_reason=self.reason)
        if params["logprobs"] is not None:
            for ev in events:
                ev["logprobs"] = [(-0.5, [(tid, -0.5)] * params["logprobs"])]
        if params.get("prompt_logprobs") is not None:
            events[0]["prompt_logprobs"] = [None] + [(-1.0, [(t, -1.0)] * params["prompt_logprobs"]) for t in ids[1:]]
        if not stream:  # the Router sends one final event with everything
            whole = dict(events[-1], text="".join(e["text"] for e in events), token_ids=[tid] * len(events))
            for key in ("logprobs", "prompt_logprobs"):
                if key in events[0]:
                    whole[key] = events[0][key] if key == "prompt_logprobs" else [lp for e in events for lp in e[key]]
            events = [whole]
        return Events(events)

    @property
    def params(self) -> dict:
        return self.calls[-1][1]


TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}it is {{ t['function']['name'] }} {% endfor %}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
    "{% for c in m.get('tool_calls') or [] %}to {{ c['function']['name'] }} {% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
"""A chat template that renders tools and earlier calls, in the tiny tokenizer's words."""


def make_api(monkeypatch, template: str = CHAT_TEMPLATE):
    from deployments.ingress import OpenAIIngress, app

    class Ingress(OpenAIIngress.func_or_class):
        def __del__(self):  # Serve's ASGI wrapper has an async __del__ (app shutdown); no app here
            pass

    tokenizer = make_tokenizer()
    tokenizer.chat_template = template
    router = ScriptedRouter(tokenizer)
    ing = object.__new__(Ingress)
    ing.routers, ing.in_flight, ing.replicas, ing.down, ing._watcher = {"A": router}, {"A": 0}, {"A": 1}, set(), None
    ing.model_name, ing.max_tokens_limit, ing.max_stop_strings = MODEL, 100, 4
    ing.draining, ing.max_resubmits, ing.resubmit_wait_s = False, 2, 5.0
    ing.tokenizer, ing.api_key = tokenizer, None
    # Serve's class-based routes find their instance through the replica context
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ing))
    http = TestClient(app)
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    return SimpleNamespace(http=http, router=router, tokenizer=tokenizer, client=client)


@pytest.fixture
def api(monkeypatch):
    return make_api(monkeypatch)


@pytest.fixture
def tool_api(monkeypatch):
    return make_api(monkeypatch, TOOLS_TEMPLATE)


def refusal(r, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param.split(".")[0] in err["message"]
    return err["message"]


# ---- 1. no silent ignores -------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_openai_field_is_handled_accepted_without_effect_or_refused(endpoint):
    keys = openai_request_keys(ENDPOINTS[endpoint][1])
    handled, no_effect, refused = (openai_fields.HANDLED[endpoint], set(openai_fields.NO_EFFECT[endpoint]),
                                   set(openai_fields.REFUSED[endpoint]))
    assert len(keys) > 15 and "stream" in keys and "model" in keys
    assert not (handled & no_effect or handled & refused or no_effect & refused)
    assert keys - handled - no_effect - refused == set(), "fields of the openai package's schema nobody sorted"
    # the tables name nothing the schema lacks (a field OpenAI dropped is taken out of them too)
    assert (handled | no_effect | refused) - keys == set()
    assert not openai_fields.VLLM_HANDLED & set(openai_fields.VLLM_REFUSED)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_request_models_declare_exactly_the_fields_of_the_tables(endpoint):
    from deployments.ingress import ChatRequest, CompletionRequest

    model = ChatRequest if endpoint == "chat" else CompletionRequest
    assert set(model.model_fields) == openai_fields.fields(endpoint)
    assert model.model_config["extra"] == "forbid"
    samples = set(REFUSED_SAMPLES) & set(openai_fields.refused(endpoint))
    assert samples == set(openai_fields.refused(endpoint)), "a refused field without a sample value here"
    assert set(openai_fields.no_effect(endpoint)) <= set(NO_EFFECT_SAMPLES)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_refused_fields_get_a_400_naming_them_unless_they_ask_for_nothing(api, endpoint):
    path = ENDPOINTS[endpoint][0]
    for name, rule in openai_fields.refused(endpoint).items():
        asks, nothing = REFUSED_SAMPLES[name]
        message = refusal(api.http.post(path, json=base(endpoint, **{name: asks})), name)
        assert rule.accepts in message
        for value in nothing:
            r = api.http.post(path, json=base(endpoint, **{name: value}))
            assert r.status_code == 200, (name, value, r.text)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fields_without_effect_are_accepted_and_change_nothing_the_engine_sees(api, endpoint):
    path = ENDPOINTS[endpoint][0]
    assert api.http.post(path, json=base(endpoint)).status_code == 200
    plain = api.router.calls[-1]
    for name in openai_fields.no_effect(endpoint):
        r = api.http.post(path, json=base(endpoint, **{name: NO_EFFECT_SAMPLES[name]}))
        assert r.status_code == 200, (name, r.text)
        assert api.router.calls[-1] == plain, name


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", base("completions", frequency_penallty=0.5), "frequency_penallty"),
    ("/v1/chat/completions", base("chat", guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
    ("/v1/completions", base("completions", max_completion_tokens=3), "max_completion_tokens"),
    ("/v1/chat/completions", base("chat", echo=True), "echo"),
    ("/v1/chat/completions", base("chat", messages=[{"role": "user", "content": "a", "colour": "red"}]), "messages.0.colour"),
    ("/v1/chat/completions", base("chat", stream=True, stream_options={"include_usage": True, "continuous": True}),
     "stream_options.continuous"),
    ("/v1/completions", base("completions", structured_outputs={"regex": "a", "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern"),
])
def test_unknown_fields_get_a_400_naming_them(api, path, body, param):
    message = refusal(api.http.post(path, json=body), param)
    assert message.startswith(f"unknown field '{param}'")
    assert not api.router.calls  # nothing reached the engine


def test_null_means_the_default_as_in_openai(api):
    r = api.http.post("/v1/chat/completions", json=base("chat", temperature=None, top_p=None, n=None, stream=None,
                                                         frequency_penalty=None, logit_bias=None, top_k=None))
    assert r.status_code == 200, r.text
    assert api.router.params["temperature"] == 1.0 and api.router.params["top_k"] == 0
    assert refusal(api.http.post("/v1/completions", json=base("completions", model=None)), "model")


def test_unknown_endpoints_and_methods_are_invalid_request_errors(api):
    for r, status in [(api.http.post("/v1/nothing", json={}), 404), (api.http.get("/v1/chat/completions"), 405),
                      (api.http.get("/nowhere"), 404)]:
        assert r.status_code == status
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] in ("not_found", "method_not_allowed")


# ---- 2. sampling controls reach the engine ----------------------------------------------------------------

def test_sampling_controls_map_into_the_engine_params(api):
    r = api.http.post("/v1/completions", json=base(
        "completions", logit_bias={"7": 100, "8": -100.0, "9": 2.5}, frequency_penalty=0.5, presence_penalty=-1,
        seed=11, stop=["mat"], top_k=5, min_tokens=2, ignore_eos=True, stop_token_ids=[3], repetition_penalty=1.2,
        bad_words=["dog"], temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=8))
    assert r.status_code == 200, r.text
    p = api.router.params
    assert p["logit_bias"] == {7: 100.0, 8: -100.0, 9: 2.5}
    assert (p["frequency_penalty"], p["presence_penalty"], p["repetition_penalty"]) == (0.5, -1.0, 1.2)
    assert (p["seed"], p["stop"], p["top_k"], p["temperature"], p["top_p"]) == (11, ["mat"], 5, 0.7, 0.9)
    assert (p["min_tokens"], p["ignore_eos"], p["stop_token_ids"], p["bad_words"]) == (2, True, [3], ["dog"])
    assert p["min_p"] == 0.05
    # a plain request's params are what they were before these controls existed
    api.http.post("/v1/completions", json=base("completions"))
    assert set(api.router.params) == {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs"}


def test_the_openai_client_sends_controls_and_vllm_extras(api):
    api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, logit_bias={"5": -100},
                                       presence_penalty=0.3, extra_body={"top_k": 3, "min_tokens": 1})
    p = api.router.params
    assert p["logit_bias"] == {5: -100.0} and p["presence_penalty"] == 0.3 and p["top_k"] == 3 and p["min_tokens"] == 1


@pytest.mark.parametrize("fields, param, message", [
    ({"logit_bias": {"99999": 1}}, "logit_bias", "not a token id in the vocabulary"),
    ({"logit_bias": {"cat": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "outside [-100, 100]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
    ({"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "more than max_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "ids must be in"),
    ({"bad_words": [""]}, "bad_words", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint per request"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"echo": True, "suffix": "x"}, "suffix", "insertion"),
    ({"best_of": 2}, "best_of", "null or equal to n"),
])
def test_bad_controls_get_a_400_naming_the_field(api, fields, param, message):
    assert message in refusal(api.http.post("/v1/completions", json=base("completions", **fields)), param)
    assert not api.router.calls


def test_best_of_equal_to_n_is_accepted(api):
    r = api.http.post("/v1/completions", json=base("completions", n=2, best_of=2, seed=1))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# ---- 3. structured outputs --------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("fields, structured", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True,
                                                                 "description": "where"}}},
     {"json_schema": {**SCHEMA, "additionalProperties": False}}),  # strict: objects allow only their properties
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}}, {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}}, {"json_schema": {}}),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"choice": ["a"]}}, {"choice": ["a"]}),
])
def test_structured_outputs_reach_the_engine(api, fields, structured):
    r = api.http.post("/v1/chat/completions", json=base("chat", **fields))
    assert r.status_code == 200, r.text
    assert api.router.params["structured"] == structured


def test_response_format_text_is_no_constraint_and_the_client_sends_json_schema(api):
    api.http.post("/v1/chat/completions", json=base("chat", response_format={"type": "text"}))
    assert "structured" not in api.router.params
    api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    assert api.router.params["structured"] == {"json_schema": toolcalls.closed(SCHEMA)}


@pytest.mark.parametrize("fmt, message", [
    ({"type": "xml"}, "{'type': 'text'}"),
    ({"type": "json_object", "schema": {}}, "takes no other field"),
    ({"type": "json_schema"}, "takes one more field"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name: required"),
    ({"type": "json_schema", "json_schema": {"name": "a b"}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}, "unknown field 'extra'"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "'strict' is a boolean"),
])
def test_bad_response_format_gets_a_400_naming_it(api, fmt, message):
    assert message in refusal(api.http.post("/v1/chat/completions", json=base("chat", response_format=fmt)), "response_format")


def test_an_engine_refusal_of_a_schema_is_a_400(api):
    def refuse(ids, params, rid, stream, resume=None):
        return Events([{"error": "structured.json_schema: unsupported keyword", "status": 400}])

    api.router.remote = refuse
    r = api.http.post("/v1/chat/completions", json=base("chat", response_format={"type": "json_object"}))
    assert r.status_code == 400 and "unsupported keyword" in r.json()["error"]["message"]


# ---- 4. tools ---------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def test_a_named_function_is_forced_and_answered_as_a_tool_call(api):
    api.router.pieces = ['{"city": ', '"Paris"}']
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert api.router.params["structured"] == {"json_schema": toolcalls.closed(SCHEMA)}
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_named_function_streams_in_openais_tool_call_deltas(api):
    api.router.pieces = ['{"city": ', '"Paris"}']
    chunks = list(api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, tools=[WEATHER],
                                                     tool_choice=NAMED, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    head = calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "weather" and head.function.arguments == ""
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert "".join(tc.function.arguments for tc in calls) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


def test_a_forced_call_cut_short_keeps_finish_reason_length(api):
    api.router.pieces, api.router.reason = ['{"city": "Pa'], "length"
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[WEATHER], tool_choice=NAMED)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Pa'


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_a_list_of_calls_and_returns_each(api, parallel):
    api.router.pieces = ['[{"name": "weather", "parameters": {"city": "Oslo"}}, ',
                         '{"name": "time", "parameters": {"zone": "CET"}}]']
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=parallel)
    schema = api.router.params["structured"]["json_schema"]
    assert schema == toolcalls.required_schema(toolcalls.Choice("required", tuple(toolcalls.check_tools([WEATHER, TIME])), parallel))
    assert schema["type"] == "array" and schema["minItems"] == 1 and ("maxItems" in schema) != parallel
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("weather", {"city": "Oslo"}), ("time", {"zone": "CET"})]
    assert r.choices[0].finish_reason == "tool_calls" and len({c.id for c in calls}) == 2
    chunks = list(api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, tools=[WEATHER, TIME],
                                                     tool_choice="required", stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.id] == ["weather", "time"] and [d.index for d in deltas if d.id] == [0, 1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_needs_a_template_that_renders_tools(api):
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        assert "does not render tools" in refusal(api.http.post("/v1/chat/completions", json=base("chat", **fields)), "tool_choice")
    # none: no call can be made, so nothing to render and nothing to parse
    api.router.pieces = ['<tool_call>{"name": "weather", "arguments": {"city": "x"}}</tool_call>']
    r = api.http.post("/v1/chat/completions", json=base("chat", tools=[WEATHER], tool_choice="none"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == api.router.pieces[0]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in r.json()["choices"][0]["message"]


def test_auto_renders_tools_and_reads_calls_from_the_text(tool_api):
    api = tool_api
    api.router.pieces = ["the cat ", '<tool_call>{"name": "weather", ', '"arguments": {"city": "Rome"}}</tool_call>']
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, tools=[WEATHER])
    prompt = api.tokenizer.decode(api.router.calls[-1][0])
    assert prompt.startswith("it is ") and "structured" not in api.router.params  # the tool, rendered ("weather": <unk>)
    message = r.choices[0].message
    assert message.content == "the cat" and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("weather", {"city": "Rome"})]
    chunks = list(api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, tools=[WEATHER], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "the cat"
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "weather" and json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Rome"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # an answer without calls is plain text, and "none" renders no tools
    api.router.pieces = ["just", " text"]
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "just text" and r.choices[0].message.tool_calls is None
    assert not api.tokenizer.decode(api.router.calls[-1][0]).startswith("it is")


def test_tool_history_reaches_a_template_that_renders_tools(tool_api):
    api = tool_api
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "dog", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "red"}]
    r = api.client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == " sat on"
    assert "to dog" in api.tokenizer.decode(api.router.calls[-1][0])  # the template rendered the earlier call


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "declared twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "a JSON schema object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no function named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice",
     "one output constraint per request"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id is required"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{"}}]}]},
     "messages", "not valid JSON"),
])
def test_bad_tools_get_a_400_naming_the_field(api, fields, param, message):
    assert message in refusal(api.http.post("/v1/chat/completions", json=base("chat", **fields)), param)


def test_allowed_tools_narrow_the_choice(api):
    api.router.pieces = ['[{"name": "time", "parameters": {}}]']
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "time"}}]}}
    r = api.http.post("/v1/chat/completions", json=base("chat", tools=[WEATHER, TIME], tool_choice=choice))
    assert r.status_code == 200, r.text
    assert api.router.params["structured"]["json_schema"]["items"]["properties"]["name"] == {"type": "string", "enum": ["time"]}


def test_auto_with_an_output_constraint_is_refused(tool_api):
    r = tool_api.http.post("/v1/chat/completions", json=base("chat", tools=[WEATHER], response_format={"type": "json_object"}))
    assert "no room for tool calls" in refusal(r, "response_format")


# ---- 5. completions echo ------------------------------------------------------------------------------------

def test_echo_puts_the_prompt_before_each_choice(api):
    r = api.client.completions.create(model=MODEL, prompt=["the cat", "a dog"], max_tokens=2, echo=True, n=2, seed=3)
    texts = sorted(c.text for c in r.choices)
    assert texts == ["a dog sat on"] * 2 + ["the cat sat on"] * 2
    assert "prompt_logprobs" not in api.router.params  # no logprobs asked: none computed
    ids = api.tokenizer.encode("the cat")
    r = api.client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text == api.tokenizer.decode(ids) + " sat on"
    chunks = list(api.client.completions.create(model=MODEL, prompt="the cat", max_tokens=2, echo=True, stream=True))
    assert chunks[0].choices[0].text == "the cat" and "".join(c.choices[0].text for c in chunks) == "the cat sat on"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompt_tokens_first(api, stream):
    prompt = "the cat sat"
    r = api.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1, stream=stream)
    assert api.router.params["prompt_logprobs"] == 1 and api.router.params["logprobs"] == 1
    if stream:
        chunks = [c.choices[0] for c in r if c.choices[0].logprobs]
        lp = {k: [x for c in chunks for x in getattr(c.logprobs, k)] for k in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
        text = "".join(c.text for c in chunks)
    else:
        lp, text = r.choices[0].logprobs.model_dump(), r.choices[0].text
    n_prompt = len(api.tokenizer.encode(prompt))
    assert text == prompt + " sat on"
    assert len(lp["tokens"]) == n_prompt + 2 and lp["tokens"][:n_prompt] == ["the", "cat", "sat"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token has none
    assert lp["token_logprobs"][1:n_prompt] == [-1.0] * (n_prompt - 1) and lp["token_logprobs"][n_prompt:] == [-0.5, -0.5]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[n_prompt] == len(prompt)


def test_echo_with_logprobs_needs_the_engine_to_return_them(api):
    real = api.router.remote

    def forgetful(ids, params, rid, stream, resume=None):
        events = real(ids, params, rid, stream, resume)
        events.events[0].pop("prompt_logprobs", None)
        return events

    api.router.remote = forgetful
    r = api.http.post("/v1/completions", json=base("completions", echo=True, logprobs=0))
    assert r.status_code == 500  # never an answer that pretends the prompt has no logprobs


# ---- tool logic as pure functions -----------------------------------------------------------------------------

def test_call_stream_releases_content_and_calls_as_they_become_certain():
    stream = toolcalls.CallStream(["f"])
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()  # one character at a time
    assert "".join(v for kind, v in events if kind == "content") == "Sure."
    assert [e for e in events if e[0] == "call"] == [("call", {"name": "f", "arguments": '{"x": 1}'}),
                                                     ("call", {"name": "f", "arguments": "{}"})]
    assert events[-1][0] == "call"  # the space before the calls was held back, then dropped
    # nothing that could still be the start of a call is released early
    stream = toolcalls.CallStream(["f"])
    assert stream.feed("a <tool") == [("content", "a")] and stream.feed("box>") == [("content", " <toolbox>")]


@pytest.mark.parametrize("text, content, calls", [
    ("no calls here  ", "no calls here  ", []),
    ('<tool_call>{"name": "g", "arguments": {}}</tool_call>', '<tool_call>{"name": "g", "arguments": {}}</tool_call>', []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call> done', "done", [{"name": "f", "arguments": '{"y": 2}'}]),
    ('<tool_call>{"name": "f", "parameters": {"z": 3}}', None, [{"name": "f", "arguments": '{"z": 3}'}]),
    ('<tool_call>{"name": "f", "arguments": {"z": ', '<tool_call>{"name": "f", "arguments": {"z": ', []),
])
def test_parse_calls(text, content, calls):
    assert toolcalls.parse_calls(text, ["f"]) == (content, calls)


def test_parallel_calls_off_keeps_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {"b": 1}}</tool_call>'
    assert toolcalls.parse_calls(text, ["f"], parallel=False) == (None, [{"name": "f", "arguments": "{}"}])


def test_required_schema_and_its_answers():
    tools = toolcalls.check_tools([WEATHER, {"type": "function", "function": {"name": "ping"}}])
    assert tools[1]["parameters"] == toolcalls.NO_PARAMETERS
    schema = toolcalls.required_schema(toolcalls.Choice("required", tuple(tools), parallel=False))
    assert schema["maxItems"] == 1 and [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["weather"], ["ping"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == toolcalls.closed(SCHEMA)
    assert toolcalls.parse_required('[{"name": "ping", "parameters": {}}]') == [{"name": "ping", "arguments": "{}"}]
    assert toolcalls.parse_required('[{"name": "ping", "param') is None


class RecordingTokenizer:
    """Records what apply_chat_template gets."""

    def __init__(self, template):
        self.chat_template, self.seen = template, None

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        self.seen = (messages, tools)
        return "x"

    def encode(self, text, add_special_tokens=False):
        return [1]


HISTORY = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": "let me look", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": "x"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "42"}]


def test_history_in_hugging_faces_shape_for_templates_that_render_tools():
    tok = RecordingTokenizer("{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert toolcalls.template_supports_tools(tok)
    encode_chat(tok, HISTORY, tools=[WEATHER])
    messages, tools = tok.seen
    assert tools == [WEATHER]
    assert messages[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"q": "x"}}}]
    assert messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_history_as_text_for_templates_that_do_not():
    tok = RecordingTokenizer(CHAT_TEMPLATE)
    assert not toolcalls.template_supports_tools(tok)
    encode_chat(tok, HISTORY)
    messages, tools = tok.seen
    assert tools is None
    assert messages[1] == {"role": "assistant", "content": 'let me look\n<tool_call>{"name": "f", "arguments": {"q": "x"}}</tool_call>'}
    assert messages[2] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    with pytest.raises(ValueError, match="does not render tools"):
        encode_chat(tok, HISTORY, tools=[WEATHER])


@pytest.mark.parametrize("template, renders", [
    ("{% for t in tools %}{{ t }}{% endfor %}", True),
    ("{{ messages }} tools are nice", False),  # the word in text is not the variable
    ({"default": "{{ messages }}", "tool_use": "{{ tools }}"}, True),
    ("{% generation %}{{ tools }}{% endgeneration %}", True),  # a tag plain Jinja does not know
    (None, False),
])
def test_template_supports_tools(template, renders):
    assert toolcalls.template_supports_tools(SimpleNamespace(chat_template=template)) is renders


def test_fuzzed_tools_formats_and_controls_never_get_a_5xx(monkeypatch):
    """Arbitrary JSON in the fields this layer parses by hand: every answer is a 200 or a 4xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    api = make_api(monkeypatch, TOOLS_TEMPLATE)
    text = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "weather", "function", "auto", "required", "none", "3"]))
    value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-200, 200), st.floats(allow_nan=False), text),
                         lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
                         max_leaves=10)
    tool = st.one_of(st.just(WEATHER), st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]),
                                                              "function": st.dictionaries(st.sampled_from(["name", "parameters", "description", "strict"]), value)}), value)
    fields = {"tools": st.one_of(st.lists(tool, max_size=3), value),
              "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", NAMED]), value),
              "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                                                 optional={"json_schema": value}), value),
              "logit_bias": st.one_of(st.dictionaries(text, st.floats(-200, 200, allow_nan=False), max_size=3), value),
              "structured_outputs": value, "guided_json": value, "stop_token_ids": value, "bad_words": value,
              "parallel_tool_calls": value, "stream": st.booleans(), "echo": value, "logprobs": value}
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.one_of(text, st.none())},
                                              optional={"tool_calls": value, "tool_call_id": value}), min_size=1, max_size=3)
    body = st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages}, optional=fields)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=body)
    def check(path, body):
        if path == "/v1/completions":
            body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "the cat"}
        r = api.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})  # ASCII: lone surrogates escaped
        assert r.status_code < 500, (path, body, r.text[:300])

    check()


def test_forced_calls_allow_only_the_arguments_a_function_declares():
    params = {"type": "object", "properties": {"city": {"type": "string"},
                                               "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                                               "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}}},
              "required": ["city"]}
    open_map = {"type": "object", "additionalProperties": {"type": "string"}}
    fn = {"type": "function", "function": {"name": "f", "parameters": params}}
    choice = toolcalls.check_tool_choice({"type": "function", "function": {"name": "f"}}, toolcalls.check_tools([fn]))
    schema = toolcalls.forced_schema(choice)
    assert schema["additionalProperties"] is False and schema["properties"]["where"]["additionalProperties"] is False
    assert schema["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in params  # the client's schema is left as it was
    assert toolcalls.closed(open_map) == open_map  # a schema that says what else it allows keeps it
