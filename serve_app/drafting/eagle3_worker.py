"""EagleWorker: hosts an Eagle3Draft and its sequences' state; the engine's draft interface.

Per sequence it holds the committed tokens t_0 .. t_{L-1} and the target's features f_p for every
position the target has made final (t_{L-1}, the recovered or bonus token, is still pending at the
target, so features are known for p <= L - 2). Draft position p pairs f_p with t_{p+1}; its KV
row holds positions [0, kv_len) computed from REAL features. A proposal first feeds the positions
whose features arrived since the last one (kv_len .. L-2: the catch-up, one forward), whose output
at L - 2 predicts t_L; then k - 1 more steps feed the draft's own output state. Those speculative
positions are written past kv_len and simply overwritten later: when the target's features for
them arrive, the next proposal recomputes them, so nothing is ever rolled back or copied.
"""

from __future__ import annotations


import torch

from serve_app.engine import lean
from serve_app.engine.draftplan import DraftPlan
from serve_app.engine.kv import pack
from serve_app.engine.worker import (Drafting, ModelWorker, Proposal, _backlog_agreement, backlog_window, mark_verified,
                                     paged_attention)


class EagleWorker(ModelWorker):
    """A ModelWorker whose model is an Eagle3Draft; sequences, paged KV and sampling are inherited."""

    def __init__(self, draft, pad_id: int = 0):
        super().__init__(draft, "draft", pad_id)
        self.feature_dim = draft.fc.in_features
        self.lean_draft = lean.draft_supports(draft)
        """Draft steps run `lean.draft_step` (its layer is the stock Llama modules), not transformers' wrappers."""

    def shares_prefixes(self) -> bool:
        """Never: draft position p holds f_p with token p + 1, so a block depends on the token after it."""
        return False

    def add(self, seq_ids, prompts, params) -> list[int]:
        cached = super().add(seq_ids, prompts, params)
        for sid in seq_ids:
            self.seqs[sid].extra["features"] = []  # [n, F] chunks not yet fed, in position order
        return cached

    def prefill(self, seq_ids, features=None, upto=None) -> None:
        """Keep the prompt's features (chunk by chunk, as the target prefills); they are fed with the first
        proposal (the first token after the prompt is needed to pair with the last prompt feature)."""
        if features is None:
            raise ValueError("an EAGLE-3 draft needs the target's features: the target must capture "
                             f"layers {self.model.feature_layers}")
        self._take(seq_ids, features)
        self._feed_known(seq_ids)

    @torch.inference_mode()
    def _feed_known(self, seq_ids) -> None:
        """Feed the layer the positions whose feature and next token are both known (a prompt's, chunk by
        chunk as the target prefills it), so the first proposal has only the last prompt position left."""
        rows, fed, feats = [], [], []
        for sid in seq_ids:
            s = self.seqs[sid]
            have = torch.cat(s.extra["features"]) if s.extra["features"] else None
            n = 0 if have is None else min(len(have), len(s.tokens) - 1 - s.kv_len)
            if n > 0:
                rows.append(sid)
                fed.append(s.tokens[s.kv_len + 1 : s.kv_len + 1 + n])
                feats.append(have[:n])
                s.extra["features"] = [have[n:]] if len(have) > n else []
        if not rows:
            return
        t0 = self.clock.start()
        fused = self.model.fuse(torch.cat(feats).to(self.device))  # [T, H], packed like the fed tokens
        self.clock.stop("forward_s", t0, self.timings)
        self._step(rows, fed, [self.seqs[sid].kv_len for sid in rows], fused, 1)
        for sid, f in zip(rows, fed):
            self.seqs[sid].kv_len += len(f)

    def commit(self, seq_ids, new_tokens, features=None) -> None:
        """Append the accepted tokens and the target's features of the positions it made final (None
        when there are none: the first token after a prefill, whose prompt features came with it)."""
        for sid, new in zip(seq_ids, new_tokens):
            self._append_committed(sid, new)
            self.cache.trim(sid, self.seqs[sid].kv_len)  # its own speculative positions go
        if features is not None:
            self._take(seq_ids, features)

    def _take(self, seq_ids, features) -> None:
        for sid, f in zip(seq_ids, features):
            if f.shape[-1] != self.feature_dim:
                raise ValueError(f"target features have {f.shape[-1]} values per position, the draft reads "
                                 f"{self.feature_dim}: a draft made for another target or other layers")
            if len(f):
                self.seqs[sid].extra["features"].append(f)

    @torch.inference_mode()
    def propose(self, seq_ids: list[str], k: int | DraftPlan) -> Proposal:
        seqs = self._rows(seq_ids)
        lens = [len(s.tokens) for s in seqs]
        drafting = Drafting(self, seqs, k, lens)
        if drafting.k == 0:
            return Proposal.empty(len(seqs))
        # catch-up: positions kv_len .. L-2, each pairing the target's feature with the token after it
        feats = [torch.cat(s.extra["features"]) if s.extra["features"] else torch.zeros(0, self.feature_dim)
                 for s in seqs]
        fed = [s.tokens[s.kv_len + 1 :] for s in seqs]
        for s, f, ids in zip(seqs, feats, fed):
            if len(f) != len(ids):  # an invariant of commit/verify; say so plainly if it ever breaks
                raise RuntimeError(f"draft holds {len(f)} target features for {len(ids)} new positions")
        window = backlog_window(fed, k)
        t0 = self.clock.start()  # the fc over every row's new features in one matmul: model work, timed so
        fused = self.model.fuse(torch.cat(feats).to(self.device))  # [T, H]: packed, like the fed tokens
        self.clock.stop("forward_s", t0, self.timings)
        logits, state, small = self._step(seq_ids, fed, [s.kv_len for s in seqs], fused, window)
        backlog = self._timed(_backlog_agreement, seqs, fed, logits) if window > 1 else (0, 0)
        for s, n in zip(seqs, lens):
            s.kv_len, s.extra["features"] = n - 1, []
        rows = drafting.rows  # the rows of the last forward: every one, then those the model still drafts for
        for j in range(drafting.k):
            tok = drafting.position(logits[:, -1], small[:, -1]).tolist()
            if not drafting.more:
                break
            # the next step feeds each drafting row's token with the draft's own state
            pick = torch.tensor([rows.index(b) for b in drafting.rows])
            rows = drafting.rows
            logits, state, small = self._step([seq_ids[b] for b in rows], [[tok[b]] for b in rows],
                                              [lens[b] - 1 + j for b in rows], state[pick, -1], 1)
        copying = drafting.copying  # before proposal(): the copying rows' tokens were not the model's predictions
        proposal = drafting.proposal(backlog)
        mark_verified(seqs, proposal, copying)
        return proposal

    def _step(self, seq_ids: list[str], fed: list[list[int]], starts: list[int], hidden: torch.Tensor, keep: int):
        """One packed forward of the draft layer: row b feeds fed[b] at positions starts[b], ... with
        hidden [T, H] (packed the same way). Returns (logits [B, keep, V], state [B, keep, H], logits over the
        draft's own vocabulary [B, keep, N]) of each row's last `keep` fed positions."""
        t0 = self.clock.start()
        index = self._last(fed, keep).to(self.device)  # [B, keep]
        ids, pos, batch = pack(self.cache, seq_ids, fed, starts, self.device)
        self.cache.batch = batch
        if self.lean_draft:
            state = lean.draft_step(self.model, ids[0], hidden.to(self.device), pos[0], batch)[index]
        else:
            with paged_attention(self.model):
                state = self.model.step(ids, hidden[None].to(self.device), pos, None, self.cache,
                                        specserve_batch=batch)[0, index]
        self.cache.batch = None
        small = self.model.reduced_logits(state)
        logits = self.model.spread(small)
        self.clock.stop("forward_s", t0, self.timings)
        return logits, state, small

    def info(self) -> dict:
        return {**super().info(), "feature_layers": self.model.feature_layers}
