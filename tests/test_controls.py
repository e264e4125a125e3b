"""A request's logit controls (penalties, logit_bias, min_tokens, stop ids, bad words) under speculation:
greedy output identical at any k to a plain reference decoder applying the same controls, seeded text
the same at any k, sampling exact; and the pure `Controls` against a dense reference."""

import pytest
import torch

from conftest import IdTokenizer, assert_marginals, sharp_pair, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine.controls import Controls
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

PROMPTS = [[1, 2, 3], [5] * 11, list(range(10, 40)), [7, 8], [42], list(range(60, 50, -1))]
EOS = 3


def reference_controls(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The controls written plainly over a dense row: what the engine must match."""
    x = logits.clone().double()
    if len(out) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids)):
            x[t] = float("-inf")
    for word in p.bad_words_ids:
        if out[len(out) - len(word) + 1:] == word[:-1] if len(word) > 1 else True:
            x[word[-1]] = float("-inf")
    for t, v in p.logit_bias.items():
        x[t] += v
    seen = set(out) | (set(prompt) if p.repetition_penalty != 1.0 else set())
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = out.count(t)
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return x


def reference_greedy(target, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    while len(out) < p.max_tokens:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(reference_controls(logits, prompt, out, p).argmax()))
        if out[-1] in p.stop_token_ids or (out[-1] == EOS and not p.ignore_eos):
            break
    return out


def make_engine(target, draft, policy, eos_ids=(EOS,), **cfg):
    return Engine(ModelWorker(target, "target"), ModelWorker(draft, "draft") if draft is not None else None,
                  IdTokenizer(), EngineConfig(policy=policy, **cfg), eos_ids=set(eos_ids))


CONTROLS = [
    {},  # a plain row in the same batch is unaffected
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"repetition_penalty": 1.8},
    {"logit_bias": {7: 4.0, 11: -100.0, 12: 2.5}},
    {"min_tokens": 12, "logit_bias": {EOS: 6.0}},  # EOS wants out early; banned until 12 tokens
    {"stop_token_ids": [9, 21], "presence_penalty": -1.0},
    {"frequency_penalty": 0.7, "repetition_penalty": 1.2, "logit_bias": {30: 1.0}, "min_tokens": 3},
    {"logit_bias": {44: 3.0}, "frequency_penalty": 2.0},  # 44 twice, then never: only if drafts count
]


def params(c: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, **c, **kw)


@pytest.fixture(scope="module")
def eos_target():
    return tiny_llama(97, layers=2, seed=0, eos=EOS)


@pytest.fixture(scope="module")
def near_draft(eos_target):
    from conftest import perturbed
    return perturbed(eos_target, 0.01)


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_greedy_with_controls_identical_to_reference_at_any_k(eos_target, near_draft, k):
    engine = make_engine(eos_target, near_draft, f"fixed:{k}", max_batch_size=4)
    jobs = [(PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate(CONTROLS)]
    reqs = [engine.submit(p, params(c)) for p, c in jobs]
    engine.run(reqs)
    for (prompt, c), r in zip(jobs, reqs):
        full = params(c).model_copy(update={"eos_token_ids": [EOS]})
        assert r.output_ids == reference_greedy(eos_target, prompt, full), (c, k)
    if k:
        assert sum(r.stats.accepted for r in reqs) > 0  # drafts were accepted under the controls


def test_greedy_with_controls_identical_to_reference_with_ragged_rows(eos_target, near_draft):
    """Per-row plans: rows stop drafting at different positions and later draft forwards run over fewer rows,
    whose controls still count each row's own drafts."""
    from test_per_row import RandomPlans

    engine = Engine(ModelWorker(eos_target, "target"), ModelWorker(near_draft, "draft"), IdTokenizer(),
                    EngineConfig(max_batch_size=4), policy=RandomPlans(5), eos_ids={EOS})
    jobs = [(PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate(CONTROLS)]
    reqs = [engine.submit(p, params(c)) for p, c in jobs]
    engine.run(reqs)
    for (prompt, c), r in zip(jobs, reqs):
        full = params(c).model_copy(update={"eos_token_ids": [EOS]})
        assert r.output_ids == reference_greedy(eos_target, prompt, full), c
    assert sum(r.stats.accepted for r in reqs) > 0


def test_controls_change_the_output_and_stop_ids_end_it(eos_target, near_draft):
    engine = make_engine(eos_target, near_draft, "fixed:3")
    plain = engine.submit(PROMPTS[0], params({}))
    banned = engine.submit(PROMPTS[0], params({}, logit_bias={t: -100.0 for t in range(0, 97, 2)}))
    forced = engine.submit(PROMPTS[0], params({}, logit_bias={44: 100.0}))
    stop = engine.submit(PROMPTS[0], params({}, logit_bias={44: 100.0}, stop_token_ids=[44]))
    engine.run([plain, banned, forced, stop])
    assert any(t % 2 == 0 for t in plain.output_ids) and all(t % 2 for t in banned.output_ids)
    assert forced.output_ids == [44] * 16
    assert stop.output_ids == [44] and stop.finished


def test_bad_words_never_appear(eos_target, near_draft):
    class Words(IdTokenizer):  # "w<id>" spells a token; words of several tokens are their ids
        def encode(self, text, add_special_tokens=False):
            return [int(w[1:]) for w in text.split()]

    ref = make_engine(eos_target, near_draft, "fixed:3")
    r0 = ref.submit(PROMPTS[2], params({}))
    ref.run([r0])
    a, pair = r0.output_ids[1], r0.output_ids[5:7]  # ban a single token, and a pair that occurs
    for k in (0, 3):
        engine = Engine(ModelWorker(eos_target, "target"), ModelWorker(near_draft, "draft"), Words(),
                        EngineConfig(policy=f"fixed:{k}"), eos_ids={EOS})
        r = engine.submit(PROMPTS[2], params({}, bad_words=[f"w{a}", f"w{pair[0]} w{pair[1]}"]))
        engine.run([r])
        assert a not in r.output_ids
        assert all(r.output_ids[i:i + 2] != pair for i in range(len(r.output_ids)))
        full = r.params
        assert r.output_ids == reference_greedy(eos_target, PROMPTS[2], full)


def test_seeded_sampling_with_controls_is_the_same_text_at_any_k(eos_target, near_draft):
    texts = []
    for k in (0, 1, 3, 7):
        engine = make_engine(eos_target, near_draft, f"fixed:{k}", max_batch_size=8)
        reqs = [engine.submit(PROMPTS[i % 6], params(c, temperature=0.9, top_p=0.95, seed=100 + i, min_p=0.05 * (i % 3)))
                for i, c in enumerate(CONTROLS)]
        engine.run(reqs)
        texts.append([r.output_ids for r in reqs])
    assert texts[0] == texts[1] == texts[2] == texts[3]


def test_sampling_with_controls_follows_the_controlled_target_distribution():
    """Tokens 2 and 3 (decided by draft + rejection sampling with penalties counting the drafts before
    them) match the exact marginals of the target under the same controls."""
    vocab, trials = 6, 2400
    target, draft = sharp_pair(vocab, 30)
    prompt = [1, 2, 3]
    p = SamplingParams(max_tokens=3, temperature=1.0, frequency_penalty=1.2, presence_penalty=0.4,
                       repetition_penalty=1.3, logit_bias={0: 1.0}, min_p=0.3)

    def dist(prefix):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + prefix])).logits[0, -1]
        x = reference_controls(logits, prompt, prefix, p)
        return x.masked_fill(x < x.max() + torch.log(torch.tensor(p.min_p)), float("-inf")).softmax(-1)

    p1 = dist([])
    p2 = {a: dist([a]) for a in range(vocab)}
    t2 = sum(p1[a] * p2[a] for a in range(vocab))
    t3 = sum(p1[a] * p2[a][b] * dist([a, b]) for a in range(vocab) for b in range(vocab))
    engine = make_engine(target, draft, "fixed:3", eos_ids=(), max_batch_size=64, max_num_tokens=100_000)
    reqs = [engine.submit(prompt, p) for _ in range(trials)]
    engine.run(reqs)
    assert sum(r.stats.accepted for r in reqs) > 0.05 * sum(r.stats.proposed for r in reqs)
    assert_marginals(reqs, t2, t3, vocab, tol=0.045)
    plain = SamplingParams(max_tokens=3, temperature=1.0)
    with torch.no_grad():  # without the controls the law is measurably different: the check has power
        u2 = sum(target(torch.tensor([prompt])).logits[0, -1].softmax(-1)[a]
                 * target(torch.tensor([prompt + [a]])).logits[0, -1].softmax(-1) for a in range(vocab))
    assert (u2 - t2).abs().sum() / 2 > 0.1, plain


