"""One model (draft or target) with the KV state of the sequences in flight.

The engine drives a pair of these; the Ray deployments wrap each in its own actor. Only token ids
and a few numbers per drafted position cross between them (for a sampled row, the draft's proposal
over its own top-N tokens); warping, sampling, the coupled sampler's noise and logprob top-N run on
the worker's own device (`sampling.py`):

  draft.propose(ids, k)                     -> Proposal: k tokens per sequence (+ sparse q when sampling)
  target.verify(ids, proposal, chunks)      -> Verdict: accepted count and one recovered/bonus token per
                                               sequence (+ the target's features, for drafts that read them);
                                               in the same forward, prefill chunks of admitted prompts
  draft.commit(ids, new_tokens, features)   -> draft appends what was accepted, rolls back the rest
  draft.prefill(ids, features, upto)        -> draft's KV catches up with the target's prefill chunks

A sequence's `tokens` are its committed tokens (prompt + output); positions [0, kv_len) of its KV
(blocks of `kv.PagedKV`) hold tokens[:kv_len]; tokens[kv_len:] are pending and get fed at the start of
the next forward. `add` starts a sequence on the cached blocks its prompt begins with (prefix caching).
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from serve_app.config import SamplingParams
from serve_app.hardware import detect_gpu_type
from serve_app.models import held_dtype
from serve_app.engine.controls import Controls, has_controls
from serve_app.engine.draftplan import DraftPlan, PlanWalk
from serve_app.engine.grammar import Guide
from serve_app.engine import allocator, attention, lean, packing, static
from serve_app.engine.static import StaticSteps
from serve_app.engine.syncs import WorkClock
from serve_app.engine.kv import (ATTENTION, PagedKV, attention_layers, cuda_memory, kv_bytes_per_token, kv_pool_tokens,
                                pack)
from serve_app.engine.history import PROMPT_TAIL, LiveOutputs, SuffixHistory, history_estimate
from serve_app.engine.lookup import LOOKUP_MIN_N, CopyRecord, NgramIndex
from serve_app.engine.sampling import (TOP_N, Warp, accept_all, argmax, draft_choice, logprob_top, logsumexp,
                                      noise_key, verify_walk)


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
    lengths: list[int] | None = None
    """Tokens each row really drafted (a `DraftPlan` stops rows early; the rest of its row of `tokens` is
    padding the target never feeds); None: every row all k."""
    conf: list[list[float]] | None = None
    """Per row, the draft's confidence at each drafted position (its distribution's largest probability),
    for the policy's online acceptance curve; None when the step had no plan."""
    lookup: list[bool] | None = None
    """Per row: its tokens were copied, from its own context (prompt lookup beside the model draft) or from the
    suffix history (`history`)."""
    history: list[bool] | None = None
    """Per row: its copy came from the suffix history of earlier outputs (`engine.history`); None: no row's did."""
    forwards: int = 0
    """Draft forwards this proposal ran (the first over every row, later ones over the rows still drafting): what
    its draft time is priced by. Rows that copy run none; a plan that kept nothing still ran its first."""
    _rows: list | None = field(default=None, repr=False, compare=False)  # tokens as host lists, once read

    @classmethod
    def empty(cls, rows: int) -> "Proposal":
        """No drafts (k = 0): the target decodes one token per row (or prefills)."""
        return cls(torch.zeros((rows, 0), dtype=torch.long))

    def row_lengths(self) -> list[int]:
        """Tokens drafted per row."""
        return list(self.lengths) if self.lengths is not None else [self.tokens.shape[1]] * self.tokens.shape[0]

    def token_rows(self) -> list[list[int]]:
        """tokens [B, k] as host lists, padding included: read once, then kept (a proposal is never changed)."""
        if self._rows is None:
            self._rows = self.tokens.tolist()
        return self._rows

    def drafts(self) -> list[list[int]]:
        """Each row's drafted tokens, without padding."""
        return [d[:n] for d, n in zip(self.token_rows(), self.row_lengths())]


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
    kv_len: int = 0
    proposal_kv: int = -1  # draft: kv_len right after its last proposal; -1 = none outstanding
    extra: dict = field(default_factory=dict)


HISTORY_OUTBOX = 4096
"""Remembered outputs a draft keeps for the shared store between its collections (the oldest go first)."""


def lookup(worker, seq_ids: list[str]) -> list:
    """A worker's sequences for seq_ids (its `seqs` by id); shared by every draft worker so all refuse
    an unknown id the same way."""
    try:
        return [worker.seqs[s] for s in seq_ids]
    except KeyError as e:
        raise KeyError(f"{worker.role}: unknown sequence {e.args[0]!r}") from None


