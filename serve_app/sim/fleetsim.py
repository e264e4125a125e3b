"""The fleet-scale engine of `specserve simulate`: thousands of replicas, vectorised over time ticks.

The step-by-step simulator (`simulate.py`) runs every engine step of every replica as an event: exact,
but about 60k steps per second of wall time, and an hour of 1,000 replicas is tens of millions of
steps. This engine advances all replicas together, one tick (`tick_s`, default 0.1 s) at a time, with
numpy arrays over replicas and requests in flight. Within a tick a replica:
- admits waiting requests FIFO up to its max batch (decoding + prefilling; admitting costs nothing,
  the KV pool is not modelled here);
- steps at the k its policy gives for its decoding batch b at its rows' mean context (asked at the
  nearest of `CONTEXTS`), lowered so that b * (k + 1) fits the step's token budget
  (`max_num_batched_tokens`, less a block's worth while prompts are prefilling), each sequence gaining
  the expected tokens per step, 1 + acceptance[0] + ... + acceptance[k-1] (a fluid model: no per-step
  draws). Its pending prompt tokens go first, in whole steps that each feed up to C = budget - b * (k + 1)
  of them (first admitted first) beside the decoding batch and cost the decode step's time plus the
  profile's chunk price (`LatencyGrid.chunk_ms`: a fixed part per step, a part per prompt token;
  `chunk_context_cost`: a part per token its row already holds); a step that only prefills costs the
  batch-1, k = 0 step plus its chunk, as in `simulate.py`. As many such steps run as the prompts need or
  the tick holds (the last may run past the tick's end: a debt the replica pays first in the next tick);
  then it decodes for the rest of the tick, a fractional number of steps of the profile's step time at
  its rows' mean context (the step engine prices a padded layout at each group's longest: the mean is a
  fluid stand-in);
- gives a prompt its first token at the end of the step that feeds its last token, and decodes it from
  the next tick; finishes requests at the moment their last token falls due (interpolated inside the tick).
Arrivals in a tick are routed at its start with the ingress's rule (the group with the fewest requests
in flight per replica, then its replica with the fewest), as water-filling. Policies are the real objects:
each hardware type's policy is asked k per (batch size, context) once per simulated second, where a
replica needs it, after being told a step with the acceptance it would see (adaptive's occasional probe
steps at k = 0 are not modelled).
A slot freed inside a tick is refilled at the next one, so latencies carry up to one tick of bias:
`tests/test_simulate.py` checks this engine against the step-by-step one on a small fleet.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from serve_app.config import EngineConfig
from serve_app.engine.policy import BatchState, make_policy
from serve_app.profiling.profiles import Profile
from serve_app.sim.summary import marginal_acceptance, summarize
from serve_app.engine.stats import StepStats


ENGINE = EngineConfig()
"""The engine's defaults: what the simulators assume where they are not told otherwise."""


@dataclass
class FleetTables:
    """Per hardware type (rows) lookup tables the ticks index with numpy."""

    step_ms: np.ndarray  # [G, max_batch + 1, max_k + 1, C] step at batch b, k, CONTEXTS[c] (b = 0: batch 1, k = 0)
    chunk_step_ms: np.ndarray  # [G, max_batch + 1] fixed price of a step that prefills, beside b decoding (b = 0: 1)
    chunk_ms_per_token: np.ndarray  # [G, max_batch + 1] price per prompt token fed, beside b decoding (b = 0: 1)
    chunk_context_ms: np.ndarray  # [G, 2] a chunk's price per token its row holds, and per held x fed token
    tokens_per_step: np.ndarray  # [G, max_k + 1] expected tokens per sequence per step at k
    marginal: list[list[float]]  # per group: P(draft token i accepted), i < max_k


CONTEXTS = 2.0 ** np.arange(5, 16)
"""KV tokens per row (32 to 32,768) the step table is priced at; a replica's step between two of them is linear in
between, as the context grid's own line is."""


