"""Seeded sampling through the coupled (Gumbel-max) sampler: exact target distribution, and the same
text whatever k, draft or batch."""

import asyncio
import copy
import math

import pytest
import torch

from test_engine import PROMPTS, make_engine

from serve_app.config import SamplingParams
from serve_app.engine.sampling import BLOCK, Warp, _hash32, gumbel, gumbel_argmax, noise_e, noise_key, warp_


def test_coupled_choice_samples_exactly_from_p():
    """Over seeds, the token at a position is distributed as p (a total-variation bound that the
    argmax, or a sampler reading the wrong distribution, fails)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 6000
    keys = torch.tensor([noise_key(seed, 17) for seed in range(n)], dtype=torch.int32)
    picks = gumbel_argmax(p.log()[None].expand(n, 5).contiguous(), keys)
    freq = torch.bincount(picks, minlength=5).double() / n
    tv = 0.5 * (freq - p.double()).abs().sum().item()
    assert tv < 0.025, (freq, tv)
    wrong = torch.tensor([0.4, 0.35, 0.15, 0.07, 0.03])  # power: a distribution 0.1 away is told apart
    assert 0.5 * (freq - wrong.double()).abs().sum().item() > 0.05


def _s32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _twin_hash(key: int, token: int) -> int:
    """The noise hash in plain Python integers, wrapping at 32 bits as the int32 tensors do: the same
    bits on any device with two's-complement int32 arithmetic (every CPU and GPU torch runs on)."""
    v = _s32(key + token * 0x2545F491)
    v ^= (v >> 16) & 0xFFFF
    v = _s32(v * 0x7FEB352D)
    v ^= (v >> 15) & 0x1FFFF
    v = _s32(v * 0x5BD1E995)
    v ^= (v >> 16) & 0xFFFF
    return v


