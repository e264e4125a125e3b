"""One model (draft or target) with the KV state of the sequences in flight.

The engine drives a pair of these; the Ray deployments wrap each in its own actor. Only token ids
and a few numbers per drafted position cross between them (for a sampled row, the draft's proposal
over its own top-N tokens); warping, sampling, the coupled sampler's noise and logprob top-N run on
the worker's own device (`sampling.py`):

  draft.propose(ids, k)                     -> Proposal: k tokens per sequence (+ sparse q when sampling)
  target.verify(ids, proposal)              -> Verdict: accepted count and one recovered/bonus token per
                                               sequence (+ the target's features, for drafts that read them)
  draft.commit(ids, new_tokens, features)   -> draft appends what was accepted, rolls back the rest

A sequence's `tokens` are its committed tokens (prompt + output); positions [0, kv_len) of its KV row
hold tokens[:kv_len]; tokens[kv_len:] are pending and get fed at the start of the next forward.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from serve_app.config import SamplingParams
from serve_app.profiling.profiles import detect_gpu_type
from serve_app.engine.kv import SlotKVCache, causal_mask, compact_rows, ragged_inputs
from serve_app.engine.sampling import TOP_N, Warp, draft_choice, logprob_top, noise_key, verify_walk


@dataclass
class Proposal:
    """What the draft sends the target for one step: O(tokens), never vocabulary-sized.

    A sampled (unseeded) row also carries q, the distribution its tokens were sampled from: the
    draft's warped distribution over its own top-N tokens (N = `sampling.TOP_N`, 1 for n-gram),
    as values and token ids; greedy and seeded rows leave theirs at zero (they are verified by the
    target's own choice).
    """

    tokens: torch.Tensor  # [B, k] long
    probs: torch.Tensor | None = None  # [B, k, N] float32 q values on the support; None: no sampled row
    support: torch.Tensor | None = None  # [B, k, N] int32 vocabulary ids of those values
    backlog: tuple[int, int] = (0, 0)
    """(checked, matched): committed tokens the draft scored while catching up this step, and how many
    its greedy prediction matched (greedy rows only): acceptance evidence from steps that did not
    speculate, which lets a policy notice when the draft starts agreeing again."""

    @classmethod
    def empty(cls, rows: int) -> "Proposal":
        """No drafts (k = 0): the target decodes one token per row (or prefills)."""
        return cls(torch.zeros((rows, 0), dtype=torch.long))


class Verdict(NamedTuple):
    """What verification decided for each sequence of the batch."""

    num_accepted: list[int]
    next_tokens: list[int]
    """The recovered (at the first rejection) or bonus (after a full accept) target token."""
    features: object = None
    """Only when the target captures features (`capture_features`): per sequence, [n, F] bfloat16
    hidden states of the n positions this forward made final (the pending tokens and the accepted
    drafts; at prefill the whole prompt), F = hidden size x captured layers. bfloat16: half the bytes
    of float32 across actors, with float32's range (residual streams can exceed float16's). Between
    Ray actors this is a reference to them: they go from the target's actor to the draft's directly."""
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
        self.top_n = TOP_N
        self.timings = new_timings()
        self.head = plain_head(model)
        self.flush_denormals = self.device.type == "cpu"

    def take_timings(self) -> dict:
        """Device work since the last call (forwards; vocabulary-sized math beside them) and the bytes
        handed to another actor directly; resets them. Benchmarks read these to split a step."""
        out, self.timings = self.timings, new_timings()
        return out

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
        tokens, probs, support, backlog = [], [], [], (0, 0)
        # After steps without speculation the draft has a backlog of committed tokens to feed; scoring
        # the last few (about 256 over the batch) costs little and shows how well it would have done.
        window = min(max(len(f) for f in fed), max(2, 256 // len(seqs)), 32)
        draw = self._drawer(seqs)
        for j in range(k):
            logits = self._forward(seq_ids, fed, keep=window if j == 0 else 1,
                                   starts=[n + j - len(f) for n, f in zip(lens, fed)])
            if j == 0:
                backlog = self._timed(_backlog_agreement, seqs, fed, logits)
            tok, q, ids = self._timed(draw, logits[:, -1], [n + j for n in lens])
            tokens.append(tok)
            probs.append(q)
            support.append(ids)
            fed = [[t] for t in tok.tolist()]
        for s, n in zip(seqs, lens):
            s.proposal_kv = n + k - 1 if k > 0 else -1
        return _proposal(tokens, probs, support, len(seqs), backlog)

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
        fed = [s.tokens[s.kv_len :] + d for s, d in zip(seqs, drafts)]
        if self.head is not None:  # logits on demand: most rows stop at their first rejection
            logits = LazyLogits(self.head, self._forward(seq_ids, fed, keep=k + 1, hidden=True), self._sync)
        else:
            logits = self._forward(seq_ids, fed, keep=k + 1)
        t0 = time.perf_counter()
        dev = self.device
        bsz = len(seqs)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        seeded = torch.tensor([_coupled(s) for s in seqs], device=dev)
        # Per row and position: a seeded row's noise key comes from (seed, position); an unseeded sampled
        # row draws a random key (its recovered / bonus token) and k uniforms (its accept tests) from its
        # own generator: a few numbers per row, not vocabulary-sized.
        keys, u = [], []
        for s, n in zip(seqs, lens):
            if _coupled(s):
                keys.append([noise_key(s.params.seed, n + j) for j in range(k + 1)])
            elif _sampled(s):
                keys.append(torch.randint(0, 2**31 - 1, (k + 1,), generator=s.generator).tolist())
                u.append(torch.rand(k, generator=s.generator))
                continue
            else:
                keys.append([-1] * (k + 1))
            u.append(torch.zeros(k))
        keys = torch.tensor(keys, dtype=torch.int32, device=dev).reshape(bsz, k + 1)
        u = torch.stack(u).to(dev) if k else torch.zeros((bsz, 0), device=dev)
        q_values = q_ids = None
        if proposal.probs is not None:
            q_values, q_ids = proposal.probs.to(dev), proposal.support.to(dev)
        with denormals_flushed(self.flush_denormals):
            num_acc, next_tok = verify_walk(logits, proposal.tokens.to(dev), greedy, keys, seeded,
                                            Warp.of([s.params for s in seqs], dev), q_values, q_ids, u)
        num_acc, next_tok = num_acc.tolist(), next_tok.tolist()
        pending = [len(s.tokens) - s.kv_len for s in seqs]  # fed before the drafts; all now final
        for s, n_b, d, t, length in zip(seqs, num_acc, drafts, next_tok, lens):
            s.tokens.extend(d[:n_b] + [t])
            s.kv_len = length + n_b  # KV through the last accepted draft; t is pending
        features = self._features(pending, num_acc, k) if self.feature_layers else None
        logprobs = _logprobs(seqs, logits, drafts, num_acc, next_tok)
        self._sync()
        head_s = logits.seconds if isinstance(logits, LazyLogits) else 0.0
        self.timings["forward_s"] += head_s  # the output projection is the model's work
        self.timings["sample_s"] += time.perf_counter() - t0 - head_s
        return Verdict(num_acc, next_tok, features, logprobs)

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
        pending[b] + k columns. Layers of a model split over devices are gathered on the first one's."""
        grabbed = [self._captured.pop(i) for i in self.feature_layers]
        h = torch.cat([g.to(grabbed[0].device) for g in grabbed], dim=-1)  # [B, T, F]
        width = h.shape[1]
        keep = torch.cat([torch.arange(b * width + width - p - k, b * width + width - k + n, device=h.device)
                          for b, (p, n) in enumerate(zip(pending, accepted))])
        rows = h.reshape(-1, h.shape[-1])[keep].to(torch.bfloat16).cpu()  # one copy off the device
        return list(rows.split([p + n for p, n in zip(pending, accepted)]))

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
        self, seq_ids: list[str], fed: list[list[int]], keep: int, starts: list[int] | None = None, hidden: bool = False
    ) -> torch.Tensor:  # logits [B, keep, V] (hidden: last hidden states [B, keep, H]) for the last `keep` fed tokens
        seqs = [self.seqs[s] for s in seq_ids]
        if starts is None:
            starts = [s.kv_len for s in seqs]
        t0 = time.perf_counter()
        ids, pos = ragged_inputs(fed, starts, self.pad_id)
        ids, pos = ids.to(self.device), pos.to(self.device)
        self.cache.prepare(self.order.index(seq_ids[0]), pos)
        mask = causal_mask(pos, self.cache._kv_max, self.mask_dtype)
        args = dict(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=self.cache, use_cache=True)
        if hidden:
            out = self.model.model(**args).last_hidden_state[:, -keep:]
        else:
            out = self.model(**args, logits_to_keep=keep).logits
        self._sync()
        self.timings["forward_s"] += time.perf_counter() - t0
        return out

    def _sync(self) -> None:
        """Wait for the device, so timings measure work done, not work queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn, *args):
        """Run vocabulary-sized work beside a forward and count it as such."""
        t0 = time.perf_counter()
        with denormals_flushed(self.flush_denormals):
            out = fn(*args)
        self._sync()
        self.timings["sample_s"] += time.perf_counter() - t0
        return out

    def _drawer(self, seqs: list[Sequence]):
        """draw(logits [B, V], positions) -> (tokens [B], q values [B, N] | None, q ids [B, N] | None): the
        next draft token per row for the token at positions[b] (`sampling.draft_choice`)."""
        dev = self.device
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        if bool(greedy.all()):
            return lambda logits, positions: (logits.max(dim=-1).indices.cpu(), None, None)
        w = Warp.of([s.params for s in seqs], dev)

        def draw(logits, positions):
            keys = torch.tensor([noise_key(s.params.seed, n) if _coupled(s) else -1 for s, n in zip(seqs, positions)],
                                dtype=torch.int32, device=dev)
            u = torch.stack([torch.rand(1, generator=s.generator)[0] if _sampled(s) else torch.zeros(()) for s in seqs]).to(dev)
            tok, q, ids = draft_choice(logits, greedy, keys, w, u, self.top_n)
            return tok.cpu(), q.cpu(), ids.cpu()

        return draw


PLAIN_HEAD_MODELS = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2"}
"""Architectures whose logits are exactly lm_head(last hidden state) (no soft-capping or scaling after
it): verification computes their logits itself, position by position as needed."""


def plain_head(model) -> torch.nn.Module | None:
    """The output projection of a model whose logits are a plain linear map of its decoder's last hidden
    state, else None (the model's own forward then makes every kept position's logits)."""
    head, decoder = getattr(model, "lm_head", None), getattr(model, "model", None)
    if getattr(model.config, "model_type", None) in PLAIN_HEAD_MODELS and isinstance(head, torch.nn.Linear) \
            and decoder is not None:
        return head
    return None


class LazyLogits:
    """The target's logits after each fed draft position, made when the acceptance walk asks: position 0
    for every row, then positions 1..k in one matmul for the rows that accepted their first draft (at
    most two passes over the output projection's weights, which at a 128k vocabulary are the largest
    matrix of the model). Most rows of a large batch stop at their first rejection."""

    def __init__(self, head: torch.nn.Module, hidden: torch.Tensor, sync):  # hidden [B, k+1, H]
        self.head, self.hidden, self.sync = head, hidden, sync
        self.rest: torch.Tensor | None = None  # [A1, k, V] for rows rest_rows
        self.rest_rows: torch.Tensor | None = None
        self.seconds = 0.0

    def __call__(self, rows: torch.Tensor, j: int) -> torch.Tensor:  # rows [A] ascending -> [A, V]
        t0 = time.perf_counter()
        if j == 0:
            out = self.head(self.hidden[:, 0].index_select(0, rows))
        else:
            if self.rest is None:  # the walk only drops rows, so later positions ask for a subset of these
                self.rest_rows, self.rest = rows, self.head(self.hidden.index_select(0, rows)[:, 1:])
            out = self.rest[:, j - 1].index_select(0, torch.searchsorted(self.rest_rows, rows))
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out

    def rows(self, rows: torch.Tensor, width: int) -> torch.Tensor:  # [R] -> [R, width, V] (logprobs)
        t0 = time.perf_counter()
        out = self.head(self.hidden.index_select(0, rows)[:, :width])
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


def _backlog_agreement(seqs: list[Sequence], fed: list[list[int]], logits: torch.Tensor) -> tuple[int, int]:
    """(checked, matched) of the draft's greedy next-token predictions over its pending tokens.

    logits [B, W, V] belong to the last W fed positions (rows are left-padded): the prediction at a
    pending token is checked against the pending token after it, which the target already committed.
    """
    w = logits.shape[1]
    pred = logits[:, :-1].max(dim=-1).indices.tolist() if w > 1 else [[] for _ in seqs]  # [B, W-1]
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
    j of this forward scored the j-th emitted token, so they are the same at any k (and without a draft).
    Computed on the device over the emitted positions only; ids and numbers leave it."""
    rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    emitted = {b: drafts[b][: num_acc[b]] + [next_tok[b]] for b in rows}
    width = max(len(e) for e in emitted.values())
    device = logits.hidden.device if isinstance(logits, LazyLogits) else logits.device
    tokens = torch.tensor([emitted[b] + [0] * (width - len(emitted[b])) for b in rows], device=device)
    top = max(seqs[b].params.logprobs for b in rows)
    index = torch.tensor(rows, device=tokens.device)
    raw = logits.rows(index, width) if isinstance(logits, LazyLogits) else logits[index, :width]
    chosen, vals, ids = logprob_top(raw, tokens, top)
    chosen, vals, ids = chosen.tolist(), vals.tolist(), ids.tolist()
    out: list = [None] * len(seqs)
    for i, b in enumerate(rows):
        n = seqs[b].params.logprobs
        out[b] = [(chosen[i][j], list(zip(ids[i][j][:n], vals[i][j][:n]))) for j in range(len(emitted[b]))]
    return out


