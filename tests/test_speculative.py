"""Acceptance as pure functions and the target's walk over positions, on hand-built distributions
(no models, no Ray)."""

import pytest
import torch

from serve_app.engine.sampling import Warp, noise_key, verify_walk, warp_
from serve_app.engine.speculative import accept_greedy, accept_rejection, residual_logits_, sample


def onehot(tokens, vocab=6):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


# ---- greedy -----------------------------------------------------------------------------------
def test_greedy_all_accepted_gives_bonus():
    n, nxt = accept_greedy(torch.tensor([[3, 1, 4]]), torch.tensor([[3, 1, 4, 5]]))
    assert n.tolist() == [3] and nxt.tolist() == [5]  # bonus: target's token after the last draft


def test_greedy_first_rejected_gives_recovered():
    n, nxt = accept_greedy(torch.tensor([[2, 1, 4]]), torch.tensor([[3, 1, 4, 5]]))
    assert n.tolist() == [0] and nxt.tolist() == [3]  # recovered: target's token at the rejection


def test_greedy_mid_rejection_ignores_later_agreement():
    n, nxt = accept_greedy(torch.tensor([[3, 0, 4]]), torch.tensor([[3, 1, 4, 5]]))
    assert n.tolist() == [1] and nxt.tolist() == [1]


def test_greedy_batch_rows_independent():
    n, nxt = accept_greedy(torch.tensor([[3, 1], [0, 0], [3, 9]]), torch.tensor([[3, 1, 7], [3, 1, 7], [3, 1, 7]]))
    assert n.tolist() == [2, 0, 1] and nxt.tolist() == [7, 3, 1]


def test_greedy_k0_is_plain_decoding():
    n, nxt = accept_greedy(torch.zeros((2, 0), dtype=torch.long), torch.tensor([[4], [2]]))
    assert n.tolist() == [0, 0] and nxt.tolist() == [4, 2]


# ---- rejection sampling (the walk over positions, with the draft's q sparse) -----------------------
def walk(p, drafts, q, accept_u, key_seed=0, seeded=False):
    """verify_walk on hand-built target distributions p [B, k+1, V] and a dense q [B, k, V] (sent
    sparse, as the draft does: its nonzero entries)."""
    bsz, k = drafts.shape
    vocab = p.shape[-1]
    n = max(int((q > 0).sum(-1).max()), 1) if k else 1
    vals, ids = q.topk(n, dim=-1) if k else (torch.zeros(bsz, 0, n), torch.zeros(bsz, 0, n, dtype=torch.long))
    keys = torch.tensor([[noise_key(key_seed + b, j) for j in range(k + 1)] for b in range(bsz)], dtype=torch.int32)
    w = Warp(torch.ones(bsz), torch.zeros(bsz, dtype=torch.long), torch.ones(bsz))
    return verify_walk(p.log(), drafts, torch.zeros(bsz, dtype=torch.bool), keys,
                       torch.full((bsz,), seeded), w, vals, ids.int(), accept_u)


def onehot_q(tokens, vocab=6):
    return onehot(tokens, vocab)


def test_sampled_identical_distributions_accept_everything():
    p = torch.softmax(torch.randn(1, 4, 6), -1)
    drafts = torch.tensor([[1, 2, 3]])
    n, _ = walk(p, drafts, p[:, :3], torch.full((1, 3), 0.999))
    assert n.tolist() == [3]


def test_sampled_token_target_never_picks_is_rejected_and_residual_excludes_it():
    q = onehot_q([[2]])  # draft is sure of token 2
    p = torch.tensor([[[0.0, 0.5, 0.0, 0.5, 0, 0], [1 / 6] * 6]])  # target gives token 2 no mass
    for seed in range(20):
        n, nxt = walk(p, torch.tensor([[2]]), q, torch.tensor([[0.0]]), key_seed=seed)
        assert n.tolist() == [0]
        assert nxt.item() in (1, 3)  # residual max(0, p - q) lives only where p > q


def test_sampled_empty_draft_samples_target():
    p = torch.tensor([[[0, 0, 0, 0, 1.0, 0]]])
    n, nxt = walk(p, torch.zeros((1, 0), dtype=torch.long), torch.zeros(1, 0, 6), torch.zeros(1, 0))
    assert n.tolist() == [0] and nxt.tolist() == [4]


def test_sampled_one_hot_reduces_to_greedy():
    target_argmax = torch.tensor([[3, 1, 4, 5]])
    drafts = torch.tensor([[3, 1, 2]])
    n, nxt = walk(onehot(target_argmax), drafts, onehot(drafts), torch.rand(1, 3))
    gn, gnxt = accept_greedy(drafts, target_argmax)
    assert n.tolist() == gn.tolist() and nxt.tolist() == gnxt.tolist()


def test_residual_changes_p_only_on_the_support():
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    logits = p.log()
    lse = torch.logsumexp(logits, -1)
    r = residual_logits_(logits.clone(), lse, torch.tensor([[0.5, 0.1]]), torch.tensor([[1, 3]]))
    assert torch.allclose(r.softmax(-1), torch.tensor([[0.1, 0.0, 0.3, 0.1]]) / 0.5, atol=1e-6)
    assert accept_rejection(torch.tensor([0.2, 0.2]), torch.tensor([0.4, 0.1]), torch.tensor([0.49, 0.99])).tolist() == [True, True]
    assert accept_rejection(torch.tensor([0.2]), torch.tensor([0.4]), torch.tensor([0.51])).tolist() == [False]


@pytest.mark.parametrize("token", [0, 2])
def test_residual_ignores_zero_padding_that_repeats_an_id(token):
    """A copy's one-hot q widened to the step's N: its padding holds q = 0 at id 0, which may be the copied
    token itself. The residual is still norm(max(0, p - q)), whichever write lands last."""
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    lse = torch.logsumexp(p.log(), -1)
    ids = torch.tensor([[token, 0, 0, 0]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    want = p.clone()
    want[0, token] = 0
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        r = residual_logits_(p.log(), lse, q[:, order], ids[:, order])
        assert torch.allclose(r.softmax(-1), want / want.sum(), atol=1e-6), (order, r.softmax(-1))


@pytest.mark.parametrize("support", [5, 2])
def test_rejection_sampling_reproduces_target_distribution(support):
    """Tokens emitted at each position follow p, not q, whatever the draft proposes (Leviathan et al.),
    also when q lives on fewer tokens than the vocabulary (a top-N proposal, sent sparse)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, trials = 5, 2, 40_000
    p1 = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])  # target at position 0
    q1 = torch.tensor([0.40, 0.10, 0.10, 0.30, 0.10])  # a draft that disagrees a lot
    if support < vocab:  # the draft's top-2, renormalized: tokens 0 and 3
        q1 = torch.where(q1 >= q1.topk(support).values[-1], q1, 0.0)
        q1 = q1 / q1.sum()
    p = torch.stack([p1, p1.flip(0), torch.full((vocab,), 0.2)])[None].expand(trials, k + 1, vocab)
    q = torch.stack([q1, q1.roll(1)])[None].expand(trials, k, vocab)
    drafts = torch.stack([torch.multinomial(q[0, j], trials, replacement=True, generator=g) for j in range(k)], 1)
    n, nxt = walk(p, drafts, q, torch.rand(trials, k, generator=g), key_seed=1000 * support)
    # The first emitted token is the accepted draft token if n >= 1, else the recovered one.
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=vocab).float() / trials
    assert (freq - p1).abs().max() < 0.012, (freq, p1)
    # Negative control: the draft's own distribution is far from p, so the check has power.
    draft_freq = torch.bincount(drafts[:, 0], minlength=vocab).float() / trials
    assert (draft_freq - p1).abs().max() > 0.1
    # Second emitted token, among rows that accepted the first: follows p at position 1.
    rows = n >= 1
    second = torch.where(n[rows] >= 2, drafts[rows, 1], nxt[rows])
    freq2 = torch.bincount(second, minlength=vocab).float() / rows.sum()
    assert (freq2 - p1.flip(0)).abs().max() < 0.02, (freq2, p1.flip(0))


# ---- warping and sampling -----------------------------------------------------------------------
def reference_warp(logits, temperature, top_k, top_p):
    """The sort-based definition warp_ must match: temperature, top-k, then top-p over the top-k
    renormalized distribution (a token stays while the mass strictly before it is below top_p)."""
    logits = logits.float() / temperature[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab)[None, :] >= torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
    out = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return out.softmax(dim=-1)


def test_warp_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    probs = warp_(logits.clone(), Warp(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.7]))).softmax(-1)
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)  # top_k = 2
    assert torch.allclose(probs[2], torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)  # 0.5 < 0.7 <= 0.8
    hot = warp_(logits[:1].clone(), Warp(torch.tensor([0.1]), torch.tensor([0]), torch.tensor([1.0]))).softmax(-1)
    assert hot[0, 0] > 0.99


@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])
def test_warp_matches_the_sort_based_definition(scale):
    """Flat rows (whose nucleus reaches past the first candidates, so the pass widens) and peaked ones;
    top-k below, inside and above the candidate width; top-p alone and with top-k."""
    g = torch.Generator().manual_seed(int(scale * 10))
    vocab = 3000
    logits = torch.randn(8, vocab, generator=g) * scale
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.5, 1.0, 2.0])
    top_k = torch.tensor([0, 0, 5, 100, 2500, 0, 40, 0])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.99, 1.0, 0.3, 0.999])
    got = warp_(logits.clone(), Warp(temperature, top_k, top_p)).softmax(-1)
    assert torch.allclose(got, reference_warp(logits, temperature, top_k, top_p), atol=1e-6)


def test_fast_logsumexp():
    from serve_app.engine.sampling import logsumexp

    x = torch.randn(5, 40000) * 20
    x[1] = float("-inf")
    x[2, 5:] = float("-inf")
    assert torch.allclose(logsumexp(x), torch.logsumexp(x, dim=-1), atol=1e-5)
    assert logsumexp(x)[1] == float("-inf")


@pytest.mark.parametrize("vocab", [100, 5000, 128256])
def test_top_candidates_are_the_top_k(vocab):
    """Candidates from the blocks with the largest maxima are exactly the top-k (a short last block,
    ties, and -inf rows included)."""
    from serve_app.engine.sampling import _top_candidates

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g) * 3
    x[1] = x[1].round()  # many ties
    x[2, 10:] = float("-inf")  # a top-p cut row with 10 tokens left
    for width in (1, 7, 64):
        vals, ids = _top_candidates(x, width)
        assert torch.equal(vals, x.topk(width, dim=-1).values)
        assert torch.equal(x.gather(1, ids), vals)


def test_sample_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 3)
    assert sample(probs, torch.tensor([0.0, 0.49, 0.999])).tolist() == [1, 1, 3]


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_accept_all_gives_the_walks_verdicts_without_reading_the_device(kernels, vocab, monkeypatch):
    """`accept_all` (every row and position at once) against `verify_walk` on the same logits and randomness: a
    batch of greedy, seeded and sampled rows (temperatures, top-k, top-p, nuclei wider than the first candidates)
    with drafted lengths below k, greedy rows drafting the target's argmax everywhere (so a row accepts past its
    length unless the length holds it). The same counts and tokens, with the C kernels and with torch's ops; with
    torch's ops (a GPU's) not one read of the device."""
    from serve_app.engine import vocab_ops
    from serve_app.engine.sampling import TOP_N, accept_all, draft_choice
    from serve_app.engine.syncs import SyncCounter

    monkeypatch.setattr(vocab_ops, "ON", kernels)
    gen = torch.Generator().manual_seed(vocab)
    bsz, k = 15, 4
    kinds = ["greedy", "seeded", "sampled"] * 5
    logits = torch.randn(bsz, k + 1, vocab, generator=gen) * torch.tensor([0.5, 2.0, 6.0] * 5)[:, None, None]
    lengths = [k, 2, 0, 3, k, k, 1, k, 2, k, 3, k, 0, k, 4]
    params = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 1.0), (1.0, 0, 1.0), (0.5, 0, 0.95), (1.0, 5, 0.8)] * 3
    params = params[:bsz]
    w = Warp(torch.tensor([p[0] for p in params]), torch.tensor([p[1] for p in params]),
             torch.tensor([p[2] for p in params]),  # the rows' settings known on the host too, as `Warp.of` makes them
             host=([p[0] != 1.0 for p in params], [p[1] > 0 or p[2] < 1.0 for p in params], [p[1] for p in params]))
    drafts = logits[:, :k].argmax(-1)
    q_values, q_ids = torch.zeros(bsz, k, TOP_N), torch.zeros(bsz, k, TOP_N, dtype=torch.int32)
    sampled = [b for b, kind in enumerate(kinds) if kind == "sampled"]
    for j in range(k):  # sampled rows draft from a q near the target's own distribution (so some accept deep)
        near = logits[sampled, j] + torch.randn(len(sampled), vocab, generator=gen) * 2.0
        tok, q, ids = draft_choice(near, torch.zeros(len(sampled), dtype=torch.bool),
                                   torch.full((len(sampled),), -1, dtype=torch.int32), w.rows(torch.tensor(sampled)),
                                   torch.rand(len(sampled), generator=gen))
        drafts[sampled, j], q_values[sampled, j], q_ids[sampled, j] = tok, q, ids
    keys = torch.tensor([[noise_key(b, 7 + j) for j in range(k + 1)] for b in range(bsz)], dtype=torch.int32)
    u = torch.rand(bsz, k, generator=gen)
    walked = verify_walk(logits, drafts, torch.tensor([x == "greedy" for x in kinds]), keys,
                         torch.tensor([x == "seeded" for x in kinds]), w, q_values, q_ids, u, None, torch.tensor(lengths))
    with SyncCounter() as c:
        num, nxt = accept_all(logits, drafts, kinds, lengths, keys, w, q_values, q_ids, u)
    assert num.tolist() == walked[0].tolist() and nxt.tolist() == walked[1].tolist()
    assert num.tolist()[0::3] == lengths[0::3]  # greedy rows accept every token they drafted, and no more
    assert 0 < sum(num.tolist()[2::3]) < sum(lengths[2::3])  # sampled rows accept some, reject some
    if not kernels:
        assert c.total == 0, c.sites
