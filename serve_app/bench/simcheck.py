"""`specserve simulate --validate`: the simulator against the real engine, on the same schedule.

The schedule is `bench policies` (b) (or, with `part`, (d) or (e), seeded as `bench replay` seeds them): seeded
Poisson arrivals swinging between low and high load, replayed in real time, every policy in turn (interleaved
rounds, as in the bench). The simulator then
replays the same arrivals (time, prompt tokens, tokens the real run generated - greedy, so the same
for every policy) on one replica of this hardware type, from the committed profile alone, averaged
over `sim_seeds` acceptance draws, with the real run's engine settings (`ENGINE`: batch, KV pool,
blocks, step token budget). Passing means: every policy's simulated mean latency within
`tolerance` of the measured one, and the same order of policies wherever the real run tells them
apart by more than `tie`. The one-k simulator drafts one length for every row of a step: it is judged on the
policies whose real steps (almost) never ran a per-row plan (`PER_ROW_MAX`), and reported on the others. Each real
round is judged at the clock's speed (its latency times its pace, `run_pace`): this machine's speed drifts over
minutes; the raw medians are reported beside.

Two more checks ride on the same real rounds:
- **The row-aware replay** (`bench.replay`): the real engine, models and policies on a virtual clock priced by
  the calibrated grid, per row (per-row k and context, the budget's plan walk, copies from the prompt, the real
  drafts' acceptance). It covers every policy, `budget` included, which the one-k simulator cannot model. Its
  policies are served as the real rounds' are: they start from the profile and calibrate towards the clock
  (with the calibrated grid as their profile too, lut and adaptive replayed 12% and 16% faster than they ran).
- **The cost model per step**: every real step's time against what the replica's online cost model predicted
  for it before it ran (`Calibration.predict_ms`: the calibrated grid's price at the recent pace, calibrating on
  the steps before it only, as a Router does), grouped by (batch, k, context bucket), beside the shape spread:
  how far steps of one exact shape stray from their median over the run.

Both simulators run on the grid calibrated over the whole run (the calibration runs and every round): this
machine's prices while it ran, so their errors are their own, not the prices'.

A profile is measured on one machine of its type; this one may be faster or slower. With `calibrate`
(the default) the schedule first runs once at fixed:1 and once at fixed:4 on this machine, and their
steps calibrate the profile's grid (`profiling.calibration`, as a Router does online); the simulated
replica then really runs at the calibrated latencies while its lut / adaptive start from the profile
and calibrate as they go, like the real ones. The summary says which was done.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

from tqdm import tqdm

from serve_app.config import EngineConfig
from serve_app.engine.policy import PER_ROW_POLICIES
from serve_app.models import LoadedModels
from serve_app.profiling.calibration import Calibration, step_cost_ms
from serve_app.profiling.profiles import Profile
from serve_app.sim.simulate import prompt_blocks, simulate
from serve_app.bench.policies import Job, _run
from serve_app.bench.replay import replay, schedule
from serve_app.bench.rounds import provenance

ENGINE = EngineConfig(max_batch_size=32, max_k=8)
"""The engine `bench policies` runs (`serve_app/bench/policies.py`, `_run` at max_batch 32): the simulation's settings."""


def discordant_pairs(real: dict[str, float], sim: dict[str, float], tie: float) -> list[tuple[str, str]]:
    """Pairs (a, b) the real run orders a < b by more than `tie` (relative) but the simulation
    orders b <= a. Pairs within `tie` in the real run are a measured tie: either order is right."""
    out = []
    for a in real:
        for b in real:
            if real[a] * (1 + tie) < real[b] and sim[a] >= sim[b]:
                out.append((a, b))
    return out


