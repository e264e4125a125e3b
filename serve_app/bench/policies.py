"""`specserve bench policies`: the paper's experiments, every policy in one run on one machine.

(a) uniform load: closed loop at concurrency 1 .. 32 (the engine's batch cap is the concurrency,
    so a finished request's slot is refilled at the next step); mean request latency (admission to
    last token) and tokens/s per policy.
(b) time-varying traffic: a seeded open-loop arrival schedule swinging between low and high load,
    replayed in real time; mean request latency (arrival to last token, queueing included).
(c) workload shift: creative prompts (the draft agrees less), then structured ones - lists, code edits,
    rewrites, whose answers follow the request's own text (it agrees more) - closed loop; lut (fixed
    table) against adaptive (follows the live acceptance).
Policies compared: none, fixed:1..K, lut, adaptive, all with the profile of this hardware type.
Greedy decoding throughout, so every policy produces the same tokens and only time differs. Every
prompt comes from the evaluation sets (serve_app/bench/prompt_sets.py): none is a distillation prompt or
one the profile was measured on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from serve_app.config import EngineConfig, SamplingParams
from serve_app.models import LoadedModels
from serve_app.engine.policy import BatchState, make_policy
from serve_app.profiling.calibration import calibrated
from serve_app.profiling.profiles import Profile
from serve_app.bench.prompt_sets import BENCH_PROMPTS, CREATIVE_PROMPTS, REWRITE_PROMPTS, STRUCTURED_PROMPTS, chat_prompts
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats
from serve_app.bench import regret
from serve_app.bench.rounds import fmt_paired, paired_ratio, provenance, rotated

LATENCY_PROMPTS = BENCH_PROMPTS + CREATIVE_PROMPTS


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    at: float = 0.0
    """Arrival time in seconds from the start (open loop)."""
    kind: str = "chat"
    """What the request is (d: chat, json, rewrite), for per-kind figures."""
    structured: dict | None = None
    """A JSON schema the answer must follow (`SamplingParams.structured`), or None."""

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, structured=self.structured)


@dataclass
class Result:
    policy: str
    latencies: list[float]
    tokens: int
    seconds: float
    steps: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since start, batch size, k) of every decode step."""
    proposed: int = 0
    accepted: int = 0
    choose_s: float = 0.0
    """Time spent in policy.choose."""
    step_s: float = 0.0
    """Time spent in engine steps (draft + verify + other)."""
    per_request: list[tuple[int, int]] = field(default_factory=list)
    """(proposed, accepted) of every request, in job order."""
    outputs: list[int] = field(default_factory=list)
    """Tokens generated for every request, in job order."""
    stats: list[StepStats] = field(default_factory=list)
    """Every step's StepStats (when the run collected them: the regret report reads them)."""

    @property
    def mean_latency(self) -> float:
        return statistics.fmean(self.latencies)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class TimedPolicy:
    """Wraps a policy to time its choose() (the overhead the design bounds at 1% of a step)."""

    def __init__(self, inner):
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def choose(self, state: BatchState) -> int:
        t = time.perf_counter()
        k = self.inner.choose(state)
        self.seconds += time.perf_counter() - t
        return k

    def observe(self, stats: StepStats) -> None:
        self.inner.observe(stats)


