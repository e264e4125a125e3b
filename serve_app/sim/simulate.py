"""`specserve simulate`: the service on a fleet of hardware types, as a discrete-event simulation
driven by profiles.

What is modelled, and how:
- Arrivals: closed-loop users following a load shape's user count over time (each user sends its
  next request when the last one finished), or an open-loop trace of (arrival time, prompt tokens,
  output tokens).
- Routing: the ingress's rule. The engine group with the fewest requests in flight per replica, then
  that group's replica with the fewest (or, `group-total`, the group with the fewest in all).
- Each replica: the engine's step (`serve_app/engine/scheduler.py`, `Engine.step`), with the engine's
  settings (`EngineConfig` defaults unless given):
  1. Admit waiting requests FIFO (no overtaking) while the batch allows (decoding + prefilling <
     max batch) and the KV pool does: a request holds its context + max_k + 1 tokens in whole blocks
     (`kv_tokens`), with a block of headroom per admitted request. Admitting costs nothing. Where the
     trace names a prompt's blocks (`prompt_blocks`), its leading blocks some earlier prompt computed
     on the replica are not fed again (the prefix cache, `PagedKV.match_prefix`; never evicted here).
  2. If the admitted outgrow the pool (contexts grow), the latest admitted goes back to the head of
     the queue (preempted) and prefills its prompt + generated tokens again later.
  3. k from the policy for the decoding batch and its rows' contexts (`BatchState.contexts`), lowered
     so that batch * (k + 1) fits the step's token budget (`max_num_batched_tokens`), less a block's
     worth while prompts are prefilling, then to the grid's nearest measured k at or below.
  4. What the budget leaves goes to prefill chunks of the admitted prompts, first admitted first, each
     min(its remaining prompt, what is left).
  5. The step's time: the decode step's latency from the grid at (batch, k) and the context its rows
     attend (`LatencyGrid.step_context`, where the profile has a context axis; linear between measured
     batch sizes; a step that only prefills runs one forward: the batch-1, k = 0 step), plus the switch
     cost when it resumes speculating after k = 0, plus, when it prefills, the profile's chunk price
     at that batch (`LatencyGrid.chunk_ms`: a fixed part per step, and a part per prompt token fed;
     profiles from before chunked prefill: their per-token prefill price; nothing without either) and
     what the chunks' rows already hold (`chunk_context_cost`).
  6. Each decoding sequence gets 1 + accepted tokens, acceptance drawn position by position from the
     profile's per-position acceptance (extended by its per-token rate past the measured k). A prompt
     whose prefill completes gets its first token at the step's end and decodes from the next step.
  Not modelled: EOS (answers run to their length); prefix caching only where the trace names the
  prompts' blocks (a closed loop's prompts are all different).
- k: the real policy objects (`serve_app/engine/policy.py`), told each step's statistics as in the engine.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field


from serve_app.config import EngineConfig
from serve_app.engine.policy import BatchState, make_policy
from serve_app.profiling.calibration import calibrated
from serve_app.pricing import context_bucket
from serve_app.profiling.profiles import Profile, fit_acceptance_rate
from serve_app.engine.stats import StepStats
from serve_app.sim.summary import marginal_acceptance, summarize

ENGINE = EngineConfig()
"""The engine's defaults: what the simulators assume where they are not told otherwise."""


@dataclass
class Job:
    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    user: int | None = None  # closed loop: the user who sends the next request when this one ends
    replica: "Replica | None" = None
    first_token: float | None = None
    done: float | None = None
    generated: int = 0
    prefilled: int = 0  # context tokens in the KV: prefill progress (back to 0 when preempted)
    preemptions: int = 0
    blocks: tuple = ()  # the prompt's full blocks by name (`prompt_blocks`): what the prefix cache can serve

    @property
    def context(self) -> int:
        """Tokens the workers hold for it: the prompt and what it generated (prefilled again after a preemption)."""
        return self.prompt_tokens + self.generated