def validate(models: LoadedModels, profile: Profile, policies: list[str], out_dir: str, scale: float = 0.7,
             seed: int = 0, repeat: int = 1, tolerance: float = 0.15, tie: float = 0.05,
             sim_seeds: int = 20, calibrate: bool = True, cost_tolerance: float = 0.10,
             part: str = "b") -> tuple[dict, str, bool]:
    """Run one part's schedule (`bench.replay.schedule`) for real and simulated; write results.json and
    summary.md. Returns (results, markdown, passed)."""
    jobs, phases = schedule(models.tokenizer, part, seed, scale)
    warm = [Job(j.prompt, 8) for j in jobs[:2]]
    for p in policies:  # first-call allocations and code paths, as in the bench
        _run(models, profile, p, warm, 2, False, tqdm(disable=True))
    calibration, seen = None, []
    if calibrate:  # this machine's own latencies first: the profile may come from another machine of the type
        calibration = Calibration(profile.latency, warmup=0)  # the engine is warm already (above)
        with tqdm(total=2 * len(jobs), desc="validate: calibrating on this machine", unit="req") as bar:
            for p in calibration_policies(policies):
                _run(models, profile, p, jobs, ENGINE.max_batch_size, True, bar, seen)
        for st in seen:
            calibration.observe(st)
        accepted = measured_acceptance(seen)
    cal_summary = None if calibration is None else {
        "how": f"the schedule at {' and '.join(calibration_policies(policies))} on this machine, before the real rounds",
        "steps": calibration.steps, "used": calibration.used, "factors": calibration.factors(),
        "drift": calibration.drift(), "acceptance": accepted, "profile_acceptance": profile.acceptance}
    real: dict[str, list[float]] = {p: [] for p in policies}
    timeline: list = []  # every real round's steps, in the order they ran
    by_round: dict[str, list[list]] = {p: [] for p in policies}  # each policy's steps, per round
    outputs: list[int] | None = None
    with tqdm(total=repeat * len(policies) * len(jobs), desc="validate: real runs", unit="req") as bar:
        for r in range(repeat):
            for p in policies[r % len(policies):] + policies[:r % len(policies)]:  # rotated: no policy holds one slot
                steps: list = []
                res = _run(models, profile, p, jobs, ENGINE.max_batch_size, True, bar, steps)
                timeline += steps
                by_round[p].append(steps)
                real[p].append(res.mean_latency)
                outputs = outputs or res.outputs
    per_row = {p: per_row_share([st for run in by_round[p] for st in run]) for p in policies}
    fixed_steps = {p: [st for run in by_round[p] for st in run] for p in policies if p.startswith("fixed:")}
    if calibration is not None:  # the workload's acceptance, pooled over every fixed-k step (one length per row)
        accepted = measured_acceptance(seen + [st for steps in fixed_steps.values() for st in steps]) or accepted
        cal_summary["acceptance"] = accepted
        cal_summary["acceptance_by_policy"] = {p: measured_acceptance(steps) for p, steps in fixed_steps.items()}
    online = calibration or Calibration(profile.latency)
    predicted = []
    for st in timeline:  # each step predicted from the steps before it, then learnt from
        predicted.append((st, online.predict_ms(st)))
        online.observe(st)
    # every step kept (no window); no pace (its grid alone is read), so no grid made again every few steps
    whole = Calibration(profile.latency, warmup=0, window=1 << 30, regrid_every=1 << 30)
    for st in seen + timeline:
        whole.observe(st)
    grid = whole.grid() if calibration else profile.latency
    trace = [(j.at, len(j.prompt), n, prompt_blocks(j.prompt)) for j, n in zip(jobs, outputs)]  # cache hits as served
    sim: dict[str, float | None] = {}
    one_k = [p for p in policies if p not in PER_ROW_POLICIES]  # the one-k simulator models no per-row lengths:
    # it is judged on the policies whose real steps drafted one length per row (lut and adaptive, served, copy past k)
    judged = [p for p in one_k if per_row[p] <= PER_ROW_MAX]
    for p in tqdm(one_k, desc="validate: simulated", unit="policy"):
        runs = [simulate({profile.gpu_type: 1}, {profile.gpu_type: profile}, p, trace=trace,
                         max_batch=ENGINE.max_batch_size, kv_budget=ENGINE.max_num_tokens, max_k=ENGINE.max_k,
                         block_size=ENGINE.block_size, max_num_batched_tokens=ENGINE.max_num_batched_tokens, seed=s,
                         true_grids={profile.gpu_type: grid} if calibration else None,
                         calibrate=calibration is not None,
                         true_acceptance={profile.gpu_type: accepted} if calibration and accepted else None)
                for s in range(sim_seeds)]
        sim[p] = statistics.fmean(r.summary()["mean_latency_s"] for r in runs)
    # the replica's clock is this machine as calibrated over the run; its policies start from the profile and
    # calibrate as they go, as the real rounds' do (each round a fresh policy)
    replayed = {p: replay(models, profile, p, jobs, ENGINE.max_batch_size, clock=grid).mean_latency
                for p in tqdm(policies, desc="validate: replayed", unit="policy")}
    raw_mean = {p: statistics.median(v) for p, v in real.items()}
    # Both simulators run at the whole run's calibrated prices; this machine ran some rounds 20-50% off them (its
    # speed drifts over minutes). Each round is taken at the clock's speed: its latency times its pace (its steps'
    # price on the clock over their measured time), to first order what it had taken on the clock. The median over
    # rounds is what both are judged against; the raw medians are reported beside.
    pace = {p: [run_pace(grid, steps) for steps in by_round[p]] for p in policies}
    real_mean = {p: statistics.median(lat * f for lat, f in zip(real[p], pace[p])) for p in policies}
    errors = {p: sim[p] / real_mean[p] - 1 for p in one_k}
    replay_errors = {p: replayed[p] / real_mean[p] - 1 for p in policies}
    raw_errors = {p: sim[p] / raw_mean[p] - 1 for p in one_k}
    replay_raw_errors = {p: replayed[p] / raw_mean[p] - 1 for p in policies}
    bad_pairs = discordant_pairs({p: real_mean[p] for p in judged}, sim, tie)
    replay_pairs = discordant_pairs(real_mean, replayed, tie)
    cost = cost_model_check(predicted)
    cost_ok = all(b["median_abs_error"] <= cost_tolerance for b in cost if b["steps"] >= COST_MIN_STEPS)
    passed = (all(abs(e) <= tolerance for e in [errors[p] for p in judged] + list(replay_errors.values()))
              and not bad_pairs and not replay_pairs and cost_ok)
    results = {"gpu_type": profile.gpu_type, "target": profile.target, "draft": profile.draft, "requests": len(jobs),
               "part": part, "phases": phases, "scale": scale, "repeat": repeat, "tolerance": tolerance, "tie": tie,
               "sim_seeds": sim_seeds, "real_mean_latency_s": real_mean, "real_rounds": real, "raw_mean_latency_s": raw_mean,
               "round_pace": pace, "raw_error": raw_errors, "replay_raw_error": replay_raw_errors,
               "calibration": cal_summary, "whole_run_factors": whole.factors(),
               "sim_mean_latency_s": sim, "error": errors, "sim_judged": judged, "per_row_share": per_row,
               "discordant_pairs": bad_pairs,
               "replay_mean_latency_s": replayed, "replay_error": replay_errors, "replay_discordant_pairs": replay_pairs,
               "cost_model": cost, "cost_tolerance": cost_tolerance, "cost_passed": cost_ok, "passed": passed,
               "provenance": provenance()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = _markdown(results, policies)
    (out / "summary.md").write_text(markdown)
    return results, markdown, passed


PER_ROW_MAX = 0.01
"""The one-k simulator drafts one length for every row of a step: a policy more than this share of whose real
decoding steps ran a per-row plan (rows of different lengths: budget's walk, lut's and adaptive's copies past their
k) is simulated and reported, not judged (the row-aware replay, which runs the real engine, is judged on it)."""


def per_row_share(steps) -> float:
    """The share of these decoding steps that ran a per-row plan (`StepStats.rows`)."""
    decoding = [st for st in steps if st.batch_size]
    return sum(st.rows is not None for st in decoding) / len(decoding) if decoding else 0.0


def run_pace(grid, steps) -> float:
    """How fast a run's steps went against the clock: their price on `grid` (`step_cost_ms`) over their measured
    time, summed (1: as priced; 0.8: this machine ran them 25% slower than the clock)."""
    measured = sum(_ms(st) for st in steps)
    return sum(step_cost_ms(grid, st) for st in steps) / measured if measured > 0 else 1.0


COST_MIN_STEPS = 8
"""A (batch, k, context) bucket with fewer real steps is reported, not judged."""


def step_bucket(st) -> tuple[int, int, int]:
    """(batch, k, context) a step is judged in: its batch size and mean row context rounded to a power of two
    (1, 2, 4, ...; 64, 128, ...), and k as it ran (the longest row's drafted length)."""
    ctx = statistics.fmean(st.contexts) if st.contexts else 1
    return 2 ** round(math.log2(max(st.batch_size, 1))), st.k, 2 ** round(math.log2(max(ctx, 1)))


def _ms(st) -> float:
    return 1000 * (st.draft_s + st.verify_s + st.other_s)


def shape_spread(steps) -> dict[tuple, float]:
    """Per bucket: the median |step / median of its exact shape - 1| over decoding steps of one exact shape (batch,
    k, tokens drafted, draft forwards, no prefill, mean context within 16 tokens) seen 5+ times: how far a step
    strays from its own kind over the run: the machine's drift and each step's own noise."""
    shapes: dict[tuple, list] = {}
    for st in steps:
        if st.batch_size and not st.prefill_tokens and _ms(st) > 0:
            shape = (st.batch_size, st.k, st.proposed, st.draft_forwards, int(statistics.fmean(st.contexts or [0]) // 16))
            shapes.setdefault(shape, []).append(st)
    devs: dict[tuple, list[float]] = {}
    for same in shapes.values():
        if len(same) >= 5:
            m = statistics.median(_ms(st) for st in same)
            for st in same:
                devs.setdefault(step_bucket(st), []).append(abs(_ms(st) / m - 1))
    return {key: statistics.median(v) for key, v in devs.items()}


def cost_model_check(predicted, seed: int = 0, resamples: int = 400) -> list[dict]:
    """`predicted`: (decoding step, its predicted ms). Per (batch, k, context) bucket: how many steps, the median
    |predicted / measured - 1|, a 95% bootstrap interval of that median, the median signed error (a bias), and the
    bucket's shape spread (None where no exact shape repeated)."""
    by: dict[tuple, list[float]] = {}
    for st, ms in predicted:
        if st.batch_size and _ms(st) > 0:
            by.setdefault(step_bucket(st), []).append(ms / _ms(st) - 1)
    spread = shape_spread(st for st, _ in predicted)
    rng, out = random.Random(seed), []
    for key in sorted(by):
        errs = by[key]
        absolute = [abs(e) for e in errs]
        boot = sorted(statistics.median(rng.choices(absolute, k=len(absolute))) for _ in range(resamples))
        out.append({"batch": key[0], "k": key[1], "context": key[2], "steps": len(errs),
                    "median_abs_error": statistics.median(absolute), "median_error": statistics.median(errs),
                    "interval": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
                    "shape_spread": spread.get(key)})
    return out


def calibration_policies(policies: list[str]) -> tuple[str, str]:
    """The two fixed k the schedule runs at before the real rounds: 1, and the deepest fixed k validated (4 at
    least). The second gives the acceptance per position the simulated replica draws from, so it reaches as deep
    as any policy drafts: past its last measured position the acceptance is extended geometrically, which
    undersells a draft that keeps agreeing once it got going (the one-k simulator ran fixed:8 16% slow when the
    acceptance came from fixed:4)."""
    deepest = max((int(p.split(":")[1]) for p in policies if p.startswith("fixed:") and p.split(":")[1].isdigit()),
                  default=4)
    return "fixed:1", f"fixed:{max(deepest, 4)}"


def measured_acceptance(steps) -> list[float] | None:
    """Acceptance per draft position these steps saw: position i's share accepted among the rows that drafted it
    (steps at a k past i; one length per row, as fixed k drafts), pooled over every step given. The workload's own,
    which the simulated replica then draws from (the profile's came from its profiling prompts). One run's
    estimate moved 15-30% at positions 2-4 between a fixed:4 and a fixed:8 run of the same schedule, so the
    validation pools every fixed-k step it ran."""
    k = max((st.k for st in steps if st.batch_size), default=0)
    out = []
    for i in range(k):
        rows = [st for st in steps if st.batch_size and st.k > i]
        total = sum(st.batch_size for st in rows)
        hits = sum(st.accepted_per_position[i] for st in rows if i < len(st.accepted_per_position))
        out.append(round(hits / total, 4))
    return out or None


def _basis(r: dict) -> str:
    cal = r.get("calibration")
    if not cal:
        return "from the profile alone (not calibrated on this machine)."
    f, w = cal["factors"], r["whole_run_factors"]
    return (f"on this machine's latencies: the profile's grid calibrated by {cal['how']} ({cal['used']} steps; drift "
            f"{cal['drift']:.0%}; factors draft {_span(f['draft'])}, verify {_span(f['verify'])}, other "
            f"{_span(f['other'])}, prefill {_span(f['chunk'])}, at the KV it held {_span(f['chunk_context'])}), and for both simulators over the whole run, those "
            f"runs and every round (factors draft {_span(w['draft'])}, verify {_span(w['verify'])}, other "
            f"{_span(w['other'])}, prefill {_span(w['chunk'])}, at the KV it held {_span(w['chunk_context'])}); drafts accepted per position as every fixed-k "
            f"step saw them ({cal.get('acceptance')}; the profile's: {cal.get('profile_acceptance')}); lut and "
            "adaptive calibrate online, in the real runs and the simulated ones.")


def _span(by_size: dict) -> str:
    values = list(by_size.values())
    return f"{min(values):.2f}-{max(values):.2f}"


def _markdown(r: dict, policies: list[str]) -> str:
    real, sim, err = r["real_mean_latency_s"], r["sim_mean_latency_s"], r["error"]
    rep, rerr = r["replay_mean_latency_s"], r["replay_error"]
    simulated = [p for p in policies if sim.get(p) is not None]
    rank_real = {p: i + 1 for i, p in enumerate(sorted(policies, key=real.get))}
    rank_sim = {p: i + 1 for i, p in enumerate(sorted(simulated, key=sim.get))}
    rank_rep = {p: i + 1 for i, p in enumerate(sorted(policies, key=rep.get))}
    tol = r["tolerance"]

    def flag(e):
        return "" if abs(e) <= tol else " **over**"

    lines = [f"<!-- written by {r['provenance']['command'] or 'validate()'} on {r['provenance']['created']} -->",
             f"# Simulator vs real engine on {r['gpu_type']}: target {r['target']}, draft {r['draft']}", "",
             f"Schedule: `bench policies` ({r.get('part', 'b')}) at scale {r['scale']}, {r['requests']} requests, "
             "phases (start s, end s, "
             f"requests/s): {', '.join(f'({a:.0f}, {b:.0f}, {c})' for a, b, c in r['phases'])}. Real: median of "
             f"{r['repeat']} round(s), the policies' order rotated each round; simulated (one k per step): mean of "
             f"{r['sim_seeds']} acceptance draws; replayed (per row: the engine on a virtual clock, deterministic). "
             + _basis(r), "",
             "Real: each round's mean latency at the clock's speed (times its pace: its steps' price on the clock "
             "over their measured time; this machine's speed drifts over minutes), the median over rounds; raw: the "
             "median as measured, and each error against it in brackets.", "",
             "| policy | real mean latency (raw) | rounds' pace | simulated | error (raw) | replayed | error (raw) "
             "| rank real / simulated / replayed |",
             "|---|---|---|---|---|---|---|---|"]
    judged, per_row = r.get("sim_judged", simulated), r.get("per_row_share", {})
    raw, raw_err, raw_rerr = r.get("raw_mean_latency_s", real), r.get("raw_error", err), r.get("replay_raw_error", rerr)
    pace = r.get("round_pace", {})
    for p in policies:
        s = f"{sim[p]:.2f}s | {err[p]:+.1%}{flag(err[p])} ({raw_err[p]:+.1%})" if p in judged else \
            f"{sim[p]:.2f}s | {err[p]:+.1%} ({raw_err[p]:+.1%}; not judged: {per_row[p]:.0%} of its steps per row)" \
            if p in simulated else "not modelled | -"
        paces = ", ".join(f"{f:.2f}" for f in pace.get(p, [])) or "-"
        lines.append(f"| {p} | {real[p]:.2f}s ({raw[p]:.2f}s) | {paces} | {s} | {rep[p]:.2f}s | "
                     f"{rerr[p]:+.1%}{flag(rerr[p])} ({raw_rerr[p]:+.1%}) | "
                     f"{rank_real[p]} / {rank_sim.get(p, '-')} / {rank_rep[p]} |")
    worst = max(abs(e) for e in [err[p] for p in judged] + list(rerr.values()))
    lines += ["", "The one-k simulator (`simulate --fleet`'s) drafts one length for every row of a step: it is judged "
                  f"on the policies that ran a per-row plan in at most {PER_ROW_MAX:.0%} of their decoding steps; the "
                  "row-aware replay on every one.",
              "", f"Largest judged error {worst:.1%} (tolerance {tol:.0%}); pairs ordered differently where the real run "
                  f"separates them by more than {r['tie']:.0%}: simulated "
                  + (", ".join(f"{a} < {b}" for a, b in r["discordant_pairs"]) or "none") + "; replayed "
                  + (", ".join(f"{a} < {b}" for a, b in r["replay_discordant_pairs"]) or "none") + ".", "",
              "## The cost model per step", "",
              "Every real step of the rounds above against what the online cost model predicted for it before it "
              "ran (`Calibration.predict_ms`: the grid calibrated on the steps before it, at their recent pace, as a "
              "Router calibrates). Buckets: batch and mean row context rounded to a power of two, k as the step ran. "
              f"Judged where a bucket has {COST_MIN_STEPS}+ steps: median |error| <= {r['cost_tolerance']:.0%}. Shape "
              "spread: how far steps of one exact shape stray from their median over the run (the machine's drift, "
              "which the pace follows, and each step's own noise, which nothing predicts).", "",
              "| batch | k | context | steps | median abs error [95%] | median error | shape spread |",
              "|---|---|---|---|---|---|---|"]
    for b in r["cost_model"]:
        judged = b["steps"] >= COST_MIN_STEPS
        mark = (" **over**" if b["median_abs_error"] > r["cost_tolerance"] else "") if judged else " (few)"
        lo, hi = b["interval"]
        floor = "-" if b.get("shape_spread") is None else f"{b['shape_spread']:.1%}"
        lines.append(f"| {b['batch']} | {b['k']} | {b['context']} | {b['steps']} | {b['median_abs_error']:.1%} "
                     f"[{lo:.1%}, {hi:.1%}]{mark} | {b['median_error']:+.1%} | {floor} |")
    lines += ["", f"**{'PASSED' if r['passed'] else 'FAILED'}**", ""]
    return "\n".join(lines)