def _twin_e(key: int, token: int, vocab: int) -> float:
    """E(token) by the block construction (see sampling.noise_e), from the twin's bits."""
    def expo(k, i):
        return -math.log((((_twin_hash(k, i) >> 8) & 0xFFFFFF) + 0.5) / 16777216)

    stride = vocab // BLOCK  # strided blocks: b, b + stride, ..., then the short tail block
    b, offset = (token % stride, token // stride) if token < stride * BLOCK else (stride, token - stride * BLOCK)
    size = BLOCK if b < stride else vocab % BLOCK
    e_min = expo(_s32(key + 0x3C6EF372), b) / size
    at = (_twin_hash(_s32(key + 0x1B873593), b) & 0x7FFFFFFF) % size
    return e_min if offset == at else e_min + expo(key, token)


def test_noise_matches_a_plain_integer_twin():
    keys = [noise_key(s, pos) for s, pos in [(0, 0), (1, 5), (2**40 + 3, 77), (123456789, 8191)]]
    tokens = [0, 1, 2, 1000, 1023, 1024, 49151, 49990, 49999, 50000, 128255]
    for vocab in (128256, 50001):  # strided blocks only; and a short last block (50000: its only token)
        ids = [t for t in tokens if t < vocab]
        e = noise_e(torch.tensor(keys, dtype=torch.int32), torch.tensor([ids] * len(keys)), vocab)
        twin = torch.tensor([[_twin_e(k, t, vocab) for t in ids] for k in keys], dtype=torch.float64)
        assert torch.allclose(e.double(), twin, rtol=2e-5, atol=1e-6)  # float32 -log(u) near u = 1
    bits = _hash32(torch.tensor([tokens] * len(keys), dtype=torch.int32), torch.tensor(keys, dtype=torch.int32)[:, None])
    assert bits.tolist() == [[_twin_hash(k, t) for t in tokens] for k in keys]  # the bits: exact
    assert 0 <= min(keys) and max(keys) < 2**31


def test_block_noise_is_iid_exponential():
    """Marginals Exp(1) (mean and variance 1), a block's minimum at a uniform position, tokens of one
    block as often above as below each other, the short last block too: the block construction has
    the law of iid draws."""
    n, vocab = 8000, 40 * BLOCK + BLOCK // 2  # the last block is half a block
    keys = torch.tensor([noise_key(5, i) for i in range(n)], dtype=torch.int32)
    for block, size in [(torch.arange(BLOCK) * 40, BLOCK), (40 * BLOCK + torch.arange(BLOCK // 2), BLOCK // 2)]:
        e = noise_e(keys, block[None].expand(n, -1), vocab)
        assert abs(e.mean().item() - 1) < 0.02 and abs(e.var().item() - 1) < 0.05
        where_min = torch.bincount(e.argmin(dim=1), minlength=size).float() / n
        assert (where_min - 1 / size).abs().max() < 0.02, where_min
        assert abs((e[:, 0] < e[:, size - 1]).float().mean().item() - 0.5) < 0.03


def test_coupling_noise_depends_on_seed_position_and_token_only():
    a = gumbel(torch.tensor([noise_key(3, 10)], dtype=torch.int32), None, 50)
    assert torch.equal(a, gumbel(torch.tensor([noise_key(3, 10)], dtype=torch.int32), None, 50))
    assert not torch.equal(a, gumbel(torch.tensor([noise_key(3, 11)], dtype=torch.int32), None, 50))
    assert not torch.equal(a, gumbel(torch.tensor([noise_key(4, 10)], dtype=torch.int32), None, 50))
    # the same row in a batch with others, and at a subset of its token ids: the same values
    batch = gumbel(torch.tensor([noise_key(9, 9), noise_key(3, 10)], dtype=torch.int32), None, 50)
    assert torch.equal(batch[1], a[0])
    ids = torch.tensor([[49, 3, 7]])
    assert torch.equal(gumbel(torch.tensor([noise_key(3, 10)], dtype=torch.int32), ids, 50), a[:, [49, 3, 7]])


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 40.0])
def test_bounded_gumbel_argmax_equals_the_full_vocabulary_one(scale):
    """Flat rows take the full noise, peaked ones are settled by the bound: both are the exact argmax."""
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(256, 5000, generator=g) * scale  # 5 blocks, the last one short
    logits[:8, 100:] = float("-inf")  # top-p / top-k cut rows
    keys = torch.tensor([noise_key(7, i) for i in range(256)], dtype=torch.int32)
    full = (logits + gumbel(keys, None, 5000)).max(dim=-1).indices
    assert torch.equal(gumbel_argmax(logits, keys), full)


def test_warped_coupled_choice_respects_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(300, 4).contiguous()
    w = Warp(torch.ones(300), torch.full((300,), 2), torch.ones(300))
    keys = torch.tensor([noise_key(s, 0) for s in range(300)], dtype=torch.int32)
    assert set(gumbel_argmax(warp_(logits.clone(), w), keys).tolist()) == {0, 1}


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


def test_seeded_text_through_the_cpu_kernels_is_the_same_whatever_k_and_draft(tiny_target, tiny_drafts, monkeypatch):
    """float32 models take the C kernels (the draft's coupled choice by `vocab_ops.choose`, the target's by
    `vocab_ops.verify`; float64 models, above, take torch's ops): the text is still the same at any k and draft."""
    from serve_app.engine import vocab_ops

    target = copy.deepcopy(tiny_target).float()
    drafts = {"near": copy.deepcopy(tiny_drafts["near"]).float(), "same": target}
    calls = {"choose": 0, "verify": 0}
    def counted(name, kernel):
        def call(*args):
            calls[name] += 1
            return kernel(*args)
        return call

    for name in calls:
        monkeypatch.setattr(vocab_ops, name, counted(name, getattr(vocab_ops, name)))
    seeds = [7, 8]
    alone = [run(make_engine(target, None, "none"), [p], [s], top_p=0.8)[0] for p, s in zip(PROMPTS[:2], seeds)]
    for draft, policy in [("near", "fixed:2"), ("near", "fixed:5"), ("same", "fixed:4")]:
        engine = make_engine(target, drafts[draft], policy, max_batch_size=2)
        assert run(engine, PROMPTS[:2] + PROMPTS[3:4], seeds + [1], top_p=0.8)[:2] == alone, (draft, policy)
    assert calls["choose"] and calls["verify"], calls
    engine = make_engine(target, target, "fixed:4")  # the draft's choice in C is the target's: all accepted
    req = engine.submit(PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.8, seed=5))
    engine.run([req])
    assert req.stats.proposed > 0 and req.stats.accepted == req.stats.proposed