def _run(models: LoadedModels, profile: Profile | None, policy: str, jobs: list[Job], max_batch: int,
         open_loop: bool, bar: tqdm, steps: list | None = None) -> Result:
    """One policy over the jobs. lut and adaptive calibrate online, as the service's Routers do
    (`profiling.calibration`); `steps` collects every StepStats when given."""
    timed = TimedPolicy(calibrated(make_policy(policy, profile), profile))
    if policy == "none":
        models = dataclasses.replace(models, draft=None)
    engine = Engine.from_models(models, EngineConfig(max_batch_size=max_batch, max_k=8), timed)
    res = Result(policy, [], 0, 0.0)
    t0 = time.perf_counter()

    def on_step(st: StepStats) -> None:
        if steps is not None:
            steps.append(st)
        res.step_s += st.draft_s + st.verify_s + st.other_s
        if st.batch_size:  # k: drafted tokens per row (a per-row plan's differ by row)
            res.steps.append((time.perf_counter() - t0, st.batch_size, st.proposed / st.batch_size))
            res.proposed += st.proposed
            res.accepted += st.accepted

    engine.on_step.append(on_step)
    reqs, i = [], 0
    while i < len(jobs) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(jobs) and (not open_loop or jobs[i].at <= now):
            req = engine.submit(jobs[i].prompt, jobs[i].params())
            if open_loop:
                req.arrival = t0 + jobs[i].at  # latency counts from the scheduled arrival
            reqs.append(req)
            i += 1
        if engine.has_work():
            for req, out in engine.step():
                if out.finished:
                    bar.update(1)
        else:
            time.sleep(max(0.0, jobs[i].at - now))
    res.seconds = time.perf_counter() - t0
    # Open loop: arrival to last token. Closed loop: admission to last token (a closed-loop client
    # sends its next request when the previous answer ends, so it never waits behind the others).
    res.latencies = [r.stats.total_s - (0.0 if open_loop else r.stats.queue_s) for r in reqs]
    res.tokens = sum(r.stats.generated_tokens for r in reqs)
    res.per_request = [(r.stats.proposed, r.stats.accepted) for r in reqs]
    res.outputs = [r.stats.generated_tokens for r in reqs]
    res.choose_s = timed.seconds
    res.stats = steps if steps is not None else []
    return res


def uniform_jobs(tokenizer, concurrency: int, rng: random.Random, scale: float) -> list[Job]:
    n = max(6, int(2 * concurrency * scale))
    prompts = chat_prompts(tokenizer, [LATENCY_PROMPTS[rng.randrange(len(LATENCY_PROMPTS))] for _ in range(n)])
    return [Job(p, rng.randint(16, 48)) for p in prompts]


def varying_jobs(tokenizer, rng: random.Random, scale: float) -> tuple[list[Job], list[tuple[float, float, float]]]:
    """Poisson arrivals whose rate swings low -> high -> low ... (the paper's time-varying traffic).

    Returns the jobs and the phases (start s, end s, requests/s)."""
    phases, t = [], 0.0
    for rate, length in [(0.4, 10), (5.0, 5), (0.4, 10), (2.0, 6), (0.4, 8), (6.0, 4)]:
        phases.append((t, t + length * scale, rate))
        t += length * scale
    jobs = []
    for start, end, rate in phases:
        at = start + rng.expovariate(rate)
        while at < end:
            text = LATENCY_PROMPTS[rng.randrange(len(LATENCY_PROMPTS))]
            jobs.append(Job(chat_prompts(tokenizer, [text])[0], rng.randint(16, 48), at))
            at += rng.expovariate(rate)
    if not jobs:
        raise ValueError("the arrival schedule drew no requests at this --scale: raise it")
    return jobs, phases


MIXED_PHASES = [(0.4, 12), (24.0, 1.5), (0.4, 10), (12.0, 2.5), (0.3, 10), (30.0, 1.2), (0.5, 8), (8.0, 3)]
"""(d)'s arrival rate (requests/s) and length (s) per phase: single requests, then bursts that fill the batch."""

MIXED_KINDS = (("chat", 0.4), ("json", 0.3), ("rewrite", 0.3))
"""(d)'s request kinds and their shares."""


def mixed_jobs(tokenizer, rng: random.Random, scale: float) -> tuple[list[Job], list[tuple[float, float, float]]]:
    """(d) the paper's setting with requests that differ: Poisson arrivals swinging between single requests
    and bursts that fill the batch (1 to 32), a mix of everyday chat (`LATENCY_PROMPTS`), JSON answers
    constrained by a schema (`bench.structured`'s suite) and rewrites that copy most of their prompt
    (`REWRITE_PROMPTS`). Returns the jobs and the phases (start s, end s, requests/s)."""
    from serve_app.bench.structured import suite

    schemas = suite(50)
    phases, t = [], 0.0
    for rate, length in MIXED_PHASES:
        phases.append((t, t + length * scale, rate))
        t += length * scale
    kinds, weights = zip(*MIXED_KINDS)
    jobs = []
    for start, end, rate in phases:
        at = start + rng.expovariate(rate)
        while at < end:
            kind = rng.choices(kinds, weights)[0]
            if kind == "json":
                case = schemas[rng.randrange(len(schemas))]
                prompt = chat_prompts(tokenizer, [case["messages"][0]["content"]])[0]
                jobs.append(Job(prompt, 96, at, kind, {"json_schema": case["schema"]}))
            elif kind == "rewrite":
                text = REWRITE_PROMPTS[rng.randrange(len(REWRITE_PROMPTS))]
                jobs.append(Job(chat_prompts(tokenizer, [text])[0], 160, at, kind))
            else:
                text = LATENCY_PROMPTS[rng.randrange(len(LATENCY_PROMPTS))]
                jobs.append(Job(chat_prompts(tokenizer, [text])[0], rng.randint(16, 64), at, kind))
            at += rng.expovariate(rate)
    if not jobs:
        raise ValueError("the arrival schedule drew no requests at this --scale: raise it")
    return jobs, phases


