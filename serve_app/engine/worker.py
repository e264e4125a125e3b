"""One model (draft or target) with the KV state of the sequences in flight.

The engine drives a pair of these; the Ray deployments wrap each in its own actor. Only token ids
(and, when sampling, the draft distributions) cross between them:

  draft.propose(ids, k)                     -> Proposal: k tokens per sequence (+ q when sampling)
  target.verify(ids, proposal)              -> Verdict: accepted count and one recovered/bonus token per
                                               sequence (+ the target's features, for drafts that read them)
  draft.commit(ids, new_tokens, features)   -> draft appends what was accepted, rolls back the rest

A sequence's `tokens` are its committed tokens (prompt + output); positions [0, kv_len) of its KV row
hold tokens[:kv_len]; tokens[kv_len:] are pending and get fed at the start of the next forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from serve_app.config import SamplingParams
from serve_app.profiling.profiles import detect_gpu_type
from serve_app.engine.kv import SlotKVCache, causal_mask, compact_rows, ragged_inputs
from serve_app.engine.speculative import accept_greedy, accept_sampled, coupled_choice, coupling_noise, sample, warp_probs


@dataclass
class Proposal:
    """What the draft sends the target for one step.

    When sampling, the target needs q, the draft distributions. Top-k / top-p leave most of a
    vocabulary at zero, so q travels as (support indices, values) when that is smaller.
    """

    tokens: torch.Tensor  # [B, k] long
    probs: torch.Tensor | None = None  # [B, k, V] q (zeros for greedy rows), or [B, k, S] values if sparse
    support: torch.Tensor | None = None  # [B, k, S] long vocabulary ids of the values in probs, if sparse
    backlog: tuple[int, int] = (0, 0)
    """(checked, matched): committed tokens the draft scored while catching up this step, and how many
    its greedy prediction matched (greedy rows only): acceptance evidence from steps that did not
    speculate, which lets a policy notice when the draft starts agreeing again."""

    def compact(self) -> "Proposal":
        """Sparse form when every row's support is below a quarter of the vocabulary."""
        if self.probs is None or self.support is not None:
            return self
        width = int((self.probs > 0).sum(-1).max())
        if width * 4 >= self.probs.shape[-1]:
            return self
        values, support = self.probs.topk(width, dim=-1)
        return Proposal(self.tokens, values, support, self.backlog)

    def dense_probs(self, vocab: int) -> torch.Tensor:  # [B, k, V]
        if self.support is None:
            return self.probs
        return torch.zeros((*self.probs.shape[:2], vocab), dtype=self.probs.dtype).scatter_(-1, self.support, self.probs)


class Verdict(NamedTuple):
    """What verification decided for each sequence of the batch."""

    num_accepted: list[int]
    next_tokens: list[int]
    """The recovered (at the first rejection) or bonus (after a full accept) target token."""
    features: list[torch.Tensor] | None = None
    """Only when the target captures features (`capture_features`): per sequence, [n, F] bfloat16
    hidden states of the n positions this forward made final (the pending tokens and the accepted
    drafts; at prefill the whole prompt), F = hidden size x captured layers. bfloat16: half the bytes
    of float32 across actors, with float32's range (residual streams can exceed float16's)."""
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    """Only for sequences that ask (`SamplingParams.logprobs`): per emitted token (accepted drafts, then
    the next token), the target's log-probability of it and the top alternatives [(id, logprob)],
    from the raw logits of this verification (before temperature / top-k / top-p)."""


@dataclass
class Sequence:
    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator
    kv_len: int = 0
    proposal_kv: int = -1  # draft: kv_len right after its last proposal; -1 = none outstanding
    extra: dict = field(default_factory=dict)


def contiguous_rows(worker, seq_ids: list[str]) -> list:
    """A worker's sequences for seq_ids (its `seqs` by id), which must be a contiguous run of its rows
    (`order`) in order; shared by every draft worker so all refuse a bad call the same way."""
    try:
        r0 = worker.order.index(seq_ids[0])
    except ValueError:
        raise KeyError(f"{worker.role}: unknown sequence {seq_ids[0]!r}") from None
    if worker.order[r0 : r0 + len(seq_ids)] != list(seq_ids):
        raise ValueError(f"{worker.role}: sequences must be contiguous rows in order")
    return [worker.seqs[s] for s in seq_ids]