def _coupled(s: Sequence) -> bool:
    """Seeded sampled requests use the coupled sampler: the same text whatever k is chosen."""
    return not s.params.greedy and s.params.seed is not None


def _sampled(s: Sequence) -> bool:
    """Unseeded sampled requests: rejection sampling with uniforms from the sequence's generator."""
    return not s.params.greedy and s.params.seed is None


@contextlib.contextmanager
def denormals_flushed(on: bool = True):
    """Denormal floats as zeros in this thread while the vocabulary-sized work runs, then back (the
    setting is per thread and process-wide code, hypothesis for one, refuses to run under it). exp()
    of logits far below a sharp row's max underflows into denormals, which CPUs handle ~25x slower (a
    logsumexp over 32 rows of 128k: 37 ms instead of 1.5 ms); as zeros they change no sample
    (probabilities under 1e-38). Worker actors set it for their whole process (deployments/workers.py)."""
    if not on:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def new_timings() -> dict:
    """What `take_timings` reports: seconds of forwards and of the vocabulary-sized work beside them,
    and bytes handed straight to another actor."""
    return {"forward_s": 0.0, "sample_s": 0.0, "direct_bytes": 0}


def _proposal(tokens: list, probs: list, support: list, rows: int, backlog: tuple[int, int]) -> Proposal:
    """A Proposal from per-position draws: tokens [B] each, and q [B, N] each when any row samples."""
    if not tokens:
        return Proposal.empty(rows)
    if probs[0] is None:
        return Proposal(torch.stack(tokens, 1), backlog=backlog)
    return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(support, 1), backlog)


def _role_seed(seed: int | None, role: str) -> int:
    """Per-request seed for one role; draft and target draw from different streams."""
    if seed is None:
        return random.getrandbits(63)
    return (seed * 1_000_003 + (1 if role == "draft" else 2)) % (2**63)
