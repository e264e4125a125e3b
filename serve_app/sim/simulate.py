"""`specserve simulate`: the service on a fleet of hardware types, as a discrete-event simulation
driven by profiles.

What is modelled, and how:
- Arrivals: closed-loop users following a load shape's user count over time (each user sends its
  next request when the last one finished), or an open-loop trace of (arrival time, prompt tokens,
  output tokens).
- Routing: the ingress's rule. The engine group with the fewest requests in flight per replica, then
  that group's replica with the fewest (or, `group-total`, the group with the fewest in all).
- Each replica: the engine's continuous batching (max batch size, KV budget, FIFO admission). A
  step's time comes from its hardware's latency grid at the current batch size and k (linear
  between measured batch sizes), plus the switch cost when it resumes speculating after k = 0. A
  step that admits requests adds their prefill: the profile's measured prefill per prompt token
  at that many admissions (one plain forward in profiles without one). Each sequence gets 1 + accepted tokens, with acceptance drawn position by position
  from the profile's per-position acceptance (extended by its per-token rate past the measured k).
- k: the real policy objects (`serve_app/engine/policy.py`), told each step's statistics as in the engine.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field


from serve_app.engine.policy import BatchState, make_policy
from serve_app.profiling.profiles import Profile
from serve_app.engine.stats import StepStats
from serve_app.sim.summary import marginal_acceptance, summarize


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

    @property
    def reserve(self) -> int:
        return self.prompt_tokens + self.output_tokens


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
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    last_k: int | None = None  # k of the last decode step (None: none yet)
    steps: list = field(default_factory=list)  # (time, batch size, k) of every step

    def __post_init__(self) -> None:
        self.marginal = marginal_acceptance(self.profile, self.max_k)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, now: float) -> tuple[float, list[Job]]:
        """Run one engine step starting at `now`: returns its duration and the jobs it finished."""
        admitted = []
        reserved = sum(j.reserve for j in self.running)
        while self.waiting and len(self.running) + len(admitted) < self.max_batch \
                and reserved + self.waiting[0].reserve <= self.kv_budget:
            job = self.waiting.popleft()
            reserved += job.reserve
            admitted.append(job)
        grid = self.profile.latency
        duration = 0.0
        if admitted:  # their prefill gives their first token (priced per prompt token when measured)
            prefill = grid.prefill_at(len(admitted), sum(j.prompt_tokens for j in admitted), self.policy.name != "none")
            duration += (grid.step_ms(len(admitted))[0] if prefill is None else prefill) / 1000
            for j in admitted:
                j.generated, j.first_token = 1, now + duration
        self.running += admitted  # as in Engine.step: the admitted join this step's decode too
        decoding = [j for j in self.running if j.generated < j.output_tokens]
        st = StepStats()
        if decoding:
            k = self.policy.choose(BatchState(len(decoding), self.max_k, True))
            k = max((x for x in grid.ks if x <= k), default=0)  # the grid's nearest measured k at or below
            duration += grid.step_ms(len(decoding))[grid.ks.index(k)] / 1000
            if k and self.last_k == 0:  # resuming speculation: the draft feeds the tokens it skipped
                duration += grid.resume_at(len(decoding)) / 1000
            self.last_k = k
            st.batch_size, st.k, st.proposed = len(decoding), k, k * len(decoding)
            st.accepted_per_position = [0] * k
            for j in decoding:
                n = self._accepted(k)
                st.accepted += n
                for i in range(n):
                    st.accepted_per_position[i] += 1
                j.generated = min(j.generated + 1 + n, j.output_tokens)
            st.generated = st.batch_size + st.accepted
            self.policy.observe(st)
        self.steps.append((now, len(decoding), st.k))
        finished = [j for j in self.running if j.generated >= j.output_tokens]
        for j in finished:
            j.done = now + duration
        self.running = [j for j in self.running if j.generated < j.output_tokens]
        return max(duration, 1e-6), finished

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
            for t, b, k in r.steps:
                if b:
                    bins.setdefault(r.group, {}).setdefault(int(t), []).append((b, k))
        return {g: (sorted(x), [sum(b for b, _ in x[i]) / len(x[i]) for i in sorted(x)],
                    [sum(k for _, k in x[i]) / len(x[i]) for i in sorted(x)]) for g, x in bins.items()}


def simulate(fleet: dict[str, int], profiles: dict[str, Profile], policy: str, *, users_at=None, duration_s: float = 60.0,
             trace: list[tuple[float, int, int]] | None = None, prompt_tokens: "int | tuple[int, int]" = 64,
             output_tokens: "int | tuple[int, int]" = 64,
             max_batch: int = 8, kv_budget: int = 65536, max_k: int = 8, seed: int = 0,
             route: str = "least-loaded") -> SimResult:
    """Simulate `fleet` ({hardware type: replicas}) under closed-loop users (`users_at(t)`, re-read
    every second of simulated time, for `duration_s`) or an open-loop `trace`. Closed-loop requests
    have `prompt_tokens` / `output_tokens` tokens: a count, or (low, high) drawn uniformly per request."""
    if (users_at is None) == (trace is None):
        raise ValueError("give exactly one of users_at (closed loop) or trace (open loop)")
    if route not in ("least-loaded", "group-total"):
        raise ValueError(f"unknown route {route!r}: expected least-loaded or group-total")
    missing = [t for t in fleet if t not in profiles or profiles[t].latency is None]
    if missing:
        raise ValueError(f"no profile with a latency grid for hardware types {missing}")
    rng = random.Random(seed)
    lengths = random.Random(seed + 1)

    def draw(tokens) -> int:  # a fixed count, or (low, high): uniform, inclusive
        return tokens if isinstance(tokens, int) else lengths.randint(*tokens)

    replicas = [Replica(i, gpu, profiles[gpu], make_policy(policy, profiles[gpu]), max_batch, kv_budget, max_k,
                        random.Random(rng.random()))
                for i, (gpu, n) in enumerate((g, n) for g, count in fleet.items() for n in range(count))]
    for i, r in enumerate(replicas):
        r.index = i
    jobs: list[Job] = []
    events: list = []  # (time, order, kind, payload)
    order = itertools.count()

    def arrive(t: float, prompt: int, output: int, user: int | None) -> None:
        jobs.append(Job(len(jobs), t, prompt, output, user))
        heapq.heappush(events, (t, next(order), "arrive", jobs[-1]))

    active_users: set[int] = set()
    if trace is not None:
        for t, p, o in sorted(trace):
            arrive(t, p, o, None)
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
