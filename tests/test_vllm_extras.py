"""vLLM's server surface through the ingress: /health, /ping, /version, and every vLLM request extra either
taking effect (what the engine receives, what the answer carries) or refused naming itself. The engine's
side of the extras (stop strings kept, special tokens, allowed ids, priority, cache salt) is tested here
too, on the tiny models."""

import json
from types import SimpleNamespace

import pytest
import torch
from tokenizers import processors

from conftest import IdTokenizer, make_tokenizer
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine.kv import PagedKV
from serve_app.engine.scheduler import Engine
from serve_app.engine.textstream import TextStream
from serve_app.engine.worker import ModelWorker
from test_semantics import base, make_api, refusal


@pytest.fixture
def api(monkeypatch):
    api = make_api(monkeypatch)

    async def ready():
        return {"ready": True}

    api.router.ready = SimpleNamespace(remote=ready)
    return api


def chat(api, **fields):
    r = api.http.post("/v1/chat/completions", json=base("chat", **fields))
    assert r.status_code == 200, r.text
    return r


def completion(api, **fields):
    r = api.http.post("/v1/completions", json=base("completions", **fields))
    assert r.status_code == 200, r.text
    return r


def sent(api) -> tuple[list[int], dict]:
    """The prompt ids and engine params of the last request the ingress sent."""
    return api.router.calls[-1]


def words(api, ids) -> str:
    return api.tokenizer.decode(ids)


# ---- the server surface ------------------------------------------------------------------------------------

def test_health_ping_and_version_answer_as_vllms_do(api):
    r = api.http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert api.http.get("/ping").status_code == 200 and api.http.post("/ping").status_code == 200
    assert isinstance(api.http.get("/version").json()["version"], str)
    api.router.ready = SimpleNamespace(remote=lambda: _ready(False))
    r = api.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "not ready"


async def _ready(ok: bool):
    return {"ready": ok, "reason": "loading"}


# ---- the prompt: chat template extras, special tokens, truncation ---------------------------------------

def test_chat_template_and_its_kwargs_make_the_prompt(api):
    template = "{{ opening }} {% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}to{% endif %}"
    chat(api, chat_template=template, chat_template_kwargs={"opening": "big red"})
    assert words(api, sent(api)[0]) == "big red the cat to"
    chat(api, chat_template=template, chat_template_kwargs={"opening": "a"}, add_generation_prompt=False)
    assert words(api, sent(api)[0]) == "a the cat"
    msg = refusal(api.http.post("/v1/chat/completions", json=base("chat", chat_template_kwargs={"messages": []})),
                  "chat_template_kwargs")
    assert "set by the server" in msg
    refusal(api.http.post("/v1/chat/completions", json=base("chat", chat_template="{% for %}")), "chat_template")


def test_generation_prompt_continue_final_message_and_documents(api):
    chat(api)
    assert words(api, sent(api)[0]) == "user : the cat assistant :"
    chat(api, add_generation_prompt=False)
    assert words(api, sent(api)[0]) == "user : the cat"
    convo = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    chat(api, messages=convo, add_generation_prompt=False, continue_final_message=True)
    assert words(api, sent(api)[0]) == "user : the cat assistant : sat on"  # open: the answer continues it
    refusal(api.http.post("/v1/chat/completions", json=base("chat", continue_final_message=True)), "continue_final_message")
    docs_template = "{% for d in documents %}{{ d['text'] }} {% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat(api, chat_template=docs_template, documents=[{"title": "x", "text": "big dog"}])
    assert words(api, sent(api)[0]) == "big dog the cat"


def test_add_special_tokens_follows_vllms_defaults_per_endpoint(api):
    bos = api.tokenizer.convert_tokens_to_ids("<eos>")  # the tiny vocabulary's one special, as a BOS here
    api.tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", bos)])
    completion(api)
    assert sent(api)[0][0] == bos  # completions: the tokenizer's specials by default
    completion(api, add_special_tokens=False)
    assert bos not in sent(api)[0]
    chat(api)
    assert bos not in sent(api)[0]  # chat: the template writes its own
    chat(api, add_special_tokens=True)
    assert sent(api)[0][0] == bos