CORPUS = Path(__file__).resolve().parents[2] / "corpora" / "smollm2-135m-instruct"
"""The embedded target's own text (committed): the documents of (e) and of `bench replay`'s grid."""

LONG_PHASES = [(0.4, 10), (10.0, 2.0), (0.3, 8), (6.0, 3.0)]
"""(e)'s arrival rate (requests/s) and length (s) per phase: single requests, then bursts (batch 16-32)."""


def document(tokenizer, tokens: int, offset: int = 0) -> list[int]:
    """A chat prompt about a document of about `tokens` tokens (the target's own text from the committed corpus;
    offset picks where in it), asking for a short summary."""
    import numpy as np

    from serve_app.drafting.corpus import load_corpus

    ids = np.concatenate([s.ids[s.prompt_len:] for s in load_corpus(CORPUS)])
    offset %= max(len(ids) - tokens, 1)
    text = tokenizer.decode(ids[offset: offset + tokens].tolist(), skip_special_tokens=True)
    return chat_prompts(tokenizer, [f"Here is a document.\n\n{text}\n\nSummarize it in two sentences."])[0]


def long_jobs(tokenizer, rng: random.Random, scale: float) -> list[Job]:
    """(e) document questions and summaries (prompts of 200-3,000 tokens) between short chat, in phases of
    single requests and bursts: the best fixed k differs by context."""
    jobs, t = [], 0.0
    for rate, length in LONG_PHASES:
        end = t + length * scale
        at = t + rng.expovariate(rate)
        while at < end:
            if rng.random() < 0.5:
                n = int(200 * 15 ** rng.random())  # 200-3,000 tokens, log-uniform
                jobs.append(Job(document(tokenizer, n, rng.randrange(1 << 20)), rng.randint(24, 64), at, "document"))
            else:
                text = LATENCY_PROMPTS[rng.randrange(len(LATENCY_PROMPTS))]
                jobs.append(Job(chat_prompts(tokenizer, [text])[0], rng.randint(16, 64), at, "chat"))
            at += rng.expovariate(rate)
        t = end
    if not jobs:
        raise ValueError("(e)'s schedule drew no requests at this --scale: raise it")
    return jobs


def shift_jobs(tokenizer, per_phase: int) -> list[Job]:
    """Creative prompts, then structured ones: the draft's agreement shifts mid-run."""
    out = []
    for texts in (CREATIVE_PROMPTS, STRUCTURED_PROMPTS):
        for i in range(per_phase):
            out.append(Job(chat_prompts(tokenizer, [texts[i % len(texts)]])[0], 48))
    return out


ADAPTIVE_POLICIES = ["lut", "adaptive", "budget"]
"""The policies that choose k from the profile (and what they observe), against none and every fixed k."""


def all_policies(max_k: int) -> list[str]:
    return ["none"] + [f"fixed:{k}" for k in range(1, max_k + 1)] + ADAPTIVE_POLICIES