@dataclass
class Replica:
    index: int
    group: str
    profile: Profile
    policy: object
    max_batch: int
    kv_budget: int
    max_k: int
    rng: random.Random
    block_size: int = ENGINE.block_size
    max_num_batched_tokens: int = ENGINE.max_num_batched_tokens
    waiting: deque = field(default_factory=deque)
    prefilling: list = field(default_factory=list)  # admitted, prompt partly in the KV, in admission order
    running: list = field(default_factory=list)  # decoding, in admission order
    busy: bool = False
    last_k: int | None = None  # k of the last decode step (None: none yet)
    steps: list = field(default_factory=list)  # (time, decoding batch size, k, prefill tokens) of every step
    true_grid: object = None
    """The latencies this replica really has (a LatencyGrid), when they are not its profile's: the
    policy still reads the profile (and calibrates from the steps, if it does)."""
    cached: set = field(default_factory=set)  # names of the prompt blocks this replica's KV has computed

    def __post_init__(self) -> None:
        self._parts_cache: dict = {}
        self.marginal = marginal_acceptance(self.profile, self.max_k)
        self.draft = self.policy.name != "none"  # the engine runs `none` without a draft (no draft prefill)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def kv_capacity(self) -> int:
        """KV tokens admission may hand out: whole blocks of the budget (`Engine.kv_capacity`)."""
        return self.kv_budget // self.block_size * self.block_size

    def kv_tokens(self, job: Job) -> int:
        """Its context + one speculation window, in whole blocks (`Engine.kv_tokens`)."""
        return -(-(job.context + self.max_k + 1) // self.block_size) * self.block_size

    def step(self, now: float) -> tuple[float, list[Job]]:
        """Run one engine step starting at `now`: returns its duration and the jobs it finished."""
        self._admit()
        self._fit_kv()
        grid = self.profile.latency if self.true_grid is None else self.true_grid
        decoding, k = list(self.running), 0
        contexts = tuple(j.context for j in decoding)  # each row's KV: the step is priced at them, as the engine's
        context = grid.step_context(contexts)
        if decoding:
            k = self.policy.choose(BatchState(len(decoding), self.max_k, self.draft, contexts=contexts))
            # within the token budget, keeping a block's worth for prompts being prefilled (`Engine.step`)
            keep = min(self.block_size, self.max_num_batched_tokens - len(decoding)) if self.prefilling else 0
            k = max(0, min(k, (self.max_num_batched_tokens - keep) // len(decoding) - 1))
            k = max(x for x in grid.ks if x <= k)  # the grid's nearest measured k at or below (ks start at 0)
        chunks = self._plan_chunks(self.max_num_batched_tokens - len(decoding) * (k + 1))
        prefill_tokens = sum(n for _, n in chunks)
        # one forward feeds the decode rows and the chunks: the decode step's time, plus the chunks' tokens
        parts = self._parts(grid, len(decoding), context) if decoding else None
        ms = max(sum(p[grid.ks.index(k)] for p in parts), 1e-3) if decoding else grid.step_ms(1)[0]
        if decoding and k and self.last_k == 0:  # resuming speculation: the draft feeds the tokens it skipped
            ms += grid.resume_at(len(decoding))
        if prefill_tokens:
            ms += (grid.chunk_ms(max(len(decoding), 1), prefill_tokens, self.draft) or 0.0) + \
                grid.chunk_context_cost([(job.prefilled, n) for job, n in chunks])
        duration = max(ms / 1000, 1e-6)
        if decoding:
            self._decode(decoding, k, tuple(p[grid.ks.index(k)] for p in parts), prefill_tokens, contexts)
        for job, n in chunks:  # a prompt whose prefill completes: its first token, decoding from the next step
            job.prefilled += n
            self.cached.update(job.blocks[: job.prefilled // self.block_size])  # named as computed (`PagedKV`)
            if job.prefilled == job.context:
                self.prefilling.remove(job)
                self.running.append(job)
                job.generated += 1
                if job.first_token is None:
                    job.first_token = now + duration
        self.steps.append((now, len(decoding), k, prefill_tokens))
        finished = [j for j in self.running if j.generated >= j.output_tokens]
        for j in finished:
            j.done = now + duration
        self.running = [j for j in self.running if j.generated < j.output_tokens]
        return duration, finished

    def _admit(self) -> None:
        """FIFO while the batch and the KV pool allow, a block of headroom per admitted request (`Engine._admit`)."""
        room = self.kv_capacity - sum(self.kv_tokens(j) for j in self.prefilling + self.running)
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            need = self.kv_tokens(self.waiting[0])
            if need + self.block_size * (len(self.running) + len(self.prefilling)) > room:
                break
            job = self.waiting.popleft()
            job.prefilled = self._cached_prefix(job)
            self.prefilling.append(job)
            room -= need

    def _cached_prefix(self, job: Job) -> int:
        """Tokens of job's prompt the prefix cache serves: its leading blocks this replica computed before."""
        hits = 0
        for name in job.blocks:
            if name not in self.cached:
                break
            hits += 1
        return hits * self.block_size

    def _fit_kv(self) -> None:
        """Preempt the latest admitted while the admitted outgrow the pool (`Engine._fit_kv`)."""
        while sum(self.kv_tokens(j) for j in self.prefilling + self.running) > self.kv_capacity \
                and len(self.prefilling) + len(self.running) > 1:
            job = (self.prefilling or self.running).pop()
            job.prefilled, job.preemptions = 0, job.preemptions + 1
            self.waiting.appendleft(job)

    def _plan_chunks(self, budget: int) -> list[tuple[Job, int]]:
        """Prompt tokens each prefilling job feeds this step, first admitted first (`Engine._plan_chunks`)."""
        chunks = []
        for job in self.prefilling:
            if budget <= 0:
                break
            chunks.append((job, min(job.context - job.prefilled, budget)))
            budget -= chunks[-1][1]
        return chunks

    def _parts(self, grid, batch_size: int, context: float | None) -> tuple[list[float], list[float], list[float]]:
        """`LatencyGrid.parts_at` at (batch size, the rows' context in its bucket), cached per replica."""
        key = (batch_size, context_bucket(context, per_octave=32))
        if key not in self._parts_cache:
            self._parts_cache[key] = grid.parts_at(*key)
        return self._parts_cache[key]

    def _decode(self, decoding: list[Job], k: int, parts: tuple[float, float, float], prefill_tokens: int,
                contexts: tuple[int, ...]) -> None:
        """Every decoding job gains 1 + accepted tokens; the policy observes the step (with its parts'
        times, as the engine measures them: what a calibrating policy learns from)."""
        st = StepStats(batch_size=len(decoding), k=k, proposed=k * len(decoding), accepted_per_position=[0] * k,
                       prefill_tokens=prefill_tokens, draft_s=parts[0] / 1000, verify_s=parts[1] / 1000,
                       other_s=parts[2] / 1000, contexts=contexts)
        for j in decoding:
            n = self._accepted(k)
            st.accepted += n
            for i in range(n):
                st.accepted_per_position[i] += 1
            j.generated = min(j.generated + 1 + n, j.output_tokens)
        st.generated = st.batch_size + st.accepted
        self.last_k = k
        self.policy.observe(st)

    def _accepted(self, k: int) -> int:
        """Draft tokens accepted in one step at k: position i is accepted, given all before it were,
        with the profile's conditional acceptance there."""
        n, previous = 0, 1.0
        for p in self.marginal[:k]:
            if previous <= 0 or self.rng.random() >= min(p / previous, 1.0):
                break
            n, previous = n + 1, p
        return n


@dataclass
class SimResult:
    jobs: list[Job]
    replicas: list[Replica]
    policy: str

    def summary(self) -> dict:
        done = [j for j in self.jobs if j.done is not None]
        span = max((j.done for j in done), default=0) - min((j.arrival for j in self.jobs), default=0)
        return summarize(self.policy, len(self.jobs), [j.done - j.arrival for j in done],
                         [j.first_token - j.arrival for j in done],
                         [(j.done - j.first_token) / (j.output_tokens - 1) for j in done if j.output_tokens > 1],
                         sum(j.output_tokens for j in done), span)

    @property
    def steps(self) -> int:
        return sum(len(r.steps) for r in self.replicas)

    def by_hardware(self) -> dict[str, dict]:
        out: dict[str, list[float]] = {}
        for j in self.jobs:
            if j.replica is not None and j.done is not None:
                out.setdefault(j.replica.group, []).append(j.done - j.arrival)
        return {g: {"requests": len(v), "mean_latency_s": sum(v) / len(v)} for g, v in out.items()}

    def series(self) -> dict[str, tuple[list[int], list[float], list[float]]]:
        """Per hardware type: (second, mean batch size, mean k) over that second's decode steps."""
        bins: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for r in self.replicas:
            for t, b, k, _ in r.steps:
                if b:
                    bins.setdefault(r.group, {}).setdefault(int(t), []).append((b, k))
        return {g: (sorted(x), [sum(b for b, _ in x[i]) / len(x[i]) for i in sorted(x)],
                    [sum(k for _, k in x[i]) / len(x[i]) for i in sorted(x)]) for g, x in bins.items()}


def simulate(fleet: dict[str, int], profiles: dict[str, Profile], policy: str, *, users_at=None, duration_s: float = 60.0,
             trace: list[tuple] | None = None, prompt_tokens: "int | tuple[int, int]" = 64,
             output_tokens: "int | tuple[int, int]" = 64,
             max_batch: int = ENGINE.max_batch_size, kv_budget: int = ENGINE.max_num_tokens, max_k: int = ENGINE.max_k,
             block_size: int = ENGINE.block_size, max_num_batched_tokens: int = ENGINE.max_num_batched_tokens,
             seed: int = 0, route: str = "least-loaded", true_grids: dict | None = None,
             calibrate: bool = False, true_acceptance: dict | None = None) -> SimResult:
    """Simulate `fleet` ({hardware type: replicas}) under closed-loop users (`users_at(t)`, re-read
    every second of simulated time, for `duration_s`) or an open-loop `trace` of (arrival s, prompt tokens,
    output tokens) or (..., the prompt's blocks by name, `prompt_blocks`: prefix-cache hits). Closed-loop requests
    have `prompt_tokens` / `output_tokens` tokens: a count, or (low, high) drawn uniformly per request.
    Every replica runs the engine with these settings (`EngineConfig`: max_batch_size, max_num_tokens,
    max_k, block_size, max_num_batched_tokens; its defaults unless given). true_grids {hardware type:
    LatencyGrid}: that type's replicas really run at these latencies, not their profile's; calibrate:
    lut / adaptive steer by a grid calibrated from their replica's steps (`profiling.calibration`);
    true_acceptance {hardware type: acceptance per draft position}: what the workload's drafts really
    get accepted at, when not the profile's (the policies still start from the profile's)."""
    if (users_at is None) == (trace is None):
        raise ValueError("give exactly one of users_at (closed loop) or trace (open loop)")
    if route not in ("least-loaded", "group-total"):
        raise ValueError(f"unknown route {route!r}: expected least-loaded or group-total")
    missing = [t for t in fleet if t not in profiles or profiles[t].latency is None]
    if missing:
        raise ValueError(f"no profile with a latency grid for hardware types {missing}")
    engine = EngineConfig(max_batch_size=max_batch, max_num_tokens=kv_budget, max_k=max_k, block_size=block_size,
                          max_num_batched_tokens=max_num_batched_tokens)  # the engine's own checks
    top = lambda x: max(x) if isinstance(x, tuple) else x  # noqa: E731
    longest = max(row[1] + row[2] for row in trace) if trace else top(prompt_tokens) + top(output_tokens)
    if longest + max_k + 1 > kv_budget // block_size * block_size:  # `Engine.submit` refuses such a request
        raise ValueError(f"a request of {longest} prompt + output tokens does not fit the KV budget "
                         f"({kv_budget} tokens) alone")
    rng = random.Random(seed)
    lengths = random.Random(seed + 1)

    def draw(tokens) -> int:  # a fixed count, or (low, high): uniform, inclusive
        return tokens if isinstance(tokens, int) else lengths.randint(*tokens)

    def policy_for(gpu: str):
        made = make_policy(policy, profiles[gpu])
        return calibrated(made, profiles[gpu]) if calibrate else made

    replicas = [Replica(i, gpu, profiles[gpu], policy_for(gpu), engine.max_batch_size,
                        engine.max_num_tokens, engine.max_k, random.Random(rng.random()), engine.block_size,
                        engine.max_num_batched_tokens)
                for i, (gpu, n) in enumerate((g, n) for g, count in fleet.items() for n in range(count))]
    for i, r in enumerate(replicas):
        r.index = i
        r.true_grid = (true_grids or {}).get(r.group)
        if r.group in (true_acceptance or {}):
            accepted = true_acceptance[r.group]
            r.marginal = marginal_acceptance(r.profile.model_copy(update={
                "acceptance": accepted, "acceptance_rate": fit_acceptance_rate(accepted)}), r.max_k)
    jobs: list[Job] = []
    events: list = []  # (time, order, kind, payload)
    order = itertools.count()

    def arrive(t: float, prompt: int, output: int, user: int | None, blocks: tuple = ()) -> None:
        jobs.append(Job(len(jobs), t, prompt, output, user, blocks=blocks))
        heapq.heappush(events, (t, next(order), "arrive", jobs[-1]))

    active_users: set[int] = set()
    if trace is not None:
        for row in sorted(trace, key=lambda row: row[:3]):
            arrive(row[0], row[1], row[2], None, tuple(row[3]) if len(row) > 3 else ())
    else:
        heapq.heappush(events, (0.0, next(order), "users", None))
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "users":  # the shape's user count: start users (each sends at once) or let some stop
            want = max(0, int(round(users_at(now))))
            for u in range(want):
                if u not in active_users:
                    active_users.add(u)
                    arrive(now, draw(prompt_tokens), draw(output_tokens), u)
            for u in [u for u in active_users if u >= want]:
                active_users.discard(u)
            if now + 1.0 < duration_s:
                heapq.heappush(events, (now + 1.0, next(order), "users", None))
            else:
                active_users.clear()
        elif kind == "arrive":
            by_group: dict[str, list[Replica]] = {}
            for r in replicas:
                by_group.setdefault(r.group, []).append(r)
            if route == "group-total":  # the group with the fewest in flight, whatever its size
                group = min(by_group.values(), key=lambda rs: sum(r.in_flight for r in rs))
            else:  # the ingress: the group with the fewest in flight per replica
                group = min(by_group.values(), key=lambda rs: sum(r.in_flight for r in rs) / len(rs))
            r = min(group, key=lambda r: r.in_flight)  # then its replica with the fewest
            item.replica = r
            r.waiting.append(item)
            if not r.busy:
                r.busy = True
                heapq.heappush(events, (now, next(order), "step", r))
        elif kind == "step":
            took, finished = item.step(now)
            for j in finished:
                if j.user is not None and j.user in active_users:
                    arrive(j.done, draw(prompt_tokens), draw(output_tokens), j.user)
            if item.in_flight:
                heapq.heappush(events, (now + took, next(order), "step", item))
            else:
                item.busy = False
    return SimResult(jobs, replicas, policy)


def prompt_blocks(tokens: list[int], block_size: int = ENGINE.block_size) -> tuple[int, ...]:
    """A prompt's full blocks as the prefix cache names them: each by a hash chained over every token up to its end,
    so two prompts share a block's name only when they agree up to there. The block holding the last token is
    left out (the engine always computes it, for its logits)."""
    names, parent = [], 0
    for i in range((len(tokens) - 1) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        names.append(parent)
    return tuple(names)


# ---- the command: several policies on one fleet and trace, a table and a plot ----------------------

def read_trace(path: str) -> list[tuple[float, int, int]]:
    """CSV rows `arrival_s,prompt_tokens,output_tokens` (a header row is skipped)."""
    import csv

    rows = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.reader(f)):
            try:
                t, p, o = float(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError):
                if i == 0:
                    continue  # header
                raise ValueError(f"{path}:{i + 1}: need arrival_s,prompt_tokens,output_tokens") from None
            if t < 0 or p < 1 or o < 1:
                raise ValueError(f"{path}:{i + 1}: need arrival_s >= 0 and token counts >= 1")
            rows.append((t, p, o))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows
