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


def test_proposal_travels_sparse_when_support_is_small_and_densifies_exactly():
    from serve_app.engine.worker import Proposal

    probs = torch.zeros(2, 3, 40)
    probs[..., 5], probs[..., 7] = 0.75, 0.25
    probs[1, :, 9] = 0.5
    p = Proposal(torch.zeros(2, 3, dtype=torch.long), probs).compact()
    assert p.support is not None and p.probs.shape == (2, 3, 3)
    assert torch.equal(p.dense_probs(40), probs)
    dense = Proposal(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, 8), 0.125)).compact()
    assert dense.support is None  # full support: sparse would be larger
