"""Acceptance as pure functions, on hand-built distributions (no models, no Ray)."""

import torch

from serve_app.engine.speculative import accept_greedy, accept_sampled, sample, warp_probs


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


# ---- rejection sampling ---------------------------------------------------------------------------
def test_sampled_identical_distributions_accept_everything():
    p = torch.softmax(torch.randn(1, 4, 6), -1)
    drafts = torch.tensor([[1, 2, 3]])
    n, _ = accept_sampled(drafts, p[:, :3], p, torch.full((1, 3), 0.999), torch.tensor([0.5]))
    assert n.tolist() == [3]


def test_sampled_token_target_never_picks_is_rejected_and_residual_excludes_it():
    q = onehot([[2]])  # draft is sure of token 2
    p = torch.tensor([[[0.0, 0.5, 0.0, 0.5, 0, 0], [1 / 6] * 6]])  # target gives token 2 no mass
    n, nxt = accept_sampled(torch.tensor([[2]]), q, p, torch.tensor([[0.0]]), torch.tensor([0.9]))
    assert n.tolist() == [0]
    assert nxt.item() in (1, 3)  # residual max(0, p - q) lives only where p > q


def test_sampled_empty_draft_samples_target():
    p = torch.tensor([[[0, 0, 0, 0, 1.0, 0]]])
    n, nxt = accept_sampled(torch.zeros((1, 0), dtype=torch.long), torch.zeros(1, 0, 6), p, torch.zeros(1, 0), torch.tensor([0.3]))
    assert n.tolist() == [0] and nxt.tolist() == [4]


def test_sampled_one_hot_reduces_to_greedy():
    target_argmax = torch.tensor([[3, 1, 4, 5]])
    drafts = torch.tensor([[3, 1, 2]])
    p, q = onehot(target_argmax), onehot(drafts)
    n, nxt = accept_sampled(drafts, q, p, torch.rand(1, 3), torch.rand(1))
    gn, gnxt = accept_greedy(drafts, target_argmax)
    assert n.tolist() == gn.tolist() and nxt.tolist() == gnxt.tolist()


def test_rejection_sampling_reproduces_target_distribution():
    """Tokens emitted at each position follow p, not q, whatever the draft proposes (Leviathan et al.)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, trials = 5, 2, 40_000
    p1 = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])  # target at position 0
    q1 = torch.tensor([0.40, 0.10, 0.10, 0.30, 0.10])  # a draft that disagrees a lot
    p = torch.stack([p1, p1.flip(0), torch.full((vocab,), 0.2)])[None].expand(trials, k + 1, vocab)
    q = torch.stack([q1, q1.roll(1)])[None].expand(trials, k, vocab)
    drafts = torch.stack([torch.multinomial(q[0, j], trials, replacement=True, generator=g) for j in range(k)], 1)
    n, nxt = accept_sampled(drafts, q, p, torch.rand(trials, k, generator=g), torch.rand(trials, generator=g))
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
def test_warp_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    probs = warp_probs(logits, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.7]))
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)  # top_k = 2
    assert torch.allclose(probs[2], torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)  # 0.5 < 0.7 <= 0.8
    hot = warp_probs(logits[:1], torch.tensor([0.1]), torch.tensor([0]), torch.tensor([1.0]))
    assert hot[0, 0] > 0.99


def test_sample_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 3)
    assert sample(probs, torch.tensor([0.0, 0.49, 0.999])).tolist() == [1, 1, 3]