def bench_policies(models: LoadedModels, profile: Profile, out_dir: str, concurrencies: list[int], max_k: int = 8,
                   scale: float = 1.0, seed: int = 0, parts: str = "abc", repeat: int = 1,
                   policies: list[str] | None = None, plots: bool = True) -> dict:
    """Run the experiments in `parts`, write results.json, summary.md and PNG plots into out_dir.

    With repeat > 1 every experiment runs that many rounds, each round running every policy once
    (interleaved, so slow spells of a shared machine hit all policies alike); figures are medians
    over the rounds, and the spread of each policy's mean latency is reported beside them.
    `policies` (default none, fixed:1..max_k, lut, adaptive, budget) must hold a fixed k for the ratios.
    plots: draw the PNGs (needs matplotlib; the GPU campaign runs without it where it is missing).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = policies or all_policies(max_k)
    tok = models.tokenizer
    results: dict = {"gpu_type": profile.gpu_type, "target": profile.target, "draft": profile.draft,
                     "profile_best_k": profile.best_k, "profile_acceptance_rate": profile.acceptance_rate,
                     "repeat": repeat, "policies": policies, "prompt_lookup": models.prompt_lookup}
    rng = random.Random(seed)
    plan = {c: uniform_jobs(tok, c, rng, scale) for c in concurrencies} if "a" in parts else {}
    varying, phases = varying_jobs(tok, rng, scale) if "b" in parts else ([], [])
    shift = shift_jobs(tok, max(4, int(12 * scale))) if "c" in parts else []
    mixed, mixed_phases = mixed_jobs(tok, random.Random(seed + 1), scale) if "d" in parts else ([], [])
    if "e" in parts:  # bench replay's (e), on the wall clock (its schedule from the same seed as the replay's)
        long = long_jobs(tok, random.Random(seed), scale)
        t, long_phases = 0.0, []
        for rate, length in LONG_PHASES:
            long_phases.append((t, t + length * scale, rate))
            t += length * scale
    else:
        long, long_phases = [], []
    shift_policies, shift_cs = [p for p in ["none", *ADAPTIVE_POLICIES] if p in policies], [1, 4]
    total = repeat * ((sum(len(j) for j in plan.values()) + len(varying) + len(mixed) + len(long)) * len(policies)
                      + len(shift) * len(shift_policies) * len(shift_cs))
    warm = [Job(j.prompt, 8) for j in uniform_jobs(tok, 2, random.Random(1), 0.5)[:2]]
    for p in policies:  # warm-up: every policy once, short (first-call allocations, code paths)
        _run(models, profile, p, warm, 2, False, tqdm(disable=True))
    with tqdm(total=total, desc="bench policies", unit="req") as bar:

        def rounds(label: str, names: list[str], jobs: list[Job], max_batch: int, open_loop: bool) -> dict[str, list[Result]]:
            runs: dict[str, list[Result]] = {p: [] for p in names}
            for i in range(repeat):
                for p in rotated(names, i):  # each policy runs at each place in the order by turns
                    bar.set_postfix_str(f"{label} {p} ({i + 1}/{repeat})")
                    runs[p].append(_run(models, profile, p, jobs, max_batch, open_loop, bar, steps=[]))
            return runs

        if plan:
            rows, results["paired_uniform"] = {}, {}
            for c, jobs in plan.items():
                runs = rounds(f"(a) c={c}", policies, jobs, c, False)
                results["paired_uniform"][c] = paired_report(runs)
                rows[c] = {p: {"mean_latency_s": _med(rs, lambda r: r.mean_latency), "spread": _spread(rs),
                               "tokens_per_s": _med(rs, lambda r: r.tokens_per_s),
                               "acceptance": _med(rs, lambda r: r.acceptance), "mean_k": _med(rs, _mean_k)}
                           for p, rs in runs.items()}
            results["uniform"] = rows
        if varying:
            runs = rounds("(b)", policies, varying, 32, True)
            results["varying"] = {"requests": len(varying), "phases": phases, "policies": _open_loop_rows(runs, varying),
                                  "paired": paired_report(runs), "regret": regret_report(runs)}
            if plots:
                _plot_varying(out / "varying.png", varying, phases, {p: _median_run(rs) for p, rs in runs.items()})
        if mixed:
            runs = rounds("(d)", policies, mixed, 32, True)
            kinds = {k: sum(j.kind == k for j in mixed) for k, _ in MIXED_KINDS}
            results["mixed"] = {"requests": len(mixed), "kinds": kinds, "phases": mixed_phases,
                                "policies": _open_loop_rows(runs, mixed), "paired": paired_report(runs),
                                "regret": regret_report(runs)}
            if plots:
                _plot_varying(out / "mixed.png", mixed, mixed_phases, {p: _median_run(rs) for p, rs in runs.items()},
                              "(d) bursts of mixed requests (chat, JSON, rewrites)")
        if long:
            runs = rounds("(e)", policies, long, 32, True)
            results["long"] = {"requests": len(long), "kinds": {k: sum(j.kind == k for j in long) for k in ("chat", "document")},
                               "phases": long_phases, "policies": _open_loop_rows(runs, long),
                               "paired": paired_report(runs), "regret": regret_report(runs)}
            if plots:
                _plot_varying(out / "long.png", long, long_phases, {p: _median_run(rs) for p, rs in runs.items()},
                              "(e) long documents (200-3,000 tokens) between short chat")
        if shift:
            half = len(shift) // 2
            results["shift"], shift_runs = {}, {}
            for c in shift_cs:
                runs = rounds(f"(c) c={c}", shift_policies, shift, c, False)
                shift_runs[c] = {p: _median_run(rs) for p, rs in runs.items()}
                results["shift"][c] = {p: {
                    "creative_mean_latency_s": _med(rs, lambda r: statistics.fmean(r.latencies[:half])),
                    "structured_mean_latency_s": _med(rs, lambda r: statistics.fmean(r.latencies[half:])),
                    "creative_acceptance": _med(rs, lambda r: _acceptance(r.per_request[:half])),
                    "structured_acceptance": _med(rs, lambda r: _acceptance(r.per_request[half:])),
                    "mean_latency_s": _med(rs, lambda r: r.mean_latency), "spread": _spread(rs),
                    "mean_k": _med(rs, _mean_k)} for p, rs in runs.items()}
            if plots:
                _plot_shift(out / "shift.png", shift_runs, half)
    if "uniform" in results and plots:
        _plot_uniform(out / "uniform.png", results["uniform"], policies)
    results["provenance"] = provenance()
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    prov = results["provenance"]
    (out / "summary.md").write_text(f"<!-- written by {prov['command'] or 'bench_policies()'} on {prov['created']} -->\n"
                                    + summary_markdown(results, policies))
    return results


def paired_report(runs: dict[str, list[Result]]) -> dict:
    """Each adaptive policy's mean latency against every fixed k, paired by round (`rounds.paired_ratio`: the
    geometric mean of per-round ratios and its 95% interval), and against a reference picked from data it is
    not compared with: the fixed k with the lowest latency over the even rounds, judged on the odd ones
    (`held_out`; needs 2 rounds or more)."""
    fixed = [p for p in runs if p.startswith("fixed:")]
    lat = {p: [r.mean_latency for r in rs] for p, rs in runs.items()}
    out: dict = {"rounds": min((len(v) for v in lat.values()), default=0), "policies": {}}
    for p in [q for q in runs if q in ADAPTIVE_POLICIES]:
        row = {f: paired_ratio(lat[p], lat[f]) for f in fixed}
        if fixed and len(lat[p]) >= 2:
            ref = min(fixed, key=lambda f: statistics.fmean(math.log(x) for x in lat[f][0::2]))
            row["held_out"] = {"reference": ref, **paired_ratio(lat[p][1::2], lat[ref][1::2])}
        out["policies"][p] = row
    return out


def paired_markdown(paired: dict, title: str) -> list[str]:
    """A table: each adaptive policy against each fixed k (paired ratio [95% interval]) and the held-out best."""
    pols = paired["policies"]
    if not pols:
        return []
    fixed = [f for f in next(iter(pols.values())) if f != "held_out"]
    lines = [f"### {title}: paired by round ({paired['rounds']} rounds; mean latency ratio, geometric mean "
             "[95% interval]; below 1 is faster)", "",
             "| policy | " + " | ".join(fixed) + " | held-out best fixed |", "|---|" + "---|" * (len(fixed) + 1)]
    for p, row in pols.items():
        held = row.get("held_out")
        tail = f"{fmt_paired(held)} vs {held['reference']}" if held else "-"
        lines.append(f"| {p} | " + " | ".join(fmt_paired(row[f]) for f in fixed) + f" | {tail} |")
    return lines + [""]


def regret_report(runs: dict[str, list[Result]]) -> dict[str, list[dict]]:
    """Each adaptive policy's steps against the hindsight-best fixed k per batch size, from every round's
    decode steps (`bench.regret`); the steps themselves are dropped afterwards (they are large)."""
    best = regret.fixed_rates({p: [st for r in rs for st in r.stats] for p, rs in runs.items()})
    report = {p: regret.regret([st for r in rs for st in r.stats], best) for p, rs in runs.items()
              if p in ADAPTIVE_POLICIES}
    for rs in runs.values():
        for r in rs:
            r.stats = []
    return report


def _open_loop_rows(runs: dict[str, list[Result]], jobs: list[Job]) -> dict:
    """Per policy: medians over the rounds of an open-loop schedule's figures, per request kind too."""
    kinds = sorted({j.kind for j in jobs})

    def kind_mean(kind):
        idx = [i for i, j in enumerate(jobs) if j.kind == kind]
        return lambda r: statistics.fmean(r.latencies[i] for i in idx)

    return {p: {"mean_latency_s": _med(rs, lambda r: r.mean_latency), "spread": _spread(rs),
                "round_latencies_s": [r.mean_latency for r in rs],
                "p90_latency_s": _med(rs, lambda r: _pct(r.latencies, 0.9)),
                "tokens_per_s": _med(rs, lambda r: r.tokens_per_s),
                "acceptance": _med(rs, lambda r: r.acceptance), "mean_k": _med(rs, _mean_k),
                "drafted_per_row": _med(rs, lambda r: r.proposed / max(sum(b for _, b, _ in r.steps), 1)),
                "by_kind": {k: _med(rs, kind_mean(k)) for k in kinds} if len(kinds) > 1 else {},
                "choose_us_per_step": _med(rs, lambda r: 1e6 * r.choose_s / max(len(r.steps), 1)),
                "choose_share_of_step": _med(rs, lambda r: r.choose_s / r.step_s)}
            for p, rs in runs.items()}


