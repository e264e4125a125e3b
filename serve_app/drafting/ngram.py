"""Prompt-lookup draft (`--draft ngram`): proposes by copying from the sequence's own context, no forward.

For each sequence, the longest suffix of its committed tokens (max_n tokens down to min_n) that
occurred earlier in the same sequence is looked up, and the k tokens that followed its most recent
earlier occurrence are proposed (Saxena 2023, "prompt lookup decoding"; vLLM's and transformers'
n-gram speculators do the same). Answers that quote, list, rewrite or repeat their prompt (code
edits, reformatting, loops) then get several tokens per step for free.

Cost: one dict lookup per n per sequence and step. Each sequence keeps an index from every n-gram of
its context to the position right after its most recent occurrence, updated as tokens are committed
(one entry per n per token), so a step never rescans the context.

The proposer is deterministic, so for sampled rows q is one-hot at the proposed token: rejection
sampling then accepts with probability p(x) and otherwise samples norm(max(0, p - q)), which is p
with x removed (`speculative.accept_sampled`): the emitted tokens still follow p exactly. q travels in
the sparse form, support size 1.

Each sequence looks only at its own context, never at other requests' outputs: a shared index of
recently finished answers gained 0.01-0.04 tokens per step on answers that end at EOS (more only in
benchmarks that generate past EOS, where answers drift into look-alike invented conversations), not
worth coupling one user's speed to another's text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.config import SamplingParams
from serve_app.hardware import detect_gpu_type
from serve_app.engine.draftplan import DraftPlan, PlanWalk
from serve_app.engine.lookup import NgramIndex
from serve_app.engine.worker import Proposal, lookup, new_timings


@dataclass(frozen=True)
class NgramDraft:
    """The n-gram draft's settings; `draft_worker` hosts it in an NgramWorker."""

    min_n: int = 1
    """Shortest suffix worth matching. 1: even a single repeated token predicts what followed it last
    time (right ~17% of the time on chat answers), which beats the filler a no-match row proposes;
    min_n = 2 costs 0.06-0.08 tokens per step at k = 4."""
    max_n: int = 4
    """Longest suffix tried first: a longer match is a more specific context, so a better prediction."""

    name = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram draft needs 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    @property
    def worker_class(self):
        return NgramWorker


@dataclass
class _Sequence:
    params: SamplingParams
    ngrams: NgramIndex
    proposed: bool = False  # a proposal is outstanding: the next commit settles it
    checked: int = 0  # backlog evidence since the last proposal (see NgramWorker.commit)
    matched: int = 0


