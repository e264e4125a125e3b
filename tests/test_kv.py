"""Paged KV: blocks, block tables, prefix caching and eviction, packed forwards, rollback by position."""

import pytest
import torch

from serve_app.config import SamplingParams
from serve_app.engine.kv import TRASH, OutOfBlocks, PagedKV
from serve_app.engine.worker import ModelWorker, Proposal


def test_blocks_follow_the_tokens_and_come_back():
    kv = PagedKV(block_size=4, max_blocks=64, prefix_caching=False)
    kv.match_prefix("a", [1] * 9)
    kv.reserve("a", 9)  # 9 positions: 3 blocks
    kv.match_prefix("b", [2])
    kv.reserve("b", 1)
    assert len(kv.tables["a"]) == 3 and len(kv.tables["b"]) == 1 and kv.held_blocks() == 4
    assert TRASH not in kv.tables["a"] + kv.tables["b"]
    kv.trim("a", 5)  # a rollback to 5 valid positions keeps 2 blocks
    assert len(kv.tables["a"]) == 2
    kv.release("a")
    assert kv.held_blocks() == 1
    kv.match_prefix("c", [3] * 8)
    kv.reserve("c", 8)
    assert kv.held_blocks() == 3 and kv.num_blocks <= 1 + 16  # freed blocks are reused before the pool grows


def test_prefix_blocks_are_shared_by_reference_and_never_the_last_token():
    kv = PagedKV(block_size=4, max_blocks=64)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks, then two
    assert kv.match_prefix("a", prompt) == 0
    kv.reserve("a", 10)
    kv.commit("a", prompt, 10)
    assert kv.match_prefix("b", prompt + [99]) == 8  # both full blocks
    assert kv.tables["b"] == kv.tables["a"][:2]
    assert kv.match_prefix("c", prompt[:8]) == 4  # the block holding its last token is computed again
    assert kv.match_prefix("d", [1, 2, 3, 5] + prompt[4:]) == 0  # one token differs: nothing after it matches
    assert kv.stats.hits == 12 and kv.stats.queries == 8 + 8 + 4 + 8


def test_cached_blocks_outlive_their_sequence_until_memory_is_needed():
    kv = PagedKV(block_size=2, max_blocks=5)  # 4 usable blocks
    kv.match_prefix("a", [1, 2, 3, 4, 5])
    kv.reserve("a", 5)
    kv.commit("a", [1, 2, 3, 4, 5], 5)
    kv.release("a")
    assert len(kv.lru) == 2 and kv.held_blocks() == 0  # two named blocks kept, the partial one freed
    assert kv.match_prefix("b", [1, 2, 3, 4, 9]) == 4  # hits after the sequence left
    kv.release("b")
    kv.match_prefix("c", [7] * 7)
    kv.reserve("c", 7)  # needs all 4 blocks: the cached ones are evicted, least recently used first
    assert kv.stats.evictions == 2 and not kv.by_hash
    kv.match_prefix("d", [8])
    with pytest.raises(OutOfBlocks):
        kv.reserve("d", 1)


@pytest.mark.parametrize("backend,short_context", [("gather", 256), ("gather", 4), ("flex", 0)],
                         ids=["gather-one-group", "gather-grouped-by-context", "flex"])
def test_packed_forward_matches_the_model_alone(tiny_target, monkeypatch, backend, short_context):
    """Rows at different positions, one of them a long chunk, in one packed forward: each row's logits
    are the plain model's over its whole context, with every attention backend (gather: short rows in
    one attention call, or split by context length; flex: the pool read in place)."""
    from serve_app import pricing

    monkeypatch.setattr(pricing, "PAD_GROUP_CONTEXT", short_context)  # the gather backend groups by it
    w = ModelWorker(tiny_target, "target")
    assert w.configure_kv(block_size=4, max_blocks=256, attention_backend=backend) == backend
    prompts = {"a": list(range(3, 13)), "b": [5, 6], "c": list(range(10, 90))}
    w.add(list(prompts), list(prompts.values()), [SamplingParams()] * 3)
    w.verify(["a", "b"], Proposal.empty(2), chunks={"c": 50})  # c: a chunk of 50 of its 80 tokens
    assert w.seqs["c"].kv_len == 50 and len(w.seqs["c"].tokens) == 80
    drafts = torch.tensor([[7, 8, 9], [11, 12, 13]])
    out = w._forward(["a", "b", "c"], [w.seqs["a"].tokens[-1:] + [7, 8, 9], w.seqs["b"].tokens[-1:] + [11, 12, 13],
                                       prompts["c"][50:]], 4)  # [3, 4, V]: each row's last 4
    for b, sid in enumerate(["a", "b"]):
        ctx = w.seqs[sid].tokens + drafts[b].tolist()
        with torch.no_grad():
            ref = tiny_target(torch.tensor([ctx])).logits[0, -4:]
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref = tiny_target(torch.tensor([prompts["c"]])).logits[0, -4:]
    torch.testing.assert_close(out[2], ref, rtol=1e-4, atol=1e-4)