def build_tables(profiles: list[Profile], max_batch: int, max_k: int, draft: bool) -> FleetTables:
    G = len(profiles)
    step = np.zeros((G, max_batch + 1, max_k + 1, len(CONTEXTS)))
    chunk = np.zeros((G, max_batch + 1))
    fixed = np.zeros((G, max_batch + 1))
    tokens = np.ones((G, max_k + 1))
    context = np.zeros((G, 2))
    marginal = []
    for g, prof in enumerate(profiles):
        grid = prof.latency
        for b in range(1, max_batch + 1):
            at = np.array([grid.step_ms(b, float(c)) for c in CONTEXTS]).T  # [ks, C]; no context axis: all alike
            for k in range(max_k + 1):
                step[g, b, k] = at[grid.ks.index(max(x for x in grid.ks if x <= k))]  # nearest measured k at or below
            one, two = grid.chunk_ms(b, 1, draft) or 0.0, grid.chunk_ms(b, 2, draft) or 0.0  # none measured: free
            chunk[g, b], fixed[g, b] = two - one, 2 * one - two
        step[g, 0] = grid.step_ms(1)[0]  # only prefilling: one forward, as a batch-1 plain step (as `simulate.py`)
        chunk[g, 0], fixed[g, 0] = chunk[g, 1], fixed[g, 1]
        context[g] = grid.chunk_context_ms or (0.0, 0.0)  # `LatencyGrid.chunk_context_cost`; unmeasured: free
        m = marginal_acceptance(prof, max_k)
        marginal.append(m)
        tokens[g] = [1.0 + sum(m[:k]) for k in range(max_k + 1)]
    return FleetTables(step, fixed, chunk, context, tokens, marginal)


def waterfill(loads: np.ndarray, count: int) -> np.ndarray:
    """How many of `count` new requests each replica gets when each goes to the least loaded one in
    turn (ties: the lower index): the loads rise evenly from the bottom."""
    n = len(loads)
    out = np.zeros(n, dtype=np.int64)
    if count <= 0 or n == 0:
        return out
    order = np.argsort(loads, kind="stable")
    s = loads[order].astype(np.int64)
    # need[j]: requests that bring the j + 1 least loaded replicas up to level s[j]
    need = np.arange(1, n + 1) * s - np.cumsum(s)
    j = int(np.searchsorted(need, count, side="left"))  # replicas taking part: need[j - 1] < count
    j = max(j, 1)
    total = int(s[:j].sum()) + count
    level, extra = divmod(total, j)
    taking = np.sort(order[:j])
    out[taking] = level - loads[taking]
    out[taking[:extra]] += 1  # the last round goes to the lowest indices, as one by one with ties to the lower
    return out


@dataclass
class FleetResult:
    policy: str
    groups: list[str]
    e2e: np.ndarray  # [finished] seconds, arrival to last token
    ttft: np.ndarray  # [finished]
    tpot: np.ndarray  # [finished] (NaN for 1-token answers)
    group_of: np.ndarray  # [finished] hardware type index
    output_tokens: np.ndarray  # [finished]
    arrivals: int
    span_s: float
    ticks: np.ndarray  # [T] tick start times
    batch: np.ndarray  # [T, G] mean batch size of busy replicas
    k: np.ndarray  # [T, G] mean k of busy replicas
    replicas: int = 0
    steps: float = 0.0

    def by_hardware(self) -> dict[str, dict]:
        return {g: {"requests": int((self.group_of == i).sum()), "mean_latency_s": float(self.e2e[self.group_of == i].mean())}
                for i, g in enumerate(self.groups) if (self.group_of == i).any()}

    def series(self) -> dict[str, tuple[list[int], list[float], list[float]]]:
        """Per hardware type: (second, mean batch size, mean k) of busy replicas, averaged over that second's ticks."""
        sec = self.ticks.astype(int)
        out = {}
        for i, g in enumerate(self.groups):
            ok = ~np.isnan(self.batch[:, i])
            if not ok.any():
                continue
            xs = np.unique(sec[ok])
            n = np.bincount(sec[ok], minlength=xs.max() + 1)[xs]
            mean = lambda col: (np.bincount(sec[ok], weights=col[ok], minlength=xs.max() + 1)[xs] / n).tolist()
            out[g] = (xs.tolist(), mean(self.batch[:, i]), mean(self.k[:, i]))
        return out

    def summary(self) -> dict:
        return summarize(self.policy, self.arrivals, self.e2e, self.ttft, self.tpot[~np.isnan(self.tpot)],
                         float(self.output_tokens.sum()), self.span_s)


