"""Speculative decoding as pure functions: the acceptance rules, and sampling from a small distribution.

Vocabulary (used across the project): the draft *proposes* k tokens per sequence; the target scores
all k+1 positions in one forward; the agreeing prefix is *accepted*; then exactly one target token
is emitted: the *recovered* token at the first rejection, or the *bonus* token after a fully
accepted draft. So every step yields between 1 and k+1 tokens per sequence.

Sampling follows the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding") and Chen et al. 2023: accept draft token x with probability
min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)). The emitted tokens are then
distributed exactly as if sampled from the target p alone. Greedy decoding is the special case
where p and q are one-hot: accept while the draft token equals the target argmax. Seeded requests
use a coupled sampler instead (`sampling.gumbel`): draft and target choose with the same noise, the
draft is accepted while the choices agree (`accept_greedy` on the target's choices), and the text
then does not depend on k. `sampling.verify_walk` applies these rules position by position over the
rows still accepting; `accept_greedy` is the rule over all k at once, which its tests check it against. The vocabulary-sized work that feeds these rules (warping, noise,
the per-position walk over the batch) is in `sampling.py`.

All randomness comes in as uniforms drawn by the caller, so these functions are deterministic and
testable with hand-built logits.
"""

from __future__ import annotations

import torch


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [N, V] from uniforms u [N] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    u = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # scale: rows need not sum to exactly 1
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def accept_greedy(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_argmax: torch.Tensor,  # [B, k+1] long: target's choice after each fed position
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_token [B]
    """Accept the longest prefix where the draft agrees with the target's argmax.

    next_token is the target's argmax at the first disagreement (recovered) or after the last draft
    token (bonus). With k = 0 this is plain greedy decoding.
    """
    k = draft_tokens.shape[1]
    agree = (draft_tokens == target_argmax[:, :k]).int()
    num_accepted = agree.cumprod(dim=1).sum(dim=1)  # length of the all-agree prefix
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def accept_rejection(
    p_x: torch.Tensor,  # [S] p(x): the target's probability of each drafted token
    q_x: torch.Tensor,  # [S] q(x): the probability the draft sampled it with (> 0)
    u: torch.Tensor,  # [S] uniforms in [0, 1)
) -> torch.Tensor:  # [S] bool
    """Accept x with probability min(1, p(x) / q(x)): u < p/q  <=>  u * q < p."""
    return u * q_x < p_x


def residual_logits_(
    logits: torch.Tensor,  # [S, V] warped target logits (changed in place)
    lse: torch.Tensor,  # [S] their logsumexp: log p = logits - lse
    q_values: torch.Tensor,  # [S, N] q on its support...
    q_ids: torch.Tensor,  # [S, N] ...these token ids (0 elsewhere)
) -> torch.Tensor:  # [S, V] logits of norm(max(0, p - q)), up to a constant per row
    """After a rejection the recovered token comes from norm(max(0, p - q)). q is zero off its support,
    so only its N entries change: their log(max(0, p - q)) + lse replaces the logit. A row with no
    residual mass (p == q, where rejection had probability 0) keeps p.

    Entries with q = 0 are padding (a copy's one-hot q widened to the step's N, a top-p cut inside the
    top N) and may repeat an id that also holds q > 0: they leave their logit as it is, and where ids
    repeat the smaller logit (the residual's: log(p - q) <= log p) wins, so no write order matters."""
    ids = q_ids.long()
    q = q_values.to(logits.dtype)
    held = q > 0
    old = logits.gather(1, ids)
    p_s = (old - lse[:, None]).exp()
    r = (p_s - q).clamp_(min=0) * held
    off = (1 - (p_s * held).sum(dim=1)).clamp(min=0)  # mass off q's support (duplicates not counted twice: q > 0 once)
    empty = r.sum(dim=1) + off <= 0
    new = torch.where(empty[:, None] | ~held, old, r.log() + lse[:, None])
    return logits.scatter_reduce_(1, ids, new, reduce="amin")