def test_survivors_keep_their_kv_when_others_leave(tiny_target):
    w = ModelWorker(tiny_target, "target")
    w.configure_kv(block_size=4, max_blocks=256, prefix_caching=False)
    ids = ["A", "B", "C", "D", "E"]
    prompts = [[1, 2], [3, 4, 5], [6], list(range(10, 30)), list(range(40, 52))]
    w.add(ids, prompts, [SamplingParams()] * 5)
    w.verify(ids, Proposal.empty(5))
    before = {s: _kv(w, s) for s in ("D", "E")}
    held = w.cache.held_blocks()
    w.remove(["A", "B", "C"])
    assert w.order == ["D", "E"] and w.cache.held_blocks() == held - 3
    w.add(["F"], [[9] * 30], [SamplingParams()])  # reuses the freed blocks
    w.verify(["F"], Proposal.empty(1))
    for s in ("D", "E"):
        assert torch.equal(_kv(w, s), before[s])


def test_rollback_is_only_a_length(tiny_target):
    """After a rejected draft, kv_len moves back and blocks past it return; nothing is copied."""
    w = ModelWorker(tiny_target, "target")
    w.configure_kv(block_size=4, max_blocks=256)
    w.add(["s"], [[1, 2, 3]], [SamplingParams()])
    w.cache.ensure(8)  # room for the drafts below, so any new storage would be a copy
    w.verify(["s"], Proposal.empty(1))
    seq = w.seqs["s"]
    first = seq.tokens[-1]
    with torch.no_grad():  # the target's greedy token after `first`: a draft token other than it is surely rejected
        right = int(tiny_target(torch.tensor([[1, 2, 3, first]])).logits[0, -1].argmax())
    wrong = (right + 1) % 97
    storage = w.cache.keys[0].data_ptr()
    n, _, _ = w.verify(["s"], Proposal(torch.tensor([[wrong] * 6])))[:3]  # writes positions 3..9: 3 blocks
    assert n == [0] and seq.tokens == [1, 2, 3, first, right]  # nothing accepted; the target's token recovered
    assert seq.kv_len == 4 and len(w.cache.tables["s"]) == 1  # KV holds [1, 2, 3, first]; the rest went back
    assert w.cache.keys[0].data_ptr() == storage  # no layer was copied


def test_memory_follows_tokens_not_the_longest_row(tiny_target):
    """One long sequence among short ones: blocks held = each sequence's own tokens, rounded up to a block."""
    w = ModelWorker(tiny_target, "target")
    w.configure_kv(block_size=16, max_blocks=1024, prefix_caching=False)
    lens = [600] + [20 + 7 * i for i in range(15)]
    ids = [f"s{i}" for i in range(16)]
    w.add(ids, [[5] * n for n in lens], [SamplingParams()] * 16)
    w.verify(["s0"], Proposal.empty(1))
    w.verify(ids[1:], Proposal.empty(15))
    held = sum(-(-(n) // 16) for n in lens)
    assert w.cache.held_blocks() == held
    per_block = sum(t[:16].numel() * t.element_size() for t in w.cache.keys + w.cache.values)
    assert w.cache.nbytes() <= 1.25 * held * per_block + 16 * per_block


def _kv(w, sid):
    slots = w.cache.slots(sid, torch.arange(w.seqs[sid].kv_len))
    return torch.stack([k[slots] for k in w.cache.keys]).clone()


def test_sampled_proposal_is_the_drafts_top_n_sent_sparse(tiny_target, tiny_drafts):
    """Only token ids and N numbers per drafted position leave the draft: a sampled row's q is its warped
    top-N renormalized (the token drawn is in it), greedy and seeded rows send zeros."""
    w = ModelWorker(tiny_drafts["random"], "draft")
    w.top_n = 8
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9, seed=3)]
    w.add(["g", "s", "c"], [[1, 2, 3]] * 3, params)
    prop = w.propose(["g", "s", "c"], 3)
    assert prop.tokens.shape == (3, 3) and prop.probs.shape == (3, 3, 8) and prop.support.shape == (3, 3, 8)
    assert prop.support.dtype == torch.int32
    assert torch.allclose(prop.probs[1].sum(-1), torch.ones(3))
    assert all(int(t) in prop.support[1, j].tolist() for j, t in enumerate(prop.tokens[1]))
    assert prop.probs[0].abs().sum() == 0 and prop.probs[2].abs().sum() == 0
