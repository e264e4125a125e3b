"""`specserve bench replay`: the policies on a virtual clock, apart from the machine's noise.

Wall-clock comparisons of policies on a 2-core machine swing ~19% a round: a 3% effect needs ~150 rounds.
Replay runs the real engine, models and policies (greedy requests, seeded arrivals), but its clock advances
by what the cost model says each step took (`calibration.step_cost_ms`: the profile's grid at the step's batch,
draft forwards, drafted tokens per row and context, plus its prefill), not by wall time. Requests arrive when
the virtual clock reaches their time. The run is deterministic: the same command gives the same figures on
one machine, so a policy's quality is measured exactly, given the cost model (validated by `bench costmodel`,
in `results/`, against measured steps). Not across CPU models: their bfloat16 kernels round differently, a
greedy near-tie can flip, and the text (so the acceptance) moves: the same tree replayed fixed:2 on (b) in
1.02 s on one 2-core machine and 0.99 s on another (accepted per drafted 0.38 against 0.41). Compare runs
made on one machine.

Parts:
- (b) time-varying chat, (d) bursts of mixed chat / JSON / rewrites, (e) long documents between short chat
  (`bench policies`' schedules): mean latency per policy, and per 1k output tokens the target
  forwards, verified tokens, draft forward-rows, KV tokens attended, and accepted per drafted token;
- grid: closed loop at batch b x context c (b streams, each sending a document of about c tokens for a short
  answer, then the next document as it ends): output tokens per virtual second per policy, and each cell's
  best fixed k (the oracle) for reference.

`--seeds N` draws each part's schedule from N seeds and reports each policy's paired ratio over them
(`across_seeds`): one schedule's outcome turns on which requests happen to meet.

Policies run as a Router serves them (`calibration.calibrated`: lut, adaptive and budget calibrate online, lut
and adaptive run a neighbouring k every 8th step, lut reprices at the live acceptance), each step's measured parts
set to the clock's before the policy sees them (`OnClock`): calibration learns the clock, and the run stays
deterministic. The clock is the profile's grid, or another (`replay(clock=...)`): a machine that runs its profile
off, which the policies learn as a replica does (`simulate --validate` replays on this machine's calibrated grid).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from serve_app.bench.policies import LONG_PHASES, document, long_jobs, mixed_jobs, varying_jobs
from serve_app.bench.rounds import fmt_paired, paired_ratio
from serve_app.config import EngineConfig
from serve_app.engine.policy import make_policy
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats
from serve_app.pricing import LatencyGrid
from serve_app.profiling.calibration import calibrated, step_cost_ms, step_parts_ms

MAX_K = 8
CELL_STREAMS = 8
"""A grid cell serves at least `rounds` x this many requests, its streams' number below it: a cell of one stream
and 8 requests (256 tokens) is a handful of copies that happen to land or not; budget's share at batch 1 x
1,024 tokens read 0.951 over 8 requests and 1.013 over 32, with the same code."""

@dataclass
class Replay:
    """One policy's run on the virtual clock."""

    policy: str
    latencies: list[float] = field(default_factory=list)
    """Per request: virtual seconds from its arrival to its last token."""
    kinds: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Virtual seconds from the first arrival to the last token."""
    tokens: int = 0
    arrivals: list[float] = field(default_factory=list)
    """Each finished request's arrival (seconds, the jobs' clock), beside `latencies`."""
    steps: list[tuple[float, int, int]] = field(default_factory=list)
    """(virtual seconds since the first arrival, rows decoded, drafts accepted) of every decode step."""
    counts: dict = field(default_factory=lambda: {"target_forwards": 0, "verified_tokens": 0, "draft_forward_rows": 0,
                                                  "kv_tokens_attended": 0, "proposed": 0, "accepted": 0, "row_steps": 0})

    @property
    def mean_latency(self) -> float:
        return statistics.fmean(self.latencies) if self.latencies else 0.0

    def per_1k(self) -> dict:
        """Work per 1,000 output tokens, and accepted per drafted token."""
        c, n = self.counts, max(self.tokens, 1) / 1000
        return {"target_forwards": c["target_forwards"] / n, "verified_tokens": c["verified_tokens"] / n,
                "draft_forward_rows": c["draft_forward_rows"] / n, "kv_tokens_attended": c["kv_tokens_attended"] / n,
                "accepted_per_drafted": c["accepted"] / c["proposed"] if c["proposed"] else 0.0}


class OnClock:
    """A policy as served (`calibrated`), whose steps it learns from read the replay's clock: it observes a copy of
    each step with the draft, verification and rest set to the cost model's parts (`step_parts_ms`). A copy: the
    step itself keeps its measured parts, which say whether a draft ran (a k = 0 step that fed the draft), and the
    clock prices its prompt chunk by that."""

    def __init__(self, policy, grid):
        self.inner, self.grid, self.name = policy, grid, policy.name

    def choose(self, state):
        return self.inner.choose(state)

    def observe(self, st: StepStats) -> None:
        draft, verify, other = (ms / 1000 for ms in step_parts_ms(self.grid, st))
        self.inner.observe(dataclasses.replace(st, draft_s=draft, verify_s=verify, other_s=other))


def _engine(models, profile, policy: str, max_batch: int, clock: LatencyGrid | None = None) -> Engine:
    if policy == "none":
        models = dataclasses.replace(models, draft=None)
    served = OnClock(calibrated(make_policy(policy, profile), profile), clock or profile.latency)
    return Engine.from_models(models, EngineConfig(max_batch_size=max_batch, max_k=MAX_K), served)


def _account(rep: Replay, st: StepStats) -> None:
    c = rep.counts
    c["target_forwards"] += 1
    c["row_steps"] += st.batch_size
    c["verified_tokens"] += st.batch_size + st.proposed
    c["draft_forward_rows"] += (st.draft_forwards or 0) * st.batch_size
    c["kv_tokens_attended"] += sum(st.contexts) * (1 + (st.proposed / st.batch_size if st.batch_size else 0))
    c["proposed"] += st.proposed
    c["accepted"] += st.accepted


def replay(models, profile, policy: str, jobs: list, max_batch: int = 32, clock: LatencyGrid | None = None) -> Replay:
    """The jobs (bench.policies.Job: prompt, max_tokens, arrival, kind) through the engine on the virtual clock.
    `clock`: the grid the steps take their time from (default: the profile's own): a machine that runs its profile
    off, where the policies start from the profile and calibrate towards the clock, as a replica does."""
    grid = clock or profile.latency
    engine = _engine(models, profile, policy, max_batch, grid)
    rep, seen = Replay(policy), []
    engine.on_step.append(seen.append)
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].at)
    arrival: dict[str, tuple[float, str]] = {}
    clock, i = jobs[order[0]].at if order else 0.0, 0
    start = clock
    while i < len(order) or engine.has_work():
        while i < len(order) and jobs[order[i]].at <= clock + 1e-12:
            j = jobs[order[i]]
            arrival[engine.submit(j.prompt, j.params()).id] = (j.at, j.kind)
            i += 1
        if not engine.has_work():
            clock = jobs[order[i]].at
            continue
        seen.clear()
        outs = engine.step()
        for st in seen:
            clock += step_cost_ms(grid, st) / 1000
            if st.batch_size:
                _account(rep, st)
                rep.steps.append((clock - start, st.batch_size, st.accepted))
        for req, out in outs:
            if out.finished:
                at, kind = arrival.pop(req.id)
                rep.latencies.append(clock - at)
                rep.arrivals.append(at)
                rep.kinds.append(kind)
                rep.tokens += req.stats.generated_tokens
    rep.seconds = clock - start
    return rep


def closed_cell(models, profile, policy: str, batch: int, prompts: list[list[int]], max_tokens: int,
                requests: int) -> float:
    """Output tokens per virtual second with `batch` streams, each sending a prompt (a document of the cell's
    context; `prompts` in turn) for `max_tokens` tokens, then the next, until `requests` have been served.
    Distinct documents: one sent again would be answered from the suffix history, a repeat no policy's k
    choice is about."""
    engine = _engine(models, profile, policy, batch)
    from serve_app.config import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seen: list[StepStats] = []
    engine.on_step.append(seen.append)
    sent, clock, tokens = 0, 0.0, 0
    live = 0
    while sent < requests or engine.has_work():
        while live < batch and sent < requests:
            engine.submit(prompts[sent % len(prompts)], params)
            sent, live = sent + 1, live + 1
        seen.clear()
        for req, out in engine.step():
            if out.finished:
                live -= 1
                tokens += req.stats.generated_tokens
        clock += sum(step_cost_ms(profile.latency, st) for st in seen) / 1000
    return tokens / clock if clock else 0.0


def replay_parts(models, profile, policies: list[str], parts: dict[str, list], max_batch: int = 32,
                 bar: tqdm | None = None) -> dict:
    """Each part's jobs under each policy: mean latency (overall and by kind), tokens per virtual second, work
    per 1k output tokens; each policy's ratio to the best fixed k (its mean latency)."""
    out = {}
    for name, jobs in parts.items():
        runs = {}
        for p in policies:
            runs[p] = replay(models, profile, p, jobs, max_batch)
            if bar is not None:
                bar.update(1)
        fixed = {p: r.mean_latency for p, r in runs.items() if p.startswith("fixed:")}
        best = min(fixed, key=fixed.get) if fixed else None
        rows = {}
        for p, r in runs.items():
            by_kind = {}
            for lat, kind in zip(r.latencies, r.kinds):
                by_kind.setdefault(kind, []).append(lat)
            rows[p] = {"mean_latency_s": r.mean_latency, "tokens_per_s": r.tokens / r.seconds if r.seconds else 0.0,
                       "by_kind": {k: statistics.fmean(v) for k, v in by_kind.items()}, "per_1k": r.per_1k(),
                       "vs_best_fixed": r.mean_latency / fixed[best] if best else None}
        out[name] = {"requests": len(jobs), "best_fixed": best, "policies": rows}
    return out


def across_seeds(runs: list[dict]) -> dict:
    """`replay_parts`' results for several seeds of the same schedules (each seed its own arrivals and prompts):
    per part, each policy's mean latency per seed and its paired ratio (geometric mean over seeds, 95% interval)
    to every fixed k and to the best single fixed k (the lowest geometric mean over the seeds). One seed's
    schedule is a few dozen requests whose overlaps (a long document beside short chat) move every policy by
    5-15%: seeds, paired, tell a policy's effect from which requests happened to meet."""
    out = {}
    for name in runs[0]:
        pols = list(runs[0][name]["policies"])
        lat = {p: [r[name]["policies"][p]["mean_latency_s"] for r in runs] for p in pols}
        fixed = [p for p in pols if p.startswith("fixed:")]
        best = min(fixed, key=lambda p: sum(math.log(x) for x in lat[p])) if fixed else None
        out[name] = {"seeds": len(runs), "requests": [r[name]["requests"] for r in runs], "best_fixed": best,
                     "policies": {p: {"mean_latency_s": lat[p],
                                      "vs_best_fixed": paired_ratio(lat[p], lat[best]) if best else None,
                                      "vs_fixed": {f: paired_ratio(lat[p], lat[f]) for f in fixed}} for p in pols}}
    return out


def replay_grid(models, profile, policies: list[str], batches: list[int], documents: dict[int, list[list[int]]],
                max_tokens: int = 32, rounds: int = 2, bar: tqdm | None = None, deadline: float | None = None) -> dict:
    """The closed-loop grid: tokens per virtual second per (batch, context) cell and policy, and each adaptive
    policy's share of the cell's oracle (its best fixed k). `documents`: per context, the prompts sent in turn.
    `deadline` (a `time.monotonic()` instant): cells not started by then are left out, named in `skipped` (a lent
    GPU's call ends at its timeout and keeps nothing it has not written: an 8B grid there ran past 4 minutes)."""
    cells, skipped = [], []
    for c, prompts in documents.items():
        for b in batches:
            if deadline is not None and time.monotonic() >= deadline:
                skipped.append({"batch": b, "context": c})
                if bar is not None:
                    bar.update(len(policies))
                continue
            rates = {}
            for p in policies:
                rates[p] = closed_cell(models, profile, p, b, prompts, max_tokens, rounds * max(b, CELL_STREAMS))
                if bar is not None:
                    bar.update(1)
            fixed = {p: v for p, v in rates.items() if p.startswith("fixed:")}
            oracle = max(fixed, key=fixed.get) if fixed else None
            cells.append({"batch": b, "context": c, "tokens_per_s": rates, "oracle": oracle,
                          "share_of_oracle": {p: v / fixed[oracle] for p, v in rates.items()} if oracle else {}})
    return {"cells": cells, "skipped": skipped} if skipped else {"cells": cells}


PARTS = ("b", "d", "e")
"""The parts a replay knows: (b) time-varying chat, (d) mixed bursts, (e) long documents."""


def schedule(tokenizer, name: str, seed: int, scale: float) -> tuple[list, list[tuple[float, float, float]]]:
    """One seed's jobs of one part and its phases (start s, end s, requests/s): (b) time-varying chat, (d) mixed
    bursts, (e) long documents."""
    import random

    if name == "b":
        return varying_jobs(tokenizer, random.Random(seed), scale)
    if name == "d":
        return mixed_jobs(tokenizer, random.Random(seed + 1), scale)
    if name == "e":
        phases, t = [], 0.0
        for rate, length in LONG_PHASES:
            phases.append((t, t + length * scale, rate))
            t += length * scale
        return long_jobs(tokenizer, random.Random(seed), scale), phases
    raise ValueError(f"unknown part {name!r} ({', '.join(PARTS)})")


def schedules(tokenizer, parts: list[str], seed: int, scale: float) -> dict[str, list]:
    """One seed's jobs for each named part (`schedule`)."""
    return {name: schedule(tokenizer, name, seed, scale)[0] for name in parts}


def run_replay(models, profile, policies: list[str], parts: list[str], scale: float, seed: int = 0, seeds: int = 1,
               batches: list[int] = (), contexts: list[int] = (), grid_rounds: int = 4,
               deadline_s: float | None = None) -> dict:
    """`bench replay`: the parts' schedules from `seeds` seeds (from `seed` on) under every policy, paired over the
    seeds, then the closed-loop grid (batches x contexts, each request of a cell its own document); the grid starts
    no cell `deadline_s` seconds after the call began (`replay_grid`)."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    tok = models.tokenizer
    seeded = [schedules(tok, parts, seed + i, scale) for i in range(seeds)]
    contexts = list(contexts) if batches else []
    requests = grid_rounds * max(list(batches) + [CELL_STREAMS])  # each request of the largest cell its own document
    docs = {c: [document(tok, c, 1000 * c + 7919 * i) for i in range(requests)] for c in contexts}
    res = {"gpu_type": profile.gpu_type, "target": profile.target, "draft": profile.draft, "policies": policies,
           "scale": scale, "seed": seed, "seeds": seeds, "grid_rounds": grid_rounds}
    with tqdm(total=sum(map(len, seeded)) * len(policies) + len(batches) * len(contexts) * len(policies), desc="replay",
              unit="run") as bar:
        runs = [replay_parts(models, profile, policies, jobs, bar=bar) for jobs in seeded]
        res["parts"] = runs[0]
        if seeds > 1 and runs[0]:
            res["seeds"] = across_seeds(runs)
        if batches:
            res["grid"] = replay_grid(models, profile, policies, list(batches), docs, rounds=grid_rounds, bar=bar,
                                      deadline=deadline)
    return res


def markdown(res: dict, policies: list[str]) -> str:
    lines = [f"# Policies on a virtual clock: {res['gpu_type']} profile, target {res['target']}, draft {res['draft']}", "",
             "Deterministic: the engine, models and policies for real; each step's time from the profile's cost model "
             "(`calibration.step_cost_ms`). Mean latency in virtual seconds; work per 1k output tokens.", ""]
    for name, part in res.get("parts", {}).items():
        kinds = sorted({k for row in part["policies"].values() for k in row["by_kind"]})
        lines += [f"## ({name}) {part['requests']} requests; best fixed k: {part['best_fixed']}", "",
                  "| policy | mean latency | vs best fixed | " + " | ".join(kinds) + " | tok/s | target fwd | verified tok | "
                  "draft fwd-rows | KV attended | accepted/drafted |", "|---|---|---|" + "---|" * len(kinds) + "---|---|---|---|---|---|"]
        for p in policies:
            x = part["policies"][p]
            w = x["per_1k"]
            vs = f"{x['vs_best_fixed']:.3f}x" if x["vs_best_fixed"] else "-"
            lines.append(f"| {p} | {x['mean_latency_s']:.2f}s | {vs} | " + " | ".join(f"{x['by_kind'].get(k, 0):.2f}s" for k in kinds)
                         + f" | {x['tokens_per_s']:.0f} | {w['target_forwards']:.0f} | {w['verified_tokens']:.0f} | "
                         f"{w['draft_forward_rows']:.0f} | {w['kv_tokens_attended'] / 1000:.0f}k | {w['accepted_per_drafted']:.2f} |")
        lines.append("")
    if isinstance(res.get("seeds"), dict):  # more than one seed: their paired ratios (one seed: its count only)
        first = next(iter(res["seeds"].values()))
        fixed = list(next(iter(first["policies"].values()))["vs_fixed"])
        lines += [f"## Across {first['seeds']} seeds: paired ratio of mean latency (geometric mean over seeds, 95% interval)",
                  "", "The tables above are the first seed's. Below 1: faster than that fixed k on the same schedules.", "",
                  "| part | policy | vs best fixed | " + " | ".join(f"vs {f}" for f in fixed) + " |",
                  "|---|---|---|" + "---|" * len(fixed)]
        for name, part in res["seeds"].items():
            for p in policies:
                x = part["policies"][p]
                lines.append(f"| ({name}) {sum(part['requests'])} requests, best {part['best_fixed']} | {p} | "
                             f"{fmt_paired(x['vs_best_fixed'])} | " + " | ".join(fmt_paired(x["vs_fixed"][f]) for f in fixed) + " |")
        lines.append("")
    if res.get("grid"):
        adaptive = [p for p in policies if not p.startswith("fixed:") and p != "none"]
        lines += ["## Closed-loop grid: share of each cell's best fixed k (oracle) in tokens per virtual second", "",
                  "| batch | context | oracle | " + " | ".join(adaptive) + " |", "|---|---|---|" + "---|" * len(adaptive)]
        for cell in res["grid"]["cells"]:
            lines.append(f"| {cell['batch']} | {cell['context']} | {cell['oracle']} | "
                         + " | ".join(f"{cell['share_of_oracle'][p]:.3f}" for p in adaptive) + " |")
        if skipped := res["grid"].get("skipped"):
            lines += ["", "Not run (past the deadline): " + ", ".join(f"batch {c['batch']} x {c['context']} tokens"
                                                                    for c in skipped) + "."]
        lines.append("")
    return "\n".join(lines)


__all__ = ["PARTS", "Replay", "across_seeds", "closed_cell", "markdown", "replay", "replay_grid", "replay_parts", "schedule",
           "run_replay", "schedules"]
