"""Continuous batching with speculative decoding: admit, step, evict, stream.

`Engine.step()` is the hot path (see DESIGN.md, "One engine step"): admit waiting requests while KV
blocks allow, ask the policy for k, draft proposes, target verifies in one forward, which also
prefills the next chunks of admitted prompts within the step's token budget (the waiting-served
balance: `EngineConfig.max_num_batched_tokens`), both commit, stream what was accepted, evict what
finished. A prompt whose prefill finished joins the decoding batch with its first token.
`Engine.generate()` streams one request's outputs as an async iterator; a background task runs steps
while any request is in flight: on the event loop's own thread when the models live in this process and
were built on it (torch keeps an OpenMP pool per calling thread, and a second pool makes libgomp count
more threads than cores and stop spinning at its barriers: a step on another thread took 1.7x as long),
otherwise on one thread of the engine's own, back to back while there is work (each step's outputs handed
to the loop as they come), so the loop stays free while remote workers compute.

A failed step (a worker crashed) loses no request: what the step made final still streams, the
running requests go back to the head of the queue with prompt + generated-so-far as their context,
the workers are repaired (`Engine.repair`, e.g. the Router replacing a dead actor) and reset, and the
next step prefills them again, so decoding goes on where it stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine import grammar
from serve_app.engine.policy import BatchState, Policy, fit_choice, make_policy
from serve_app.engine.predicted_output import PredictedOutput
from serve_app.engine.stats import RequestStats, RowOutcomes, StepStats
from serve_app.engine.textstream import TextStream
from serve_app.engine.worker import ModelWorker, Proposal

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One streamed piece of a request: newly final text and the token ids behind it."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    """stop (EOS or a stop string), length (max_tokens or context), abort, error."""
    error: str | None = None
    stats: RequestStats | None = None
    """Set on the final output."""
    logprobs: list | None = None
    """With `SamplingParams.logprobs`: per token id, (logprob, [(alternative id, logprob), ...])."""
    retry_after_s: int | None = None
    """With an error the client may retry: seconds to wait first (HTTP Retry-After)."""
    prompt_logprobs: list | None = None
    """With `SamplingParams.prompt_logprobs`, on the first output: per prompt token, None for the first,
    then (logprob, [(alternative id, logprob), ...])."""


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    cancelled: bool = False
    finished: bool = False
    queue: asyncio.Queue | None = None
    queued_at: float = field(default_factory=time.perf_counter)  # entered the queue (again, when resumed)
    prefilled: int = 0  # context tokens in the target's KV (from the prefix cache, then chunk by chunk)
    prompt_logprobs: list | None = None  # computed at first admission, sent with the first output
    prompt_logprobs_sent: bool = False
    predicted: PredictedOutput | None = None  # its predicted output (Predicted Outputs), drafted from
    failure: str | None = None  # the error its last failed step raised (`failure_cause`)

    def context(self) -> list[int]:
        """What the workers hold for it: the prompt, plus what it generated before a resume."""
        return self.prompt_ids + self.output_ids

    @property
    def context_len(self) -> int:
        """len(context()) without building it (the scheduler asks every step, for every request)."""
        return len(self.prompt_ids) + len(self.output_ids)


class Engine:
    def __init__(
        self,
        target: ModelWorker,
        draft: ModelWorker | None,
        tokenizer,
        config: EngineConfig | None = None,
        policy: Policy | None = None,
        eos_ids: set[int] | None = None,
        vocab_size: int | None = None,
    ):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        for w in (target, draft):  # in-process workers read grammars with the engine's tokenizer (actors load their own)
            if isinstance(w, ModelWorker) and w.tokenizer is None:
                w.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.draft_room = max(self.config.max_k, self.config.max_copy_tokens)
        """Most tokens a row drafts in a step (copies may go past max_k): the KV headroom each request keeps."""
        self.policy = policy or make_policy(self.config.policy)
        info = target.info()  # target may be a local ModelWorker or a proxy to a Ray actor
        self.max_model_len = self.config.max_model_len or min(info["max_position_embeddings"] or 4096, 4096)
        if eos_ids is None:
            eos_ids = set(info["eos_ids"]) or ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size or info["vocab_size"]
        self._link_draft()
        self.waiting: deque[Request] = deque()
        # Guards every change to `waiting`: `_admit` (step thread) peeks the head and then pops it, while
        # `abort` (event-loop thread) may remove any entry; a removal between that peek and pop would
        # pop the wrong request (or an empty queue). Held only for queue bookkeeping, never a forward.
        self._queue_lock = threading.Lock()
        self.running: list[Request] = []  # decoding, in admission order
        self.prefilling: list[Request] = []  # admitted, prompt partly in the KV, in admission order
        self.on_step: list[Callable[[StepStats], None]] = []  # observers (metrics, benchmarks)
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._home = threading.get_ident()  # the thread that built the engine (and, in-process, its models)
        self._step_thread: concurrent.futures.ThreadPoolExecutor | None = None  # one thread: one OpenMP pool
        self._looping = False  # the serving loop runs the steps (StepStats.gap_s is measured between them)
        self._step_end: float | None = None
        self.repair: Callable[["Engine"], None] | None = None
        """Called (in a worker thread) after a failed step: replace dead workers, e.g. the Router
        starting a new actor. It may set `draft` to None (decode with k = 0) and `attach_draft` a new
        one later. The engine resets the workers afterwards. None: only reset them."""
        self.repairing = False  # a repair is under way (readiness reports it)
        self._repair_needed = False
        self._pending_draft: ModelWorker | None = None
        self._outs: list[tuple[Request, RequestOutput]] = []  # the current step's outputs so far
        self._setup_kv()

    def _setup_kv(self) -> None:
        """Size both workers' KV pools (after a reset: a new pool, cache rebuilt): max_num_tokens, or on a GPU
        what gpu_memory_utilization leaves after the weights and a profiling forward, the smaller of the
        two workers' rooms (admission counts one budget for both)."""
        c = self.config
        workers = [w for w in (self.target, self.draft) if w is not None]
        if not hasattr(self, "kv_pool"):  # measured once: a repair's replacement worker is the same model
            rooms = [w.kv_room(c.gpu_memory_utilization, c.max_num_batched_tokens) for w in workers]
            rooms = [r for r in rooms if r is not None]
            tokens = min([c.max_num_tokens, *rooms]) // c.block_size * c.block_size
            self.kv_pool = {"tokens": tokens, "from": "device memory" if rooms and min(rooms) < c.max_num_tokens
                            else "max_num_tokens", "rooms": rooms, "attention": None}
            log.info("KV pool: %d tokens per worker (from %s)", tokens, self.kv_pool["from"])
        for w in workers:
            chosen = w.configure_kv(c.block_size, self.kv_pool["tokens"] // c.block_size + 1, c.prefix_caching,
                                    c.attention_backend, bool(self.kv_pool["rooms"]), c.static_steps)
            if w is self.target:
                self.kv_pool["attention"] = chosen

    @property
    def kv_capacity(self) -> int:
        """KV tokens admission may hand out (whole blocks of the pool: `kv_pool`)."""
        return self.kv_pool["tokens"]

    def kv_tokens(self, req: Request) -> int:
        """KV tokens a request may hold by the end of the next step: its context and one speculation
        window, in whole blocks (shared prefix blocks counted for every holder: an upper bound)."""
        bs = self.config.block_size
        return -(-(req.context_len + self.draft_room + 1) // bs) * bs

    @property
    def reserved(self) -> int:
        """KV tokens counted against the pool for the admitted requests (`kv_tokens`)."""
        return sum(self.kv_tokens(r) for r in self.running + self.prefilling)

    def _link_draft(self) -> None:
        info = self.draft.info() if self.draft is not None else {}  # one call: a draft actor answers it remotely
        # a model draft with prompt lookup: its rows may copy from their context, past a one-k policy's k
        self.draft_copies = bool(info.get("prompt_lookup"))
        if info.get("feature_layers"):
            # An EAGLE-style draft reads the target's hidden states: the target returns them with
            # every verification, for the positions that verification made final.
            self.target.capture_features(info["feature_layers"])

    @classmethod
    def from_models(cls, models, config: EngineConfig | None = None, policy: Policy | None = None) -> "Engine":
        from serve_app.drafting import draft_worker

        pad = models.tokenizer.pad_token_id or 0
        target = ModelWorker(models.target, "target", pad)
        draft = (draft_worker(models.draft, pad, models.prompt_lookup, models.history_tokens, models.history_shared)
                 if models.draft is not None else None)
        return cls(target, draft, models.tokenizer, config, policy)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               resume: dict | None = None) -> Request:
        """Validate and queue a request; bad input raises ValueError and touches nothing.

        resume: {"output_ids", "sent_chars"} continues a request another engine started (its replica
        died): those tokens count as generated, and the client already has that much of their text.
        """
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if len(params.predicted_output) > self.max_model_len:  # it could never all be output
            raise ValueError(f"prediction has {len(params.predicted_output)} tokens, more than the context limit "
                             f"({self.max_model_len})")
        if len(params.stop) > self.config.max_stop_strings:
            raise ValueError(f"at most {self.config.max_stop_strings} stop strings, got {len(params.stop)}")
        params = self._with_controls(params, n)
        reserve = min(n + params.max_tokens, self.max_model_len) + self.draft_room + 1
        if reserve > self.kv_capacity:
            raise ValueError(
                f"request needs {reserve} KV tokens (prompt {n} + max_tokens {params.max_tokens} + "
                f"speculation window) but the KV budget is {self.kv_capacity}"
            )
        rid = f"{request_id or 'req'}-{next(self._ids)}"  # unique even if callers reuse ids
        req = Request(rid, list(prompt_ids), params, TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                               params.skip_special_tokens))
        req.stats.prompt_tokens = n
        if params.predicted_output and params.structured is None and self.config.max_predicted_tokens:
            req.predicted = PredictedOutput(params.predicted_output)  # (a grammar's masks follow only tokens it allows)
        if resume:
            done = [int(t) for t in resume["output_ids"]]
            if any(not 0 <= t < self.vocab_size for t in done) or n + len(done) >= self.max_model_len \
                    or len(done) >= params.max_tokens:
                raise ValueError("resume: output ids outside the vocabulary or past the request's limits")
            req.output_ids = done
            req.stream.resume(done, int(resume.get("sent_chars", 0)))
            req.stats.resumes, req.stats.carried_tokens = 1, len(done)
            if req.predicted is not None:
                req.predicted.advance(done, len(done))
        with self._queue_lock:  # behind every waiting request of its priority or a more urgent one (lower value)
            at = len(self.waiting)
            while at and self.waiting[at - 1].params.priority > params.priority:
                at -= 1
            self.waiting.insert(at, req)
        return req

    def _with_controls(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Check a request's controls against the vocabulary and fill what the workers need to apply them
        (where its output starts, the end-of-sequence ids, bad words as token ids)."""
        for name, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids)):
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size})")
        if params.structured is not None:
            grammar.check(params.structured, self.tokenizer, self.vocab_size)
        words = []
        for w in params.bad_words:  # as vLLM: the word alone and after a space (mid-sentence)
            for form in {w, " " + w.lstrip()}:
                ids = self.tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return params.model_copy(update={"prompt_len": prompt_len, "eos_token_ids": sorted(self.eos_ids),
                                         "bad_words_ids": words})

    def abort(self, req: Request) -> None:
        """Cancel a request. A waiting one leaves the queue at once: it must stop counting toward the
        router's queue bound (a burst of disconnects would otherwise turn live clients away with 429).
        A running one leaves the batch, freeing its KV, at the next step (the step thread owns the batch).

        Call it from the event-loop thread that consumes `req.queue` (or with no loop at all).
        """
        with self._queue_lock:
            req.cancelled = True
            for i, r in enumerate(self.waiting):
                if r is req:  # identity: Request is a dataclass, so == would compare every field
                    del self.waiting[i]
                    break
            else:
                return  # admitted already (or finished): `_drop_cancelled` ends it at the next step
        # Never admitted, so no worker or KV state to free. It still ends like any abort, with one final
        # output, so a consumer other than the one that cancelled is not left waiting for it.
        out = RequestOutput(req.id)
        self._finish(req, out, "abort")
        if req.queue is not None:
            req.queue.put_nowait(out)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, RequestOutput]]:
        """One engine iteration over the whole batch. Returns (request, output) pairs to stream."""
        t0 = time.perf_counter()
        st = StepStats(gap_s=t0 - self._step_end if self._step_end is not None else 0.0)
        # Outputs collect here as they become final, so a step that fails halfway still streams them.
        outs = self._outs = []
        if self._pending_draft is not None:
            self._rejoin_draft()
        self._drop_cancelled()
        self._admit(st)
        self._fit_kv(st)
        budget = self.config.max_num_batched_tokens
        ids = [r.id for r in self.running]
        # the step's tokens stay within the budget, keeping a block's worth for prompts being prefilled
        # (never less than k = 0 leaves: admission keeps running + prefilling <= max_batch_size <= budget)
        keep = min(self.config.block_size, budget - len(ids)) if self.prefilling else 0
        room = budget - keep - len(ids)
        predicted = self._predicted(room)  # rows drafting from their request's predicted output, first
        room -= sum(len(t) for t in predicted.values())
        drafting = [b for b in range(len(ids)) if b not in predicted]
        draft_ids = [ids[b] for b in drafting]
        st.contexts = tuple(r.context_len for r in self.running)
        proposal = Proposal.empty(len(draft_ids))
        if draft_ids and self.draft is not None:
            choice = self.policy.choose(BatchState(len(draft_ids), self.config.max_k, True, tuple(draft_ids),
                                                   len(self.prefilling) + len(self.waiting),
                                                   tuple(self.running[b].params.structured is not None for b in drafting),
                                                   tuple(st.contexts[b] for b in drafting), self.config.max_copy_tokens,
                                                   self.draft_copies))
            choice = fit_choice(choice, self.config.max_k, room, len(draft_ids), self.config.max_copy_tokens)
            if choice:
                t = time.perf_counter()
                proposal = self.draft.propose(draft_ids, choice)
                st.draft_s += time.perf_counter() - t
        drafts = proposal  # the draft model's rows only: what the policy chose and observes
        if predicted:
            proposal = with_predictions(proposal, drafting, predicted, [r.params for r in self.running])
        drafted = sum(proposal.row_lengths())
        chunks = self._plan_chunks(budget - len(ids) - drafted)
        st.chunks = tuple((r.prefilled, chunks[r.id]) for r in self.prefilling if r.id in chunks)
        if ids or chunks:
            t = time.perf_counter()
            verdict = self.target.verify(ids, proposal, chunks or None, self._same_next(proposal, chunks))
            st.verify_s += time.perf_counter() - t
            st.prefill_tokens = sum(chunks.values())
            st.scheduled_tokens = len(ids) + drafted + st.prefill_tokens
            features, chunk_features = split_rows(verdict.features, len(ids))
            logprobs = verdict.logprobs or [None] * (len(ids) + len(chunks))
            if ids:
                self._decoded(st, ids, proposal, verdict, features, logprobs, drafts, drafting, predicted)
            if chunks:
                self._prefilled(st, chunks, verdict.next_tokens[len(ids):], chunk_features, logprobs[len(ids):])
            self._evict([r for r in self.running if r.finished])
        st.other_s = time.perf_counter() - t0 - st.draft_s - st.verify_s
        if st.batch_size and not st.predicted:  # a step that verified predicted tokens did not cost its k's price
            self.policy.observe(st)
        for fn in self.on_step:
            fn(st)
        self._step_end = time.perf_counter() if self._looping else None
        return outs

    def _decoded(self, st: StepStats, ids: list[str], proposal: Proposal, verdict, features, logprobs,
                 drafts: Proposal, drafting: list[int], predicted: dict[int, list[int]]) -> None:
        """The decoding rows' part of a step: commit the draft, stream the accepted tokens. `drafts`: the draft
        model's proposal for rows `drafting` (the policy's part of the step); `predicted`: the other rows'
        tokens from their predicted outputs."""
        num_accepted, next_tokens = verdict.num_accepted[: len(ids)], verdict.next_tokens[: len(ids)]
        new = [d[:n] + [nt] for d, n, nt in zip(proposal.token_rows(), num_accepted, next_tokens)]
        if self.draft is not None:
            t = time.perf_counter()
            self.draft.commit(ids, new, features)
            st.draft_s += time.perf_counter() - t
        lengths = proposal.row_lengths()
        mine, got = drafts.row_lengths(), [num_accepted[b] for b in drafting]
        k = max(mine, default=0)
        st.batch_size, st.k, st.proposed = len(ids), k, sum(mine)
        st.backlog_checked, st.backlog_matched = drafts.backlog
        st.draft_forwards = drafts.forwards
        st.accepted = sum(got)
        st.accepted_per_position = [sum(n > i for n in got) for i in range(k)]
        st.predicted = sum(len(t) for t in predicted.values())
        st.by_source = by_source(drafts, mine, got)
        st.generated = sum(len(x) for x in new)
        if drafts.lengths is not None:  # a per-row plan: what each row drafted and got, for the policy
            st.rows = RowOutcomes([ids[b] for b in drafting], mine, got, drafts.conf, drafts.lookup,
                                  [self.running[b].params.structured is not None for b in drafting], drafts.history)
        for b, (req, n, toks, lp, length) in enumerate(zip(self.running, num_accepted, new, logprobs, lengths)):
            req.stats.add_step(length, n)
            if b in predicted:
                req.predicted.settle(length, n)
            self._outs.append((req, self._advance(req, toks, lp)))

    def _same_next(self, proposal: Proposal, chunks: dict) -> bool:
        """Whether the next step is likely these rows' plain decoding step again (a target in its own process
        then runs it while this step's tokens stream): no speculation (none chosen, none to come), nothing
        waiting or being prefilled, no row ending on its length or following a grammar. A row that stops on
        EOS or a stop string costs the look-ahead (the target undoes it)."""
        return (self.config.look_ahead and bool(self.running) and not chunks and not self.waiting and not self.prefilling
                and proposal.tokens.shape[1] == 0 and (self.draft is None or self.policy.name == "none")
                and all(self._left(r) >= 1 and r.params.structured is None for r in self.running))

    def _left(self, req: Request) -> int:
        """Tokens a request may still emit after this step's target token: its max_tokens and the context limit."""
        return min(req.params.max_tokens - len(req.output_ids), self.max_model_len - req.context_len) - 1

    def _predicted(self, room: int) -> dict[int, list[int]]:
        """Per running row aligned with its predicted output: the predicted tokens to draft this step (at most
        `max_predicted_tokens`, what its max_tokens and the context limit leave, and `room` in all)."""
        out: dict[int, list[int]] = {}
        for b, req in enumerate(self.running):
            if req.predicted is None or room <= 0:
                continue
            left = self._left(req)
            toks = req.predicted.propose(min(self.config.max_predicted_tokens, left, room))
            if toks:
                out[b] = toks
                room -= len(toks)
        return out

    def _prefilled(self, st: StepStats, chunks: dict[str, int], first: list[int], features, logprobs) -> None:
        """The prefill chunks' part of a step: the draft catches up to the same positions; a prompt
        whose prefill finished joins the decoding batch with its first token."""
        reqs = {r.id: r for r in self.prefilling}
        for rid, n in chunks.items():
            reqs[rid].prefilled += n
        if self.draft is not None:
            t = time.perf_counter()
            self.draft.prefill(list(chunks), features, [reqs[rid].prefilled for rid in chunks])
            done = [(rid, f) for rid, f in zip(chunks, first) if f >= 0]
            if done:
                self.draft.commit([rid for rid, _ in done], [[f] for _, f in done])
            st.draft_s += time.perf_counter() - t
        for rid, f, lp in zip(chunks, first, logprobs):
            if f < 0:
                continue
            r = reqs[rid]
            self.prefilling.remove(r)
            self.running.append(r)
            st.prefilled += 1
            self._outs.append((r, self._advance(r, [f], lp)))

    def _plan_chunks(self, budget: int) -> dict[str, int]:
        """Prompt tokens each prefilling request feeds this step, first admitted first, within budget."""
        chunks = {}
        for r in self.prefilling:
            if budget <= 0:
                break
            chunks[r.id] = min(r.context_len - r.prefilled, budget)
            budget -= chunks[r.id]
        return chunks

    def _admit(self, st: StepStats) -> None:
        """Admit waiting requests while the batch and the KV pool allow (FIFO, no overtaking); their
        prefill starts at the cached blocks their prompts begin with and runs in chunks (`step`)."""
        new: list[Request] = []
        room = self.kv_capacity - self.reserved
        while len(self.running) + len(self.prefilling) + len(new) < self.config.max_batch_size:
            with self._queue_lock:  # peek and pop as one: `abort` may remove entries meanwhile
                # a block of headroom per admitted request: its growth over the next steps
                if not self.waiting or self.kv_tokens(self.waiting[0]) + self.config.block_size * (
                        len(self.running) + len(self.prefilling) + len(new)) > room:
                    break
                req = self.waiting.popleft()  # never a cancelled one: `abort` removes those under this lock
            new.append(req)
            room -= self.kv_tokens(req)
        if not new:
            return
        ids = [r.id for r in new]
        now = time.perf_counter()
        for r in new:
            if not r.output_ids:  # first admission, not a resume
                r.stats.queue_s = now - r.arrival
                if r.params.prompt_logprobs is not None and not r.stats.generated_tokens:
                    r.prompt_logprobs = self.target.prompt_logprobs(r.prompt_ids, r.params.prompt_logprobs)
        self.prefilling += new  # before any worker call: a failure below must requeue these too, not strand them
        cached = self.target.add(ids, [r.context() for r in new], [r.params for r in new])
        if self.draft is not None:
            self.draft.add(ids, [r.context() for r in new], [r.params for r in new])
        for r, c in zip(new, cached):
            r.prefilled = c
            r.stats.cached_tokens += c
        st.admitted = len(new)
        st.prefix_queried = sum((r.context_len - 1) // self.config.block_size * self.config.block_size for r in new)
        st.prefix_hits = sum(cached)

    def _fit_kv(self, st: StepStats) -> None:
        """Keep the admitted requests' KV (`reserved`) within the pool as they grow: the most recently
        admitted go back to the head of the queue (preempted) and are prefilled again later, mostly
        from their own cached blocks."""
        while self.reserved > self.kv_capacity and len(self.running) + len(self.prefilling) > 1:
            req = (self.prefilling or self.running)[-1]
            for w in (self.target, self.draft):
                if w is not None:
                    w.remove([req.id])
            (self.prefilling if req in self.prefilling else self.running).remove(req)
            req.prefilled = 0
            req.stats.preemptions += 1
            st.preempted += 1
            with self._queue_lock:
                req.queued_at = time.perf_counter()
                self.waiting.appendleft(req)

    def _advance(self, req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        """Append accepted tokens to a request, applying EOS, max_tokens, context and stop strings."""
        p = req.params
        reason = None
        taken: list[int] = []
        text = ""
        for tok in tokens:
            taken.append(tok)
            n_out = len(req.output_ids) + len(taken)
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
            elif n_out >= p.max_tokens or len(req.prompt_ids) + n_out >= self.max_model_len:
                reason = "length"
            if p.stop:  # one token at a time, so ids end where the stop string completed
                text += req.stream.push([tok])
                if req.stream.stopped and n_out >= p.min_tokens:
                    reason = "stop"
            if reason:
                break
        if not p.stop:
            text = req.stream.push(taken)
        req.output_ids += taken
        if req.predicted is not None:
            req.predicted.advance(req.output_ids, len(taken))
        if not req.stats.generated_tokens:
            req.stats.ttft_s = time.perf_counter() - req.arrival
        req.stats.generated_tokens = len(req.output_ids)
        out = RequestOutput(req.id, text, taken, logprobs=logprobs[: len(taken)] if logprobs is not None else None)
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        if reason:
            out.text += req.stream.flush()
            self._finish(req, out, reason)
        return out

    def _finish(self, req: Request, out: RequestOutput, reason: str, error: str | None = None) -> None:
        req.finished = True
        req.stats.total_s = time.perf_counter() - req.arrival
        if req.predicted is not None:
            u = req.predicted.usage()
            req.stats.accepted_prediction_tokens, req.stats.rejected_prediction_tokens = (
                u["accepted_prediction_tokens"], u["rejected_prediction_tokens"])
        out.finished, out.finish_reason, out.error, out.stats = True, reason, error, req.stats

    def _evict(self, reqs: list[Request]) -> None:
        """Remove finished requests from both workers; their KV blocks go back to the pool."""
        if not reqs:
            return
        gone = {r.id for r in reqs}
        self.target.remove(list(gone))
        if self.draft is not None:
            self.draft.remove(list(gone), remember=True)  # their outputs join the draft's suffix history
        self.running = [r for r in self.running if r.id not in gone]
        self.prefilling = [r for r in self.prefilling if r.id not in gone]

    def _drop_cancelled(self) -> None:
        gone = [r for r in self.running + self.prefilling if r.cancelled]
        for r in gone:
            out = RequestOutput(r.id)
            self._finish(r, out, "abort")
            self._outs.append((r, out))
        self._evict(gone)

    # ---- failure and repair ------------------------------------------------------------------
    def _requeue(self, again: list[Request]) -> None:
        """Put requests back at the head of the queue, in order, to be prefilled with their context."""
        self.running, self.prefilling = [], []
        now = time.perf_counter()
        with self._queue_lock:
            for r in reversed(again):
                r.queued_at = now
                self.waiting.appendleft(r)

    def resume_running(self, cause: str | None = None) -> list[tuple[Request, RequestOutput]]:
        """After a failed step: requeue every unfinished running request for a resume, or end it
        (503-style error) once it has been resumed `max_resumes` times, or at once, naming the error,
        when its last step failed with the same one (`cause`, from `failure_cause`): a fault in the code
        or the request fails the same way on repaired workers, so retrying it only repeats the error.
        Returns the final outputs."""
        outs, again = [], []
        for r in self.running + self.prefilling:
            if r.finished:  # its final output is among the failed step's outputs already
                continue
            out = RequestOutput(r.id)
            repeated, r.failure = cause is not None and r.failure == cause, cause
            if r.cancelled:
                self._finish(r, out, "abort")
            elif repeated:
                self._finish(r, out, "error", f"the request failed twice with the same error on repaired "
                                              f"workers, so it was not retried again: {cause}")
            elif r.stats.resumes >= self.config.max_resumes:
                # No internals (actor ids, addresses) in what the client reads: the log has them.
                self._finish(r, out, "error", f"the request failed {r.stats.resumes + 1} times because a model "
                                              "worker crashed; giving up (retry later)")
            else:
                r.stats.resumes += 1
                again.append(r)
                continue
            outs.append((r, out))
        self._requeue(again)
        return outs

    @property
    def speculating(self) -> bool:
        """A draft is attached, or a replacement joins at the next step."""
        return self.draft is not None or self._pending_draft is not None

    def attach_draft(self, draft: ModelWorker) -> None:
        """Bring a (replacement) draft in at the next step; callable from any thread."""
        self._pending_draft = draft

    def _rejoin_draft(self) -> None:
        """A draft back after decoding without one: the running requests are prefilled again with
        both workers (the draft needs their context, an EAGLE-style one the target's features too)."""
        self.draft, self._pending_draft = self._pending_draft, None
        self._link_draft()
        for w in (self.target, self.draft):
            w.reset()
        self._setup_kv()
        self._requeue(list(self.running + self.prefilling))

    def request_repair(self) -> None:
        """Check and repair the workers soon (e.g. a worker found dead while idle). Loop thread only."""
        self._repair_needed = True
        self._ensure_loop()

    def _repair_workers(self) -> None:
        if self.repair is not None:
            self.repair(self)
            self._link_draft()  # a new target must capture features for the draft again
        for w in (self.target, self.draft):
            if w is not None:
                w.reset()
        self._setup_kv()

    def _expire_waiting(self) -> list[tuple[Request, RequestOutput]]:
        """During a repair: end new queued requests that waited longer than `recovery_wait_s`. Resumed
        ones stay: their streams are under way, and `max_resumes` bounds them."""
        now, limit = time.perf_counter(), self.config.recovery_wait_s
        with self._queue_lock:
            late = [r for r in self.waiting if not r.stats.resumes and now - r.queued_at > limit]
            if late:  # by identity (Request is a dataclass: == would compare every field)
                keep = [r for r in self.waiting if all(r is not x for x in late)]
                self.waiting.clear()
                self.waiting.extend(keep)
        outs = []
        for r in late:
            out = RequestOutput(r.id)
            self._finish(r, out, "error", f"the service is recovering from a worker failure and could not take "
                                          f"this request within {limit:g} s; retry shortly")
            out.retry_after_s = max(1, round(limit / 10))
            outs.append((r, out))
        return outs

    async def _recover(self) -> None:
        """Repair the workers in a thread; meanwhile requests wait in the queue, but not forever."""
        self.repairing = True
        try:
            task = asyncio.ensure_future(asyncio.to_thread(self._repair_workers))
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                self._deliver(self._expire_waiting())
            task.result()
        except Exception:
            log.exception("worker repair failed")
            await asyncio.sleep(1.0)  # the next step fails (bounded by max_resumes); no hot loop
        finally:
            self.repairing = False
            self._repair_needed = False
            self._step_end = None  # the wait for the repair is no step gap

    # ---- driving -----------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> None:
        """Step until the given (already submitted) requests finish; for offline use and benchmarks."""
        while any(not r.finished for r in requests):
            self.step()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, resume: dict | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs as tokens are accepted. Raises ValueError on bad input."""
        req = self.submit(prompt_ids, params, request_id, resume)
        req.queue = asyncio.Queue()
        self._ensure_loop()
        try:
            while True:
                out = await req.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            # A fresh context: the loop serves every request, so it must not inherit the one that
            # started it (under Ray Serve, cancelling that request would cancel the loop's worker calls).
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())

    async def _loop(self) -> None:
        self._looping = True
        try:
            await self._steps()
        finally:
            self._looping, self._step_end = False, None

    def _steps_inline(self) -> bool:
        """Steps on the loop's thread: the models compute in this process, on the thread that built the engine."""
        return isinstance(self.target, ModelWorker) and threading.get_ident() == self._home

    async def _step(self) -> list[tuple[Request, RequestOutput]]:
        if self._steps_inline():
            outs = self.step()
            await asyncio.sleep(0)  # the callers read what the step made (and may abort) before the next one
            return outs
        if self._step_thread is None:
            self._step_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._step_thread, self._run_steps, loop)

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> list[tuple[Request, RequestOutput]]:
        """Steps back to back on the engine's thread while there is work, each one's outputs handed to the loop as
        they are made: no hop through the event loop between two steps (at one request in flight the hop and the
        loop's turn were 1-2 ms of a ~18 ms step on 2 cores). The last step's outputs come back; a failure
        raises, the steps before it delivered."""
        outs = self.step()
        while self.has_work() and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, outs)
            outs = self.step()
        return outs

    async def _steps(self) -> None:
        while self.has_work() or self._repair_needed:
            if self._repair_needed:
                await self._recover()
                continue
            try:
                outs = await self._step()
            except Exception as e:  # never leave callers hanging on a failed step: resume them
                log.exception("engine step failed; resuming its requests on repaired workers")
                outs = self._outs + self.resume_running(failure_cause(e))
                self._repair_needed = True
            self._deliver(outs)

    @staticmethod
    def _deliver(outs: list[tuple[Request, RequestOutput]]) -> None:
        for req, out in outs:
            if req.queue is not None:
                req.queue.put_nowait(out)


