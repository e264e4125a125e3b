"""The EAGLE-3 draft on tiny random Llamas: lossless, proposals equal to a recompute from scratch, exact sampling."""

import pytest
import torch

from conftest import IdTokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.eagle3_worker import EagleWorker
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker, Proposal

LAYERS = [0, 1, 2]  # the tiny target has 2 layers; 2 = the output of the last one, before the final norm
PROMPTS = [[1, 2, 3], [5] * 11, list(range(10, 40)), [7, 8], [42], list(range(60, 50, -1))]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(97, layers=2, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    d = Eagle3Draft.from_target(target, torch.arange(0, 97, 3), LAYERS)  # a reduced head: every 3rd token
    with torch.no_grad():  # a trained-looking layer: let the embedding half speak too
        g = torch.Generator().manual_seed(0)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(d.self_attn, name).weight
            w[:, : w.shape[1] // 2] = torch.randn(w.shape[0], w.shape[1] // 2, generator=g, dtype=w.dtype) * 0.1
        for norm in (d.input_layernorm, d.hidden_norm, d.post_attention_layernorm, d.norm):  # each its own
            norm.weight.mul_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g, dtype=norm.weight.dtype))
    return d


def reference(model, prompts, n):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=[])
        outs.append(out[0, len(p):].tolist())
    return outs


def target_features(target, tokens):  # [len(tokens), 3H]: the residual stream entering layers 0, 1 and the norm
    grabbed = {}
    hooks = [target.model.layers[i].register_forward_pre_hook(lambda m, a, kw, i=i: grabbed.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True) for i in (0, 1)]
    hooks.append(target.model.norm.register_forward_pre_hook(lambda m, a: grabbed.__setitem__(2, a[0])))
    with torch.no_grad():
        target(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.cat([grabbed[i][0] for i in LAYERS], dim=-1)


def recompute(draft, target, tokens, k):
    """The k greedy proposals after `tokens` (the last one pending at the target), from scratch: the
    draft over every position with the target's real features, then its own states, no cache."""
    feats = draft.fuse(target_features(target, tokens[:-1]).to(torch.bfloat16))  # [L-1, H]: as they cross actors
    ids, hidden, out = list(tokens[1:]), feats[None], []
    for _ in range(k):
        n = len(ids)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            logits, state = draft(torch.tensor([ids]), hidden, torch.arange(n)[None], attention_mask=mask)
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
        hidden = torch.cat([hidden, state[:, -1:]], dim=1)
    return out


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "wrapped"])
def test_proposals_equal_a_recompute_from_scratch(target, draft, lean):
    """Catch-up after k = 0 steps, ragged rows, rows leaving: the cached draft proposes exactly what a
    from-scratch computation over the target's real features proposes, through the lean draft step
    (`lean.draft_step`, which the stock layer takes) and through transformers' modules."""
    tw, dw = ModelWorker(target, "target"), EagleWorker(draft)
    assert dw.lean_draft
    dw.lean_draft = lean
    tw.capture_features(LAYERS)
    ids = ["a", "b", "c"]
    params = [SamplingParams()] * 3
    for w in (tw, dw):
        w.add(ids, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], params)
    _, first, feats = tw.verify(ids, Proposal(torch.zeros((3, 0), dtype=torch.long)))[:3]
    dw.prefill(ids, feats)
    dw.commit(ids, [[f] for f in first])
    checked = 0
    for step, k in enumerate([2, 0, 0, 3, 1, 4, 0, 2, 3]):
        if step == 5:  # row b leaves: rows compact in both workers
            for w in (tw, dw):
                w.remove(["b"])
            ids = ["a", "c"]
        prop = dw.propose(ids, k)
        for b, sid in enumerate(ids):
            if k:
                assert prop.tokens[b].tolist() == recompute(draft, target, dw.seqs[sid].tokens, k), (step, sid)
                checked += 1
        n, nxt, feats = tw.verify(ids, prop)[:3]
        dw.commit(ids, [d[:m] + [t] for d, m, t in zip(prop.tokens.tolist(), n, nxt)], feats)
    assert checked > 10 and dw.seqs["a"].tokens == tw.seqs["a"].tokens


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identical_to_target_alone(target, draft, k):
    ref = reference(target, PROMPTS, 20)
    engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(),
                    EngineConfig(policy=f"fixed:{k}", max_batch_size=4), eos_ids=set())
    reqs = [engine.submit(p, SamplingParams(max_tokens=20 - 2 * (i % 3))) for i, p in enumerate(PROMPTS)]
    engine.run(reqs)  # batch 4 < 6 prompts: later ones join mid-flight, rows leave at different lengths
    for i, r in enumerate(reqs):
        assert r.output_ids == ref[i][: 20 - 2 * (i % 3)], (i, k)
    assert 0 < sum(r.stats.accepted for r in reqs) < sum(r.stats.proposed for r in reqs)
    assert engine.running == [] and engine.draft.order == [] and engine.draft.seqs == {}


