"""`specserve simulate --validate`: the simulator against the real engine, on the same schedule.

The schedule is `bench policies` (b): seeded Poisson arrivals swinging between low and high load,
replayed in real time, every policy in turn (interleaved rounds, as in the bench). The simulator then
replays the same arrivals (time, prompt tokens, tokens the real run generated - greedy, so the same
for every policy) on one replica of this hardware type, from the committed profile alone, averaged
over `sim_seeds` acceptance draws, with the real run's engine settings (`ENGINE`: batch, KV pool,
blocks, step token budget). Passing means: every policy's simulated mean latency within
`tolerance` of the measured one, and the same order of policies wherever the real run tells them
apart by more than `tie`.

A profile is measured on one machine of its type; this one may be faster or slower. With `calibrate`
(the default) the schedule first runs once at fixed:1 and once at fixed:4 on this machine, and their
steps calibrate the profile's grid (`profiling.calibration`, as a Router does online); the simulated
replica then really runs at the calibrated latencies while its lut / adaptive start from the profile
and calibrate as they go, like the real ones. The summary says which was done.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from tqdm import tqdm

from serve_app.config import EngineConfig
from serve_app.models import LoadedModels
from serve_app.profiling.calibration import Calibration
from serve_app.profiling.profiles import Profile
from serve_app.sim.simulate import simulate
from serve_app.bench.policies import Job, _run, varying_jobs
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
             sim_seeds: int = 20, calibrate: bool = True) -> tuple[dict, str, bool]:
    """Run the schedule for real and simulated; write results.json and summary.md. Returns
    (results, markdown, passed)."""
    jobs, phases = varying_jobs(models.tokenizer, random.Random(seed), scale)
    warm = [Job(j.prompt, 8) for j in jobs[:2]]
    for p in policies:  # first-call allocations and code paths, as in the bench
        _run(models, profile, p, warm, 2, False, tqdm(disable=True))
    calibration = None
    if calibrate:  # this machine's own latencies first: the profile may come from another machine of the type
        calibration, seen = Calibration(profile.latency, warmup=0), []  # the engine is warm already (above)
        with tqdm(total=2 * len(jobs), desc="validate: calibrating on this machine", unit="req") as bar:
            for p in ("fixed:1", "fixed:4"):
                _run(models, profile, p, jobs, ENGINE.max_batch_size, True, bar, seen)
        for st in seen:
            calibration.observe(st)
        accepted = measured_acceptance(seen)
    real: dict[str, list[float]] = {p: [] for p in policies}
    outputs: list[int] | None = None
    with tqdm(total=repeat * len(policies) * len(jobs), desc="validate: real runs", unit="req") as bar:
        for _ in range(repeat):
            for p in policies:
                res = _run(models, profile, p, jobs, ENGINE.max_batch_size, True, bar)
                real[p].append(res.mean_latency)
                outputs = outputs or res.outputs
    trace = [(j.at, len(j.prompt), n) for j, n in zip(jobs, outputs)]
    sim = {}
    for p in tqdm(policies, desc="validate: simulated", unit="policy"):
        runs = [simulate({profile.gpu_type: 1}, {profile.gpu_type: profile}, p, trace=trace,
                         max_batch=ENGINE.max_batch_size, kv_budget=ENGINE.max_num_tokens, max_k=ENGINE.max_k,
                         block_size=ENGINE.block_size, max_num_batched_tokens=ENGINE.max_num_batched_tokens, seed=s,
                         true_grids={profile.gpu_type: calibration.grid()} if calibration else None,
                         calibrate=calibration is not None,
                         true_acceptance={profile.gpu_type: accepted} if calibration and accepted else None)
                for s in range(sim_seeds)]
        sim[p] = statistics.fmean(r.summary()["mean_latency_s"] for r in runs)
    real_mean = {p: statistics.median(v) for p, v in real.items()}
    errors = {p: sim[p] / real_mean[p] - 1 for p in policies}
    bad_pairs = discordant_pairs(real_mean, sim, tie)
    passed = all(abs(e) <= tolerance for e in errors.values()) and not bad_pairs
    results = {"gpu_type": profile.gpu_type, "target": profile.target, "draft": profile.draft, "requests": len(jobs),
               "phases": phases, "scale": scale, "repeat": repeat, "tolerance": tolerance, "tie": tie,
               "sim_seeds": sim_seeds, "real_mean_latency_s": real_mean, "real_rounds": real,
               "calibration": None if calibration is None else {
                   "how": "the schedule at fixed:1 and fixed:4 on this machine, before the real rounds",
                   "steps": calibration.steps, "used": calibration.used, "factors": calibration.factors(),
                   "drift": calibration.drift(), "acceptance": accepted, "profile_acceptance": profile.acceptance},
               "sim_mean_latency_s": sim, "error": errors, "discordant_pairs": bad_pairs, "passed": passed,
               "provenance": provenance()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = _markdown(results, policies)
    (out / "summary.md").write_text(markdown)
    return results, markdown, passed


def measured_acceptance(steps) -> list[float] | None:
    """Acceptance per draft position these steps saw (from the steps at their largest k): the workload's
    own, which the simulated replica then draws from (the profile's came from its profiling prompts)."""
    k = max((st.k for st in steps if st.batch_size), default=0)
    rows = [st for st in steps if st.batch_size and st.k == k]
    total = sum(st.batch_size for st in rows)
    if not k or not total:
        return None
    return [round(sum(st.accepted_per_position[i] for st in rows) / total, 4) for i in range(k)]


def _basis(r: dict) -> str:
    cal = r.get("calibration")
    if not cal:
        return "from the profile alone (not calibrated on this machine)."
    f = cal["factors"]
    return (f"on this machine's latencies: the profile's grid calibrated by {cal['how']} ({cal['used']} steps; "
            f"drift {cal['drift']:.0%}; factors draft {_span(f['draft'])}, verify {_span(f['verify'])}, other "
            f"{_span(f['other'])}, prefill {_span(f['chunk'])}); drafts accepted per position as those runs saw "
            f"them ({cal.get('acceptance')}; the profile's: {cal.get('profile_acceptance')}); lut and adaptive "
            "calibrate online, in the real runs and the simulated ones.")


def _span(by_size: dict) -> str:
    values = list(by_size.values())
    return f"{min(values):.2f}-{max(values):.2f}"


def _markdown(r: dict, policies: list[str]) -> str:
    real, sim, err = r["real_mean_latency_s"], r["sim_mean_latency_s"], r["error"]
    rank_real = {p: i + 1 for i, p in enumerate(sorted(policies, key=real.get))}
    rank_sim = {p: i + 1 for i, p in enumerate(sorted(policies, key=sim.get))}
    lines = [f"<!-- written by {r['provenance']['command'] or 'validate()'} on {r['provenance']['created']} -->",
             f"# Simulator vs real engine on {r['gpu_type']}: target {r['target']}, draft {r['draft']}", "",
             f"Schedule: `bench policies` (b) at scale {r['scale']}, {r['requests']} requests, phases (start s, end s, "
             f"requests/s): {', '.join(f'({a:.0f}, {b:.0f}, {c})' for a, b, c in r['phases'])}. Real: median of "
             f"{r['repeat']} round(s); simulated: mean of {r['sim_seeds']} acceptance draws, " + _basis(r), "",
             "| policy | real mean latency | simulated | error | rank real / simulated |", "|---|---|---|---|---|"]
    for p in policies:
        flag = "" if abs(err[p]) <= r["tolerance"] else " **over**"
        lines.append(f"| {p} | {real[p]:.2f}s | {sim[p]:.2f}s | {err[p]:+.1%}{flag} | {rank_real[p]} / {rank_sim[p]} |")
    worst = max(abs(e) for e in err.values())
    lines += ["", f"Largest error {worst:.1%} (tolerance {r['tolerance']:.0%}); pairs ordered differently where the "
                  f"real run separates them by more than {r['tie']:.0%}: "
                  + (", ".join(f"{a} < {b}" for a, b in r["discordant_pairs"]) or "none") + ".",
              "", f"**{'PASSED' if r['passed'] else 'FAILED'}**", ""]
    return "\n".join(lines)