@dataclass
class _Requests:
    """Requests in flight, one array per field (index = request slot)."""

    replica: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    arrival: np.ndarray = field(default_factory=lambda: np.zeros(0))
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    output: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    user: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    running: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    generated: np.ndarray = field(default_factory=lambda: np.zeros(0))
    first: np.ndarray = field(default_factory=lambda: np.zeros(0))
    left: np.ndarray = field(default_factory=lambda: np.zeros(0))  # prompt tokens still to prefill once admitted

    NAMES = ("replica", "arrival", "prompt", "output", "user", "seq", "running", "generated", "first", "left")

    def append(self, **cols) -> None:
        for name in self.NAMES:
            setattr(self, name, np.concatenate([getattr(self, name), cols[name]]))

    def keep(self, mask: np.ndarray) -> None:
        for name in self.NAMES:
            setattr(self, name, getattr(self, name)[mask])


def simulate_fleet(fleet: dict[str, int], profiles: dict[str, Profile], policy: str, *, users_at=None,
                   duration_s: float = 60.0, trace: list[tuple[float, int, int]] | None = None,
                   prompt_tokens: "int | tuple[int, int]" = 64, output_tokens: "int | tuple[int, int]" = 64,
                   max_batch: int = ENGINE.max_batch_size, max_k: int = ENGINE.max_k,
                   max_num_batched_tokens: int = ENGINE.max_num_batched_tokens, block_size: int = ENGINE.block_size,
                   tick_s: float = 0.1, route: str = "least-loaded", seed: int = 0) -> FleetResult:
    """`fleet` ({hardware type: replicas}) under closed-loop users (`users_at(t)`, re-read every
    simulated second, for `duration_s`) or an open-loop `trace` of (arrival s, prompt tokens, output
    tokens). `route`: least-loaded (the ingress: the group with the fewest in flight per replica, then
    its replica with the fewest) or group-total (the group with the fewest in flight, whatever its size:
    the ingress's rule before it counted replicas). max_batch, max_k, max_num_batched_tokens, block_size:
    the engine's settings (`EngineConfig` defaults unless given)."""
    if (users_at is None) == (trace is None):
        raise ValueError("give exactly one of users_at (closed loop) or trace (open loop)")
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}: expected one of {', '.join(ROUTES)}")
    missing = [t for t in fleet if t not in profiles or profiles[t].latency is None]
    if missing:
        raise ValueError(f"no profile with a latency grid for hardware types {missing}")
    if max_num_batched_tokens < max_batch:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_batch ({max_batch})")
    sim = _Fleet(fleet, profiles, policy, max_batch, max_k, max_num_batched_tokens, block_size, tick_s, route, seed)
    arrivals = _Trace(trace) if trace is not None else _Users(users_at, duration_s, prompt_tokens, output_tokens, seed)
    t = 0.0
    while t < arrivals.end_s or len(sim.req.seq) or arrivals.pending():
        if t - sim.last_policy >= 1.0:
            sim.ask_policies(t)
        sim.route(*arrivals.due(t, t + tick_s))
        sim.admit()
        for users, done in sim.step(t):
            arrivals.finished(users, done)
        t += tick_s
        if t > arrivals.end_s + 3600:  # an overloaded fleet never drains: stop an hour past the end
            break
    return sim.result(arrivals.first_s)


class _Trace:
    """Open loop: the trace's requests, each due at its arrival time."""

    def __init__(self, trace: list[tuple[float, int, int]]):
        self.rows = np.array(sorted(trace), dtype=float).reshape(-1, 3)
        self.end_s = float(self.rows[-1, 0]) if len(self.rows) else 0.0
        self.first_s = float(self.rows[0, 0]) if len(self.rows) else 0.0
        self.next = 0

    def pending(self) -> bool:
        return self.next < len(self.rows)

    def due(self, t0: float, t1: float):
        stop = int(np.searchsorted(self.rows[:, 0], t1, side="left"))
        rows, self.next = self.rows[self.next:stop], stop
        return rows[:, 0], rows[:, 1].astype(np.int64), rows[:, 2].astype(np.int64), np.full(len(rows), -1)

    def finished(self, users: np.ndarray, done: np.ndarray) -> None:
        pass


class _Users:
    """Closed loop: users_at(t) users (re-read each simulated second), each sending its next request
    when its last one finished; users over the count stop after their request in flight."""

    def __init__(self, users_at, duration_s: float, prompt_tokens, output_tokens, seed: int):
        self.users_at, self.end_s, self.first_s = users_at, duration_s, 0.0
        self.prompt, self.output = prompt_tokens, output_tokens  # a count, or (low, high) drawn per request
        self.rng = np.random.default_rng(seed + 1)
        self.active = np.zeros(0, bool)  # [users] counted by the shape now
        self.busy = np.zeros(0, bool)  # [users] a request in flight or due
        self.at, self.who = np.zeros(0), np.zeros(0, np.int64)  # next requests: due time, user
        self.checked = -1

    def pending(self) -> bool:
        return len(self.at) > 0

    def due(self, t0: float, t1: float):
        if t0 < self.end_s and math.floor(t0) > self.checked:
            self.checked = math.floor(t0)
            want = max(0, int(round(self.users_at(t0))))
            if want > len(self.active):
                grow = np.zeros(want - len(self.active), bool)
                self.active, self.busy = np.concatenate([self.active, grow]), np.concatenate([self.busy, grow])
            starting = np.flatnonzero(~self.active[:want] & ~self.busy[:want])
            self.active[:] = False
            self.active[:want] = True
            self.busy[starting] = True
            self.at, self.who = np.concatenate([self.at, np.full(len(starting), t0)]), np.concatenate([self.who, starting])
        if t0 >= self.end_s:
            self.active[:] = False
        now = self.at < t1
        at, who = self.at[now], self.who[now]
        self.at, self.who = self.at[~now], self.who[~now]
        return at, self._draw(self.prompt, len(at)), self._draw(self.output, len(at)), who

    def _draw(self, tokens, n: int) -> np.ndarray:
        if isinstance(tokens, int):
            return np.full(n, tokens)
        return self.rng.integers(tokens[0], tokens[1] + 1, size=n)

    def finished(self, users: np.ndarray, done: np.ndarray) -> None:
        again = self.active[users]
        self.busy[users[~again]] = False
        self.at, self.who = np.concatenate([self.at, done[again]]), np.concatenate([self.who, users[again]])