def test_seeded_sampled_tokens_follow_the_target_distribution():
    """Seeded requests with the EAGLE draft (the coupled sampler, not rejection sampling: that one is checked
    unseeded, with a planted-bias control, in tests/test_exactness.py) stay exact: the second token's
    frequencies match the target's distribution averaged over the first tokens drawn. (A peaked target, so a
    wrong sampler would show: the frequencies are far from uniform.)"""
    target = tiny_llama(97, layers=2, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    draft = Eagle3Draft.from_target(target, torch.arange(97), LAYERS)
    engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(),
                    EngineConfig(policy="fixed:2", max_batch_size=64), eos_ids=set())
    prompt, trials = [5, 6, 7, 8], 3000
    reqs = [engine.submit(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=s)) for s in range(trials)]
    engine.run(reqs)
    assert sum(r.stats.accepted for r in reqs) > 30  # some of the draft's samples were accepted
    pairs = torch.tensor([r.output_ids for r in reqs])  # [trials, 2]
    expected = torch.zeros(97)
    for t1 in pairs[:, 0].unique():
        with torch.no_grad():
            logits = target(torch.tensor([prompt + [int(t1)]])).logits[0, -1:]
        p = logits.float().softmax(-1)[0]  # temperature 1, no top-k / top-p
        expected += (pairs[:, 0] == t1).float().mean() * p.float()
    assert expected.max() > 0.3  # peaked: the check has power
    freq = torch.bincount(pairs[:, 1], minlength=97).float() / trials
    assert 0.5 * (freq - expected).abs().sum() < 0.06, (freq.topk(5), expected.topk(5))


def test_draft_refuses_missing_or_foreign_features(target, draft):
    w = EagleWorker(draft)
    w.add(["s"], [[1, 2, 3]], [SamplingParams()])
    with pytest.raises(ValueError, match="needs the target's features"):
        w.prefill(["s"], None)
    with pytest.raises(ValueError, match="another target or other layers"):
        w.prefill(["s"], [torch.zeros(3, 7)])
    assert w.info()["feature_layers"] == LAYERS
    logits, _ = draft(torch.tensor([[5, 6]]), torch.zeros(1, 2, 32, dtype=torch.float64), torch.arange(2)[None])
    outside = torch.ones(97, dtype=torch.bool)
    outside[draft.token_ids] = False
    assert torch.isinf(logits[..., outside]).all() and not torch.isinf(logits[..., ~outside]).any()


def test_rows_that_never_drafted_can_leave(target, draft):
    """Under k = 0 (a profile's choice at large batches) the draft runs no forward, so its cache never
    grows to the rows that joined meanwhile; sequences leaving must still compact the rows (this crashed
    the engine under time-varying load)."""
    from serve_app.engine.policy import FixedK

    class SmallBatchesOnly(FixedK):  # speculate at batch <= 2, as a profile's table does on small batches
        def choose(self, state):
            return 1 if state.batch_size <= 2 else 0

    engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(),
                    EngineConfig(policy="fixed:1", max_batch_size=6), SmallBatchesOnly(1), eos_ids=set())
    first = [engine.submit(p, SamplingParams(max_tokens=3)) for p in PROMPTS[:2]]
    engine.step()  # the draft's cache holds two rows
    reqs = first + [engine.submit(p, SamplingParams(max_tokens=2 + 3 * i)) for i, p in enumerate(PROMPTS[2:], 2)]
    engine.run(reqs)
    refs = reference(target, PROMPTS, 17)
    assert [r.output_ids for r in reqs] == [refs[0][:3], refs[1][:3]] + [refs[i][: 2 + 3 * i] for i in range(2, 6)]


def test_prefix_cache_hands_the_draft_the_kept_features(target, draft):
    """Prompts sharing blocks, prefilled in chunks: the target takes cached blocks and hands the draft
    the features it kept beside them, so the draft proposes exactly as without caching."""
    shared = list(range(5, 45))
    prompts = [shared + [1, 2], shared + [3], shared[:30] + [7, 8, 9]]
    runs = {}
    for caching in (True, False):
        engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(),
                        EngineConfig(policy="fixed:3", max_batch_size=2, block_size=4, max_num_batched_tokens=16,
                                     prefix_caching=caching), eos_ids=set())
        steps = []
        engine.on_step.append(steps.append)
        reqs = []
        for p in prompts:
            reqs.append(engine.submit(p, SamplingParams(max_tokens=10)))
            engine.run(reqs)  # one after another: later prompts find the earlier ones' blocks
        runs[caching] = ([r.output_ids for r in reqs], [(r.stats.proposed, r.stats.accepted) for r in reqs])
        if caching:
            assert sum(st.prefix_hits for st in steps) >= 40 + 28
    assert runs[True] == runs[False]
    assert runs[True][0] == reference(target, prompts, 10)


def test_backlog_counts_only_tokens_no_verification_decided(target, draft):
    """The draft re-feeds the tokens its last proposal got accepted; predicting them again is no new evidence
    (those outcomes are already in that step's stats): a step right after a speculating one reports no
    backlog, a step after k = 0 steps scores the tokens committed meanwhile."""

    class Script:
        name = "script"
        ks = iter([0] * 5 + [3] * 6 + [0] * 3 + [2] * 100)

        def choose(self, state):
            return next(self.ks)

        def observe(self, stats):
            pass

    engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(),
                    EngineConfig(policy="fixed:3", max_batch_size=4), eos_ids=set())
    engine.policy = Script()
    seen = []
    engine.on_step.append(seen.append)
    reqs = [engine.submit(p, SamplingParams(max_tokens=24)) for p in PROMPTS[:3]]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == [x[:24] for x in reference(target, PROMPTS[:3], 24)]
    pairs = list(zip(seen, seen[1:]))
    assert sum(s.accepted for s in seen) > 0  # drafts were accepted and then re-fed
    assert all(s.backlog_checked == 0 for prev, s in pairs if prev.k and s.k)
    assert [s.backlog_checked > 0 for prev, s in pairs if not prev.k and s.k] == [True, True]
