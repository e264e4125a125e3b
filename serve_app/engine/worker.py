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
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from serve_app.config import SamplingParams
from serve_app.profiling.profiles import detect_gpu_type
from serve_app.engine.controls import Controls
from serve_app.engine.grammar import Guide
from serve_app.engine.kv import ATTENTION, PagedKV, pack
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
        self.timings = new_timings()
        self.head = plain_head(model)
        self.flush_denormals = self.device.type == "cpu"
        self.tokenizer = None  # for structured outputs (grammar masks need the vocabulary's strings)

    def take_timings(self) -> dict:
        """Device work since the last call (forwards; vocabulary-sized math beside them) and the bytes
        handed to another actor directly; resets them. Benchmarks read these to split a step."""
        out, self.timings = self.timings, new_timings()
        return out

    # ---- lifecycle -------------------------------------------------------------------------
    def configure_kv(self, block_size: int = 16, max_blocks: int = 4096, prefix_caching: bool = True) -> None:
        """Set the KV pool's block size, its limit in blocks and prefix caching (before any sequence)."""
        if self.seqs:
            raise RuntimeError(f"{self.role}: configure the KV cache before adding sequences")
        self.cache = PagedKV(block_size, max_blocks, prefix_caching and self.shares_prefixes())
        self.kept = None

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
            gen = torch.Generator().manual_seed(_role_seed(p.seed, self.role))
            self.seqs[sid] = Sequence(tokens=list(prompt), params=p, generator=gen)
            self.order.append(sid)
            self._start_controls(self.seqs[sid])
            self.seqs[sid].kv_len = self.cache.match_prefix(sid, list(prompt))
            cached.append(self.seqs[sid].kv_len)
            if self.feature_layers and cached[-1]:  # the draft needs these positions' features too
                self.seqs[sid].extra["kept_features"] = cached[-1]
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

    def remove(self, seq_ids: list[str]) -> None:
        """Drop finished sequences; their blocks go back to the pool (named ones stay cached)."""
        gone = set(seq_ids) & set(self.seqs)
        for sid in gone:
            del self.seqs[sid]
            self.cache.release(sid)
        self.order = [s for s in self.order if s not in gone]

    def reset(self) -> None:
        """Drop every sequence (after a failed step: the engine prefills the survivors again)."""
        self.remove(list(self.order))

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
            logits = self._forward(seq_ids, fed, window if j == 0 else 1,
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
            settle_guide(s, new)
            self.cache.trim(sid, s.kv_len)
            self.cache.commit(sid, s.tokens, s.kv_len)

    # ---- target side -------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, seq_ids: list[str], proposal: Proposal, chunks: dict[str, int] | None = None) -> Verdict:
        """Score pending + k draft tokens of every sequence in ONE forward; accept; commit.

        With k = 0 this is one plain decoding step. chunks {id: n}: prompts being prefilled feed their
        next n tokens in the same forward; one that reaches its prompt's end gets its first token. The
        Verdict lists seq_ids, then the chunk rows (next token -1 for a chunk that did not finish).
        """
        chunks = chunks or {}
        seqs, cseqs = self._rows(seq_ids), self._rows(list(chunks))
        drafts = proposal.tokens.tolist()
        k = proposal.tokens.shape[1]
        lens = [len(s.tokens) for s in seqs]
        fed = [s.tokens[s.kv_len :] + d for s, d in zip(seqs, drafts)]
        cfed = [s.tokens[s.kv_len : s.kv_len + n] for s, n in zip(cseqs, chunks.values())]
        done = [b for b, (s, f) in enumerate(zip(cseqs, cfed)) if s.kv_len + len(f) == len(s.tokens)]
        index, cindex = self._last(fed + cfed, k + 1)[: len(seqs)], self._last(fed + cfed, 1)[len(seqs):][done]
        out = self._forward(seq_ids + list(chunks), fed + cfed, torch.cat([index.flatten(), cindex.flatten()]),
                            hidden=self.head is not None)
        out, cout = out[: index.numel()].unflatten(0, index.shape), out[index.numel():][:, None]
        # logits [B, k+1, V] on demand: most rows stop at their first rejection
        logits = LazyLogits(self.head, out, self._sync) if self.head is not None else out
        clogits = LazyLogits(self.head, cout, self._sync) if self.head is not None else cout
        t0 = time.perf_counter()
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
        self._sync()
        head_s = sum(x.seconds for x in (logits, clogits) if isinstance(x, LazyLogits))
        self.timings["forward_s"] += head_s  # the output projection is the model's work
        self.timings["sample_s"] += time.perf_counter() - t0 - head_s
        return Verdict(num_acc + [0] * len(cseqs), next_tok + cnext, features, logprobs)

    def _decide(self, seqs: list[Sequence], lens: list[int], logits, proposal: Proposal) -> tuple[list, list]:
        """Acceptance for rows whose logits [B, k+1, V] scored `proposal`: (accepted counts, next tokens)."""
        if not seqs:
            return [], []
        dev = self.device
        k = proposal.tokens.shape[1]
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
        controls, process = Controls.of(seqs, dev), None
        if controls is not None:
            drafts = proposal.tokens.tolist()
            controls.set_masks(drafts)
            process = lambda x, rows, j: controls.apply(x, rows, j, drafts)  # noqa: E731
        with denormals_flushed(self.flush_denormals):
            num_acc, next_tok = verify_walk(logits, proposal.tokens.to(dev), greedy, keys, seeded,
                                            Warp.of([s.params for s in seqs], dev), q_values, q_ids, u, process)
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
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }

    # ---- internals -------------------------------------------------------------------------
    def _rows(self, seq_ids: list[str]) -> list[Sequence]:
        return lookup(self, seq_ids)

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
                 starts: list[int] | None = None, hidden: bool = False) -> torch.Tensor:
        """One packed forward of every row's fed tokens (row b at positions starts[b], ... ; default its
        kv_len). index: which packed tokens' outputs to return ([N], or int keep: each row's last keep,
        shaped [B, keep, ...]); logits [N, V], or with hidden the last hidden states [N, H]."""
        seqs = [self.seqs[s] for s in seq_ids]
        if starts is None:
            starts = [s.kv_len for s in seqs]
        shape = None
        if isinstance(index, int):
            index = self._last(fed, index)
            shape = index.shape
            index = index.flatten()
        t0 = time.perf_counter()
        ids, pos, batch = pack(self.cache, seq_ids, fed, starts, self.device)
        index = index.to(self.device)
        self.cache.batch, self._slots = batch, batch.slots
        args = dict(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                    specserve_batch=batch)
        with paged_attention(self.model):
            if hidden:
                out = self.model.model(**args).last_hidden_state[0, index]
            else:
                out = self.model(**args, logits_to_keep=index).logits[0]
        self.cache.batch = None
        self._sync()
        self.timings["forward_s"] += time.perf_counter() - t0
        return out if shape is None else out.unflatten(0, shape)

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
        controls = Controls.of(seqs, dev)
        if controls is not None:  # the request's controls on every proposal, as the target applies them
            return self._controlled(seqs, controls, self._drawer_plain(seqs, greedy))
        return self._drawer_plain(seqs, greedy)

    def _drawer_plain(self, seqs: list[Sequence], greedy: torch.Tensor):
        dev = self.device
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

    @staticmethod
    def _controlled(seqs: list[Sequence], controls: Controls, draw):
        """draw, with each drafted position's logits under the request's controls first: its grammar's
        mask from the sequence's matcher (which then consumes the proposal, rolled back at commit) and
        the rest counting the proposals before it."""
        drawn: list[list[int]] = [[] for _ in seqs]
        guided = [b for b, s in enumerate(seqs) if "guide" in s.extra]
        every = torch.arange(len(seqs))

        def controlled(logits, positions):
            j = len(drawn[0])
            logits = controls.apply(logits, every, j, drawn)  # a float32 copy when any row has controls
            if guided:
                bits = torch.empty((len(guided), seqs[guided[0]].extra["guide"].words()), dtype=torch.int32)
                for i, b in enumerate(guided):
                    seqs[b].extra["guide"].mask_into(bits[i])
                controls.apply_mask_rows(logits, bits, guided)
            tok, q, ids = draw(logits, positions)
            for b, t in enumerate(tok.tolist()):
                drawn[b].append(t)
            for b in guided:
                seqs[b].extra["guide"].step_ahead(drawn[b][-1])
            return tok, q, ids

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
            out = self._head(self.hidden[:, 0].index_select(0, rows))
        else:
            if self.rest is None:  # the walk only drops rows, so later positions ask for a subset of these
                self.rest_rows, self.rest = rows, self._head(self.hidden.index_select(0, rows)[:, 1:])
            out = self.rest[:, j - 1].index_select(0, torch.searchsorted(self.rest_rows, rows))
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        # as one contiguous 2D matmul: on CPUs a bfloat16 linear over a strided 3D slice takes a slow path
        # (1.2 s instead of 3 ms for 16 x 1 rows of SmolLM2's 49k head, torch 2.13)
        return self.head(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], -1)

    def rows(self, rows: torch.Tensor, width: int) -> torch.Tensor:  # [R] -> [R, width, V] (logprobs)
        t0 = time.perf_counter()
        out = self._head(self.hidden.index_select(0, rows)[:, :width])
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


def _backlog_agreement(seqs: list[Sequence], fed: list[list[int]], logits: torch.Tensor) -> tuple[int, int]:
    """(checked, matched) of the draft's greedy next-token predictions over its pending tokens.

    logits [B, W, V] belong to the last W fed positions (a row with fewer repeats its first on the left,
    as `_last` picks them): the prediction at a pending token is checked against the pending token after
    it, which the target already committed.
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


def settle_guide(s: Sequence, new: list[int]) -> None:
    """A draft's grammar matcher, back from its proposals and on through the newly committed tokens."""
    if "guide" in s.extra:
        s.extra["guide"].settle(new)


def _coupled(s: Sequence) -> bool:
    """Seeded sampled requests use the coupled sampler: the same text whatever k is chosen."""
    return not s.params.greedy and s.params.seed is not None


def _sampled(s: Sequence) -> bool:
    """Unseeded sampled requests: rejection sampling with uniforms from the sequence's generator."""
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
