"""Continuous batching at scale: paged KV, chunked prefill within a per-step token budget, prefix
caching, preemption. Greedy stays identical to the target alone, seeded text the same, under each."""

import random

import pytest
import torch

from conftest import IdTokenizer
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting.ngram import NgramDraft, NgramWorker
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker
from test_engine import reference

rng = random.Random(7)
LONG = [rng.randrange(1, 97) for _ in range(150)]
SYSTEM = [rng.randrange(1, 97) for _ in range(45)]  # a shared "system prompt": several blocks of 4
PROMPTS = [LONG, [1, 2, 3], SYSTEM + [5, 6], [7, 8, 9, 10], SYSTEM + [11], list(range(30, 60)), SYSTEM + [12, 13, 14]]


@pytest.fixture(scope="module")
def ref(tiny_target):
    return reference(tiny_target, PROMPTS, 12)


def engine_for(target, draft, policy="fixed:3", **cfg):
    cfg = {"block_size": 4, "max_batch_size": 4, "max_num_batched_tokens": 24, **cfg}
    d = None if draft is None else NgramWorker(draft) if isinstance(draft, NgramDraft) else ModelWorker(draft, "draft")
    steps = []
    engine = Engine(ModelWorker(target, "target"), d, IdTokenizer(), EngineConfig(policy=policy, **cfg), eos_ids=set())
    engine.on_step.append(steps.append)
    return engine, steps


@pytest.mark.parametrize("draft_kind", ["none", "near", "same", "ngram"])
def test_chunked_prefill_and_prefix_sharing_stay_greedy_identical(tiny_target, tiny_drafts, ref, draft_kind):
    draft = {"none": None, "ngram": NgramDraft()}.get(draft_kind, tiny_drafts.get(draft_kind))
    engine, steps = engine_for(tiny_target, draft, "none" if draft is None else "fixed:3")
    reqs = []
    for i, p in enumerate(PROMPTS):  # arrivals while others decode: joins mid-flight, leaves as they finish
        reqs.append(engine.submit(p, SamplingParams(max_tokens=12 - (i % 3))))
        engine.step()
    engine.run(reqs)
    for i, r in enumerate(reqs):
        assert r.output_ids == ref[i][: 12 - (i % 3)], (i, draft_kind)
    budget = engine.config.max_num_batched_tokens
    assert all(st.scheduled_tokens <= budget for st in steps)  # the knob holds in every step
    assert sum(st.prefill_tokens > 0 and st.batch_size > 0 for st in steps) >= 3  # chunks shared steps with decoding
    assert sum(st.prefill_tokens > 0 for st in steps) >= len(LONG) // budget  # the long prompt took several
    assert sum(st.prefix_hits for st in steps) >= 2 * 44  # later SYSTEM prompts took its 11 full blocks
    assert engine.running == engine.prefilling == [] and engine.reserved == 0
    assert engine.target.cache.held_blocks() == 0


def test_prefix_cache_changes_no_output_and_evicts_under_pressure(tiny_target, tiny_drafts, ref):
    """A pool too small to keep everything cached: blocks are evicted (least recently used first),
    requests are preempted when they outgrow it, and outputs equal a run without caching."""
    outs = {}
    for caching in (True, False):
        engine, steps = engine_for(tiny_target, tiny_drafts["near"], prefix_caching=caching, max_num_tokens=200,
                                   max_batch_size=3)
        reqs = [engine.submit(p, SamplingParams(max_tokens=12)) for p in PROMPTS]
        engine.run(reqs)
        outs[caching] = [r.output_ids for r in reqs]
        assert outs[caching] == ref
        assert all(st.scheduled_tokens <= 24 for st in steps)
        if caching:
            assert engine.target.cache.stats.evictions > 0 and engine.target.cache.stats.hits > 0
    assert outs[True] == outs[False]


