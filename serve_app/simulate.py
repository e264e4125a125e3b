"""`specserve simulate`: the service on a fleet of hardware types, as a discrete-event simulation
driven by profiles.

What is modelled, and how:
- Arrivals: closed-loop users following a load shape's user count over time (each user sends its
  next request when the last one finished), or an open-loop trace of (arrival time, prompt tokens,
  output tokens).
- Routing: the ingress's rule. The engine group with the fewest requests in flight, then that
  group's replica with the fewest.
- Each replica: the engine's continuous batching (max batch size, KV budget, FIFO admission). A
  step's time comes from its hardware's latency grid at the current batch size and k (linear
  between measured batch sizes). A step that admits requests adds one plain target forward for
  their prefill. Each sequence gets 1 + accepted tokens, with acceptance drawn position by position
  from the profile's per-position acceptance (extended by its per-token rate past the measured k).
- k: the real policy objects (`serve_app/policy.py`), told each step's statistics as in the engine.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from .policy import BatchState, make_policy
from .profiles import Profile
from .stats import StepStats


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
    steps: list = field(default_factory=list)  # (time, batch size, k) of every step

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
        if admitted:  # one plain target forward prefills them and gives their first token
            duration += grid.step_ms(len(self.running) + len(admitted))[0] / 1000
            for j in admitted:
                j.generated, j.first_token = 1, now + duration
        self.running += admitted  # as in Engine.step: the admitted join this step's decode too
        decoding = [j for j in self.running if j.generated < j.output_tokens]
        st = StepStats()
        if decoding:
            k = self.policy.choose(BatchState(len(decoding), self.max_k, True))
            k = max((x for x in grid.ks if x <= k), default=0)  # the grid's nearest measured k at or below
            duration += grid.step_ms(len(decoding))[grid.ks.index(k)] / 1000
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
        marginal = self.profile.acceptance or []
        rate = self.profile.acceptance_rate if self.profile.acceptance_rate is not None else 0.0
        n, previous = 0, 1.0
        for i in range(k):
            p = marginal[i] if i < len(marginal) else previous * rate
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

        def pct(values, q):
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

        e2e = [j.done - j.arrival for j in done]
        ttft = [j.first_token - j.arrival for j in done]
        tpot = [(j.done - j.first_token) / (j.output_tokens - 1) for j in done if j.output_tokens > 1]
        span = max((j.done for j in done), default=0) - min((j.arrival for j in self.jobs), default=0)
        return {"policy": self.policy, "requests": len(self.jobs), "finished": len(done),
                "mean_latency_s": sum(e2e) / len(e2e) if e2e else float("nan"),
                **{f"{name}_p{int(q * 100)}_s": pct(vals, q) for name, vals in (("e2e", e2e), ("ttft", ttft), ("tpot", tpot))
                   for q in (0.5, 0.9, 0.99)},
                "goodput_tokens_per_s": sum(j.output_tokens for j in done) / span if span > 0 else float("nan")}


def simulate(fleet: dict[str, int], profiles: dict[str, Profile], policy: str, *, users_at=None, duration_s: float = 60.0,
             trace: list[tuple[float, int, int]] | None = None, prompt_tokens: int = 64, output_tokens: int = 64,
             max_batch: int = 8, kv_budget: int = 65536, max_k: int = 8, seed: int = 0) -> SimResult:
    """Simulate `fleet` ({hardware type: replicas}) under closed-loop users (`users_at(t)`, re-read
    every second of simulated time, for `duration_s`) or an open-loop `trace`. Every request has
    `prompt_tokens` / `output_tokens` unless the trace says otherwise."""
    if (users_at is None) == (trace is None):
        raise ValueError("give exactly one of users_at (closed loop) or trace (open loop)")
    missing = [t for t in fleet if t not in profiles or profiles[t].latency is None]
    if missing:
        raise ValueError(f"no profile with a latency grid for hardware types {missing}")
    rng = random.Random(seed)
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
                    arrive(now, prompt_tokens, output_tokens, u)
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
            group = min(by_group.values(), key=lambda rs: sum(r.in_flight for r in rs))
            r = min(group, key=lambda r: r.in_flight)
            item.replica = r
            r.waiting.append(item)
            if not r.busy:
                r.busy = True
                heapq.heappush(events, (now, next(order), "step", r))
        elif kind == "step":
            took, finished = item.step(now)
            for j in finished:
                if j.user is not None and j.user in active_users:
                    arrive(j.done, j.prompt_tokens, j.output_tokens, j.user)
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


def run_simulations(fleet: dict[str, int], profiles: dict[str, Profile], policies: list[str], out_dir: str,
                    **kwargs) -> tuple[dict, str]:
    """Every policy on the same fleet and arrivals (same seed); writes out_dir/{results.json, summary.md,
    k_batch.png}. Returns (results, markdown)."""
    import json
    import os
    import time

    from tqdm import tqdm

    os.makedirs(out_dir, exist_ok=True)
    results, runs = {}, {}
    for policy in tqdm(policies, desc="simulate", unit="policy"):
        t = time.perf_counter()
        res = simulate(fleet, profiles, policy, **kwargs)
        wall = time.perf_counter() - t
        s = res.summary()
        s["wall_s"] = round(wall, 2)
        s["steps"] = sum(len(r.steps) for r in res.replicas)
        s["by_hardware"] = {}
        for gpu in fleet:
            done = [j for j in res.jobs if j.replica is not None and j.replica.group == gpu and j.done is not None]
            s["by_hardware"][gpu] = {"requests": len(done),
                                     "mean_latency_s": sum(j.done - j.arrival for j in done) / len(done) if done else None}
        results[policy], runs[policy] = s, res
    _plot(runs, os.path.join(out_dir, "k_batch.png"))
    fleet_text = ", ".join(f"{n} x {g}" for g, n in fleet.items())
    lines = [f"# specserve simulate: {fleet_text}", "",
             "| policy | requests | mean latency (s) | e2e p50 / p90 / p99 (s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             "| goodput (tokens/s) | simulated steps | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for p, s in results.items():
        lines.append(f"| {p} | {s['finished']} | {s['mean_latency_s']:.3f} | {s['e2e_p50_s']:.2f} / {s['e2e_p90_s']:.2f} / "
                     f"{s['e2e_p99_s']:.2f} | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} | "
                     f"{s['tpot_p50_s'] * 1000:.1f} / {s['tpot_p99_s'] * 1000:.1f} | {s['goodput_tokens_per_s']:.1f} | "
                     f"{s['steps']} | {s['wall_s']} |")
    lines += ["", "Mean latency (s) per hardware type:", "", "| policy | " + " | ".join(fleet) + " |",
              "|---|" + "---|" * len(fleet)]
    for p, s in results.items():
        cells = [s["by_hardware"][g]["mean_latency_s"] for g in fleet]
        lines.append(f"| {p} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += ["", "![k and batch size over time](k_batch.png)"]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"fleet": fleet, "policies": results}, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown)
    return results, markdown


def _plot(runs: dict[str, SimResult], path: str) -> None:
    """Mean k and mean batch size over all replicas, per 1 s of simulated time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_k) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for policy, res in runs.items():
        bins: dict[int, list[tuple[int, int]]] = {}
        for r in res.replicas:
            for t, b, k in r.steps:
                if b:
                    bins.setdefault(int(t), []).append((b, k))
        xs = sorted(bins)
        ax_b.plot(xs, [sum(b for b, _ in bins[x]) / len(bins[x]) for x in xs], label=policy)
        ax_k.plot(xs, [sum(k for _, k in bins[x]) / len(bins[x]) for x in xs], label=policy)
    ax_b.set(ylabel="mean batch size", title="simulated: batch size and k chosen, per second")
    ax_k.set(ylabel="mean k", xlabel="simulated seconds")
    for ax in (ax_b, ax_k):
        ax.grid(alpha=0.3)
    ax_k.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
