"""Speculative decoding as pure functions: warp logits, sample, and accept or reject drafts.

Vocabulary (used across the project): the draft *proposes* k tokens per sequence; the target scores
all k+1 positions in one forward; the agreeing prefix is *accepted*; then exactly one target token
is emitted: the *recovered* token at the first rejection, or the *bonus* token after a fully
accepted draft. So every step yields between 1 and k+1 tokens per sequence.

Sampling follows the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding") and Chen et al. 2023: accept draft token x with probability
min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)). The emitted tokens are then
distributed exactly as if sampled from the target p alone. Greedy decoding is the special case
where p and q are one-hot: accept while the draft token equals the target argmax. Seeded requests
use a coupled sampler instead (`coupled_choice`): their text then does not depend on k.

All randomness comes in as uniforms drawn by the caller, so these functions are deterministic and
testable with hand-built logits.
"""

from __future__ import annotations

import torch


def warp_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N], > 0
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N], 1.0 = off
) -> torch.Tensor:  # [N, V] probabilities
    """Turn logits into the distribution a request samples from (temperature, top-k, top-p)."""
    logits = logits.float() / temperature[:, None]
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab)[:, None]
        drop = ranks >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [N, V] from uniforms u [N] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    u = u.to(cdf.dtype)[:, None] * cdf[:, -1:]  # scale: rows need not sum to exactly 1
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def coupling_noise(seed: int, position: int, vocab: int) -> torch.Tensor:  # [V] Gumbel(0, 1)
    """Noise for the token at one position of one seeded request, the same on every worker, at every k
    and in every batch: it depends on nothing but (seed, position)."""
    g = torch.Generator().manual_seed((seed * 6364136223846793005 + position * 1442695040888963407 + 1) % 2**63)
    return -(-torch.rand(vocab, generator=g).log()).log()


def coupled_choice(
    probs: torch.Tensor,  # [N, V]: the warped distribution at each position
    noise: torch.Tensor,  # [N, V]: coupling_noise of each position
) -> torch.Tensor:  # [N] long
    """Gumbel-max: argmax(log p + G) is an exact sample from p. Draft and target choosing with the same
    noise agree as often as a shared-randomness coupling allows, and the target's choice, which is what
    is emitted, depends only on p and the seed: seeded output is the same whatever k the policy picks
    (Daliri et al. 2024, "Coupling without Communication and Drafter-Invariant Speculative Decoding").
    Verification is then `accept_greedy` against these choices instead of the argmax."""
    return (probs.log() + noise).argmax(dim=-1)


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


def accept_sampled(
    draft_tokens: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor,  # [B, k, V]: q, the distribution each draft token was sampled from
    target_probs: torch.Tensor,  # [B, k+1, V]: p, the warped target distribution at each position
    accept_u: torch.Tensor,  # [B, k] uniforms for the accept tests
    final_u: torch.Tensor,  # [B] uniform for the recovered / bonus sample
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_token [B]
    """Rejection sampling: accept draft token x with prob min(1, p(x)/q(x)), resample on rejection."""
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    if k == 0:
        return torch.zeros(bsz, dtype=torch.long, device=rows.device), sample(target_probs[:, 0], final_u)
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    # u < p/q  <=>  u * q < p; q(x) > 0 because x was sampled from q.
    accepted = (accept_u * q_x < p_x).int()
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]

    # Distribution of the one target token: residual at the first rejection, p itself after all k.
    p_at = target_probs[rows, num_accepted]  # [B, V]
    q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)]  # [B, V]
    rejected = (num_accepted < k)[:, None]
    residual = (p_at - q_at).clamp_(min=0)
    # p == q leaves no residual mass; rejection then had probability 0, fall back to p for safety.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(rejected & ~empty, residual, p_at)
    return num_accepted, sample(dist, final_u)