def test_preempted_requests_resume_where_they_were(tiny_target, tiny_drafts):
    """Requests admitted small outgrow a pool of 64 tokens: the latest admitted go back to the queue and
    are prefilled again later, and every output is still the target's own."""
    short = [[1, 2, 3], [7, 8, 9, 10], [42], [5, 6]]
    engine, steps = engine_for(tiny_target, tiny_drafts["near"], max_num_tokens=64, prefix_caching=False)
    reqs = [engine.submit(p, SamplingParams(max_tokens=40)) for p in short]
    engine.run(reqs)
    assert sum(st.preempted for st in steps) > 0 and sum(r.stats.preemptions for r in reqs) > 0
    assert [r.output_ids for r in reqs] == reference(tiny_target, short, 40)


@pytest.mark.parametrize("budget", [8, 24, 512])
def test_seeded_text_is_the_same_whatever_the_chunking_and_k(tiny_target, tiny_drafts, budget):
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=s) for s in range(len(PROMPTS))]
    texts = []
    for policy in ("none", "fixed:2"):
        engine, _ = engine_for(tiny_target, tiny_drafts["near"], policy, max_num_batched_tokens=budget)
        reqs = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
        engine.run(reqs)
        texts.append([r.output_ids for r in reqs])
    alone, _ = engine_for(tiny_target, None, "none", max_num_batched_tokens=512, prefix_caching=False, max_batch_size=1)
    reqs = [alone.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    alone.run(reqs)
    assert texts[0] == texts[1] == [r.output_ids for r in reqs]


def test_budget_must_fit_a_batch():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_batch_size=16, max_num_batched_tokens=8)


def test_long_prompt_does_not_stall_decoding_streams(tiny_target, tiny_drafts):
    """While a long prompt prefills, every step still decodes the running streams, and each step feeds
    at most the budget: the prompt spreads over steps instead of one long forward."""
    engine, steps = engine_for(tiny_target, tiny_drafts["near"], max_batch_size=8, max_num_batched_tokens=32)
    running = [engine.submit([i + 1, i + 2], SamplingParams(max_tokens=40)) for i in range(4)]
    for _ in range(3):
        engine.step()
    long = engine.submit(LONG, SamplingParams(max_tokens=2))
    before = len(steps)
    while not long.output_ids:
        engine.step()
    during = steps[before:]
    assert len(during) >= len(LONG) // 32 and all(st.batch_size == 4 and st.generated >= 4 for st in during)
    assert all(st.scheduled_tokens <= 32 for st in during)
    engine.run(running + [long])


def test_kv_blocks_held_match_tokens_at_scale_shapes():
    """At an 8B model's KV shape (8 kv heads x 128 head dim, shallow): bytes held per token are
    2 x layers x kv heads x head dim x dtype bytes, plus at most one partly filled block per sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    w = ModelWorker(model, "target")
    w.configure_kv(block_size=16, max_blocks=4096, prefix_caching=False)
    lens = [1800] + [100 + 7 * i for i in range(31)]
    ids = [f"s{i}" for i in range(32)]
    w.add(ids, [[3] * n for n in lens], [SamplingParams()] * 32)
    from serve_app.engine.worker import Proposal
    w.verify(ids, Proposal.empty(32))
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 128 * 2
    held_bytes = w.cache.held_blocks() * 16 * per_token
    tokens = sum(lens)
    assert tokens * per_token <= held_bytes <= (tokens + 32 * 15) * per_token
    assert w.cache.nbytes() <= 1.25 * tokens * per_token


def test_kv_memory_bench_reports_memory_following_tokens(tiny_target):
    from serve_app.bench.kvmem import markdown, run_kv_memory

    engine, _ = engine_for(tiny_target, None, "none", max_batch_size=6, block_size=16, max_num_tokens=4096, max_model_len=1024,
                           max_num_batched_tokens=64)
    out = run_kv_memory(engine, [600, 150, 200, 250, 180, 220], 97, decode_steps=2)
    m = out["target"]
    assert m["sequences"] == 6 and m["tokens_held"] >= 1600
    assert m["token_bytes"] <= m["held_block_bytes"] <= m["partial_block_bound_bytes"]
    assert m["allocated_over_tokens"] <= 1.25 < m["before_over_tokens"]
    assert "| target |" in markdown([{**out, "model": "tiny"}])