class ModelWorker:
    """Holds a causal LM and the per-sequence state for it; rows follow `order`."""

    def __init__(self, model: torch.nn.Module, role: str, pad_id: int = 0):
        self.model = model.eval()
        self.role = role
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"{role} model uses attention {impl!r}; specserve needs 'sdpa' or 'eager'")
        self.mask_dtype = None if impl == "sdpa" else model.dtype
        self.cache = SlotKVCache()
        self.seqs: dict[str, Sequence] = {}
        self.order: list[str] = []  # order[row] = sequence id
        self.feature_layers: list[int] = []  # target: residual-stream inputs of these layers are captured
        self._captured: dict[int, torch.Tensor] = {}  # layer id -> [B, T, H] of the current forward

    # ---- lifecycle -------------------------------------------------------------------------
    def add(self, seq_ids: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Register new sequences in the rows after the running ones (no forward yet)."""
        for sid, prompt, p in zip(seq_ids, prompts, params):
            if sid in self.seqs:
                raise ValueError(f"sequence {sid!r} already exists")
            gen = torch.Generator().manual_seed(_role_seed(p.seed, self.role))
            self.seqs[sid] = Sequence(tokens=list(prompt), params=p, generator=gen)
            self.order.append(sid)

    @torch.inference_mode()
    def remove(self, seq_ids: list[str]) -> None:
        """Drop finished sequences and compact rows (the engine mirrors this with compact_rows)."""
        gone = set(seq_ids) & set(self.seqs)
        new_order, moves = compact_rows(self.order, gone)
        rows = list(self.order)  # who sits in each row as the moves apply
        for src, dst in moves:
            rows[dst] = rows[src]
            self.cache.move_row(src, dst, self.seqs[rows[src]].kv_len)
        for sid in gone:
            del self.seqs[sid]
        self.order = new_order

    def reset(self) -> None:
        """Drop every sequence (after a failed step: the engine prefills the survivors again)."""
        self.remove(list(self.order))

    @torch.inference_mode()
    def prefill(self, seq_ids: list[str], features: list[torch.Tensor] | None = None) -> None:
        """Feed every pending token so the KV catches up (draft: prompts of new sequences). A draft
        that reads no target features ignores them."""
        seqs = self._rows(seq_ids)
        self._forward(seq_ids, [s.tokens[s.kv_len :] for s in seqs], keep=1)
        for s in seqs:
            s.kv_len = len(s.tokens)

    # ---- draft side --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seq_ids: list[str], k: int) -> Proposal:
        """k autoregressive draft forwards; the first also feeds (and scores) each sequence's pending tokens."""
        seqs = self._rows(seq_ids)
        lens = [len(s.tokens) for s in seqs]
        fed = [s.tokens[s.kv_len :] for s in seqs]
        tokens, probs, backlog = [], [], (0, 0)
        # After steps without speculation the draft has a backlog of committed tokens to feed; scoring
        # the last few (about 256 over the batch) costs little and shows how well it would have done.
        window = min(max(len(f) for f in fed), max(2, 256 // len(seqs)), 32)
        for j in range(k):
            logits = self._forward(seq_ids, fed, keep=window if j == 0 else 1,
                                   starts=[n + j - len(f) for n, f in zip(lens, fed)])
            if j == 0:
                backlog = _backlog_agreement(seqs, fed, logits)
            tok, q = self._draw(seqs, logits[:, -1], [n + j for n in lens])
            tokens.append(tok)
            probs.append(q)
            fed = [[t] for t in tok.tolist()]
        for s, n in zip(seqs, lens):
            s.proposal_kv = n + k - 1 if k > 0 else -1
        if k == 0:
            return Proposal(torch.zeros((len(seqs), 0), dtype=torch.long))
        any_sampled = any(not s.params.greedy for s in seqs)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1) if any_sampled else None, backlog=backlog).compact()

    def commit(self, seq_ids: list[str], new_tokens: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Append each sequence's accepted drafts + target token; keep only KV that is still valid.
        (`features` are for drafts that read the target's; this one does not.)"""
        for sid, new in zip(seq_ids, new_tokens):
            s = self.seqs[sid]
            committed = len(s.tokens)
            if s.proposal_kv >= 0:
                # KV holds the proposal's first k-1 tokens; the first len(new)-1 of them were accepted.
                s.kv_len = min(s.proposal_kv, committed + len(new) - 1)
                s.proposal_kv = -1
            s.tokens.extend(new)

    # ---- target side -------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, seq_ids: list[str], proposal: Proposal) -> Verdict:
        """Score pending + k draft tokens of every sequence in ONE forward; accept; commit.

        Returns a Verdict per sequence. With k = 0 this is one plain decoding step (and, for a new
        sequence, its prefill: the pending tokens are the whole prompt).
        """
        seqs = self._rows(seq_ids)
        drafts = proposal.tokens.tolist()
        k = proposal.tokens.shape[1]
        lens = [len(s.tokens) for s in seqs]
        logits = self._forward(seq_ids, [s.tokens[s.kv_len :] + d for s, d in zip(seqs, drafts)], keep=k + 1)
        num_acc = torch.zeros(len(seqs), dtype=torch.long)
        next_tok = torch.zeros(len(seqs), dtype=torch.long)
        greedy = [b for b, s in enumerate(seqs) if s.params.greedy]
        coupled = [b for b, s in enumerate(seqs) if _coupled(s)]
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy and not _coupled(s)]
        if greedy:
            g = torch.tensor(greedy)
            n, t = accept_greedy(proposal.tokens[g], logits[g].argmax(-1).cpu())
            num_acc[g], next_tok[g] = n, t
        if coupled:  # the target's own coupled choice at every position; drafts accepted while they match
            cb = torch.tensor(coupled)
            rows = [seqs[b] for b in coupled]
            p = self._warp(rows, logits[cb].reshape(len(coupled) * (k + 1), -1), repeat=k + 1).cpu()
            noise = torch.stack([coupling_noise(s.params.seed, lens[b] + j, p.shape[-1])
                                 for b, s in zip(coupled, rows) for j in range(k + 1)])
            choice = coupled_choice(p, noise).reshape(len(coupled), k + 1)
            n, t = accept_greedy(proposal.tokens[cb], choice)
            num_acc[cb], next_tok[cb] = n, t
        if sampled:
            sb = torch.tensor(sampled)
            rows = [seqs[b] for b in sampled]
            p = self._warp(rows, logits[sb].reshape(len(sampled) * (k + 1), -1), repeat=k + 1)
            p = p.reshape(len(sampled), k + 1, -1).cpu()
            u = torch.stack([torch.rand(k + 1, generator=s.generator) for s in rows])  # [Bs, k+1]
            q = proposal.dense_probs(p.shape[-1])[sb] if k > 0 else p[:, :0]
            n, t = accept_sampled(proposal.tokens[sb], q, p, u[:, :k], u[:, k])
            num_acc[sb], next_tok[sb] = n, t
        pending = [len(s.tokens) - s.kv_len for s in seqs]  # fed before the drafts; all now final
        for s, n_b, d, t, length in zip(seqs, num_acc.tolist(), drafts, next_tok.tolist(), lens):
            s.tokens.extend(d[:n_b] + [t])
            s.kv_len = length + n_b  # KV through the last accepted draft; t is pending
        features = self._features(pending, num_acc.tolist(), k) if self.feature_layers else None
        logprobs = _logprobs(seqs, logits, drafts, num_acc.tolist(), next_tok.tolist())
        return Verdict(num_acc.tolist(), next_tok.tolist(), features, logprobs)

    # ---- target features (for drafts that read them, EAGLE-style) -----------------------------
    def capture_features(self, layers: list[int]) -> None:
        """From now on, verify() also returns the residual stream entering each of `layers` (layer
        id == the layer count means the output of the last layer, before the final norm)."""
        decoder = self.model.model
        n = len(decoder.layers)
        if not layers or any(not 0 <= i <= n for i in layers):
            raise ValueError(f"feature layers {layers} do not fit a target of {n} layers (ids 0..{n})")
        if self.feature_layers:
            if layers != self.feature_layers:
                raise ValueError(f"target already captures layers {self.feature_layers}, not {layers}")
            return

        def hook(i):
            def grab(module, args, kwargs):
                self._captured[i] = args[0] if args else kwargs["hidden_states"]
            return grab

        for i in layers:
            (decoder.layers[i] if i < n else decoder.norm).register_forward_pre_hook(hook(i), with_kwargs=True)
        self.feature_layers = list(layers)

    def _features(self, pending: list[int], accepted: list[int], k: int) -> list[torch.Tensor]:
        """Per row, the captured features of the positions this forward made final: its pending
        tokens and its accepted drafts. Rows are left-padded, so row b's fed tokens are its last
        pending[b] + k columns."""
        h = torch.cat([self._captured.pop(i) for i in self.feature_layers], dim=-1)  # [B, T, F]
        width = h.shape[1]
        return [h[b, width - p - k : width - k + n].to(torch.bfloat16).cpu()
                for b, (p, n) in enumerate(zip(pending, accepted))]

    def info(self) -> dict:
        """What the engine needs to know about this model without holding it."""
        cfg = self.model.config
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        return {
            "role": self.role,
            "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
            "vocab_size": self.model.get_output_embeddings().weight.shape[0],
            "eos_ids": eos,
            "gpu_type": detect_gpu_type(),
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }

    # ---- internals -------------------------------------------------------------------------
    def _rows(self, seq_ids: list[str]) -> list[Sequence]:
        return contiguous_rows(self, seq_ids)

    def _forward(
        self, seq_ids: list[str], fed: list[list[int]], keep: int, starts: list[int] | None = None
    ) -> torch.Tensor:  # logits [B, keep, V] for the last `keep` fed tokens of each row
        seqs = [self.seqs[s] for s in seq_ids]
        if starts is None:
            starts = [s.kv_len for s in seqs]
        ids, pos = ragged_inputs(fed, starts, self.pad_id)
        ids, pos = ids.to(self.device), pos.to(self.device)
        self.cache.prepare(self.order.index(seq_ids[0]), pos)
        mask = causal_mask(pos, self.cache._kv_max, self.mask_dtype)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits

    def _warp(self, seqs: list[Sequence], logits: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """Warped probabilities for rows of logits [N*repeat, V], each row repeated per sequence."""
        ps = [s.params for s in seqs]

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device).repeat_interleave(repeat)

        return warp_probs(
            logits,
            col([p.temperature for p in ps], torch.float32),
            col([p.top_k for p in ps], torch.long),
            col([p.top_p for p in ps], torch.float32),
        )

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next draft token per row of logits [B, V] for the token at positions[b]: argmax for greedy
        rows, the coupled choice for seeded rows, a sample from q otherwise."""
        tokens = logits.argmax(-1).cpu()
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return tokens, None
        sb = torch.tensor(sampled)
        q = torch.zeros(logits.shape, dtype=torch.float32)
        q[sb] = self._warp([seqs[b] for b in sampled], logits[sb]).cpu()
        for b in sampled:
            s = seqs[b]
            if _coupled(s):
                tokens[b] = coupled_choice(q[b : b + 1], coupling_noise(s.params.seed, positions[b], q.shape[-1])[None])[0]
            else:
                tokens[b] = sample(q[b : b + 1], torch.rand(1, generator=s.generator))[0]
        return tokens, q


def _backlog_agreement(seqs: list[Sequence], fed: list[list[int]], logits: torch.Tensor) -> tuple[int, int]:
    """(checked, matched) of the draft's greedy next-token predictions over its pending tokens.

    logits [B, W, V] belong to the last W fed positions (rows are left-padded): the prediction at a
    pending token is checked against the pending token after it, which the target already committed.
    """
    w = logits.shape[1]
    pred = logits[:, :-1].argmax(-1).tolist()  # [B, W-1]
    checked = matched = 0
    for b, (s, f) in enumerate(zip(seqs, fed)):
        n = min(len(f), w)  # real tokens in the window; the rest is padding
        if n < 2 or not s.params.greedy:
            continue
        checked += n - 1
        matched += sum(p == t for p, t in zip(pred[b][w - n :], f[len(f) - n + 1 :]))
    return checked, matched


def _logprobs(seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]], num_acc: list[int],
              next_tok: list[int]) -> list | None:
    """Verdict.logprobs: the target's own log-probabilities of what each asking sequence emits. Position
    j of this forward scored the j-th emitted token, so they are the same at any k (and without a draft)."""
    rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    out: list = [None] * len(seqs)
    picked = logits[torch.tensor(rows, device=logits.device)]
    lsm = torch.log_softmax(picked.double() if picked.dtype == torch.float64 else picked.float(), dim=-1).cpu()  # [R, k+1, V]
    for i, b in enumerate(rows):
        top = seqs[b].params.logprobs
        emitted = drafts[b][: num_acc[b]] + [next_tok[b]]
        vals, ids = lsm[i, : len(emitted)].topk(top, dim=-1) if top else (None, None)
        out[b] = [(lsm[i, j, t].item(), list(zip(ids[j].tolist(), vals[j].tolist())) if top else [])
                  for j, t in enumerate(emitted)]
    return out


def _coupled(s: Sequence) -> bool:
    """Seeded sampled requests use the coupled sampler: the same text whatever k is chosen."""
    return not s.params.greedy and s.params.seed is not None


def _role_seed(seed: int | None, role: str) -> int:
    """Per-request seed for one role; draft and target draw from different streams."""
    if seed is None:
        return random.getrandbits(63)
    return (seed * 1_000_003 + (1 if role == "draft" else 2)) % (2**63)