def _med(rs: list[Result], fn) -> float:
    return statistics.median(fn(r) for r in rs)


def _spread(rs: list[Result]) -> float:
    """(max - min) / median of the rounds' mean latencies: how much the machine moved the figure."""
    xs = [r.mean_latency for r in rs]
    return (max(xs) - min(xs)) / statistics.median(xs)


def _median_run(rs: list[Result]) -> Result:
    return sorted(rs, key=lambda r: r.mean_latency)[len(rs) // 2]


def _acceptance(pairs: list[tuple[int, int]]) -> float:
    proposed = sum(p for p, _ in pairs)
    return sum(a for _, a in pairs) / proposed if proposed else 0.0


def _mean_k(r: Result) -> float:
    return statistics.fmean(k for _, _, k in r.steps) if r.steps else 0.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def best_fixed(row: dict, with_none: bool = False) -> tuple[str, float]:
    """(policy, mean latency) of the best fixed k in a row of results (k >= 1, or k >= 0 with none)."""
    cands = {p: v["mean_latency_s"] for p, v in row.items() if p.startswith("fixed:") or (with_none and p == "none")}
    p = min(cands, key=cands.get)
    return p, cands[p]


def summary_markdown(res: dict, policies: list[str]) -> str:
    lines = [f"# Policies on {res['gpu_type']}: target {res['target']}, draft {res['draft']}", "",
             f"Profile: best k {res['profile_best_k']}, fitted acceptance rate {res['profile_acceptance_rate']}.",
             "Mean request latency in seconds (lower is better); ratios are against the best fixed k >= 1 "
             "and, in brackets, against the best of none and fixed k, measured in this same run.",
             f"Rounds: {res.get('repeat', 1)} (each round runs every policy once, interleaved; figures are medians"
             " over rounds; spread = (max - min) / median of a policy's mean latency over the rounds).", ""]
    if "uniform" in res:
        rows = res["uniform"]
        lines += ["## (a) Uniform load (closed loop)", "",
                  "| policy | " + " | ".join(f"c={c}" for c in rows) + " |", "|---|" + "---|" * len(rows)]
        for p in policies:
            cells = [f"{rows[c][p]['mean_latency_s']:.2f}s / {rows[c][p]['tokens_per_s']:.0f} tok/s"
                     + (f" (±{50 * rows[c][p]['spread']:.0f}%)" if res.get("repeat", 1) > 1 else "") for c in rows]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines += ["", "| vs best fixed | " + " | ".join(f"c={c}" for c in rows) + " |", "|---|" + "---|" * len(rows)]
        for p in [q for q in ADAPTIVE_POLICIES if q in policies]:
            cells = []
            for c, row in rows.items():
                bf, bl = best_fixed(row)
                bn, bnl = best_fixed(row, with_none=True)
                v = row[p]["mean_latency_s"]
                cells.append(f"{v / bl:.3f}x {bf} ({v / bnl:.3f}x {bn})")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
        for c, paired in res.get("paired_uniform", {}).items():
            lines += paired_markdown(paired, f"(a) c={c}")
    for key, title in (("varying", "(b) Time-varying traffic (open loop, seeded Poisson arrivals)"),
                       ("mixed", "(d) Bursts of mixed requests: chat, JSON, rewrites (open loop, seeded)"),
                       ("long", "(e) Long documents between short chat (open loop, seeded; bench replay's (e))")):
        if key in res:
            lines += _open_loop_markdown(res[key], title, policies)
    if "shift" in res:
        lines += ["## (c) Workload shift (creative prompts, then structured ones; closed loop)", "",
                  "Acceptance is what speculating policies saw in each phase (lut and adaptive may speculate "
                  "at different k).", "",
                  "| concurrency | policy | creative | structured | overall | spread | vs lut | acceptance creative / structured | mean k |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c, rows in res["shift"].items():
            for p, x in rows.items():
                lines.append(f"| {c} | {p} | {x['creative_mean_latency_s']:.2f}s | {x['structured_mean_latency_s']:.2f}s | "
                             f"{x['mean_latency_s']:.2f}s | {100 * x['spread']:.0f}% | {x['mean_latency_s'] / rows['lut']['mean_latency_s']:.3f}x | "
                             f"{x['creative_acceptance']:.2f} / {x['structured_acceptance']:.2f} | {x['mean_k']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def _open_loop_markdown(v: dict, title: str, policies: list[str]) -> list[str]:
    rows = v["policies"]
    bf, bl = best_fixed(rows)
    bn, bnl = best_fixed(rows, with_none=True)
    kinds = list(next(iter(rows.values()))["by_kind"])
    lines = [f"## {title}", "",
             f"{v['requests']} requests" + (" (" + ", ".join(f"{n} {k}" for k, n in v["kinds"].items()) + ")"
                                            if v.get("kinds") else "")
             + "; phases (start s, end s, requests/s): "
             + ", ".join(f"({a:.0f}, {b:.0f}, {r})" for a, b, r in v["phases"]), "",
             "| policy | mean latency | spread | vs best fixed k | p90 latency | " + "".join(f"{k} | " for k in kinds)
             + "tokens/s | acceptance | mean k | drafted per row | choose() per step |",
             "|---|---|---|---|---|" + "---|" * len(kinds) + "---|---|---|---|---|"]
    for p in policies:
        x = rows[p]
        lines.append(f"| {p} | {x['mean_latency_s']:.2f}s | {100 * x['spread']:.0f}% | {x['mean_latency_s'] / bl:.3f}x | "
                     f"{x['p90_latency_s']:.2f}s | " + "".join(f"{x['by_kind'][k]:.2f}s | " for k in kinds)
                     + f"{x['tokens_per_s']:.1f} | {x['acceptance']:.2f} | {x['mean_k']:.2f} | {x['drafted_per_row']:.2f} | "
                     f"{x['choose_us_per_step']:.0f} us ({100 * x['choose_share_of_step']:.3f}%) |")
    lines += ["", f"Best fixed k >= 1: {bf} ({bl:.2f}s); best of none and fixed: {bn} ({bnl:.2f}s). "
              "Per kind: mean latency of that kind's requests.", ""]
    if v.get("paired"):
        lines += paired_markdown(v["paired"], title.split(" ")[0])
    if v.get("regret"):
        lines += ["Regret per batch size (decode-only steps of every round; the reference is the fixed k whose steps "
                  "made tokens fastest in that batch-size group, in this same run; time lost is what the policy's "
                  "tokens there took beyond that rate, negative when it was faster):", ""]
        lines += regret.markdown(v["regret"]) + [""]
    return lines


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(p: str) -> dict:
    if p == "adaptive":
        return {"color": "tab:red", "linewidth": 2.5, "marker": "o"}
    if p == "lut":
        return {"color": "tab:blue", "linewidth": 2.5, "marker": "s"}
    if p == "budget":
        return {"color": "tab:green", "linewidth": 2.5, "marker": "^"}
    if p == "none":
        return {"color": "black", "linewidth": 2, "linestyle": "--"}
    k = int(p.split(":")[1])
    return {"color": _plt().cm.Greys(0.25 + 0.08 * k), "linewidth": 1}


def _plot_uniform(path: Path, rows: dict, policies: list[str]) -> None:
    plt = _plt()
    cs = list(rows)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for p in policies:
        ax.plot(cs, [rows[c][p]["mean_latency_s"] for c in cs], label=p, **_style(p))
        best = [min(v["mean_latency_s"] for q, v in rows[c].items() if q.startswith("fixed:") or q == "none") for c in cs]
        ax2.plot(cs, [rows[c][p]["mean_latency_s"] / b for c, b in zip(cs, best)], label=p, **_style(p))
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(cs, cs)
        a.set_xlabel("concurrency (requests in flight)")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("mean request latency (s)")
    ax.set_title("(a) uniform load: latency per policy")
    ax2.set_ylabel("latency / best of none and fixed k at that concurrency")
    ax2.set_ylim(0.9, min(3.0, ax2.get_ylim()[1]))
    ax2.axhline(1.03, color="tab:green", linestyle=":", label="+3%")
    ax2.set_title("relative to the best static choice")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_varying(path: Path, jobs: list[Job], phases: list, runs: dict[str, Result],
                  title: str = "(b) time-varying traffic") -> None:
    plt = _plt()
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    for start, end, rate in phases:
        ax0.axvspan(start, end, alpha=0.15 if rate > 1 else 0.0, color="tab:orange")
    ax0.hist([j.at for j in jobs], bins=max(10, int(phases[-1][1])), color="tab:orange")
    ax0.set_ylabel("arrivals per second")
    ax0.set_title(f"{title}: arrivals, request latency, chosen k")
    fixed = {p: r for p, r in runs.items() if p.startswith("fixed:")}
    best = min(fixed, key=lambda p: fixed[p].mean_latency)
    for p in [q for q in ("none", best, *ADAPTIVE_POLICIES) if q in runs]:
        r = runs[p]
        pts = sorted(zip([j.at for j in jobs], r.latencies))
        ax1.plot([a for a, _ in pts], [lat for _, lat in pts], label=f"{p} (mean {r.mean_latency:.2f}s)", **_style(p))
    ax1.set_yscale("log")
    ax1.set_ylabel("request latency (s) by arrival time")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    shown = [p for p in ADAPTIVE_POLICIES if p in runs]
    for p in shown:
        r = runs[p]
        ax2.step([t for t, _, _ in r.steps], [k for _, _, k in r.steps], where="post", label=f"{p}: k", alpha=0.8,
                 color=_style(p)["color"])
    ax2b = ax2.twinx()
    r = runs[shown[-1]] if shown else best
    ax2b.plot([t for t, _, _ in r.steps], [b for _, b, _ in r.steps], color="tab:gray", alpha=0.5,
              label=f"batch ({shown[-1] if shown else best})")
    ax2b.set_ylabel("batch size", color="tab:gray")
    ax2.set_ylabel("k chosen per step (budget: drafted per row)")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_shift(path: Path, runs_by_c: dict[int, dict[str, Result]], half: int) -> None:
    plt = _plt()
    fig, axes = plt.subplots(2, len(runs_by_c), figsize=(6 * len(runs_by_c), 8), squeeze=False)
    for col, (c, runs) in enumerate(runs_by_c.items()):
        ax, ax2 = axes[0][col], axes[1][col]
        for i, (p, r) in enumerate(runs.items()):
            vals = [statistics.fmean(r.latencies[:half]), statistics.fmean(r.latencies[half:])]
            ax.bar([x + 0.27 * (i - 1) for x in (0, 1)], vals, width=0.27, label=p, color=_style(p)["color"])
        ax.set_xticks([0, 1], ["creative", "structured (lists, code edits, rewrites)"])
        ax.set_ylabel("mean request latency (s)")
        ax.set_title(f"(c) workload shift, concurrency {c}")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # headroom: the legend sits above the bars, not on them
        ax.legend(loc="upper center", ncol=3, framealpha=0.9)
        for p in [q for q in ADAPTIVE_POLICIES if q in runs]:
            r = runs[p]
            ax2.step([t for t, _, _ in r.steps], [k for _, _, k in r.steps], where="post", label=p,
                     color=_style(p)["color"], alpha=0.8)
        ax2.set_xlabel("seconds since start (creative requests first)")
        ax2.set_ylabel("k chosen per step")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