def failure_cause(e: BaseException) -> str | None:
    """What a failed step raised, as its type and first line: the original error where Ray wraps one raised in
    a worker actor (its own text carries actor ids and a traceback, which differ from try to try). None for
    Ray's own errors (an actor died, a node left): those are what a repair mends, so they are retried."""
    cause = getattr(e, "cause", None)
    if not isinstance(cause, BaseException):
        if type(e).__module__.split(".")[0] == "ray":
            return None
        cause = e
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def split_rows(features, n: int) -> tuple:
    """A Verdict's features as (the first n rows', the rest's): a list in process; from a worker actor,
    already two references (its rows stay on its node until the draft's actor reads them)."""
    if features is None:
        return None, None
    if isinstance(features, tuple):
        return features
    return features[:n], features[n:]


def by_source(drafts: Proposal, drafted: list[int], accepted: list[int]) -> dict[str, list[int]]:
    """Draft tokens [proposed, accepted] by source (model, context, history) over the drafting rows."""
    out: dict[str, list[int]] = {}
    copied, history = drafts.lookup or [], drafts.history or []
    for b, (n, a) in enumerate(zip(drafted, accepted)):
        if n:
            src = ("history" if b < len(history) and history[b] else "context") if b < len(copied) and copied[b] else "model"
            tally = out.setdefault(src, [0, 0])
            tally[0] += n
            tally[1] += a
    return out