def test_truncate_prompt_tokens_keeps_the_prompts_end(api):
    completion(api, prompt="the big red dog sat on the mat", truncate_prompt_tokens=3)
    assert words(api, sent(api)[0]) == "on the mat"
    completion(api, prompt="the cat", truncate_prompt_tokens=5)
    assert words(api, sent(api)[0]) == "the cat"
    r = completion(api, prompt="the big red dog", truncate_prompt_tokens=2, echo=True)
    assert r.json()["choices"][0]["text"].startswith("red dog")  # what was served is what is echoed
    refusal(api.http.post("/v1/completions", json=base("completions", truncate_prompt_tokens=-2)), "truncate_prompt_tokens")


# ---- what reaches the engine ------------------------------------------------------------------------------

def test_engine_extras_reach_the_engine_only_when_set(api):
    completion(api)
    plain = sent(api)[1]
    assert not {"include_stop_str_in_output", "skip_special_tokens", "priority", "cache_salt", "allowed_token_ids",
                "predicted_output", "prompt_logprobs"} & set(plain)
    completion(api, include_stop_str_in_output=True, skip_special_tokens=False, priority=-3, cache_salt="tenant-a",
               allowed_token_ids=[9, 7, 9], prompt_logprobs=2)
    p = sent(api)[1]
    assert (p["include_stop_str_in_output"], p["skip_special_tokens"], p["priority"], p["cache_salt"]) == (True, False, -3, "tenant-a")
    assert p["allowed_token_ids"] == [7, 9] and p["prompt_logprobs"] == 2
    refusal(api.http.post("/v1/completions", json=base("completions", allowed_token_ids=[10**6])), "allowed_token_ids")
    refusal(api.http.post("/v1/completions", json=base("completions", allowed_token_ids=[])), "allowed_token_ids")


