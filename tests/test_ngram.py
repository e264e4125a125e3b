"""The n-gram (prompt-lookup) draft: lossless greedy and sampled decoding, its index, and `--draft ngram`."""

import json
import random

import pytest
import torch

from conftest import IdTokenizer
from test_engine import reference
from serve_app.cli import main
from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.ngram import NgramDraft, NgramWorker
from serve_app.models import display_name, load_draft, model_names
from serve_app.engine.scheduler import Engine
from serve_app.engine.sampling import Warp, warp_
from serve_app.engine.worker import ModelWorker

PROMPTS = [[1, 2, 3], [5] * 11, list(range(10, 40)), [7, 8], [42], [5, 6, 7, 8] * 5, list(range(60, 50, -1))]


@pytest.fixture(scope="module")
def ref24(tiny_target):
    return reference(tiny_target, PROMPTS, 24)


def ngram_engine(target, policy, draft=None, **cfg):
    return Engine(ModelWorker(target, "target"), NgramWorker(draft or NgramDraft()), IdTokenizer(),
                  EngineConfig(policy=policy, **cfg), eos_ids=set())


def lookup(tokens, k, min_n, max_n):
    """Brute force of what NgramWorker proposes: scan for the most recent earlier occurrence of the
    longest suffix, copy the k tokens after it (reading its own copy once it runs past the end)."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[len(tokens) - n:]:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[e + i])
                return ext[len(tokens):]
    # no match: the most frequent token, ties going to the one that reached the top count first
    counts: dict[int, int] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    top = max(counts.values())
    seen: dict[int, int] = {}
    for t in tokens:
        seen[t] = seen.get(t, 0) + 1
        if seen[t] == top:
            return [t] * k


# ---- lossless decoding through the engine ---------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identical_to_target_alone(tiny_target, ref24, k):
    # batch 4 < 7 prompts: later ones join mid-flight as rows with fewer max_tokens leave
    engine = ngram_engine(tiny_target, f"fixed:{k}", max_batch_size=4)
    lengths = [24 - 3 * (i % 4) for i in range(len(PROMPTS))]
    reqs = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, lengths)]
    engine.run(reqs)
    for i, (r, n) in enumerate(zip(reqs, lengths)):
        assert r.output_ids == ref24[i][:n], (i, k)
    assert engine.running == [] and engine.draft.order == [] and engine.draft.seqs == {}
    # tiny random models loop, so their own context predicts them: speculation pays
    accepted, steps = sum(r.stats.accepted for r in reqs), sum(r.stats.steps for r in reqs)
    assert accepted > 0 and 1 + accepted / steps > 1.2, (accepted, steps)


def test_repetitive_prompt_gives_more_than_one_token_per_step(tiny_target):
    prompt = [5, 6, 7, 8] * 5
    (ref,) = reference(tiny_target, [prompt], 30)
    engine = ngram_engine(tiny_target, "fixed:4", max_batch_size=1)
    (req,) = [engine.submit(prompt, SamplingParams(max_tokens=30))]
    engine.run([req])
    assert req.output_ids == ref
    assert req.stats.accepted > 0 and (1 + req.stats.accepted / req.stats.steps) > 1.5, req.stats


def test_draft_scores_its_backlog_after_steps_without_speculation(tiny_target, ref24):
    """Tokens committed with no proposal outstanding (the first one after prefill, then one per k = 0
    step) are scored against what the draft would have proposed; speculating steps add nothing."""

    class Script:
        name = "script"
        ks = iter([0] * 6 + [2] + [0] * 5 + [1] * 100)

        def choose(self, state):
            return next(self.ks)

        def observe(self, stats):
            pass

    engine = ngram_engine(tiny_target, "none", max_batch_size=4)
    engine.policy = Script()
    seen = []
    engine.on_step.append(seen.append)
    reqs = [engine.submit(p, SamplingParams(max_tokens=24)) for p in PROMPTS[:3]]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == ref24[:3]
    spec = [s for s in seen if s.k]
    assert (spec[0].backlog_checked, spec[1].backlog_checked) == (3 * 7, 3 * 5)
    assert all(s.backlog_checked == 0 for s in spec[2:]) and all(s.backlog_checked == 0 for s in seen if not s.k)
    # the loops of tiny models are predictable from their own context, not perfectly
    assert 0 < spec[0].backlog_matched <= spec[0].backlog_checked


def test_seeded_sampled_tokens_follow_the_target_distribution(tiny_target):
    """Many seeded requests at one context (the coupled sampler; unseeded rejection sampling with the n-gram
    draft is checked in tests/test_exactness.py): the joint distribution of the first three emitted tokens
    matches the target's own (temperature 0.1, top-k 2: the tiny model's logits are nearly flat, this
    makes its top token about 70% likely), computed exactly from its forwards. The first comes from
    prefill, the next two from one speculation step whose drafts get accepted often (the prompt ends
    inside the target's own greedy loop, which the draft copies), so drafts are accepted
    and rejected often. A greedy row shares the
    batch (its q rows are zeros) and must still match greedy decoding."""
    seed_prompt = [1, 2, 3]
    (greedy,) = reference(tiny_target, [seed_prompt], 30)
    prompt = seed_prompt + greedy[:20]
    params = dict(temperature=0.1, top_k=2, max_tokens=3)

    def target_p(ctx):  # warped target distribution after ctx: [V]
        with torch.no_grad():
            logits = tiny_target(torch.tensor([ctx])).logits[:, -1]
        w = Warp(torch.tensor([params["temperature"]]), torch.tensor([params["top_k"]]), torch.ones(1))
        return warp_(logits.float(), w).softmax(-1)[0].double()

    exact = {}  # (t1, t2, t3) -> probability
    p1 = target_p(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = target_p(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = target_p(prompt + [a, b])
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])

    trials = 4000
    engine = ngram_engine(tiny_target, "fixed:2", max_batch_size=64)
    reqs = [engine.submit(prompt, SamplingParams(seed=i, **params)) for i in range(trials)]
    greedy_req = engine.submit(prompt, SamplingParams(max_tokens=3))
    engine.run(reqs + [greedy_req])
    assert greedy_req.output_ids == greedy[20:23]
    counts: dict = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(x, 0) / trials - p) for x, p in exact.items())
    # E[TV] <= 0.5 * sqrt(cells / trials) ~ 0.022 for 8 cells; a wrong residual moves it by > 0.1
    assert tv < 0.035, (tv, counts, exact)
    accepted, proposed = sum(r.stats.accepted for r in reqs), sum(r.stats.proposed for r in reqs)
    assert accepted > 0.2 * proposed, (accepted, proposed)  # 0.33 here: both paths well used
    # power: the draft's own (deterministic) continuation is far from what the target samples
    loop = (greedy[20], greedy[21], greedy[22])
    assert exact[loop] < 0.6 and abs(counts[loop] / trials - exact[loop]) < 0.03


def test_sampled_proposal_is_sparse_one_hot():
    w = NgramWorker(NgramDraft())
    w.add(["g", "s"], [[1, 2, 3, 1, 2], [4, 5, 4, 6]], [SamplingParams(), SamplingParams(temperature=0.8)])
    prop = w.propose(["g", "s"], 3)
    # "1 2" recurs: copy what followed it, then its own copy (a loop of period 3); 6 is new: filler 4
    assert prop.tokens.tolist() == [[3, 1, 2], [4, 4, 4]]
    assert prop.probs.shape == (2, 3, 1) and prop.support.shape == (2, 3, 1)
    dense = torch.zeros(2, 3, 10).scatter_(-1, prop.support.long(), prop.probs)  # [B, k, V]
    assert dense[0].sum() == 0  # greedy row: q unused, zeros as ModelWorker sends
    assert torch.equal(dense[1], torch.nn.functional.one_hot(prop.tokens[1], 10).float())


# ---- the index ------------------------------------------------------------------------------------
def test_index_matches_brute_force_through_commits_and_removals():
    """Random sequences over a small vocabulary grow by random chunks while others leave and join:
    every proposal equals the brute-force scan, survivors keep their order."""
    rng = random.Random(0)
    for min_n, max_n in [(1, 4), (2, 3), (1, 1)]:
        w = NgramWorker(NgramDraft(min_n, max_n))
        tokens: dict[str, list[int]] = {}
        next_id = 0
        for step in range(300):
            if len(tokens) < 6 and rng.random() < 0.3:
                new = [f"s{next_id + i}" for i in range(rng.randint(1, 3))]
                next_id += len(new)
                prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in new]
                w.add(new, prompts, [SamplingParams()] * len(new))
                tokens.update(zip(new, (list(p) for p in prompts)))
            if tokens and rng.random() < 0.15:
                gone = set(rng.sample(sorted(tokens), rng.randint(1, len(tokens))))
                expected = [s for s in w.order if s not in gone]
                w.remove(list(gone))
                assert w.order == expected and set(w.seqs) == set(expected)
                for sid in gone:
                    del tokens[sid]
            if not tokens:
                continue
            ids = list(w.order)
            k = rng.randint(1, 6)
            prop = w.propose(ids, k).tokens.tolist()
            assert prop == [lookup(tokens[s], k, min_n, max_n) for s in ids], (step, min_n, max_n)
            new_tokens = [[rng.randrange(5) for _ in range(rng.randint(1, k + 1))] for _ in ids]
            w.commit(ids, new_tokens)
            for sid, new in zip(ids, new_tokens):
                tokens[sid] += new


def test_sequences_must_be_known_and_new():
    w = NgramWorker(NgramDraft())
    w.add(["a", "b", "c"], [[1], [2], [3]], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="already exists"):
        w.add(["a"], [[1]], [SamplingParams()])
    assert w.propose(["c", "a"], 2).tokens.shape == (2, 2)  # any subset, any order
    with pytest.raises(KeyError, match="unknown sequence"):
        w.prefill(["zz"])
    w.remove(["a"])
    assert w.order == ["b", "c"]


def test_bad_settings_are_refused():
    for lo, hi in [(0, 3), (3, 2)]:
        with pytest.raises(ValueError, match="min_n"):
            NgramDraft(lo, hi)


# ---- wiring: models, draft_worker, CLI --------------------------------------------------------------
def test_ngram_spec_loads_without_a_model(tiny_model_dirs):
    draft = load_draft("ngram", None, None)
    assert isinstance(draft, NgramDraft) and isinstance(draft_worker(draft), NgramWorker)
    assert display_name("ngram") == "ngram"
    assert model_names(ModelConfig(target=tiny_model_dirs["target"], draft="ngram"))[1] == "ngram"
    info = draft_worker(draft).info()
    assert info["role"] == "draft" and not info.get("feature_layers")


def test_generate_with_ngram_draft_equals_plain_decoding(tmp_path, tiny_model_dirs):
    prompts = tmp_path / "in.jsonl"
    lines = [{"prompt": "the cat sat on the mat the cat sat on the"}, {"prompt": "a big red dog", "max_tokens": 5},
             {"messages": [{"role": "user", "content": "the dog ran to the dog"}]}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")

    def generate(*extra):
        out = tmp_path / f"out{len(extra)}.jsonl"
        code = main(["generate", "--prompts", str(prompts), "--out", str(out), "--target", tiny_model_dirs["target"],
                     "--max-tokens", "16", *extra])
        assert code == 0
        return [json.loads(x) for x in out.read_text().splitlines()]

    plain = generate("--policy", "none")
    spec = generate("--draft", "ngram", "--policy", "fixed:3", "--batch-size", "2")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    assert sum(r["stats"]["proposed"] for r in spec) > 0