def with_predictions(drafts: Proposal, drafting: list[int], predicted: dict[int, list[int]], params: list) -> Proposal:
    """One proposal for the whole batch: the draft model's for rows `drafting`, each other row's predicted
    tokens. A predicted token is a deterministic proposal (a function of the prediction and the output so
    far), so a sampled row's q for it is one-hot and rejection sampling stays exact."""
    n = len(params)
    lengths = [0] * n
    for b, m in zip(drafting, drafts.row_lengths()):
        lengths[b] = m
    for b, t in predicted.items():
        lengths[b] = len(t)
    kd = drafts.tokens.shape[1]  # may pass the longest row: a walk can stop every row at its last position
    tokens = torch.zeros((n, max(max(lengths), kd)), dtype=torch.long)  # [B, K]
    rows = torch.tensor(drafting, dtype=torch.long)
    if kd:
        tokens[rows, :kd] = drafts.tokens
    for b, t in predicted.items():
        tokens[b, : len(t)] = torch.tensor(t)
    probs = support = None
    sampled = [b for b in predicted if not params[b].greedy]
    if drafts.probs is not None or sampled:
        width = drafts.probs.shape[2] if drafts.probs is not None else 1
        probs = torch.zeros((n, tokens.shape[1], width))  # [B, K, N]
        support = torch.zeros((n, tokens.shape[1], width), dtype=torch.int32)
        if drafts.probs is not None:
            probs[rows, :kd], support[rows, :kd] = drafts.probs, drafts.support
        for b in sampled:
            probs[b, : lengths[b], 0] = 1.0
            support[b, : lengths[b], 0] = tokens[b, : lengths[b]].to(torch.int32)
    return Proposal(tokens, probs, support, drafts.backlog, lengths)