def test_a_prediction_reaches_the_engine_as_token_ids_and_usage_reports_it(api):
    r = chat(api, prediction={"type": "content", "content": [{"type": "text", "text": "the big cat"}]})
    assert words(api, sent(api)[1]["predicted_output"]) == "the big cat"
    assert r.json()["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    chat(api, prediction={"type": "content", "content": ""})
    assert "predicted_output" not in sent(api)[1]
    refusal(api.http.post("/v1/chat/completions", json=base("chat", prediction={"type": "file", "content": "x"})), "prediction")


# ---- the answer's shape -------------------------------------------------------------------------------------

def test_request_id_names_the_response(api):
    r = chat(api, request_id="job-42")
    assert r.json()["id"] == "chatcmpl-job-42"
    r = api.http.post("/v1/completions", json=base("completions", request_id="job-43", stream=True))
    assert '"id": "cmpl-job-43"' in r.text
    r = api.http.post("/v1/completions", json=base("completions"), headers={"X-Request-Id": "hdr-1"})
    assert r.json()["id"] == "cmpl-hdr-1"  # without the field, the header's id (Serve's proxy echoes it)


def test_return_token_ids_gives_prompt_and_output_ids(api):
    tid = api.tokenizer.convert_tokens_to_ids("cat")
    body = chat(api, return_token_ids=True).json()
    assert body["prompt_token_ids"] == sent(api)[0] and body["choices"][0]["token_ids"] == [tid, tid]
    body = completion(api, return_token_ids=True).json()
    assert body["choices"][0]["prompt_token_ids"] == sent(api)[0] and body["choices"][0]["token_ids"] == [tid, tid]
    r = api.http.post("/v1/chat/completions", json=base("chat", return_token_ids=True, stream=True))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == sent(api)[0]
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == [tid, tid]


def test_tokens_as_token_ids_in_logprobs(api):
    tid = api.tokenizer.convert_tokens_to_ids("cat")
    body = chat(api, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).json()
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == f"token_id:{tid}" and entry["top_logprobs"][0]["token"] == f"token_id:{tid}"
    body = completion(api, logprobs=1, return_tokens_as_token_ids=True).json()
    assert body["choices"][0]["logprobs"]["tokens"] == [f"token_id:{tid}"] * 2


def test_prompt_logprobs_in_vllms_shape(api):
    body = completion(api, prompt_logprobs=1).json()
    ids = sent(api)[0]
    lps = body["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(ids)
    assert lps[1][str(ids[1])]["logprob"] == -1.0 and lps[1][str(ids[1])]["decoded_token"] == words(api, [ids[1]])
    body = chat(api, prompt_logprobs=0).json()
    assert len(body["prompt_logprobs"]) == len(sent(api)[0])


def test_continuous_usage_stats_put_usage_in_every_chunk(api):
    r = api.http.post("/v1/completions", json=base("completions", stream=True,
                                                   stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and all("usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 2][: len(chunks) - 1]
    r = api.http.post("/v1/completions", json=base("completions", stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert ["usage" in c and c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# ---- the engine's side ----------------------------------------------------------------------------------------

def test_stop_strings_kept_on_request_and_special_tokens_shown():
    tok = make_tokenizer()
    ids = tok.encode("the cat sat on the mat")
    kept = TextStream(tok, ["sat"], include_stop=True)
    assert kept.push(ids) + kept.flush() == "the cat sat" and kept.stopped
    cut = TextStream(tok, ["sat"])
    assert cut.push(ids) + cut.flush() == "the cat "
    eos = tok.convert_tokens_to_ids("<eos>")
    assert TextStream(tok, [], skip_special=False).push(ids[:2] + [eos]) == "the cat <eos>"
    assert TextStream(tok, []).push(ids[:2] + [eos]) == "the cat"


def make_engine(target, **cfg):
    return Engine(ModelWorker(target, "target"), None, IdTokenizer(), EngineConfig(**cfg), eos_ids=set())


def test_allowed_token_ids_are_the_only_ones_generated(tiny_target):
    engine = make_engine(tiny_target)
    allowed = [5, 17, 60]
    [r] = [engine.submit([1, 2, 3], SamplingParams(max_tokens=12, allowed_token_ids=allowed))]
    [s] = [engine.submit([1, 2, 3], SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed))]
    engine.run([r, s])
    assert set(r.output_ids) <= set(allowed) and set(s.output_ids) <= set(allowed)
    logits = tiny_target(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert r.output_ids[0] == max(allowed, key=lambda t: logits[t])  # the best of the allowed, not the best


def test_priority_orders_admission_among_waiting_requests(tiny_target):
    engine = make_engine(tiny_target, max_batch_size=1)
    reqs = [engine.submit([1, 2, 3], SamplingParams(max_tokens=2, priority=p)) for p in (0, 5, -1, 0, -1)]
    assert [r.params.priority for r in engine.waiting] == [-1, -1, 0, 0, 5]
    assert list(engine.waiting) == [reqs[2], reqs[4], reqs[0], reqs[3], reqs[1]]  # FIFO within a priority


def test_cache_salt_keeps_prefix_cache_entries_apart():
    kv = PagedKV(block_size=4, max_blocks=64)
    tokens = list(range(20))
    assert kv.match_prefix("a", tokens) == 0
    kv.reserve("a", 20)
    kv.commit("a", tokens, 20)
    assert kv.match_prefix("same", tokens) == 16
    kv.match_prefix("salted", tokens, salt="tenant-b")
    kv.reserve("salted", 20)
    kv.commit("salted", tokens, 20)
    assert kv.match_prefix("other", tokens, salt="tenant-c") == 0
    assert kv.match_prefix("b-again", tokens, salt="tenant-b") == 16
