"""Log-probabilities of generated tokens: the target's own, the same with and without speculation."""

import pytest
import torch

from test_engine import PROMPTS, make_engine

from serve_app.config import SamplingParams


def generate(engine, prompt, **params):
    req = engine.submit(prompt, SamplingParams(max_tokens=12, logprobs=3, **params))
    lps = []
    while not req.finished:
        lps += [lp for r, o in engine.step() if r is req for lp in (o.logprobs or [])]
    return req.output_ids, lps


@pytest.mark.parametrize("params", [{}, {"temperature": 1.0, "seed": 5}])
def test_logprobs_are_the_targets_at_any_k(tiny_target, tiny_drafts, params):
    ids, plain = generate(make_engine(tiny_target, None, "none"), PROMPTS[2], **params)
    for draft, policy in [("near", "fixed:3"), ("random", "fixed:2"), ("same", "fixed:5")]:
        ids2, spec = generate(make_engine(tiny_target, tiny_drafts[draft], policy), PROMPTS[2], **params)
        assert ids2 == ids and len(spec) == len(ids)
        for (lp, alts), (lp2, alts2) in zip(plain, spec):
            assert lp2 == pytest.approx(lp, abs=1e-9)
            assert [a for a, _ in alts2] == [a for a, _ in alts]
    # ...and they are what one forward of the target over prompt + output says
    with torch.inference_mode():
        full = torch.log_softmax(tiny_target(torch.tensor([PROMPTS[2] + ids])).logits[0].double(), -1)
    n = len(PROMPTS[2])
    for j, (t, (lp, alts)) in enumerate(zip(ids, plain)):
        row = full[n - 1 + j]
        assert lp == pytest.approx(row[t].item(), abs=1e-9)
        assert [a for a, _ in alts] == row.topk(3).indices.tolist()
        if not params:  # greedy: the token is the top alternative
            assert alts[0][0] == t


def test_no_logprobs_unless_asked(tiny_target, tiny_drafts):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2")
    req = engine.submit(PROMPTS[0], SamplingParams(max_tokens=6))
    outs = []
    while not req.finished:
        outs += [o for r, o in engine.step() if r is req]
    assert all(o.logprobs is None for o in outs)