class ModelWorker:
    """Holds a causal LM and the per-sequence state for it; rows follow `order`."""

    def __init__(self, model: torch.nn.Module, role: str, pad_id: int = 0):
        self.model = model.eval()
        self.role = role
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        if packing.wanted(self.device):  # oneDNN's layouts, fused siblings: the forward at the CPU's bandwidth
            packing.pack_linears(model)
        if self.device.type == "cpu":  # a step's large tensors reuse the last step's pages (`allocator`)
            allocator.keep_freed_memory()
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager", ATTENTION):
            raise ValueError(f"{role} model uses attention {impl!r}; specserve needs 'sdpa' or 'eager'")
        if getattr(model.config, "attn_logit_softcapping", None):
            raise ValueError(f"{role} model soft-caps attention logits, which specserve's paged attention does not")
        self.cache = PagedKV()
        self.kept: torch.Tensor | None = None  # [slots, F] bfloat16 target features beside the KV (EAGLE drafts)
        self._slots: torch.Tensor | None = None  # pool slots of the last forward's packed tokens
        self.seqs: dict[str, Sequence] = {}
        self.order: list[str] = []  # sequence ids in the order they were added
        self.feature_layers: list[int] = []  # target: residual-stream inputs of these layers are captured
        self._captured: dict[int, torch.Tensor] = {}  # layer id -> [B, T, H] of the current forward
        self.top_n = TOP_N
        # unseeded sampled rows' randomness (draws, accept tests, recovered tokens): one stream for the worker, so a
        # batch's numbers come from one call, not one per row; seeded rows draw from their seed's noise instead
        self.rng = torch.Generator().manual_seed(random.getrandbits(63))
        self.timings = new_timings()
        self.clock = WorkClock(self.device)  # device time without a wait per forward (events on CUDA)
        self.head = plain_head(model)
        self.lean = lean.supports(model)
        """Forwards run `lean.forward` (a stock Llama decoder) instead of transformers' wrapped one."""
        self.flush_denormals = self.device.type == "cpu"
        self.tokenizer = None  # for structured outputs (grammar masks need the vocabulary's strings)
        self.prompt_lookup = False
        """A draft: rows may copy from their own context where that agrees better (`engine.lookup`)."""
        self.history: SuffixHistory | None = None
        """A draft with prompt lookup: rows may also copy from earlier requests' outputs (`engine.history`)."""
        self.live: LiveOutputs | None = None
        """Beside the history: the outputs of the rows running now, as they commit (`history.LiveOutputs`)."""
        self.history_shared = False
        """Every request drafts from one history (a single-tenant deployment); else from its tenant's only."""
        self.history_outbox: list[tuple[str, list[int], list[int]]] | None = None
        """Outputs remembered since the last `take_history` (tenant, prompt tail, output): what a shared history
        store collects from this replica. None until a store first collects (an engine without one keeps none)."""
        self.ahead: tuple | None = None
        """A step looked ahead (`look_ahead`): (its rows, its Verdict or None while it runs, what undoes it)."""
        self.ahead_used = 0  # looked-ahead steps a verification was answered with
        self.one_pass = {"1": True, "0": False}.get(os.environ.get("SPECSERVE_ONE_PASS", ""), self.device.type == "cuda")
        """A batch without controls is accepted in one vectorized pass (`sampling.accept_all`: every position's logits
        in one pass over the output projection, one read-back) instead of the walk's read per position: on a GPU,
        where each read stalls the stream and the projection's cost is its weights, not its rows. The environment's
        SPECSERVE_ONE_PASS (1 / 0) overrides the device's default (a CPU run of a GPU's path; a GPU without it)."""
        self.static: StaticSteps | None = None
        """Decoding and verification forwards at bucketed shapes, replayed as CUDA graphs (`configure_kv`)."""

    def take_timings(self) -> dict:
        """Device work since the last call (forwards; vocabulary-sized math beside them) and the bytes
        handed to another actor directly; resets them. Benchmarks read these to split a step."""
        self.clock.settle(self.timings)
        out, self.timings = self.timings, new_timings()
        return out

    # ---- lifecycle -------------------------------------------------------------------------
    def configure_kv(self, block_size: int = 16, max_blocks: int = 4096, prefix_caching: bool = True,
                     attention_backend: str = "auto", preallocate: bool = False, static_steps: str = "auto") -> str:
        """Set the KV pool's block size, its limit in blocks, prefix caching and attention backend (before any
        sequence); preallocate: take all its blocks now (a pool sized from device memory); static_steps: whether
        decoding and verification forwards run from bucketed buffers, captured as CUDA graphs (`engine/static.py`,
        `EngineConfig.static_steps`). Returns the attention backend chosen (`auto` resolved for this device)."""
        if self.seqs:
            raise RuntimeError(f"{self.role}: configure the KV cache before adding sequences")
        backend = attention.choose(attention_backend, self.device, block_size)
        self.cache = PagedKV(block_size, max_blocks, prefix_caching and self.shares_prefixes(), backend, preallocate)
        self.kept = None
        self.static = static.resolve(static_steps, self.device, backend)
        return backend

    def kv_room(self, utilization: float, probe_tokens: int, share: float = 1.0, memory=None) -> int | None:
        """KV tokens this worker's pool may hold on its device: `utilization` x `share` of the device's memory,
        less the weights and the activations of one forward of `probe_tokens` tokens (measured now: the
        step's largest). None on a CPU (memory is shared there: the pool grows up to max_num_tokens).
        share: this worker's part of its GPU (0.5 when draft and target share one). memory: a function
        (model, probe_tokens) -> (peak bytes used, device total bytes), injected by tests; default: torch's
        CUDA counters around a forward."""
        if memory is None:
            if self.device.type != "cuda":
                return None
            memory = cuda_memory
        used, total = memory(self.model, probe_tokens)
        per_token = kv_bytes_per_token(self.model.config, next(self.model.parameters()).dtype, attention_layers(self.model))
        return kv_pool_tokens(total, used, utilization, share, per_token)

    def shares_prefixes(self) -> bool:
        """Whether this worker may take cached blocks for a new prompt. A target that hands its features to
        an EAGLE-style draft keeps them beside its KV (`kept`) and hands over those of cached positions."""
        return True

    def add(self, seq_ids: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Register new sequences (no forward yet); each starts on the cached blocks its prompt begins
        with. Returns per sequence the prompt tokens those blocks hold (its prefill starts there)."""
        cached = []
        for sid, prompt, p in zip(seq_ids, prompts, params):
            if sid in self.seqs:
                raise ValueError(f"sequence {sid!r} already exists")
            self.seqs[sid] = Sequence(tokens=list(prompt), params=p)
            self.order.append(sid)
            self._start_controls(self.seqs[sid])
            self.seqs[sid].kv_len = self.cache.match_prefix(sid, list(prompt), p.cache_salt)
            cached.append(self.seqs[sid].kv_len)
            if self.feature_layers and cached[-1]:  # the draft needs these positions' features too
                self.seqs[sid].extra["kept_features"] = cached[-1]
            if self.prompt_lookup:
                self.seqs[sid].extra["copy"] = CopyRecord(NgramIndex(LOOKUP_MIN_N, 4, prompt))
            if self.live is not None:
                s = self.seqs[sid]
                s.extra["live"] = sid
                self.live.start(sid, self._tenant(p), s.tokens, s.extra["prompt_len"])
        bs = self.cache.block_size
        self.cache.ensure(sum(-(-(len(p) - c) // bs) + 1 for p, c in zip(prompts, cached)))
        return cached

    def _start_controls(self, s: Sequence) -> None:
        """Where the output starts (the context may hold some after a preemption or resume), and the
        grammar matcher, walked through that output."""
        plen = s.params.prompt_len if s.params.prompt_len is not None else len(s.tokens)
        s.extra["prompt_len"] = plen
        if s.params.structured is not None:
            if self.tokenizer is None:
                raise ValueError(f"{self.role}: structured outputs need the tokenizer (worker.tokenizer)")
            s.extra["guide"] = Guide(s.params.structured, self.tokenizer, self.vocab_size(), s.tokens[plen:],
                                     s.params.eos_token_ids)

    def vocab_size(self) -> int:
        """Width of the logits this worker samples from (an EAGLE-3 head maps its reduced vocabulary
        onto the target's whole one)."""
        full = getattr(self.model, "vocab_size", None)
        return full if isinstance(full, int) else self.model.get_output_embeddings().weight.shape[0]

    def remove(self, seq_ids: list[str], remember: bool = False) -> None:
        """Drop finished sequences; their blocks go back to the pool (named ones stay cached). remember: their
        outputs go into the suffix history (requests that finished, not preempted ones)."""
        gone = set(seq_ids) & set(self.seqs)
        if remember and self.history is not None:
            for sid in sorted(gone):
                self._remember(self.seqs[sid])
        for sid in gone:
            del self.seqs[sid]
            self.cache.release(sid)
            if self.live is not None:
                self.live.stop(sid)
        self.order = [s for s in self.order if s not in gone]

    def reset(self) -> None:
        """Drop every sequence (after a failed step: the engine prefills the survivors again)."""
        self.remove(list(self.order))

    # ---- suffix history ----------------------------------------------------------------------
    def _tenant(self, p: SamplingParams) -> str:
        return "" if self.history_shared else (p.cache_salt or "")

    def _remember(self, s: Sequence) -> None:
        plen = s.extra.get("prompt_len", len(s.tokens))
        out = s.tokens[plen:]
        if out:
            doc = (self._tenant(s.params), s.tokens[max(plen - PROMPT_TAIL, 0) : plen], out)
            self.history.add(doc[2], doc[0], doc[1])
            if self.history_outbox is not None:
                self.history_outbox.append(doc)
                del self.history_outbox[:-HISTORY_OUTBOX]

    def take_history(self) -> list[tuple[str, list[int], list[int]]]:
        """The outputs remembered since the last call (tenant, prompt tail, output), for a shared store; the first
        call starts the collection."""
        out, self.history_outbox = self.history_outbox or [], []
        return out

    def add_history(self, docs: list[tuple[str, list[int], list[int]]]) -> int:
        """Other replicas' outputs (from the shared store) into this draft's history; returns its tokens held."""
        if self.history is None:
            return 0
        for tenant, prompt, out in docs:
            self.history.add(out, "" if self.history_shared else tenant, prompt)
        return len(self.history)

    def export_history(self) -> list[tuple[str, list[int], list[int]]]:
        """Every output this draft's history holds (`SuffixHistory.export`): a restarted shared store refills
        from it."""
        return self.history.export() if self.history is not None else []

    def history_stats(self) -> dict | None:
        """The suffix history's size and hit rate (`SuffixHistory.stats`), and the running rows' outputs' lookups
        and hits (`LiveOutputs`); None without a history."""
        if self.history is None:
            return None
        live = self.live
        return {**self.history.stats(), **({"running_rows": len(live), "running_lookups": live.lookups,
                                            "running_hits": live.hits} if live is not None else {})}

    @torch.inference_mode()
    def prefill(self, seq_ids: list[str], features: list[torch.Tensor] | None = None,
                upto: list[int] | None = None) -> None:
        """Feed pending tokens so the KV catches up (draft: the prompts the target is prefilling), every
        one or through position upto[b]. A draft that reads no target features ignores them."""
        seqs = self._rows(seq_ids)
        ends = [len(s.tokens) if upto is None else min(u, len(s.tokens)) for s, u in zip(seqs, upto or seqs)]
        fed = [s.tokens[s.kv_len : e] for s, e in zip(seqs, ends)]
        if any(fed):
            self._forward(seq_ids, fed, 1)
        for sid, s, e in zip(seq_ids, seqs, ends):
            s.kv_len = max(s.kv_len, e)
            self.cache.commit(sid, s.tokens, s.kv_len)

    # ---- draft side --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seq_ids: list[str], k: int | DraftPlan) -> Proposal:
        """k autoregressive draft forwards; the first also feeds (and scores) each sequence's pending tokens.
        With a `DraftPlan`, each row drafts while its tokens are worth verifying (up to plan.k forwards); with
        prompt lookup on, a row may copy from its own context instead (`Drafting`)."""
        seqs = self._rows(seq_ids)
        lens = [len(s.tokens) for s in seqs]
        fed = [s.tokens[s.kv_len :] for s in seqs]
        drafting = Drafting(self, seqs, k, lens)
        backlog = (0, 0)
        window = backlog_window(fed, k)
        if self.one_pass and isinstance(k, int) and k > 0 and not drafting.copyable and not any(map(_steered, seqs)):
            return self._propose_on_device(seq_ids, seqs, fed, lens, k, window)
        forwards = [0] * len(seqs)  # per row: the forwards that fed it
        j = 0
        while drafting.more:
            rows = drafting.rows
            if j == 0:  # every row: each feeds its pending tokens
                logits = self._forward(seq_ids, fed, window, starts=[n - len(f) for n, f in zip(lens, fed)])
                if window > 1:
                    backlog = self._timed(_backlog_agreement, seqs, fed, logits)
            else:  # the rows the model still drafts for, each its last drafted token
                logits = self._forward([seq_ids[b] for b in rows], [[tok[b]] for b in rows], 1,
                                       starts=[lens[b] + j - 1 for b in rows])
            for b in rows:
                forwards[b] += 1
            tok = drafting.position(logits[:, -1]).tolist()
            j += 1
        for s, n, f in zip(seqs, lens, forwards):  # the KV holds the pending tokens and what later forwards fed
            s.proposal_kv = n + f - 1 if f else -1
        return drafting.proposal(backlog)  # its KV keeps what the model drafted: no token is scored twice

    def _propose_on_device(self, seq_ids: list[str], seqs: list[Sequence], fed: list[list[int]], lens: list[int], k: int,
                           window: int) -> Proposal:
        """`propose` for k positions of rows without a plan, copies or controls: each position's draws (tokens, a
        sampled row's q) stay on the device and the tokens feed the next forward, read back once at the end (the
        loop above reads each position's). The same draws as the loop: the same noise keys, the same uniforms
        from the worker's stream in the same order."""
        greedy = all(s.params.greedy for s in seqs)
        if not greedy:
            dev = self.device
            w = Warp.of([s.params for s in seqs], dev)
            kind = [s.params.greedy for s in seqs], [_coupled(s) for s in seqs]
            is_greedy = torch.tensor(kind[0], device=dev)
        logits = self._forward(seq_ids, fed, window, starts=[n - len(f) for n, f in zip(lens, fed)])
        guessed = self._timed(backlog_guesses, logits)  # [B, window - 1] on the device
        drawn, qs, ids = [], [], []
        for j in range(k):
            if greedy:
                drawn.append(self._timed(argmax, logits[:, -1]))  # [B] on the device
            else:
                keys = torch.tensor([noise_key(s.params.seed, n + j) if c else -1 for s, n, c in zip(seqs, lens, kind[1])],
                                    dtype=torch.int32).to(dev, non_blocking=True)
                u = torch.rand(len(seqs), generator=self.rng).to(dev, non_blocking=True)
                tok, q, q_ids = self._timed(draft_choice, logits[:, -1], is_greedy, keys, w, u, self.top_n, kind, False)
                drawn.append(tok)
                qs.append(q)
                ids.append(q_ids)
            if j + 1 < k:
                logits = self._forward(seq_ids, [[self.pad_id]] * len(seqs), 1, starts=[n + j for n in lens],
                                       ids=drawn[-1])
        for s, n in zip(seqs, lens):
            s.proposal_kv = n + k - 1
        probs = support = None
        if qs:  # copied without waiting; the tokens' copy below waits for the stream once
            probs = torch.stack(qs, 1).to("cpu", non_blocking=True)
            support = torch.stack(ids, 1).to("cpu", non_blocking=True)
        host = torch.cat([torch.stack(drawn, 1), guessed], 1).cpu()  # the one read: drafts and backlog guesses
        rows = host.tolist()
        backlog = _backlog_matches(seqs, fed, window, [r[k:] for r in rows]) if window > 1 else (0, 0)
        out = Proposal(host[:, :k], probs, support, backlog=backlog, _rows=[r[:k] for r in rows])
        out.forwards = k
        return out

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
            self._append_committed(sid, new)
            self.cache.trim(sid, s.kv_len)
            self.cache.commit(sid, s.tokens, s.kv_len)

    def _append_committed(self, sid: str, new: list[int]) -> None:
        """A draft's sequence takes its committed tokens: its grammar, prompt lookup and the running rows'
        outputs (`live`) follow."""
        s = self.seqs[sid]
        s.tokens.extend(new)
        if s.extra.pop("proposed", False):  # a verification's outcomes end here (`_backlog_agreement`)
            s.extra["verified_until"] = len(s.tokens)
        settle_guide(s, new)
        settle_copy(s, new)
        if self.live is not None:
            self.live.extend(sid)

    # ---- target side (looking ahead: the next plain decoding step, run while the caller handles this one) ----
    @torch.inference_mode()
    def look_ahead(self, seq_ids: list[str]) -> bool:
        """Run the next plain decoding step (k = 0, no chunks) of seq_ids now, keeping what undoes it, so that a
        `verify` asking exactly that is answered at once; any other call is to `drop_ahead` first. A worker
        hosted in its own process calls this while its caller streams the last step's tokens (the hop and the
        caller's work overlap the forward). False (nothing run) where a row follows a grammar (its guide's
        state is not rewound here) or is unknown."""
        self.drop_ahead()
        seqs = [self.seqs.get(sid) for sid in seq_ids]
        if not seqs or any(s is None or "guide" in s.extra for s in seqs):
            return False
        self.ahead = (list(seq_ids), None, ([(len(s.tokens), s.kv_len) for s in seqs], self.rng.get_state()))
        verdict = self._verify(seq_ids, Proposal.empty(len(seq_ids)), {})
        self.ahead = (self.ahead[0], verdict, self.ahead[2])
        return True

    def drop_ahead(self) -> None:
        """Undo a step looked ahead that was not asked for: the rows' tokens and valid KV (what it wrote past
        that is scratch, as after a rejected draft), and the random stream of unseeded rows."""
        if self.ahead is None:
            return
        seq_ids, _, (rows, rng) = self.ahead
        self.ahead = None
        for sid, (n_tokens, kv_len) in zip(seq_ids, rows):
            s = self.seqs[sid]
            del s.tokens[n_tokens:]
            s.kv_len = kv_len
            self.cache.trim(sid, kv_len)
        self.rng.set_state(rng)

    @torch.inference_mode()
    def verify(self, seq_ids: list[str], proposal: Proposal, chunks: dict[str, int] | None = None,
               ahead: bool = False) -> Verdict:
        """Score pending + k draft tokens of every sequence in ONE forward; accept; commit.

        With k = 0 this is one plain decoding step. chunks {id: n}: prompts being prefilled feed their
        next n tokens in the same forward; one that reaches its prompt's end gets its first token. The
        Verdict lists seq_ids, then the chunk rows (next token -1 for a chunk that did not finish).
        ahead: the caller expects the same rows' plain decoding step next (a host may `look_ahead`).
        """
        if self.ahead is not None:
            ahead_ids, verdict, _ = self.ahead
            if verdict is not None and ahead_ids == list(seq_ids) and not chunks and proposal.tokens.shape[1] == 0:
                self.ahead, self.ahead_used = None, self.ahead_used + 1  # already run: the same forward and decisions
                return verdict
            self.drop_ahead()
        return self._verify(seq_ids, proposal, chunks or {})

    def _verify(self, seq_ids: list[str], proposal: Proposal, chunks: dict[str, int]) -> Verdict:
        seqs, cseqs = self._rows(seq_ids), self._rows(list(chunks))
        drafts = proposal.drafts()  # a row drafted lengths[b] <= k tokens; the rest of its row is padding
        k = proposal.tokens.shape[1]
        lens = [len(s.tokens) for s in seqs]
        fed = [s.tokens[s.kv_len :] + d for s, d in zip(seqs, drafts)]
        cfed = [s.tokens[s.kv_len : s.kv_len + n] for s, n in zip(cseqs, chunks.values())]
        done = [b for b, (s, f) in enumerate(zip(cseqs, cfed)) if s.kv_len + len(f) == len(s.tokens)]
        index = self._tail(fed, [len(d) + 1 for d in drafts], k + 1)  # decoding rows come first in the pack
        cindex = self._last(fed + cfed, 1)[len(seqs):][done]
        out = self._forward(seq_ids + list(chunks), fed + cfed, torch.cat([index.flatten(), cindex.flatten()]),
                            hidden=self.head is not None)
        out, cout = out[: index.numel()].unflatten(0, index.shape), out[index.numel():][:, None]
        # logits [B, k+1, V] on demand: most rows stop at their first rejection
        timer = (self.clock, self.timings)
        logits = LazyLogits(self.head, out, timer, proposal.lengths) if self.head is not None else out
        clogits = LazyLogits(self.head, cout, timer) if self.head is not None else cout
        t0 = self.clock.start()
        num_acc, next_tok = self._decide(seqs, lens, logits, proposal)
        done_seqs = [cseqs[b] for b in done]
        first = self._decide(done_seqs, [len(s.tokens) for s in done_seqs], clogits, Proposal.empty(len(done)))[1]
        pending = [len(s.tokens) - s.kv_len for s in seqs]  # fed before the drafts; all now final
        for sid, s, n_b, d, t, length in zip(seq_ids, seqs, num_acc, drafts, next_tok, lens):
            s.tokens.extend(d[:n_b] + [t])
            if "guide" in s.extra:
                s.extra["guide"].advance(d[:n_b] + [t])
            s.kv_len = length + n_b  # KV through the last accepted draft; t is pending
        cnext = [-1] * len(cseqs)
        for b, t in zip(done, first):
            cnext[b] = t
        for s, f in zip(cseqs, cfed):
            s.kv_len += len(f)
        for b in done:
            cseqs[b].tokens.append(cnext[b])
            if "guide" in cseqs[b].extra:
                cseqs[b].extra["guide"].advance([cnext[b]])
        for sid, s in zip(seq_ids + list(chunks), seqs + cseqs):
            self.cache.trim(sid, s.kv_len)
            self.cache.commit(sid, s.tokens, s.kv_len)
        features = None
        if self.feature_layers:
            features = self._features(seq_ids + list(chunks), [len(f) for f in fed + cfed], pending + [len(f) for f in cfed],
                                      num_acc + [0] * len(cseqs))
        logprobs = _logprobs(seqs, logits, drafts, num_acc, next_tok)
        clp = _logprobs(done_seqs, clogits, [[] for _ in done], [0] * len(done), first)
        if logprobs is not None or clp is not None:
            logprobs = (logprobs or [None] * len(seqs)) + [None] * len(cseqs)
            for i, b in enumerate(done):
                logprobs[len(seqs) + b] = clp[i] if clp is not None else None
        self.clock.stop("sample_s", t0, self.timings)  # less the output projection's spans ("head": model work)
        return Verdict(num_acc + [0] * len(cseqs), next_tok + cnext, features, logprobs)

    def _decide(self, seqs: list[Sequence], lens: list[int], logits, proposal: Proposal) -> tuple[list, list]:
        """Acceptance for rows whose logits [B, k+1, V] scored `proposal`: (accepted counts, next tokens)."""
        if not seqs:
            return [], []
        dev = self.device
        k = proposal.tokens.shape[1]
        bsz = len(seqs)
        # Per row and position: a seeded row's noise key comes from (seed, position); an unseeded sampled
        # row draws a random key (its recovered / bonus token) and k uniforms (its accept tests) from the
        # worker's stream, the batch's in one call each: a few numbers per row, not vocabulary-sized.
        keys = [[noise_key(s.params.seed, n + j) for j in range(k + 1)] if _coupled(s) else [-1] * (k + 1)
                for s, n in zip(seqs, lens)]
        keys = torch.tensor(keys, dtype=torch.int64).reshape(bsz, k + 1)
        u = torch.zeros((bsz, k))
        sampled = [b for b, s in enumerate(seqs) if _sampled(s)]
        if sampled:
            at = torch.tensor(sampled)
            keys[at] = torch.randint(0, 2**31 - 1, (len(sampled), k + 1), generator=self.rng)
            u[at] = torch.rand((len(sampled), k), generator=self.rng)
        keys, u = keys.to(dev, torch.int32), u.to(dev)
        q_values = q_ids = None
        if proposal.probs is not None:
            q_values, q_ids = proposal.probs.to(dev), proposal.support.to(dev)
        warp = Warp.of([s.params for s in seqs], dev)
        if self.one_pass and not any(_steered(s) for s in seqs):  # every row and position at once, one read-back
            full = logits.all() if isinstance(logits, LazyLogits) else logits  # [B, k+1, V]
            kinds = ["greedy" if s.params.greedy else "seeded" if _coupled(s) else "sampled" for s in seqs]
            with denormals_flushed(self.flush_denormals):
                num_acc, next_tok = accept_all(full, proposal.tokens.to(dev), kinds, proposal.row_lengths(), keys, warp,
                                               q_values, q_ids, u)
            num_acc, next_tok = torch.stack([num_acc, next_tok]).tolist()
            return num_acc, next_tok
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        seeded = torch.tensor([_coupled(s) for s in seqs], device=dev)
        controls, process = Controls.of(seqs, dev), None
        if controls is not None:
            drafts = proposal.drafts()
            controls.set_masks(drafts, k)
            process = lambda x, rows, j: controls.apply(x, rows, j, drafts)  # noqa: E731
        lengths = None if proposal.lengths is None else torch.tensor(proposal.lengths, device=dev)
        with denormals_flushed(self.flush_denormals):
            num_acc, next_tok = verify_walk(logits, proposal.tokens.to(dev), greedy, keys, seeded, warp, q_values, q_ids,
                                            u, process, lengths)
        return num_acc.tolist(), next_tok.tolist()

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int], top: int) -> list:
        """The target's log-probability of each prompt token given the ones before it (None for the first)
        and its `top` alternatives: one plain forward of the prompt outside the batch's KV (completions
        `echo` with `logprobs`; rare, so it does not share the step)."""
        logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, :-1]  # [T-1, V]
        self._captured.clear()  # a target that captures features for an EAGLE draft: not this forward's business
        chosen, vals, alts = logprob_top(logits[None], torch.tensor([ids[1:]], device=self.device), top)
        chosen, vals, alts = chosen[0].tolist(), vals[0].tolist(), alts[0].tolist()
        return [None] + [(c, list(zip(a, v))) for c, a, v in zip(chosen, alts, vals)]

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

        if not self.lean:  # the lean forward fills _captured itself
            for i in layers:
                (decoder.layers[i] if i < n else decoder.norm).register_forward_pre_hook(hook(i), with_kwargs=True)
        self.feature_layers = list(layers)

    def _features(self, ids: list[str], fed: list[int], final: list[int], accepted: list[int]) -> list[torch.Tensor]:
        """Per row, the captured features of the positions this forward made final: the first final[b]
        + accepted[b] of its fed[b] packed tokens (pending tokens, then accepted drafts); for a prompt that
        started on cached blocks, first those positions' features, kept beside the KV when they were
        computed. Layers of a model split over devices are gathered on the first one's."""
        grabbed = [self._captured.pop(i) for i in self.feature_layers]
        h = torch.cat([g.to(grabbed[0].device) for g in grabbed], dim=-1)[0].to(torch.bfloat16)  # [T, F]
        self._keep_features(h)
        starts = [sum(fed[:b]) for b in range(len(fed))]
        keep = torch.cat([torch.arange(o, o + p + n) for o, p, n in zip(starts, final, accepted)]).to(h.device)
        rows = list(h[keep].cpu().split([p + n for p, n in zip(final, accepted)]))  # one copy off the device
        for b, sid in enumerate(ids):
            cached = self.seqs[sid].extra.pop("kept_features", 0)
            if cached:
                slots = self.cache.slots(sid, torch.arange(cached)).to(self.kept.device)
                rows[b] = torch.cat([self.kept[slots].cpu(), rows[b]])
        return rows

    def _keep_features(self, h: torch.Tensor) -> None:  # h [T, F]: this forward's features, packed
        """Write every fed position's features beside its KV slot, so a later prompt that takes these blocks
        from the prefix cache can hand them to the draft (like KV, a rejected draft's are overwritten)."""
        size = self.cache.num_blocks * self.cache.block_size
        if self.kept is None or self.kept.shape[0] < size:
            grown = h.new_zeros((size, h.shape[1]))
            if self.kept is not None:
                grown[: self.kept.shape[0]] = self.kept
            self.kept = grown
        self.kept.index_copy_(0, self._slots.to(h.device), h)

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
            "dtype": held_dtype(self.model),
            "prompt_lookup": self.prompt_lookup,
        }

    # ---- internals -------------------------------------------------------------------------
    def _rows(self, seq_ids: list[str]) -> list[Sequence]:
        return lookup(self, seq_ids)

    @staticmethod
    def _tail(fed: list[list[int]], widths: list[int], keep: int) -> torch.Tensor:
        """[B, keep] indices into a packed forward's tokens: row b's last widths[b] fed tokens first, then
        its last one repeated (a row that drafted fewer tokens than the longest)."""
        lens = torch.tensor([len(f) for f in fed], dtype=torch.long)
        offsets = torch.cumsum(lens, 0) - lens
        first = lens - torch.tensor(widths, dtype=torch.long)
        col = torch.arange(keep)
        return offsets[:, None] + torch.minimum(first[:, None] + col, lens[:, None] - 1)

    @staticmethod
    def _last(fed: list[list[int]], keep: int) -> torch.Tensor:
        """[B, keep] indices into a packed forward's tokens: each row's last `keep` fed tokens (a row
        with fewer repeats its first one on the left, like left padding)."""
        lens = torch.tensor([len(f) for f in fed], dtype=torch.long)
        offsets = torch.cumsum(lens, 0) - lens
        col = torch.arange(keep)
        return offsets[:, None] + torch.clamp(lens[:, None] - keep + col, min=0)

    @torch.inference_mode()
    def _forward(self, seq_ids: list[str], fed: list[list[int]], index: torch.Tensor | int,
                 starts: list[int] | None = None, hidden: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
        """One packed forward of every row's fed tokens (row b at positions starts[b], ... ; default its
        kv_len). index: which packed tokens' outputs to return ([N], or int keep: each row's last keep,
        shaped [B, keep, ...]); logits [N, V], or with hidden the last hidden states [N, H]. ids [B] on the
        device: the tokens fed, one per row (fed then holds placeholders), so they need not be read back."""
        seqs = [self.seqs[s] for s in seq_ids]
        if starts is None:
            starts = [s.kv_len for s in seqs]
        shape = None
        if isinstance(index, int):
            index = self._last(fed, index)
            shape = index.shape
            index = index.flatten()
        t0 = self.clock.start()
        key = self.static.key(fed) if self.static is not None and not self.feature_layers \
            and (hidden or self.head is not None) else None
        if key is None:
            packed_ids, pos, batch = pack(self.cache, seq_ids, fed, starts, self.device)
            if ids is not None:
                packed_ids = ids[None]
            out = self._packed(packed_ids, pos, batch, index.to(self.device), hidden)
        else:  # at its bucket's fixed shape: replayed from a graph on CUDA; its outputs at the packed tokens'
            fixed, where = self.static.fill(self.cache, seq_ids, fed, starts, key, self.pad_id)
            if ids is not None:
                fixed.ids[0].view(key)[: len(ids), 0].copy_(ids)
            run = lambda ids, pos, batch, every: self._packed(ids, pos, batch, every, hidden=True)  # noqa: E731
            out = self.static.run(run, fixed, self.cache, key)[where[index].to(self.device)]
            if not hidden:
                out = self.head(out)
        self.clock.stop("forward_s", t0, self.timings)
        return out if shape is None else out.unflatten(0, shape)

    @torch.inference_mode()
    def _packed(self, ids: torch.Tensor, pos: torch.Tensor, batch, index: torch.Tensor,  # ids, pos [1, T]; index [N]
                hidden: bool = False) -> torch.Tensor:
        """The model over a packed batch `kv.pack` built: logits [N, V] at `index`, or with hidden the last hidden
        states [N, H]. Queued, not waited for (`bench graphs` captures it as it is)."""
        self.cache.batch, self._slots = batch, batch.slots
        if self.lean:
            capture = dict.fromkeys(self.feature_layers) if self.feature_layers else None
            out = lean.forward(self.model, ids[0], pos[0], batch, index, capture)
            if capture:
                self._captured.update({i: h[None] for i, h in capture.items()})
            if not hidden:
                out = self.model.lm_head(out)
        else:
            args = dict(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                        specserve_batch=batch)
            with paged_attention(self.model):
                if hidden:
                    out = self.model.model(**args).last_hidden_state[0, index]
                else:
                    out = self.model(**args, logits_to_keep=index).logits[0]
        self.cache.batch = None
        return out

    def _timed(self, fn, *args):
        """Run vocabulary-sized work beside a forward and count it as such."""
        t0 = self.clock.start()
        with denormals_flushed(self.flush_denormals):
            out = fn(*args)
        self.clock.stop("sample_s", t0, self.timings)
        return out

    def _drawer(self, seqs: list[Sequence], conf: bool = False):
        """draw(logits [A, V], positions [A], small=None, rows=None) -> (tokens [A], q values [A, N] | None,
        q ids [A, N] | None, confidence [A] | None): the next draft token of each of `rows` (an [A] index into
        seqs; None: all of them) for the token at positions[a] (`sampling.draft_choice`), and with `conf`
        each row's confidence there (`confidence`; else None), from `small` when given: a draft's logits
        over its own reduced vocabulary, the same distribution at a sixth of the work. The rows drawn
        shrink from position to position (rows stop drafting), never grow."""
        dev = self.device
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        controls = Controls.of(seqs, dev)
        if controls is not None:  # the request's controls on every proposal, as the target applies them
            return self._controlled(seqs, controls, self._drawer_plain(seqs, greedy, conf))
        return self._drawer_plain(seqs, greedy, conf)

    def _drawer_plain(self, seqs: list[Sequence], greedy: torch.Tensor, conf: bool = False):
        dev = self.device
        if all(s.params.greedy for s in seqs):  # known on the host: no read of `greedy` back
            def draw_greedy(logits, positions, small=None, rows=None):
                tokens = argmax(logits)  # one C pass on a CPU (torch's max over a 128k row block took ~4x as long)
                c = None
                if conf:
                    c = confidence(small) if small is not None else \
                        confidence(logits, logits.gather(1, tokens[:, None])[:, 0])
                return tokens.cpu(), None, None, c

            return draw_greedy
        w = Warp.of([s.params for s in seqs], dev)
        is_greedy, coupled = [s.params.greedy for s in seqs], [_coupled(s) for s in seqs]

        def draw(logits, positions, small=None, rows=None):
            picked = list(range(len(seqs))) if rows is None else rows.tolist()  # rows: a host tensor
            kind = [is_greedy[b] for b in picked], [coupled[b] for b in picked]
            if any(kind[1]):
                keys = torch.tensor([noise_key(seqs[b].params.seed, n) if coupled[b] else -1
                                     for b, n in zip(picked, positions)], dtype=torch.int32, device=dev)
            else:  # no seeded row: no noise keys to work out
                keys = torch.full((len(picked),), -1, dtype=torch.int32, device=dev)
            u = torch.rand(len(picked), generator=self.rng).to(dev)  # read by the unseeded sampled rows alone
            # before draft_choice, which may warp logits' rows in place
            c = confidence(small if small is not None else logits) if conf else None
            if rows is None:
                tok, q, ids = draft_choice(logits, greedy, keys, w, u, self.top_n, kind)
            else:
                index = rows.to(dev)
                tok, q, ids = draft_choice(logits, greedy[index], keys, w.rows(index, picked), u, self.top_n, kind)
            # q and ids copied without waiting, then tok's copy waits for the stream once: one sync, not three
            if q is not None:  # None: every row drawn here is greedy
                q, ids = q.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True)
            return tok.cpu(), q, ids, c

        return draw

    @staticmethod
    def _controlled(seqs: list[Sequence], controls: Controls, draw):
        """draw, with each drafted position's logits under the request's controls first: its grammar's
        mask from the sequence's matcher (which then consumes the proposal, rolled back at commit) and
        the rest counting the proposals before it."""
        drawn: list[list[int]] = [[] for _ in seqs]
        every = torch.arange(len(seqs))
        calls = [0]

        def controlled(logits, positions, small=None, rows=None):
            j = calls[0]  # the position: the rows drawn now drew every one before it
            calls[0] += 1
            rows = every if rows is None else rows
            batch = rows.tolist()
            logits = controls.apply(logits, rows, j, drawn)  # a float32 copy when any row has controls
            guided = [i for i, b in enumerate(batch) if "guide" in seqs[b].extra]
            if guided:
                bits = torch.empty((len(guided), seqs[batch[guided[0]]].extra["guide"].words()), dtype=torch.int32)
                for i, g in enumerate(guided):
                    seqs[batch[g]].extra["guide"].mask_into(bits[i])
                controls.apply_mask_rows(logits, bits, guided)
            tok, q, ids, c = draw(logits, positions, small, None if len(batch) == len(seqs) else rows)
            for b, t in zip(batch, tok.tolist()):
                drawn[b].append(t)
            for i in guided:
                seqs[batch[i]].extra["guide"].step_ahead(drawn[batch[i]][-1])
            if c is not None and guided and small is not None:  # a grammar's rows: how sure under its mask
                for i, x in zip(guided, confidence(logits[guided])):
                    c[i] = x
            return tok, q, ids, c

        return controlled


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
    for every row, then positions 1..lengths[b] in one matmul for the rows that accepted their first draft
    (at most two passes over the output projection's weights, which at a 128k vocabulary are the largest
    matrix of the model). Most rows of a large batch stop at their first rejection; a row that drafted
    fewer tokens than the longest costs only its own positions."""

    def __init__(self, head: torch.nn.Module, hidden: torch.Tensor, timer: tuple,  # hidden [B, k+1, H]
                 lengths: list[int] | None = None):  # [B] tokens each row drafted (None: all k)
        self.head, self.hidden = head, hidden
        self.clock, self.timings = timer  # the worker's WorkClock and timings: each pass is a "head" span
        k = hidden.shape[1] - 1
        self.lengths = torch.tensor(lengths if lengths is not None else [k] * hidden.shape[0], device=hidden.device)
        self.rest: torch.Tensor | None = None  # [P, V]: positions 1.. of rows rest_rows, packed
        self.rest_rows: torch.Tensor | None = None
        self.slot: torch.Tensor | None = None  # [A1, k]: row i's position j + 1 is rest[slot[i, j]]

    def __call__(self, rows: torch.Tensor, j: int) -> torch.Tensor:  # rows [A] ascending -> [A, V]
        t0 = self.clock.start()
        if j == 0:
            out = self._head(self.hidden[:, 0].index_select(0, rows))
        else:
            if self.rest is None:  # the walk only drops rows, so later positions ask for a subset of these
                lengths = self.lengths.index_select(0, rows)  # [A1]
                width = self.hidden.shape[1] - 1
                r, c = (torch.arange(1, width + 1, device=rows.device)[None] <= lengths[:, None]).nonzero(as_tuple=True)
                self.rest = self._head(self.hidden[rows[r], c + 1])
                self.slot = torch.zeros((len(rows), width), dtype=torch.long, device=rows.device)
                self.slot[r, c] = torch.arange(len(r), device=rows.device)
                self.rest_rows = rows
            at = self.slot[torch.searchsorted(self.rest_rows, rows), j - 1]
            out = self.rest.index_select(0, at)
        self.clock.stop("head", t0, self.timings)
        return out

    def all(self) -> torch.Tensor:  # -> [B, k+1, V]
        """Every position's logits in one pass over the output projection (`sampling.accept_all`)."""
        t0 = self.clock.start()
        out = self._head(self.hidden)
        self.clock.stop("head", t0, self.timings)
        return out

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        # as one contiguous 2D matmul: on CPUs a bfloat16 linear over a strided 3D slice takes a slow path
        # (1.2 s instead of 3 ms for 16 x 1 rows of SmolLM2's 49k head, torch 2.13)
        return self.head(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], -1)

    def rows(self, rows: torch.Tensor, width: int) -> torch.Tensor:  # [R] -> [R, width, V] (logprobs)
        t0 = self.clock.start()
        out = self._head(self.hidden.index_select(0, rows)[:, :width])
        self.clock.stop("head", t0, self.timings)
        return out


