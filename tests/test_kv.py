"""KV bookkeeping: ragged inputs, masks, row compaction, rollback by position."""

import torch

from serve_app.config import SamplingParams
from serve_app.engine.kv import causal_mask, compact_rows, ragged_inputs
from serve_app.engine.worker import ModelWorker


def test_ragged_inputs_left_pad_with_positions_past_real_tokens():
    ids, pos = ragged_inputs([[5, 6, 7], [9]], [0, 4], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert pos.tolist() == [[0, 1, 2], [5, 6, 4]]  # pads sit at 5, 6: after row 1's real token at 4


def test_causal_mask_from_positions():
    pos = torch.tensor([[2, 3], [0, 1]])
    m = causal_mask(pos, 4, None)
    assert m.shape == (2, 1, 2, 4)
    assert m[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert m[1, 0].tolist() == [[True, False, False, False], [True, True, False, False]]
    additive = causal_mask(pos, 4, torch.float32)
    assert additive[1, 0, 0, 1] == torch.finfo(torch.float32).min and additive[1, 0, 0, 0] == 0


def test_compact_rows_fills_holes_from_the_end():
    order, moves = compact_rows(["A", "B", "C", "D", "E"], {"A", "B", "C"})
    assert order == ["E", "D"]
    assert moves == [(4, 2), (3, 1), (2, 0)]  # the last move copies E again, from row 2
    assert compact_rows(["A", "B"], {"B"}) == (["A"], [])


def test_worker_keeps_survivors_kv_when_many_leave_at_once(tiny_target):
    """Regression: a row moved earlier in the same eviction must be copied with its own length."""
    w = ModelWorker(tiny_target, "target")
    ids = ["A", "B", "C", "D", "E"]
    prompts = [[1, 2], [3, 4, 5], [6], list(range(10, 30)), list(range(40, 52))]
    w.add(ids, prompts, [SamplingParams()] * 5)
    w.verify(ids, _empty(5))
    before = {s: _row(w, s) for s in ("D", "E")}
    w.remove(["A", "B", "C"])
    assert w.order == ["E", "D"]
    for s in ("D", "E"):
        assert torch.equal(_row(w, s), before[s])


def test_rollback_is_only_a_length(tiny_target):
    """After a rejected draft, the KV row keeps its storage; only kv_len moves back."""
    from serve_app.engine.worker import Proposal

    w = ModelWorker(tiny_target, "target")
    w.add(["s"], [[1, 2, 3]], [SamplingParams()])
    w.verify(["s"], _empty(1))
    seq = w.seqs["s"]
    storage = w.cache.keys[0].data_ptr()
    first = seq.tokens[-1]
    with torch.no_grad():  # the target's greedy token after `first`: a draft token other than it is surely rejected
        right = int(tiny_target(torch.tensor([[1, 2, 3, first]])).logits[0, -1].argmax())
    wrong = (right + 1) % 97
    n, _, _ = w.verify(["s"], Proposal(torch.tensor([[wrong, wrong, wrong]])))[:3]
    assert n == [0] and seq.tokens == [1, 2, 3, first, right]  # nothing accepted; the target's token recovered
    assert seq.kv_len == 4 and w.cache.keys[0].data_ptr() == storage  # KV holds [1, 2, 3, first] and no more


def _empty(b):
    from serve_app.engine.worker import Proposal

    return Proposal(torch.zeros((b, 0), dtype=torch.long))


def _row(w, sid):
    seq, row = w.seqs[sid], w.order.index(sid)
    return torch.stack([k[row, :, : seq.kv_len] for k in w.cache.keys]).clone()


def test_sampled_proposal_is_the_drafts_top_n_sent_sparse(tiny_target, tiny_drafts):
    """Only token ids and N numbers per drafted position leave the draft: a sampled row's q is its warped
    top-N renormalized (the token drawn is in it), greedy and seeded rows send zeros."""
    from serve_app.engine.worker import ModelWorker

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
