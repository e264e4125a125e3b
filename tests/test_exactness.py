"""Unseeded rejection sampling, end to end, against distributions enumerated from the target.

Seeded requests take the coupled sampler (same text at any k), so they never exercise the rejection test;
these requests set no seed. Each case serves one prompt many times through the engine with a real draft (an
EAGLE-3 head over a reduced vocabulary, a layer-copy draft, the n-gram draft, per-row lengths beside
prompt-lookup copies), with temperature, top-p and top-k, and compares the joint distribution of the first
the 2nd and 3rd sampled tokens (decided by the first decoding step's drafted positions 0 and 1) with the exact one by a G-test at significance 1e-4. The same test must catch a planted
acceptance bias (accept when u * q < 1.1 * p): the negative control runs the same trials under it. Each case
also checks its power: enough drafts accepted that acceptance is really exercised, and (for a model draft) the
draft's own distribution told apart from the target's by the same test.

Uniforms come from each sequence's generator, seeded from Python's `random`, which `conftest.seeded_streams`
seeds per test: a failure reproduces.
"""


import copy

import pytest
import torch

from conftest import IdTokenizer, perturbed, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.ngram import NgramDraft
from serve_app.engine import sampling, vocab_ops
from serve_app.engine.policy import FixedK
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

VOCAB = 8
ALPHA = 1e-4
TRIALS = 12_000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats itself: the n-gram draft and prompt lookup find copies


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(VOCAB, layers=2, seed=10)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # sharp enough that top-p and top-k cut, and drafts agree or not
    return model


def warped(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:  # [V] -> [V]
    """The sampling distribution, written independently of the engine: temperature, then the top_k most likely,
    then the smallest prefix (most likely first) whose mass before the last kept token is below top_p."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    kept = probs[order] * (torch.arange(len(probs)) < (top_k or len(probs)))
    kept = kept / kept.sum()
    before = kept.cumsum(0) - kept
    keep[order] = (kept > 0) & (before < top_p)
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def exact_joint(model, prompt, params: dict) -> torch.Tensor:  # [V, V]: P(second = b, third = c)
    """The joint of the 2nd and 3rd sampled tokens, summed over the 1st: the 1st comes from the prompt's
    prefill, the 2nd and 3rd from the first decoding step, decided by its drafted positions 0 and 1."""
    w = dict(temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0), top_k=params.get("top_k", 0))

    def dist(prefix):
        with torch.no_grad():
            return warped(model(torch.tensor([prefix])).logits[0, -1], **w)

    p1 = dist(prompt)
    out = torch.zeros(VOCAB, VOCAB, dtype=torch.double)
    for a in range(VOCAB):
        if p1[a] > 0:
            p2 = dist(prompt + [a])
            out += p1[a] * torch.stack([p2[b] * dist(prompt + [a, b]) if p2[b] > 0 else torch.zeros(VOCAB, dtype=torch.double)
                                        for b in range(VOCAB)])
    return out


def g_test(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value of the G-test of counts against the expected probabilities; cells expected below 5 are pooled."""
    n = counts.sum()
    e, o = (expected_p.flatten() * n).double(), counts.flatten().double()
    small = e < 5
    if small.any():
        e, o = torch.cat([e[~small], e[small].sum()[None]]), torch.cat([o[~small], o[small].sum()[None]])
    if (o[e == 0] > 0).any():  # a token the target can never emit
        return 0.0
    o, e = o[e > 0], e[e > 0]
    g = 2 * (o * torch.log(torch.where(o > 0, o / e, torch.ones_like(o)))).sum()
    df = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), g / 2))


def sample_joint(target, draft, params: dict, policy=4, prompt_lookup=False, trials=TRIALS, one_pass=False):
    """Serve the prompt `trials` times, unseeded: the 2nd and 3rd tokens' joint counts, and how often the first
    drafted token was accepted (the chance the rejection test is reached past position 0). one_pass: the workers
    take a GPU's path (`ModelWorker.one_pass`: draws kept on the device, `sampling.accept_all`)."""
    worker = draft_worker(draft, prompt_lookup=prompt_lookup) if draft is not None else None
    engine = Engine(ModelWorker(target, "target"), worker, IdTokenizer(),
                    EngineConfig(max_batch_size=256, max_k=8, max_num_tokens=1 << 20, max_num_batched_tokens=8192),
                    policy=FixedK(policy) if isinstance(policy, int) else policy, eos_ids=set())
    if one_pass:
        engine.target.one_pass = worker.one_pass = True
    reqs = [engine.submit(PROMPT, SamplingParams(max_tokens=3, **params)) for _ in range(trials)]
    engine.run(reqs)
    counts = torch.zeros(VOCAB, VOCAB)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    drafted = [r for r in reqs if r.stats.proposed]
    first = sum(r.stats.accepted_per_position[0] for r in drafted) / len(drafted) if drafted else 0.0
    return counts, first


def biased(p_x, q_x, u):  # the planted fault: accepts 10% too easily
    return u * q_x < 1.1 * p_x


def eagle3(target):
    return Eagle3Draft.from_target(target, torch.arange(1, VOCAB), [0, 1])  # reduced vocabulary: 7 of 8 tokens


def layers(target):
    return perturbed(target, 0.05, seed=3)


class Plans:
    """Per-row lengths: random caps per row and step."""

    name = "plans"

    def __init__(self):
        import random

        from serve_app.engine.draftplan import DraftPlan

        self.rng, self.plan = random.Random(5), DraftPlan

    def choose(self, state):
        return self.plan(caps=[self.rng.choice([0, 2, 3, 4, 5, 6]) for _ in range(state.batch_size)])

    def observe(self, stats):
        pass