class NgramWorker:
    """The engine's draft interface over n-gram lookups; rows follow `order` like ModelWorker's."""

    def __init__(self, draft: NgramDraft, pad_id: int = 0):
        self.draft = draft
        self.role = "draft"
        self.seqs: dict[str, _Sequence] = {}
        self.order: list[str] = []  # sequence ids in the order they were added

    # ---- lifecycle -------------------------------------------------------------------------
    def add(self, seq_ids: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Register new sequences and index their prompts (no KV: nothing cached to start from)."""
        for sid, prompt, p in zip(seq_ids, prompts, params):
            if sid in self.seqs:
                raise ValueError(f"sequence {sid!r} already exists")
            self.seqs[sid] = _Sequence(p, NgramIndex(self.draft.min_n, self.draft.max_n, prompt))
            self.order.append(sid)
        return [0] * len(seq_ids)

    def configure_kv(self, block_size: int = 16, max_blocks: int = 4096, prefix_caching: bool = True,
                     attention_backend: str = "auto", preallocate: bool = False, static_steps: str = "auto") -> str:
        """No KV to configure: the n-gram draft holds token indexes only."""
        return "none"

    def kv_room(self, utilization: float, probe_tokens: int, share: float = 1.0, memory=None) -> None:
        """No KV: no limit from this worker."""
        return None

    def remove(self, seq_ids: list[str], remember: bool = False) -> None:
        """Drop finished sequences (an n-gram draft keeps no history: `remember` is the model drafts')."""
        gone = set(seq_ids) & set(self.seqs)
        self.order = [s for s in self.order if s not in gone]
        for sid in gone:
            del self.seqs[sid]

    def history_stats(self) -> None:
        """No suffix history: an n-gram draft copies from its own context only."""
        return None

    def reset(self) -> None:
        """Drop every sequence (after a failed step)."""
        self.remove(list(self.order))

    def prefill(self, seq_ids: list[str], features: list[torch.Tensor] | None = None, upto=None) -> None:
        """Nothing to feed: add() indexed the prompts. Checks the ids like ModelWorker does."""
        self._rows(seq_ids)

    # ---- draft side --------------------------------------------------------------------------
    def propose(self, seq_ids: list[str], k: int | DraftPlan) -> Proposal:
        """k tokens per sequence from its own context; q one-hot at them for sampled rows. With a
        `DraftPlan`, a row's copy is as sure as its matched suffix is long (`match_confidence`), and the
        plan's walk keeps what is worth verifying."""
        seqs = self._rows(seq_ids)
        plan = k if isinstance(k, DraftPlan) else None
        k = plan.k if plan is not None else k
        if k == 0:  # keep the backlog for a step that speculates (a k = 0 step's stats drop it)
            return Proposal.empty(len(seqs))
        backlog = (sum(s.checked for s in seqs), sum(s.matched for s in seqs))
        rows, confs = [], []
        for s in seqs:
            tokens, n = s.ngrams.match(k)
            rows.append(tokens)
            confs.append(self.match_confidence(n))
            s.proposed, s.checked, s.matched = True, 0, 0
        tokens = torch.tensor(rows, dtype=torch.long)  # [B, k]
        if all(s.params.greedy for s in seqs):
            out = Proposal(tokens, backlog=backlog)
        else:
            # One-hot q in the sparse form: support = the proposed token, value 1 (0 for greedy rows, which
            # the target never reads; ModelWorker leaves them at zero too).
            sampled = torch.tensor([0.0 if s.params.greedy else 1.0 for s in seqs])
            probs = sampled[:, None, None].expand(len(seqs), k, 1).contiguous()  # [B, k, 1]
            out = Proposal(tokens, probs, tokens[..., None].int(), backlog)  # support [B, k, 1]
        if plan is None:
            return out
        walk = PlanWalk(plan)
        for j in range(k):  # a copy is as sure at every position as its match
            walk.position(j, confs, [True] * len(seqs))
            if not any(walk.active):
                break
        if not any(walk.lengths):
            for s in seqs:  # nothing proposed after all: the next commit is not a verdict on a proposal
                s.proposed = False
            return Proposal.empty(len(seqs))
        out.lengths, out.lookup = walk.lengths, [True] * len(seqs)
        out.conf = [[c] * n for c, n in zip(confs, walk.lengths)]
        return out

    def match_confidence(self, n: int) -> float:
        """A copy's confidence for a policy's curve: its matched suffix's length over the longest tried (0:
        no match, the filler)."""
        return n / self.draft.max_n

    def commit(self, seq_ids: list[str], new_tokens: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Append each sequence's accepted drafts + target token and index them.

        Tokens committed with no proposal outstanding (steps at k = 0, and the first token after
        prefill) are scored first: would the first proposed token have been right? That is the
        backlog evidence the next proposal reports (Proposal.backlog), so an adaptive policy sees
        when the draft starts agreeing again. Sampled rows count too: with a one-hot q the draft
        token is accepted with probability p(x), the chance that the target's own sample equals x.
        """
        for sid, new in zip(seq_ids, new_tokens):
            s = self.seqs[sid]
            if s.proposed:  # verification already counted these as accepted / rejected
                s.proposed = False
                s.ngrams.extend(new)
                continue
            for t in new:
                s.checked += 1
                s.matched += s.ngrams.match(1)[0][0] == t
                s.ngrams.extend([t])

    def take_timings(self) -> dict:
        """No device work: lookups only (the engine's interface for benchmarks)."""
        return new_timings()

    def info(self) -> dict:
        """What the engine may ask a draft; no model, so no vocabulary or context limit of its own."""
        return {
            "role": self.role,
            "kind": self.draft.name,
            "min_n": self.draft.min_n,
            "max_n": self.draft.max_n,
            "max_position_embeddings": None,
            "eos_ids": [],
            "gpu_type": detect_gpu_type(),
        }

    # ---- internals -------------------------------------------------------------------------
    def _rows(self, seq_ids: list[str]) -> list[_Sequence]:
        return lookup(self, seq_ids)