def test_controls_against_a_dense_reference_with_drafts_counted():
    torch.manual_seed(0)
    vocab = 50
    ps = [SamplingParams(frequency_penalty=0.8, presence_penalty=-0.3, repetition_penalty=1.5, logit_bias={3: 2.0}),
          SamplingParams(),
          SamplingParams(min_tokens=4, stop_token_ids=[7], eos_token_ids=[1], bad_words_ids=[[5], [8, 9]])]
    ps = [p.model_copy(update={"eos_token_ids": p.eos_token_ids or [1]}) for p in ps]
    contexts = [[4, 4, 6, 3, 3, 3, 10], [1, 2], [8, 2, 2, 8]]
    prompt_lens = [3, 1, 2]
    drafts = [[3, 12, 4], [5, 5, 5], [9, 8, 1]]
    c = Controls(ps, contexts, prompt_lens, [None] * 3, "cpu")
    logits = torch.randn(3, vocab) * 3
    for j in range(4):
        rows = torch.tensor([0, 2]) if j == 2 else torch.arange(3)  # a row that left the walk
        got = c.apply(logits[rows].clone(), rows, j, torch.tensor(drafts))
        for i, b in enumerate(rows.tolist()):
            prompt, out = contexts[b][: prompt_lens[b]], contexts[b][prompt_lens[b]:] + drafts[b][:j]
            want = reference_controls(logits[b], prompt, out, ps[b])
            torch.testing.assert_close(got[i].double(), want.float().double(), msg=f"row {b} position {j}")


def test_out_of_vocabulary_ids_are_refused(eos_target):
    engine = make_engine(eos_target, None, "fixed:0")
    for bad in ({"logit_bias": {500: 1.0}}, {"stop_token_ids": [-1]}):
        with pytest.raises(ValueError, match="token ids must be in"):
            engine.submit([1, 2], params(bad))


def test_min_p_one_samples_the_most_likely_token(eos_target, near_draft):
    """min_p = 1 keeps only the most likely token: sampled and seeded rows decode greedily, at any k."""
    want = []
    for k in (0, 3):
        engine = make_engine(eos_target, near_draft, f"fixed:{k}", max_batch_size=4)
        greedy = [engine.submit(p, params({})) for p in PROMPTS[:3]]
        sampled = [engine.submit(p, params({}, temperature=1.0, min_p=1.0, seed=i if i % 2 else None))
                   for i, p in enumerate(PROMPTS[:3])]
        engine.run(greedy + sampled)
        assert [r.output_ids for r in sampled] == [r.output_ids for r in greedy]
        want.append([r.output_ids for r in greedy])
    assert want[0] == want[1]