class _Fleet:
    """The replicas (arrays over R) and the requests in flight (arrays over requests)."""

    def __init__(self, fleet: dict[str, int], profiles: dict[str, Profile], policy: str, max_batch: int, max_k: int,
                 budget: int, block_size: int, tick_s: float, route: str, seed: int):
        self.groups = list(fleet)
        self.counts = np.array([fleet[g] for g in self.groups])
        self.R, G = int(self.counts.sum()), len(self.groups)
        self.group_of = np.repeat(np.arange(G), self.counts)  # [R]
        self.first_replica = np.concatenate([[0], np.cumsum(self.counts)[:-1]])  # [G]
        self.has_draft = policy != "none"
        self.tables = build_tables([profiles[g] for g in self.groups], max_batch, max_k, self.has_draft)
        self.policy = policy
        self.policies = [make_policy(policy, profiles[g]) for g in self.groups]
        self.k_table = np.zeros((G, max_batch + 1, len(CONTEXTS)), dtype=np.int64)  # [G, batch, C] k (-1: not asked)
        self.askers: list = []  # per hardware type: the copy of its policy this second's k come from
        self.max_batch, self.max_k, self.budget, self.block_size = max_batch, max_k, budget, block_size
        self.tick_s, self.route_rule = tick_s, route
        self.rng = np.random.default_rng(seed)
        self.req = _Requests()
        self.next_seq, self.arrivals, self.steps, self.last_done, self.last_policy = 0, 0, 0.0, 0.0, -1.0
        self.debt = np.zeros(self.R)  # [R] ms of prefill steps a replica still owes from earlier ticks
        self.done: dict[str, list] = {"e2e": [], "ttft": [], "tpot": [], "group": [], "out": []}
        self.ticks, self.batch_log, self.k_log = [], [], []

    def ask_policies(self, t: float) -> None:
        """From now on k per (batch size, context) comes from a copy of each hardware type's policy (so asking is
        not a step), asked where a replica first needs it (`_ks`)."""
        self.last_policy = t
        self.askers = []
        for pol in self.policies:
            probe = copy.copy(pol)
            if hasattr(probe, "_since_probe"):
                probe._since_probe = 0  # adaptive counts k = 0 answers towards its probe: not here
            self.askers.append(probe)
        self.k_table[:] = -1
        self.k_table[:, 0] = 0

    def _ks(self, g: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[R] k the policies give at each replica's (hardware type, batch size, context index), asking those
        not asked since `ask_policies`: b rows of CONTEXTS[c] tokens each."""
        ks = self.k_table[g, b, c]
        if (ks < 0).any():
            for gi, bi, ci in np.unique(np.stack([g, b, c])[:, ks < 0], axis=1).T.tolist():
                state = BatchState(bi, self.max_k, self.has_draft, contexts=(int(CONTEXTS[ci]),) * bi)
                self.k_table[gi, bi, ci] = self.askers[gi].choose(state)
            ks = self.k_table[g, b, c]
        return ks

    def route(self, at: np.ndarray, prompt: np.ndarray, output: np.ndarray, user: np.ndarray) -> None:
        n = len(at)
        if not n:
            return
        in_flight = np.bincount(self.req.replica, minlength=self.R)
        target = _route(in_flight, n, self.group_of, self.first_replica, self.counts, self.route_rule)
        self.req.append(replica=target, arrival=at, prompt=prompt, output=output, user=user,
                        seq=np.arange(self.next_seq, self.next_seq + n), running=np.zeros(n, bool),
                        generated=np.zeros(n), first=np.full(n, np.nan), left=prompt.astype(float))
        self.next_seq += n
        self.arrivals += n

    def admit(self) -> None:
        """FIFO per replica while decoding + prefilling < max batch; their prefill starts (no cost here)."""
        req, R = self.req, self.R
        waiting = np.flatnonzero(~req.running)
        if not len(waiting):
            return
        admitted_per = np.bincount(req.replica[req.running], minlength=R)
        order = waiting[np.lexsort((req.seq[waiting], req.replica[waiting]))]  # by replica, then arrival
        reps = req.replica[order]
        rank = np.arange(len(order)) - np.searchsorted(reps, reps, side="left")  # place in its replica's queue
        req.running[order[rank < (self.max_batch - admitted_per)[reps]]] = True

    def step(self, t: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every replica steps for the tick (module docstring): prefill chunks beside the decoding batch
        until its prompts are in, then decoding alone. Returns (users, done times) of the finished requests."""
        req, tick_ms, R = self.req, self.tick_s * 1000, self.R
        dec = np.flatnonzero(req.running & (req.left <= 0))
        pre = np.flatnonzero(req.running & (req.left > 0))
        batch = np.bincount(req.replica[dec], minlength=R)  # [R] decoding
        b = np.minimum(batch, self.max_batch)
        g = self.group_of
        prefilling = np.bincount(req.replica[pre], minlength=R) > 0  # [R]
        kept = np.where(prefilling, np.minimum(self.block_size, self.budget - b), 0)  # a block's worth for prompts
        # each replica's rows' mean KV tokens (prompt + generated), as a fractional index into CONTEXTS (the engine
        # prices a padded layout at each group's longest: the mean is a fluid stand-in)
        kv = np.bincount(req.replica[dec], weights=req.prompt[dec] + req.generated[dec], minlength=R)
        at = np.interp(kv / np.maximum(batch, 1), CONTEXTS, np.arange(len(CONTEXTS)))  # [R]
        asked = self._ks(g, b, np.rint(at).astype(np.int64))
        ks = np.where(b > 0, np.minimum(asked, (self.budget - kept) // np.maximum(b, 1) - 1), 0)  # [R]
        step_ms = self._step_ms(g, b, ks, at)  # [R] (b = 0: the batch-1 plain step)
        per_step = self.tables.tokens_per_step[g, ks]  # [R] expected tokens per sequence
        chunk = (self.budget - b * (ks + 1)).astype(float)  # [R] prompt tokens a step feeds while prefilling
        price = self.tables.chunk_ms_per_token[g, b]  # [R] ms per prompt token
        feed_ms = step_ms + self.tables.chunk_step_ms[g, b]  # [R] a step that prefills, before its tokens' price
        pending = np.bincount(req.replica[pre], weights=req.left[pre], minlength=R)  # [R] prompt tokens to feed
        # what the chunks' rows already hold, as a price per pending token (a fluid share; `_prefill` is exact)
        held_rows = self._held_ms(pre, req.prompt[pre] - req.left[pre], req.left[pre], chunk)  # [len(pre)]
        held_ms = np.bincount(req.replica[pre], weights=held_rows, minlength=R)
        fed_price = price + np.where(pending > 0, held_ms / np.maximum(pending, 1), 0.0)  # [R]
        # A replica still busy with an earlier tick's last step (debt) starts that much later. It feeds its
        # pending prompt tokens first, in whole steps of up to C tokens, each the decode step's time and
        # the chunk's fixed price plus its tokens' price, as many as the tick needs or holds (the last
        # may run past the tick's end: a debt on the next), then decodes for what is left of the tick.
        free = self.debt < tick_ms
        begin = np.where(free, self.debt, tick_ms)  # [R] ms into the tick the replica starts
        can = free & (chunk > 0) & (pending > 0)
        c = np.maximum(chunk, 1)
        needed = np.ceil(np.where(can, pending / c, 0.0) - 1e-9)  # [R] steps to feed them all
        fits = needed * feed_ms + pending * fed_price <= tick_ms - begin
        holds = np.ceil((tick_ms - begin) / (feed_ms + c * fed_price))  # [R] feeding steps the tick holds
        prefill_steps = np.where(fits, needed, np.minimum(holds, needed))
        prefill_steps = np.where(can, prefill_steps, 0.0)  # [R]
        fed = np.where(can, np.minimum(prefill_steps * c, pending), 0.0)  # [R] prompt tokens fed
        prefill_ms = prefill_steps * feed_ms + fed * fed_price  # [R]
        rest = tick_ms - begin - prefill_ms
        decode_steps = np.where(free & (batch > 0) & (rest > 0), rest / step_ms, 0.0)  # [R] after the prompts are in
        self.debt = np.where(free, np.maximum(-rest, 0.0), self.debt - tick_ms)
        self.steps += float(prefill_steps.sum() + decode_steps.sum())
        self._log(t, batch, ks)
        self._observe(batch, ks)
        if len(pre):
            self._prefill(t + begin / 1000, pre, held_rows, fed, chunk, feed_ms, price, batch, step_ms)
        if not len(dec):
            return []
        r = req.replica[dec]
        steps = np.where(batch > 0, prefill_steps + decode_steps, 0.0)
        need = np.maximum(req.output[dec] - req.generated[dec], 0.0)
        req.generated[dec] += steps[r] * per_step[r]
        ends = need <= steps[r] * per_step[r]
        fin, rf = dec[ends], r[ends]
        if not len(fin):
            return []
        m = need[ends] / per_step[rf]  # steps until its last token: the prefilling steps first, then plain ones
        during = np.ceil(m - 1e-9) * feed_ms[rf] + np.minimum(np.ceil(m - 1e-9) * chunk[rf], fed[rf]) * fed_price[rf]
        after = prefill_ms[rf] + (m - prefill_steps[rf]) * step_ms[rf]
        at_ms = begin[rf] + np.where(m <= prefill_steps[rf], during, after)
        done = np.maximum(t + at_ms / 1000, req.first[fin])
        out = req.output[fin]
        self.done["e2e"].append(done - req.arrival[fin])
        self.done["ttft"].append(req.first[fin] - req.arrival[fin])
        self.done["tpot"].append(np.where(out > 1, (done - req.first[fin]) / np.maximum(out - 1, 1), np.nan))
        self.done["group"].append(self.group_of[rf])
        self.done["out"].append(out)
        self.last_done = max(self.last_done, float(done.max()))
        users = req.user[fin]
        keep = np.ones(len(req.seq), bool)
        keep[fin] = False
        req.keep(keep)
        return [(users, done)]

    def _step_ms(self, g: np.ndarray, b: np.ndarray, ks: np.ndarray, at: np.ndarray) -> np.ndarray:
        """[R] each replica's decode step at its context `at` [R] (a fractional index into CONTEXTS), linear
        between the table's contexts."""
        i0 = np.minimum(at.astype(np.int64), len(CONTEXTS) - 2)
        w = at - i0
        by_context = self.tables.step_ms[g, b, ks]  # [R, C]
        rows = np.arange(self.R)
        return by_context[rows, i0] * (1 - w) + by_context[rows, i0 + 1] * w

    def _held_ms(self, rows: np.ndarray, done: np.ndarray, left: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """[rows] ms their chunks pay for what their rows already hold (`LatencyGrid.chunk_context_cost`) while
        `left` more prompt tokens go in, `chunk` [R] at a time, after `done` are in: held done, done + C, ..."""
        r = self.req.replica[rows]
        c = np.maximum(chunk[r], 1)
        m = np.ceil(left / c - 1e-9)  # chunks to go
        per_held, per_pair = self.tables.chunk_context_ms[self.group_of[r]].T
        return (m * done + c * m * (m - 1) / 2) * (per_held + per_pair * c)

    def _prefill(self, start: np.ndarray, pre: np.ndarray, held_rows: np.ndarray, fed: np.ndarray, chunk: np.ndarray,
                 feed_ms: np.ndarray, price: np.ndarray, batch: np.ndarray, decode_ms: np.ndarray) -> None:
        """Feed `fed` [R] prompt tokens to each replica's prefilling requests, first admitted first, from
        `start` [R] (seconds; feed_ms [R]: a feeding step before its tokens' price; price [R]: ms per token
        fed, before what the rows hold: held_rows [len(pre)], `_held_ms` of each). A prompt whose last token
        is fed gets its first token at the end of that step: after ceil(tokens fed up to it / chunk) steps,
        the price of the tokens they feed and the held price of the rows up to it; and not before its
        arrival, a step boundary (a uniform part of the decode step it lands in, decode_ms [R], when the
        replica is decoding) and its own prefill. A one-token answer is done then."""
        req = self.req
        order = np.lexsort((req.seq[pre], req.replica[pre]))  # by replica, then admission (arrival) order
        pre, held_rows = pre[order], held_rows[order]
        r, left = req.replica[pre], req.left[pre]
        run = np.searchsorted(r, r, side="left")  # first row of each replica's run

        def within(x):  # cumulative within each replica's run
            cum = np.cumsum(x)
            return cum - (cum[run] - x[run])

        cum, held = within(left), within(held_rows)
        req.left[pre] = np.clip(cum - fed[r], 0.0, left)
        done = req.left[pre] <= 1e-9
        if not done.any():
            return
        now_in, ri, cum, held = pre[done], r[done], cum[done], held[done]
        req.left[now_in] = 0.0
        c, s, p = np.maximum(chunk[ri], 1), feed_ms[ri], price[ri]
        steps = np.ceil(cum / c - 1e-9)  # the step that feeds its last token ends after all that step feeds
        first = start[ri] + (steps * s + np.minimum(steps * c, fed[ri]) * p + held) / 1000
        own = req.prompt[now_in]
        # it lands at a uniform point of the decode step under way (a fixed half step narrows the TTFT spread)
        wait = np.where(batch[ri] > 0, self.rng.uniform(size=len(ri)) * decode_ms[ri], 0.0)
        own_ms = np.ceil(own / c - 1e-9) * s + own * p + self._held_ms(now_in, 0.0, own, chunk)
        req.first[now_in] = np.maximum(first, req.arrival[now_in] + (wait + own_ms) / 1000)
        req.generated[now_in] = 1.0  # decoding from the next tick (a one-token answer finishes there, at `first`)

    def _log(self, t: float, batch: np.ndarray, ks: np.ndarray) -> None:
        """Mean batch size and k of busy replicas per hardware type, this tick."""
        busy = batch > 0
        G = len(self.groups)
        n = np.bincount(self.group_of[busy], minlength=G)
        self.ticks.append(t)
        with np.errstate(invalid="ignore", divide="ignore"):
            self.batch_log.append(np.bincount(self.group_of[busy], weights=batch[busy], minlength=G) / n)
            self.k_log.append(np.bincount(self.group_of[busy], weights=ks[busy], minlength=G) / n)

    def _observe(self, batch: np.ndarray, ks: np.ndarray) -> None:
        """Tell each hardware type's policy one step at its most common k, with acceptance drawn from
        its profile (what adaptive's estimate follows)."""
        for g, pol in enumerate(self.policies):
            sel = (batch > 0) & (self.group_of == g)
            if not sel.any() or ks[sel].max() == 0:
                continue
            k = int(np.bincount(ks[sel]).argmax()) or int(ks[sel].max())
            b = int(round(batch[sel].mean()))
            per_pos = [int(self.rng.binomial(b, p)) for p in self.tables.marginal[g][:k]]
            per_pos = [min(x, per_pos[i - 1]) if i else x for i, x in enumerate(per_pos)]  # accepted only after all before
            pol.observe(StepStats(batch_size=b, k=k, proposed=b * k, accepted=sum(per_pos), accepted_per_position=per_pos))

    def result(self, first_arrival: float) -> FleetResult:
        def cat(name, dtype=float):
            return np.concatenate(self.done[name]) if self.done[name] else np.zeros(0, dtype)

        G = len(self.groups)
        return FleetResult(self.policy, self.groups, cat("e2e"), cat("ttft"), cat("tpot"), cat("group", np.int64),
                           cat("out", np.int64), self.arrivals, self.last_done - first_arrival, np.array(self.ticks),
                           np.array(self.batch_log).reshape(-1, G), np.array(self.k_log).reshape(-1, G), self.R, self.steps)


ROUTES = ("least-loaded", "group-total")


def _route(in_flight: np.ndarray, n: int, group_of: np.ndarray, first_replica: np.ndarray, counts: np.ndarray,
           route: str) -> np.ndarray:
    """Replica index for each of `n` new requests routed together."""
    totals = np.bincount(group_of, weights=in_flight, minlength=len(counts))
    if route == "group-total":  # each request to the group with the fewest in flight, whatever its size
        per_group = waterfill(totals.astype(np.int64), n)
    else:  # least-loaded: the group with the fewest in flight per replica
        per_group = _share(totals, counts, n)
    out = []
    for g, c in enumerate(per_group):
        if c:
            lo = first_replica[g]
            per = waterfill(in_flight[lo:lo + counts[g]], int(c))
            out.append(lo + np.repeat(np.arange(counts[g]), per))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _share(totals: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Split n requests over groups so their in flight per replica levels out from the bottom (what
    sending each to the group with the lowest level does), rounded to whole requests."""
    levels = totals / counts
    order = np.argsort(levels, kind="stable")
    # raise the j lowest groups together to level h, where sum(counts * (h - level)) over them = n
    for j in range(1, len(order) + 1):
        idx = order[:j]
        h = (n + (totals[idx]).sum()) / counts[idx].sum()
        if j == len(order) or h <= levels[order[j]]:
            break
    want = np.zeros(len(counts))
    want[idx] = np.maximum(h * counts[idx] - totals[idx], 0.0)
    share = np.floor(want).astype(np.int64)
    rest = n - int(share.sum())
    if rest > 0:  # the remainder to the largest fractions
        share[np.argsort(-(want - share), kind="stable")[:rest]] += 1
    return share
