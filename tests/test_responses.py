"""The Responses API (deployments/responses.py) without Ray: the field classification against the
installed openai package's request schema, the translation of requests into chat messages and engine
parameters, and the Response objects and stream events checked against the openai package's own
models. The endpoint runs end to end over a fake engine group (the ingress built as in
tests/test_cancel.py). Through a real service and the real openai client: tests/test_serve.py
(`-k responses`).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming, ResponseCreateParamsStreaming
from pydantic import TypeAdapter

from conftest import make_tokenizer
from deployments.ingress import APIError
from deployments.responses import (
    HANDLED,
    NO_EFFECT,
    VLLM_HANDLED,
    REFUSED,
    ResponsesRequest,
    ResponseWriter,
    create_response,
    engine_params,
    parse_request,
    to_messages,
)
from serve_app.config import SamplingParams
from test_cancel import FakeRouterHandle, collected, make_ingress

BASE = {"model": "m", "input": "the cat"}

# A value of every refused field that would change the answer, and one that changes nothing.
REFUSED_VALUES = {
    "previous_response_id": "resp_123",
    "conversation": "conv_123",
    "prompt": {"id": "pmpt_123"},
    "background": True,
    "background_options": {"completion_window": "2h"},
    "reasoning": {"effort": "high"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "moderation": {"model": "omni-moderation-latest"},
    "truncation": "auto",
    "prompt_cache_options": {"prewarm": True},
}
HARMLESS_VALUES = {
    "previous_response_id": None, "conversation": None, "prompt": None,
    "background": False, "background_options": {}, "reasoning": {"effort": "none", "summary": None},
    "context_management": [], "moderation": None, "truncation": "disabled", "prompt_cache_options": {"ttl": "30m"},
}
NO_EFFECT_VALUES = {
    "user": "u1", "safety_identifier": "hashed-user", "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
    "prompt_cache_key": "key", "prompt_cache_retention": "24h", "max_tool_calls": 3,
    "stream_options": {"include_obfuscation": False}, "image": {"context_compression": "auto"},
    "access_programs": {"cyber": "standard"},
}


def refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        parse_request(body)
    assert e.value.status == 400
    return e.value


# ---- the classification -------------------------------------------------------------------------

def test_every_field_of_openais_request_schema_is_classified_once():
    schema = set()
    for params in (ResponseCreateParamsNonStreaming, ResponseCreateParamsStreaming):
        schema |= params.__required_keys__ | params.__optional_keys__
    assert "input" in schema and "stream" in schema  # the walk sees the base class's keys and `stream`
    refused = set(REFUSED)
    assert not (HANDLED & NO_EFFECT) and not (HANDLED & refused) and not (NO_EFFECT & refused)
    assert HANDLED | NO_EFFECT | refused == schema, {
        "not classified": sorted(schema - (HANDLED | NO_EFFECT | refused)),
        "not OpenAI's": sorted((HANDLED | NO_EFFECT | refused) - schema)}
    assert set(ResponsesRequest.model_fields) == schema | VLLM_HANDLED  # exactly those fields, and vLLM's extras
    assert not VLLM_HANDLED & schema
    assert set(REFUSED_VALUES) == set(HARMLESS_VALUES) == refused and set(NO_EFFECT_VALUES) == NO_EFFECT


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_fields_get_a_400_naming_them_and_harmless_values_pass(field):
    e = refusal({**BASE, field: REFUSED_VALUES[field]})
    assert e.param == field and e.message.startswith(f"{field}: ")
    assert engine_params(parse_request({**BASE, field: HARMLESS_VALUES[field]}), 8) == engine_params(parse_request(BASE), 8)


def test_no_effect_fields_are_accepted_and_change_nothing_sent_to_the_engine():
    req = parse_request({**BASE, **NO_EFFECT_VALUES})
    assert engine_params(req, 8) == engine_params(parse_request(BASE), 8)
    assert to_messages(req) == to_messages(parse_request(BASE))


def test_unknown_fields_get_a_400_naming_them():
    e = refusal({**BASE, "frequency_penalty": 3, "messages": []})
    assert e.param == "frequency_penalty" and "'frequency_penalty', 'messages'" in e.message and e.code == "unknown_parameter"


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({**BASE, "input": 5}, "input"),
    ({**BASE, "max_output_tokens": 0}, "max_output_tokens"),
    ({**BASE, "temperature": 3}, "temperature"),
    ({**BASE, "top_p": 0}, "top_p"),
    ({**BASE, "top_logprobs": 21}, "top_logprobs"),
    ({**BASE, "include": ["file_search_call.results"]}, "include"),
    ({**BASE, "text": {"verbosity": "low"}}, "text.verbosity"),
    ({**BASE, "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({**BASE, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({**BASE, "metadata": {"k": 1}}, "metadata.k"),
])
def test_bad_values_of_handled_fields_get_a_400_naming_them(body, param):
    assert refusal(body).param == param


# ---- translation -------------------------------------------------------------------------------

def test_input_shapes_become_chat_messages_with_instructions_first():
    assert to_messages(parse_request({**BASE, "instructions": "be brief"})) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "the cat"},
                                                         {"type": "input_text", "text": "sat"}]},
        # an earlier answer, as the SDK hands it back (output message with id, status, annotations)
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "on the mat", "annotations": []}]},
        {"role": "user", "content": "and"},
    ]
    assert to_messages(parse_request({**BASE, "input": items})) == [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "the cat\nsat"},
        {"role": "assistant", "content": "on the mat"}, {"role": "user", "content": "and"}]


@pytest.mark.parametrize("item, param, words", [
    ({"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}, "input[0].call_id", "a string"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type", "item_reference"),
    ({"type": "reasoning", "summary": []}, "input[0].type", "reasoning"),
    ({"role": "tool", "content": "x"}, "input[0].role", "one of"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
     "input[0].content[0].type", "text only"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0]", "input_text"),
    ({"role": "user", "content": "\ud800"}, "input[0].content", "surrogate"),
    ("the cat", "input[0]", "message item"),
])
def test_input_items_that_are_not_messages_or_calls_get_a_400(item, param, words):
    with pytest.raises(APIError) as e:
        to_messages(parse_request({**BASE, "input": [item]}))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_engine_params_follow_the_request():
    p = engine_params(parse_request(BASE), 16)
    assert p == {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [], "logprobs": None}
    req = parse_request({**BASE, "temperature": 0, "top_p": 0.5, "top_logprobs": 3,
                         "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]})
    assert engine_params(req, 4) == {**p, "max_tokens": 4, "temperature": 0.0, "top_p": 0.5, "logprobs": 3}
    assert engine_params(parse_request({**BASE, "top_logprobs": 3}), 16)["logprobs"] is None  # only with include
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert engine_params(parse_request({**BASE, "text": {"format": fmt}}), 8)["structured"] == {"json_schema": schema}
    assert engine_params(parse_request({**BASE, "text": {"format": {"type": "json_object"}}}), 8)["structured"] == {"json_object": True}
    assert "structured" not in engine_params(parse_request({**BASE, "text": {"format": {"type": "text"}}}), 8)
    # every variant is what the engine's own parameter model takes (the router validates with it)
    for body in [BASE, {**BASE, "text": {"format": fmt}}, {**BASE, "text": {"format": {"type": "json_object"}}},
                 {**BASE, "include": ["message.output_text.logprobs"], "top_logprobs": 20, "temperature": 2, "top_p": 0.1}]:
        SamplingParams(**engine_params(parse_request(body), 8))


# ---- Response objects and events -----------------------------------------------------------------

def engine_events(pieces: list[str], reason: str = "stop", logprobs: bool = False) -> list[dict]:
    evs = [{"text": t, "token_ids": [i], "finished": i == len(pieces) - 1,
            "finish_reason": reason if i == len(pieces) - 1 else None} for i, t in enumerate(pieces)]
    if logprobs:
        for i, ev in enumerate(evs):
            ev["logprobs"] = [(-0.5, [(i, -0.5), (99, -1.5)])]
    evs[-1]["stats"] = {"cached_tokens": 2}
    return evs


def writer(body: dict | None = None, logprobs_of=None) -> ResponseWriter:
    return ResponseWriter(parse_request({**BASE, **(body or {})}), "r1", "m", 5, logprobs_of)


def fake_logprobs(ids, lps):
    return [{"token": f"w{t}", "bytes": [119], "logprob": lp,
             "top_logprobs": [{"token": f"w{a}", "bytes": [119], "logprob": alp} for a, alp in alts]}
            for t, (lp, alts) in zip(ids, lps)]


def run_collect(w: ResponseWriter, evs: list[dict]) -> dict:
    rest = iter(evs[1:])

    async def next_event():
        return next(rest)

    return asyncio.run(w.collect(evs[0], next_event))


def run_stream(w: ResponseWriter, evs: list[dict]) -> list[tuple[str, dict]]:
    rest = iter(evs[1:])

    async def next_event():
        return next(rest)

    async def main():
        return [chunk async for chunk in w.stream(evs[0], next_event)]

    out = []
    for chunk in asyncio.run(main()):
        event, data, blank = chunk.split("\n", 2)
        assert event.startswith("event: ") and data.startswith("data: ") and blank == "\n"
        out.append((event[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_response_object_parses_as_openais_and_says_completed_or_incomplete():
    done = Response.model_validate(run_collect(writer({"instructions": "hi", "metadata": {"k": "v"}}),
                                               engine_events([" the", " cat"])))
    assert done.output_text == " the cat" and done.status == "completed" and done.incomplete_details is None
    assert done.id == "resp_r1" and done.output[0].id == "msg_r1" and done.output[0].status == "completed"
    assert done.instructions == "hi" and done.metadata == {"k": "v"} and done.tools == [] and done.tool_choice == "auto"
    u = done.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens, u.input_tokens_details.cached_tokens) == (5, 2, 7, 2)
    assert u.output_tokens_details.reasoning_tokens == 0
    cut = Response.model_validate(run_collect(writer({"max_output_tokens": 2}), engine_events([" a", " b"], "length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.max_output_tokens == 2


def test_engine_error_while_collecting_is_a_503():
    evs = engine_events([" a", " b"])
    evs[1] = {"error": "engine replica crashed", "text": "", "token_ids": [], "finished": True, "status": 503}
    with pytest.raises(APIError) as e:
        run_collect(writer(), evs)
    assert e.value.status == 503


def test_logprobs_on_the_text_part_and_deltas():
    include = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    body = run_collect(writer(include, fake_logprobs), engine_events([" a", " b"], logprobs=True))
    part = Response.model_validate(body).output[0].content[0]
    assert [lp.token for lp in part.logprobs] == ["w0", "w1"] and part.logprobs[0].top_logprobs[1].token == "w99"
    events = run_stream(writer(include, fake_logprobs), engine_events([" a", " b"], logprobs=True))
    deltas = [d for e, d in events if e == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == ["w0", "w1"]
    assert not run_collect(writer(), engine_events([" a"]))["output"][0]["content"][0]["logprobs"]


EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("reason, final", [("stop", "response.completed"), ("length", "response.incomplete")])
def test_stream_events_in_openais_order_and_shapes(reason, final):
    events = run_stream(writer(), engine_events([" the", "", " cat"], reason))
    names = [e for e, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    parsed = [EVENT.validate_python(d) for _, d in events]  # each one a valid event of the openai package
    assert [p.type for p in parsed] == names and [p.sequence_number for p in parsed] == list(range(len(names)))
    assert "".join(p.delta for p in parsed if p.type == "response.output_text.delta") == " the cat"
    assert parsed[-4].text == " the cat" and parsed[-1].response.output_text == " the cat"
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    assert parsed[-1].response.usage.output_tokens == 3


def test_engine_error_mid_stream_is_an_error_event_and_the_end():
    evs = engine_events([" a", " b", " c"])
    evs[1] = {"error": "no engine replica of this group is available", "text": "", "token_ids": [], "finished": True,
              "status": 503}
    events = run_stream(writer(), evs)
    assert events[-1][0] == "error" and "no engine replica" in events[-1][1]["message"]
    assert EVENT.validate_python(events[-1][1]).type == "error"
    assert not any(e.startswith("response.completed") for e, _ in events)


# ---- the endpoint over a fake engine group --------------------------------------------------------

def ingress(**events_kw):
    handle = FakeRouterHandle(**events_kw)
    ing = make_ingress(handle)
    ing.tokenizer = make_tokenizer()
    return ing, handle


def call(ing, body: dict):
    return create_response(ing, SimpleNamespace(headers={}), {**BASE, **body})


def test_endpoint_sends_the_chat_template_prompt_and_params_and_answers():
    ing, handle = ingress(n_events=3)
    calls = []
    remote = handle.remote
    handle.remote = lambda ids, params, rid, stream, resume=None: calls.append((ids, params, stream)) or remote(ids, params, rid, stream, resume)

    async def main():
        body = await call(ing, {"instructions": "be brief", "max_output_tokens": 3, "temperature": 0})
        await collected()
        return body

    body = asyncio.run(main())
    tok = ing.tokenizer
    ids, params, stream = calls[0]
    assert tok.decode(ids) == tok.decode(tok.encode("system : be brief user : the cat assistant :"))
    assert params["max_tokens"] == 3 and params["temperature"] == 0.0 and stream is False
    assert Response.model_validate(body).output_text == " t0 t1 t2"
    assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 0


def test_endpoint_limits_model_and_draining():
    ing, _ = ingress(n_events=3)
    for body, status, param in [({"max_output_tokens": 101}, 400, "max_output_tokens"), ({"model": "other"}, 400, "model"),
                                ({"input": ""}, 400, "input")]:
        with pytest.raises(APIError) as e:
            asyncio.run(call(ing, body))
        assert (e.value.status, e.value.param) == (status, param)
    ing.draining = True
    with pytest.raises(APIError) as e:
        asyncio.run(call(ing, {}))
    assert e.value.status == 503 and ing.in_flight["A"] == 0


def test_streamed_endpoint_releases_its_lease_and_cancels_when_the_client_leaves():
    ing, handle = ingress(n_events=10)

    async def main():
        resp = await call(ing, {"stream": True})
        assert resp.media_type == "text/event-stream" and ing.in_flight["A"] == 1
        body = resp.body_iterator
        assert (await body.__anext__()).startswith("event: response.created\n")
        await body.aclose()  # the client disconnected
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 1
        whole = await call(ing, {"stream": True})
        chunks = [c async for c in whole.body_iterator]
        assert chunks[-1].startswith("event: response.incomplete\n")  # the fake's last event says "length"
        assert ing.in_flight["A"] == 0 and handle.streams[1].cancels == 0

    asyncio.run(main())


def test_fuzzed_bodies_get_a_400_or_a_request():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "", "input_text", "message", "user"]))
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 30), st.floats(allow_nan=False), text)
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(text, inner, max_size=3)), max_leaves=10)
    part = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]),
                                            "text": values}), values)
    item = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                            "content": st.one_of(text, st.lists(part, max_size=2), values)},
                                           optional={"type": st.sampled_from(["message", "function_call"])}), values)
    fields = {k: values for k in ResponsesRequest.model_fields if k not in ("model", "input")}
    base = {"model": st.just("m"), "input": st.one_of(text, st.lists(item, max_size=3), values)}
    # most bodies set no other field, so their input reaches to_messages instead of a refused field's 400
    body = st.one_of(st.fixed_dictionaries(base), st.fixed_dictionaries(base, optional=fields))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=body)
    def check(body):
        try:
            req = parse_request(body)
            to_messages(req)
            engine_params(req, 8)
        except APIError as e:
            assert e.status == 400 and e.message

    check()


def test_vllms_sampling_extras_take_effect_as_load_tools_send_them():
    """guidellm sends `stop: null` and `ignore_eos: true` to /v1/responses, as vLLM takes them."""
    plain = engine_params(parse_request(BASE), 8)
    assert engine_params(parse_request({**BASE, "stop": None, "ignore_eos": False}), 8) == plain
    p = engine_params(parse_request({**BASE, "stop": ["END"], "ignore_eos": True, "top_k": 5, "seed": 3, "priority": 2,
                                     "min_tokens": 2, "cache_salt": "t"}), 8)
    assert (p["stop"], p["ignore_eos"], p["top_k"], p["seed"], p["priority"], p["min_tokens"], p["cache_salt"]) == (
        ["END"], True, 5, 3, 2, 2, "t")
    with pytest.raises(APIError) as e:
        engine_params(parse_request({**BASE, "min_tokens": 9}), 8)
    assert e.value.param == "min_tokens"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_function_tools_are_forced_through_chats_rules():
    """Responses' flat function tools: a named choice or "required" constrains the output to calls (the same
    schemas as chat's); built-in tools, unknown names and JSON formats beside a call are 400s."""
    named = engine_params(parse_request({**BASE, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}), 8)
    assert named["structured"]["json_schema"]["required"] == ["city"]
    required = engine_params(parse_request({**BASE, "tools": [WEATHER], "tool_choice": "required"}), 8)
    assert required["structured"]["json_schema"]["type"] == "array"
    assert "structured" not in engine_params(parse_request({**BASE, "tools": [WEATHER], "tool_choice": "none"}), 8)
    json_too = {**BASE, "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}
    assert engine_params(parse_request(json_too), 8) == required  # a forced call leaves no text for the format
    for body, param in [({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": "auto", "text": {"format": {"type": "json_object"}}},
                         "text.format")]:
        with pytest.raises(APIError) as e:
            engine_params(parse_request({**BASE, **body}), 8)
        assert e.value.param == param, body


def test_calls_come_back_as_function_call_items_and_go_back_as_history():
    req = parse_request({**BASE, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    writer = ResponseWriter(req, "r1", "m", 5)
    writer.add({"text": '{"city": "Paris"}', "token_ids": [1, 2], "finished": True, "finish_reason": "stop"})
    [item] = writer.response("completed")["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["arguments"] == '{"city": "Paris"}'
    assert item["call_id"].startswith("call_") and item["id"] == "fc_r1_0"
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": item["call_id"], "name": "get_weather", "arguments": item["arguments"]},
               {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}]
    messages = to_messages(parse_request({**BASE, "input": history}))
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": item["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert messages[2] == {"role": "tool", "tool_call_id": item["call_id"], "content": "sunny"}


def test_streamed_calls_are_whole_items_at_the_end():
    import asyncio

    req = parse_request({**BASE, "stream": True, "tools": [WEATHER], "tool_choice": "required"})
    writer = ResponseWriter(req, "r2", "m", 5)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    first = {"text": text[:10], "token_ids": [1], "finished": False, "finish_reason": None}
    rest = [{"text": text[10:], "token_ids": [2], "finished": True, "finish_reason": "stop"}]

    async def nxt():
        return rest.pop(0)

    async def run():
        return [chunk async for chunk in writer.stream(first, nxt)]

    events = [json.loads(c.split("data: ", 1)[1]) for c in asyncio.run(run())]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[4]["arguments"]) == {"city": "Oslo"} and events[-1]["response"]["output"][0]["name"] == "get_weather"
