"""A request's logit controls, applied the same in draft and target at every position they score.

`Controls` is built once per call for the rows of a batch (None when no row has any, so plain batches
pay nothing) and turns a position's raw logits into the ones a request samples from: its grammar mask,
bans (min_tokens: end-of-sequence and stop ids; bad words), logit_bias, then the presence / frequency /
repetition penalties. Under speculation position j of a row follows its j drafted tokens, so the
controls count those as generated: the output is exactly what the target alone would produce with the
same controls (greedy identical at any k, sampling exact, seeded text the same at any k).

Everything vocabulary-sized is a tensor op on the worker's device; Python touches token ids only, and
the penalties work on the tokens a row has seen (gather, change, scatter), never on a [rows, V] table.
"""

from __future__ import annotations

import torch

from serve_app.engine.grammar import apply_mask_, closing_bias


class Controls:
    """Per-row controls of one batch.

    contexts: each row's committed tokens (prompt + output); prompt_lens: where its output starts;
    guides: each row's `grammar.Guide` or None. Position j of row b follows extra[b][:j] (its drafts).
    """

    def __init__(self, params: list, contexts: list[list[int]], prompt_lens: list[int], guides: list, device):
        self.device = device
        self.params, self.contexts, self.prompt_lens, self.guides = params, contexts, prompt_lens, guides
        self.masks: torch.Tensor | None = None  # [B, k+1, W] grammar bitmasks (target), set by `set_masks`
        n = len(params)
        self.bias_rows = [b for b in range(n) if params[b].logit_bias]
        self.ban_rows = [b for b in range(n) if params[b].min_tokens or params[b].bad_words_ids]
        self.pen_rows = [b for b in range(n) if _penalized(params[b])]
        self.allow_rows = [b for b in range(n) if params[b].allowed_token_ids]
        if self.bias_rows:
            self._bias = self._sparse([(b, t, v) for b in self.bias_rows for t, v in params[b].logit_bias.items()])
        if self.pen_rows:
            self._seen = self._base_seen()

    @classmethod
    def of(cls, seqs, device) -> "Controls | None":
        """From a worker's Sequences (their params, tokens, prompt_len, guide); None when none has any."""
        guides = [s.extra.get("guide") for s in seqs]
        if not any(has_controls(s.params) for s in seqs) and all(g is None for g in guides):
            return None
        return cls([s.params for s in seqs], [s.tokens for s in seqs],
                   [s.extra.get("prompt_len", len(s.tokens)) for s in seqs], guides, device)

    def set_masks(self, drafts: list[list[int]], k: int | None = None) -> None:
        """The grammar rows' masks for positions 0..k of a verification of `drafts` (row b drafted
        len(drafts[b]) <= k tokens; its positions past them are never reached)."""
        k = max((len(d) for d in drafts), default=0) if k is None else k
        rows = [b for b, g in enumerate(self.guides) if g is not None]
        if rows:
            words = self.guides[rows[0]].words()
            self.masks = torch.full((len(self.guides), k + 1, words), -1, dtype=torch.int32)
            for b in rows:
                self.masks[b, : len(drafts[b]) + 1] = self.guides[b].masks(drafts[b])

    def apply(self, x: torch.Tensor, rows: torch.Tensor, j: int, extra) -> torch.Tensor:
        """x [A, V]: raw logits of batch rows `rows` [A] at position j (after extra[b][:j], extra a [B, >=j]
        tensor or lists). Returns float32 logits with the controls applied (x itself when none apply)."""
        rows_l = rows.tolist()
        if not any(self._touches(b) for b in rows_l):
            return x
        x = x.float() if x.dtype != torch.float32 else x.clone()
        if isinstance(extra, torch.Tensor):
            extra = extra.tolist()
        local = {b: i for i, b in enumerate(rows_l)}
        if self.masks is not None:
            g = [i for i, b in enumerate(rows_l) if self.guides[b] is not None]
            if g:
                self.apply_mask_rows(x, self.masks[[rows_l[i] for i in g], j], g)
        self.close(x, rows_l, j)
        bans = [(local[b], t) for b in self.ban_rows if b in local for t in self._banned(b, j, extra[b][:j] if extra else [])]
        if bans:
            r, t = zip(*bans)
            x[torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)] = float("-inf")
        if self.bias_rows:
            self._add_sparse(x, self._bias, local)
        for b in self.allow_rows:
            if b in local:
                self._allow_only(x[local[b]], b)
        if self.pen_rows:
            self._penalize(x, local, j, extra)
        return x

    def close(self, x: torch.Tensor, rows_l: list[int], j: int) -> None:
        """Grammar rows near the end of their budget favour closing tokens (`grammar.closing_bias`)."""
        for i, b in enumerate(rows_l):
            guide = self.guides[b]
            if guide is None:
                continue
            p = self.params[b]
            bias = closing_bias(p.max_tokens - (len(self.contexts[b]) - self.prompt_lens[b] + j) - 1, p.max_tokens)
            if bias:
                x[i] += bias * guide.closers_on(x.device)[: x.shape[-1]]

    def apply_mask_rows(self, x: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> None:
        """The draft's masks (one position, computed from its guides as it proposes) for these rows."""
        idx = torch.tensor(rows, device=x.device)
        x.index_copy_(0, idx, apply_mask_(x.index_select(0, idx), bits))

    # ---- internals -------------------------------------------------------------------------
    def _touches(self, b: int) -> bool:
        return has_controls(self.params[b]) or self.guides[b] is not None

    def _allow_only(self, row: torch.Tensor, b: int) -> None:
        """row [V]: every logit but row b's allowed_token_ids becomes -inf, in place on the row's device (no
        vocabulary-sized mask built or copied; ids past a draft's narrower logits drop out)."""
        ids = torch.tensor([t for t in self.params[b].allowed_token_ids if t < row.shape[-1]], dtype=torch.long,
                           device=row.device)
        kept = row.index_select(0, ids)
        row.fill_(float("-inf")).index_copy_(0, ids, kept)

    def _banned(self, b: int, j: int, drafted: list[int]) -> list[int]:
        p = self.params[b]
        out: list[int] = []
        generated = len(self.contexts[b]) - self.prompt_lens[b] + j
        if generated < p.min_tokens and self.guides[b] is None:  # a grammar decides where its output ends
            out += list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
        for word in p.bad_words_ids:  # the last token of a word, where the tokens before it were just generated
            head = word[:-1]
            if not head:
                out.append(word[-1])
                continue
            tail = (self.contexts[b][max(self.prompt_lens[b], len(self.contexts[b]) - len(head)):] + list(drafted))[-len(head):]
            if tail == head:
                out.append(word[-1])
        return out

    def _sparse(self, entries: list[tuple[int, int, float]]):
        rows = torch.tensor([e[0] for e in entries], device=self.device)
        ids = torch.tensor([e[1] for e in entries], device=self.device)
        vals = torch.tensor([e[2] for e in entries], dtype=torch.float32, device=self.device)
        return rows, ids, vals

    def _add_sparse(self, x: torch.Tensor, sparse, local: dict[int, int]) -> None:
        rows, ids, vals = sparse
        lookup = torch.full((len(self.params),), -1, dtype=torch.long, device=x.device)
        lookup[torch.tensor(list(local), device=x.device)] = torch.tensor(list(local.values()), device=x.device)
        at = lookup[rows]
        keep = at >= 0
        x.index_put_((at[keep], ids[keep]), vals[keep], accumulate=True)

    def _base_seen(self):
        """Per penalized row: (token ids seen [S], of them generated how often [S]), over the committed
        tokens; the prompt's tokens count (with 0) only for the repetition penalty."""
        out = {}
        for b in self.pen_rows:
            ctx, pl, p = self.contexts[b], self.prompt_lens[b], self.params[b]
            gen = torch.tensor(ctx[pl:], dtype=torch.long)
            ids = torch.cat([gen, torch.tensor(ctx[:pl], dtype=torch.long)]) if p.repetition_penalty != 1.0 else gen
            counts = torch.cat([torch.ones(len(gen)), torch.zeros(len(ids) - len(gen))])
            uniq, inv = ids.unique(return_inverse=True)
            out[b] = (uniq, torch.zeros(len(uniq)).index_add_(0, inv, counts))
        return out

    def _penalize(self, x: torch.Tensor, local: dict[int, int], j: int, extra) -> None:
        """OpenAI's presence / frequency penalties on generated tokens and vLLM's repetition penalty on
        every seen token, for the penalized rows among `local`, at position j (drafts count)."""
        parts_r, parts_t, parts_c = [], [], []
        for b in self.pen_rows:
            if b not in local:
                continue
            ids, counts = self._seen[b]
            drafted = torch.tensor(list(extra[b][:j]) if extra else [], dtype=torch.long)
            parts_r.append(torch.full((len(ids) + len(drafted),), local[b], dtype=torch.long))
            parts_t += [ids, drafted]
            parts_c += [counts, torch.ones(len(drafted))]
        if not parts_r:
            return
        vocab = x.shape[-1]
        keys = torch.cat(parts_r) * vocab + torch.cat(parts_t)
        uniq, inv = keys.unique(return_inverse=True)
        counts = torch.zeros(len(uniq)).index_add_(0, inv, torch.cat(parts_c)).to(x.device)
        r, t = (uniq // vocab).to(x.device), (uniq % vocab).to(x.device)
        rows_b = torch.tensor(list(local), device=x.device)  # local index -> batch row, to read params
        by_local = torch.empty(len(local), dtype=torch.long, device=x.device)
        by_local[torch.tensor(list(local.values()), device=x.device)] = rows_b
        pres, freq, rep = (torch.tensor([getattr(p, f) for p in self.params], dtype=torch.float32, device=x.device)[by_local[r]]
                           for f in ("presence_penalty", "frequency_penalty", "repetition_penalty"))
        v = x[r, t]
        v = torch.where(v > 0, v / rep, v * rep)
        v = v - freq * counts - pres * (counts > 0).float()
        x[r, t] = v


def _penalized(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def has_controls(p) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.bad_words_ids or p.allowed_token_ids or _penalized(p))
