"""Seeded sampling through the coupled (Gumbel-max) sampler: exact target distribution, and the same
text whatever k, draft or batch."""

import asyncio

import pytest
import torch

from test_engine import PROMPTS, make_engine

from serve_app.config import SamplingParams
from serve_app.engine.speculative import coupled_choice, coupling_noise, warp_probs


def test_coupled_choice_samples_exactly_from_p():
    """Over seeds, the token at a position is distributed as p (a total-variation bound that the
    argmax, or a sampler reading the wrong distribution, fails)."""
    p = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]])
    n = 6000
    picks = torch.stack([coupled_choice(p, coupling_noise(seed, 17, 5)[None]) for seed in range(n)]).flatten()
    freq = torch.bincount(picks, minlength=5).double() / n
    tv = 0.5 * (freq - p[0].double()).abs().sum().item()
    assert tv < 0.025, (freq, tv)
    wrong = torch.tensor([[0.4, 0.35, 0.15, 0.07, 0.03]])  # power: a distribution 0.1 away is told apart
    assert 0.5 * (freq - wrong[0].double()).abs().sum().item() > 0.05


def test_coupling_noise_depends_on_seed_and_position_only():
    a = coupling_noise(3, 10, 50)
    assert torch.equal(a, coupling_noise(3, 10, 50))
    assert not torch.equal(a, coupling_noise(3, 11, 50)) and not torch.equal(a, coupling_noise(4, 10, 50))


def test_warped_coupled_choice_respects_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = warp_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    picks = {coupled_choice(p, coupling_noise(s, 0, 4)[None]).item() for s in range(300)}
    assert picks == {0, 1}


def run(engine, prompts, seeds, max_tokens=24, temperature=0.9, top_p=1.0):
    async def one(p, seed):
        return sum([o.token_ids async for o in engine.generate(p, SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed))], [])

    async def main():
        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds)))

    return asyncio.run(main())


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_seeded_text_is_the_same_whatever_k_draft_and_batch(tiny_target, tiny_drafts, top_p):
    seeds = [7, 8, 9]
    alone = [run(make_engine(tiny_target, None, "none"), [p], [s], top_p=top_p)[0] for p, s in zip(PROMPTS[:3], seeds)]
    assert len({tuple(x) for x in alone}) == 3
    for draft, policy in [("near", "fixed:1"), ("near", "fixed:3"), ("random", "fixed:7"), ("same", "fixed:4")]:
        engine = make_engine(tiny_target, tiny_drafts[draft], policy, max_batch_size=2)  # a batch, with joins
        together = run(engine, PROMPTS[:3] + PROMPTS[3:5], seeds + [1, 2], top_p=top_p)
        assert together[:3] == alone, (draft, policy)
    # another seed gives another text
    assert run(make_engine(tiny_target, None, "none"), PROMPTS[:1], [70], top_p=top_p)[0] != alone[0]


def test_coupled_drafts_are_accepted_when_the_draft_is_the_target(tiny_target, tiny_drafts):
    """Same model as draft, same noise: every proposal is the target's own choice."""
    engine = make_engine(tiny_target, tiny_drafts["same"], "fixed:4")
    req = engine.submit(PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0, seed=5))
    engine.run([req])
    assert req.stats.proposed > 0 and req.stats.accepted == req.stats.proposed


def test_seeded_text_holds_when_k_changes_every_step(tiny_target, tiny_drafts):
    """What lut / adaptive do under varying load, at its most extreme: a new k at every step."""
    class Cycle:
        name = "cycle"
        ks, i = [3, 0, 1, 7, 2, 0, 5], 0

        def choose(self, state):
            self.i += 1
            return self.ks[self.i % len(self.ks)]

        def observe(self, stats):
            pass

    alone = run(make_engine(tiny_target, None, "none"), PROMPTS[:2], [21, 22])
    engine = make_engine(tiny_target, tiny_drafts["near"], "none", max_batch_size=4)
    engine.policy = Cycle()
    assert run(engine, PROMPTS[:2], [21, 22]) == alone