CASES = {  # name: (draft, sampling params, policy, prompt lookup)
    "eagle3": (eagle3, {"temperature": 1.0}, 4, False),
    "eagle3-top-p": (eagle3, {"temperature": 1.3, "top_p": 0.9}, 3, False),
    "layers-top-k": (layers, {"temperature": 1.0, "top_k": 4}, 4, False),
    "ngram-top-p-top-k": (lambda t: NgramDraft(), {"temperature": 1.0, "top_p": 0.95, "top_k": 5}, 4, False),
    "per-row-lookup": (layers, {"temperature": 0.9, "top_p": 0.95}, "plans", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unseeded_sampling_is_exact(target, case):
    make, params, policy, lookup = CASES[case]
    exact = exact_joint(target, PROMPT, params)
    counts, acceptance = sample_joint(target, make(target), params, Plans() if policy == "plans" else policy, lookup)
    assert acceptance >= 0.2, f"{case}: only {acceptance:.0%} of first drafts accepted: acceptance barely exercised"
    p = g_test(counts, exact)
    assert p > ALPHA, f"{case}: the joint of tokens 1-2 differs from the target's (G-test p = {p:.2e})"


# The test's power, case by case: one case in `make test`, the others (about 100 s here) in the slow tier, which CI runs.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "per-row-lookup" else pytest.mark.slow)
                                  for c in CASES])
def test_a_planted_bias_is_caught(target, case, monkeypatch):
    make, params, policy, lookup = CASES[case]
    draft = make(target)
    exact = exact_joint(target, PROMPT, params)
    pick = (lambda: Plans()) if policy == "plans" else (lambda: policy)
    # power: the planted bias is caught by the G-test above on twice the trials (on as many, p lands within a few
    # powers of ten of ALPHA: a random stream can miss it)
    monkeypatch.setattr(sampling, "accept_rejection", biased)
    bad, _ = sample_joint(target, draft, params, pick(), lookup, trials=2 * TRIALS)
    assert g_test(bad, exact) < ALPHA, f"{case}: a 10% acceptance bias went unnoticed"
    monkeypatch.undo()
    if isinstance(draft, torch.nn.Module) and not isinstance(draft, Eagle3Draft):
        alone, _ = sample_joint(draft, None, params, 0, trials=TRIALS // 4)  # the draft's own text
        assert g_test(alone, exact) < ALPHA, f"{case}: the draft alone passes for the target: no power"


@pytest.mark.slow  # ~10 s; `accept_all` gives the walk's tokens from the same randomness (tests/test_speculative.py)
def test_unseeded_sampling_in_one_pass_is_exact(target, monkeypatch):
    """A GPU's path (`one_pass`: the draft's draws kept on the device, every row and position decided at once by
    `sampling.accept_all`) on the torch ops: the exact joint (the G-test's power: the planted-bias tests above, which
    `accept_all` would fail as the walk does: it calls the same `accept_rejection`)."""
    from serve_app.engine import worker

    make, params, _, _ = CASES["layers-top-k"]
    draft = make(target)
    exact = exact_joint(target, PROMPT, params)
    calls, real = [], worker.accept_all
    monkeypatch.setattr(worker, "accept_all", lambda *a: calls.append(1) or real(*a))
    counts, acceptance = sample_joint(target, draft, params, 4, one_pass=True)
    assert calls  # the one-pass verdicts were the ones counted
    assert acceptance >= 0.2 and g_test(counts, exact) > ALPHA, (acceptance, g_test(counts, exact))


@pytest.mark.parametrize("case", ["eagle3-top-p", "layers-top-k", "per-row-lookup"])
def test_unseeded_sampling_through_the_cpu_kernels_is_exact(target, case, monkeypatch):
    """A float32 target and draft take the C kernels (`vocab_ops.draft_sample` for the draft's q and draw,
    `vocab_ops.verify` for the target's test and recovered token; a float64 model takes torch's ops): the same
    joint as the exact one, and an acceptance bias planted in the kernel's test (its uniforms scaled) caught: 25%,
    where the torch path's test above plants 10% (the same choices bit for bit, so the same power; at 10% some of
    these cases' drafts sit too close to the target for the trials to tell)."""
    target32 = copy.deepcopy(target).float()
    make, params, policy, lookup = CASES[case]
    draft = make(target32)
    exact = exact_joint(target, PROMPT, params)
    pick = (lambda: Plans()) if policy == "plans" else (lambda: policy)
    calls = {"verify": 0, "draft_sample": 0}
    kernels = {name: getattr(vocab_ops, name) for name in calls}

    def spy(name, bias=1.0):
        def call(*args):
            calls[name] += 1
            if bias != 1.0:  # u * q < bias * p, as u / bias * q < p
                args = args[:10] + (args[10] / bias,) + args[11:]
            return kernels[name](*args)
        return call

    monkeypatch.setattr(vocab_ops, "verify", spy("verify"))
    monkeypatch.setattr(vocab_ops, "draft_sample", spy("draft_sample"))
    counts, acceptance = sample_joint(target32, draft, params, pick(), lookup)
    assert calls["verify"] and calls["draft_sample"], f"{case}: the kernels were not reached: {calls}"
    assert acceptance >= 0.2, f"{case}: only {acceptance:.0%} of first drafts accepted"
    p = g_test(counts, exact)
    assert p > ALPHA, f"{case}: the joint of tokens 1-2 differs from the target's (G-test p = {p:.2e})"
    monkeypatch.setattr(vocab_ops, "verify", spy("verify", bias=1.25))
    bad, _ = sample_joint(target32, draft, params, pick(), lookup)
    assert g_test(bad, exact) < ALPHA, f"{case}: a 25% acceptance bias in the kernel went unnoticed"