def confidence(logits: torch.Tensor, top: torch.Tensor | None = None) -> list[float]:  # logits [B, V]
    """Each row's largest probability (of its raw, unwarped distribution): how sure the draft is at this
    position. A function of the distribution only, never of the token drawn from it, so a policy may stop
    drafting on it without biasing rejection sampling (`draftplan`)."""
    if top is None:
        top = logits.amax(dim=-1)
    total = logsumexp(logits if logits.device.type == "cpu" else logits.float())  # C on a CPU, from either dtype
    return (top.float() - total).exp().tolist()


def backlog_window(fed: list[list[int]], k: int | DraftPlan) -> int:
    """Fed positions per row whose logits the draft's first forward keeps. After steps without speculation the
    draft has a backlog of committed tokens to feed; scoring the last few (about 256 over the batch) costs little
    and shows how well it would have done (`_backlog_agreement`, which `adaptive` learns from). A per-row plan's
    step keeps only the last: its policy learns from the rows' outcomes, and a row that copied 16 tokens would
    otherwise widen every row's logits to 16 positions (at batch 16, 256 rows of a vocabulary-wide head for the
    16 the step drafts from)."""
    if isinstance(k, DraftPlan):
        return 1
    return min(max(len(f) for f in fed), max(2, 256 // len(fed)), 32)


def _backlog_agreement(seqs: list[Sequence], fed: list[list[int]], logits: torch.Tensor) -> tuple[int, int]:
    """(checked, matched) of the draft's greedy next-token predictions over its pending tokens.

    logits [B, W, V] belong to the last W fed positions (a row with fewer repeats its first on the left,
    as `_last` picks them): the prediction at a pending token is checked against the pending token after
    it, which the target already committed. A draft that re-feeds the tokens its model drafted and got accepted
    (EAGLE-3) would predict them again, counting each outcome twice: those are skipped (`verified_until`, set
    through `mark_verified`).
    """
    w = logits.shape[1]
    return _backlog_matches(seqs, fed, w, backlog_guesses(logits).tolist())


def backlog_guesses(logits: torch.Tensor) -> torch.Tensor:  # [B, W, V] -> [B, W-1] long
    """The draft's greedy prediction after each of the first W - 1 positions of its backlog window."""
    return logits[:, :-1].max(dim=-1).indices


def _backlog_matches(seqs: list[Sequence], fed: list[list[int]], w: int, pred: list[list[int]]) -> tuple[int, int]:
    """`_backlog_agreement` from its predictions pred [B, W-1], read to the host."""
    checked = matched = 0
    for b, (s, f) in enumerate(zip(seqs, fed)):
        n = min(len(f), w)  # real tokens in the window; the rest is padding
        if n < 2 or not s.params.greedy:
            continue
        first = len(s.tokens) - n + 1  # the index in s.tokens of the first token checked
        skip = min(max(s.extra.get("verified_until", 0) - first, 0), n - 1)
        checked += n - 1 - skip
        matched += sum(p == t for p, t in zip(pred[b][w - n + skip :], f[len(f) - n + 1 + skip :]))
    return checked, matched


def mark_verified(seqs: list[Sequence], proposal: "Proposal", copying: list[bool]) -> None:
    """For a draft that re-feeds the tokens its proposal got accepted (EAGLE-3): the rows the model drafted for
    commit its predictions and the verdict on them, which that step's stats already counted, so they are not
    backlog evidence for the next proposal (`_append_committed` records where they end, `_backlog_agreement`
    skips them). A copying row's tokens the model never predicted: they stay evidence."""
    for s, d, c in zip(seqs, proposal.row_lengths(), copying):
        if d and not c:
            s.extra["proposed"] = True


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


def settle_copy(s: Sequence, new: list[int]) -> None:
    """A draft's prompt lookup: score its outstanding copy, index the newly committed tokens."""
    if "copy" in s.extra:
        s.extra["copy"].settle(new)


class Drafting:
    """One proposal of a model draft, position by position: the draws, a per-row plan's walk, and the rows that
    copy from their own context instead (prompt lookup, chosen at the first position where the row's copy
    record beats the model's confidence). The worker runs a forward over `rows` (at first every row), passes
    its logits to `position`, and goes on while `more`, each forward over the rows the model still drafts
    for (`rows` shrinks: rows that stopped or copy need no forward). `proposal()` finishes the copying rows,
    which need no forward at all."""

    def __init__(self, worker: "ModelWorker", seqs: list[Sequence], k: int | DraftPlan, lens: list[int]):
        self.worker, self.seqs, self.lens = worker, seqs, lens
        self.walk = PlanWalk(k) if isinstance(k, DraftPlan) else None
        self.k = k.k if self.walk is not None else k
        self.copyable = [b for b, s in enumerate(seqs) if "copy" in s.extra and not _steered(s)]
        self.draw = worker._drawer(seqs, conf=self.walk is not None or bool(self.copyable))
        self.copy: list[list[int] | None] = [None] * len(seqs)  # a copying row's tokens
        self.copy_conf: list[float | list[float]] = [0.0] * len(seqs)  # a history copy's: one per token
        self.copy_len = [0] * len(seqs)  # tokens its source had (a history match may hold fewer than k)
        self.from_history = [False] * len(seqs)
        self.copy_at = [-1] * len(seqs)  # a history copy's start in the history
        self.tokens, self.probs, self.support, self.confs = [], [], [], []
        self.rows = list(range(len(seqs)))  # the rows of the next forward
        self.more = self.k > 0
        self.forwards = 0  # forwards whose logits `position` drew from

    @property
    def copying(self) -> list[bool]:
        return [c is not None for c in self.copy]

    def position(self, logits: torch.Tensor, small: torch.Tensor | None = None) -> torch.Tensor:
        """Draw the next position of `rows` from the model's logits [A, V] (`small` [A, N]: over its own reduced
        vocabulary); returns every row's token [B] (a row not drawn: its copy, or padding)."""
        j, rows, n = len(self.tokens), self.rows, len(self.seqs)
        self.forwards += 1
        index = None if len(rows) == n else torch.tensor(rows)
        tok, q, ids, conf = self.worker._timed(self.draw, logits, [self.lens[b] + j for b in rows], small, index)
        if index is not None:  # back to full rows: the rest are padding (or copies, below)
            tok = torch.zeros(n, dtype=tok.dtype).index_copy_(0, index, tok)
            if q is not None:
                q = q.new_zeros((n, q.shape[1])).index_copy_(0, index, q)
                ids = ids.new_zeros((n, ids.shape[1])).index_copy_(0, index, ids)
            if conf is not None:
                full = [0.0] * n
                for b, c in zip(rows, conf):
                    full[b] = c
                conf = full
        if j == 0 and self.copyable:
            self._choose_copies(conf)
        tok, q, ids, conf = self._copied(j, tok, q, ids, conf)
        self._append(tok, q, ids, conf)
        more = j + 1 < self.k
        if self.walk is not None:
            self._copy_ended(j)
            more = self.walk.position(j, conf, self.copying, self.from_history) and more
        self.rows = [b for b in rows if self.copy[b] is None and (self.walk is None or self.walk.active[b])]
        self.more = more and bool(self.rows)
        return tok

    def _choose_copies(self, conf: list[float]) -> None:
        """Per copyable row, its source: the model, its own context or the history, whichever is likelier to be
        accepted at the first position (the model: its curve at its confidence; a copy: its record's estimate)."""
        plan = self.walk.plan if self.walk is not None else None
        history = self.worker.history
        found = resynced = live = [None] * len(self.copyable)
        if history is not None and len(history):
            tenants = [self.worker._tenant(self.seqs[b].params) for b in self.copyable]
            found = history.match_rows([self.seqs[b].tokens[-history.window:] for b in self.copyable], self.k, tenants)
            resynced = history.resync_rows([self.seqs[b].extra["copy"].cursor for b in self.copyable],
                                           [self.seqs[b].tokens[-1] for b in self.copyable], self.k, tenants)
        if self.worker.live is not None:
            live = self.worker.live.match_rows([self.seqs[b].extra.get("live", "") for b in self.copyable], self.k)
        for b, hist, again, now in zip(self.copyable, found, resynced, live):
            rec = self.seqs[b].extra["copy"]
            # the history's proposal: what the row's last tokens anchor (in finished outputs or running rows'),
            # or the earlier output it followed picked up past its slot, whichever is likelier at the first token
            # (a history copy's estimate is per token)
            hist_e = max(((history_estimate(rec.history_hits, rec.history_tries, m), m) for m in (hist, again, now) if m),
                         key=lambda x: x[0][0], default=None)
            best = conf[b] if plan is None else plan.estimate(b, conf[b])
            toks, n = rec.index.match(self.k)
            if n >= LOOKUP_MIN_N:
                e = rec.estimate(n)
                score = e if plan is None else plan.estimate(b, e, True)
                if score > best:
                    best, self.copy[b], self.copy_conf[b], self.copy_len[b] = score, toks, e, self.k
            if hist_e is not None:
                e, hist = hist_e
                if (e[0] if plan is None else plan.estimate(b, e[0], True, True)) > best:
                    # shorter than k: the rest repeats its last token (a walk stops the row there instead)
                    pad = self.k - len(hist.tokens)
                    self.copy[b], self.copy_conf[b] = hist.tokens + [hist.tokens[-1]] * pad, e + [e[-1]] * pad
                    self.copy_len[b], self.from_history[b], self.copy_at[b] = len(hist.tokens), True, hist.at

    def _copy_ended(self, j: int) -> None:
        """A walk drafts no row past its copy's end (a history match shorter than the plan's k)."""
        for b, c in enumerate(self.copy):
            if c is not None and j >= self.copy_len[b]:
                self.walk.active[b] = False

    def _copied(self, j: int, tok, q, ids, conf):
        """The draws with the copying rows' tokens put in (a one-hot q for a sampled row)."""
        rows = [b for b, c in enumerate(self.copy) if c is not None]
        if not rows:
            return tok, q, ids, conf
        tok = tok.clone()
        tok[rows] = torch.tensor([self.copy[b][j] for b in rows])
        if q is None and any(not self.seqs[b].params.greedy for b in rows):
            # only greedy rows were drawn at this position (the sampled ones copy): a copying sampled row
            # still needs its one-hot q
            q, ids = torch.zeros((len(self.seqs), 1)), torch.zeros((len(self.seqs), 1), dtype=torch.int32)
        if q is not None:
            q, ids = q.clone(), ids.clone()
            q[rows] = 0.0
            ids[rows] = 0
            q[rows, 0] = torch.tensor([0.0 if self.seqs[b].params.greedy else 1.0 for b in rows])
            ids[rows, 0] = tok[rows].to(ids.dtype)
        if conf is not None:
            conf = list(conf)
            for b in rows:
                c = self.copy_conf[b]  # a history copy's estimate is per token
                conf[b] = c[j] if isinstance(c, list) else c
        return tok, q, ids, conf

    def _append(self, tok, q, ids, conf) -> None:
        self.tokens.append(tok)
        self.probs.append(q)
        self.support.append(ids)
        self.confs.append(conf)

    def proposal(self, backlog: tuple[int, int]) -> "Proposal":
        """The proposal: after the model's forwards, copying rows go on to their own length (no forward)."""
        if any(self.copying) and self.tokens:
            if self.walk is not None:
                for b, c in enumerate(self.copy):
                    self.walk.active[b] &= c is not None
            while len(self.tokens) < self.k and (self.walk is None or any(self.walk.active)):
                j = len(self.tokens)
                self._append(*self._copied(j, self.tokens[-1], self.probs[-1], self.support[-1], self.confs[-1]))
                if self.walk is not None:
                    self._copy_ended(j)
                    self.walk.position(j, self.confs[-1], self.copying, self.from_history)
        out = _proposal(self.tokens, self.probs, self.support, len(self.seqs), backlog, self.walk, self.confs,
                        self.copying if any(self.copying) else None)
        out.forwards = self.forwards
        lengths = out.row_lengths()
        for b, c in enumerate(self.copy):
            if c is not None:
                rec = self.seqs[b].extra["copy"]
                rec.copied, rec.from_history, rec.history_at = lengths[b], self.from_history[b], self.copy_at[b]
        if any(self.from_history):
            out.history = list(self.from_history)
        return out


def _steered(s: Sequence) -> bool:
    """A request with controls (grammar, penalties, bans, bias): its draft positions follow them, a copy would not."""
    return "guide" in s.extra or has_controls(s.params)


def settle_guide(s: Sequence, new: list[int]) -> None:
    """A draft's grammar matcher, back from its proposals and on through the newly committed tokens."""
    if "guide" in s.extra:
        s.extra["guide"].settle(new)


def _coupled(s: Sequence) -> bool:
    """Seeded sampled requests use the coupled sampler: the same text whatever k is chosen."""
    return not s.params.greedy and s.params.seed is not None


def _sampled(s: Sequence) -> bool:
    """Unseeded sampled requests: rejection sampling with uniforms from the worker's stream (`rng`)."""
    return not s.params.greedy and s.params.seed is None


@contextlib.contextmanager
def paged_attention(model):
    """Run the model's attention as `kv.paged_attention` for one forward, then as it was (the same model
    object may serve plain forwards too, e.g. a reference `generate`). Every config object its modules
    hold is switched: a draft built from copied layers carries one per layer."""
    configs = getattr(model, "_specserve_configs", None)
    if configs is None:
        found = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
                 and hasattr(c, "_attn_implementation")}
        configs = list(found.values())
        object.__setattr__(model, "_specserve_configs", configs)  # not a submodule or parameter
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b


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


def _proposal(tokens: list, probs: list, support: list, rows: int, backlog: tuple[int, int],
              walk: PlanWalk | None = None, confs: list[list[float]] | None = None,
              lookup: list[bool] | None = None) -> Proposal:
    """A Proposal from per-position draws: tokens [B] each, and q [B, N] each when any row samples; with a
    plan's walk, the lengths it kept and each row's confidence at its drafted positions."""
    if not tokens or (walk is not None and not any(walk.lengths)):
        return Proposal.empty(rows)
    if all(q is None for q in probs):
        out = Proposal(torch.stack(tokens, 1), backlog=backlog)
    else:  # positions whose drawn rows were all greedy carry no q: zeros, as greedy rows' q are
        width = max(q.shape[1] for q in probs if q is not None)
        out = Proposal(torch.stack(tokens, 1), _widened(probs, rows, width, torch.float32),
                       _widened(support, rows, width, torch.int32), backlog)
    if walk is not None:
        out.lengths = list(walk.lengths)
        out.conf = [[c[b] for c in confs[:n]] for b, n in enumerate(walk.lengths)]
    out.lookup = lookup
    return out


def _widened(per_position: list, rows: int, width: int, dtype) -> torch.Tensor:  # k x ([B, n] | None) -> [B, k, width]
    """Per-position q values (or their ids) stacked into one tensor: a position with none (its drawn rows were all
    greedy) is zeros, and a narrower one (a copy's one-hot column) is padded with zeros, which no row reads."""
    out = torch.zeros((rows, len(per_position), width), dtype=dtype)
    for j, x in enumerate(per_position):
        if x is not None:
            out[:, j, : x.shape[1]] = x
    return out
