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

import time

import torch

from serve_app.engine.kv import causal_mask, ragged_inputs

from serve_app.engine.worker import ModelWorker, Proposal, _backlog_agreement, _proposal


class EagleWorker(ModelWorker):
    """A ModelWorker whose model is an Eagle3Draft; rows, KV compaction and sampling are inherited."""

    def __init__(self, draft, pad_id: int = 0):
        super().__init__(draft, "draft", pad_id)
        self.feature_dim = draft.fc.in_features

    def add(self, seq_ids, prompts, params) -> None:
        super().add(seq_ids, prompts, params)
        for sid in seq_ids:
            self.seqs[sid].extra["features"] = []  # [n, F] chunks not yet fed, in position order

    def prefill(self, seq_ids, features=None) -> None:
        """Keep the prompt's features; they are fed with the first proposal (the first token after the
        prompt is needed to pair with the last prompt feature)."""
        if features is None:
            raise ValueError("an EAGLE-3 draft needs the target's features: the target must capture "
                             f"layers {self.model.feature_layers}")
        self._take(seq_ids, features)

    def commit(self, seq_ids, new_tokens, features=None) -> None:
        """Append the accepted tokens and the target's features of the positions it made final (None
        when there are none: the first token after a prefill, whose prompt features came with it)."""
        for sid, new in zip(seq_ids, new_tokens):
            self.seqs[sid].tokens.extend(new)
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
    def propose(self, seq_ids: list[str], k: int) -> Proposal:
        seqs = self._rows(seq_ids)
        if k == 0:
            return Proposal.empty(len(seqs))
        lens = [len(s.tokens) for s in seqs]
        # catch-up: positions kv_len .. L-2, each pairing the target's feature with the token after it
        feats = [torch.cat(s.extra["features"]) if s.extra["features"] else torch.zeros(0, self.feature_dim)
                 for s in seqs]
        fed = [s.tokens[s.kv_len + 1 :] for s in seqs]
        for s, f, ids in zip(seqs, feats, fed):
            if len(f) != len(ids):  # an invariant of commit/verify; say so plainly if it ever breaks
                raise RuntimeError(f"draft holds {len(f)} target features for {len(ids)} new positions")
        window = min(max(len(f) for f in fed), max(2, 256 // len(seqs)), 32)
        ids, pos = ragged_inputs(fed, [s.kv_len for s in seqs], self.pad_id)
        t0 = time.perf_counter()  # the fc over every row's new features in one matmul: model work, timed so
        fused = self.model.fuse(torch.cat(feats).to(self.device)).split([len(f) for f in feats])  # [n_b, H] each
        hidden = self._left_pad(list(fused), ids.shape[1])  # [B, W, H]
        self._sync()
        self.timings["forward_s"] += time.perf_counter() - t0
        row0 = self.order.index(seq_ids[0])
        logits, state = self._step(row0, ids, hidden, pos, keep=window)
        backlog = self._timed(_backlog_agreement, seqs, fed, logits)
        for s, n in zip(seqs, lens):
            s.kv_len, s.extra["features"] = n - 1, []
        tokens, probs, support = [], [], []
        draw = self._drawer(seqs)
        for j in range(k):
            tok, q, ids = self._timed(draw, logits[:, -1], [n + j for n in lens])
            tokens.append(tok)
            probs.append(q)
            support.append(ids)
            if j + 1 < k:  # the next step feeds this token with the draft's own state
                step_pos = torch.tensor([[n - 1 + j] for n in lens])
                logits, state = self._step(row0, tok[:, None], state[:, -1:], step_pos, keep=1)
        return _proposal(tokens, probs, support, len(seqs), backlog)

    def _step(self, row0: int, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, keep: int):
        """One forward of the draft layer over ids [B, T] / hidden [B, T, H] at positions [B, T], for the
        rows starting at row0."""
        t0 = time.perf_counter()
        ids, pos = ids.to(self.device), pos.to(self.device)
        self.cache.prepare(row0, pos)
        mask = causal_mask(pos, self.cache._kv_max, self.mask_dtype)
        out = self.model(ids, hidden, pos, attention_mask=mask, past_key_values=self.cache, logits_to_keep=keep)
        self._sync()
        self.timings["forward_s"] += time.perf_counter() - t0
        return out

    @staticmethod
    def _left_pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:  # rows of [n_b, H] -> [B, width, H]
        out = rows[0].new_zeros((len(rows), width, rows[0].shape[-1]))
        for b, r in enumerate(rows):
            if len(r):
                out[b, width - len(r):] = r
        return out

    def info(self) -> dict:
        return {**super().info(), "feature_layers": self.model.feature_layers}
