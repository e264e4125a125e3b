"""Regret: what a policy's choices cost against the best fixed k, per batch size, from a run's own steps.

A policy can lose to a fixed k for reasons that a mean latency hides: the wrong k at some batch sizes, a price
model the machine does not follow, exploration, switching k. `regret` takes the decoding steps of runs (StepStats,
decode only: a step that also prefilled prompt chunks prices the chunk, not k) and, per batch-size group (the
nearest of 1, 2, 4, 8, 16, 32), compares each policy's tokens per millisecond with the best fixed k's in the same
group, measured in the same run set (the hindsight-best k: the one whose steps made tokens fastest there). The
time a policy lost (or won) in a group is what its tokens there would have taken at the best rate, less what
they took. `grid_rates` gives the same reference from a (calibrated) profile instead of fixed-k runs, for runs
that have no fixed-k runs beside them (a serving Router).
"""

from __future__ import annotations

from collections import defaultdict

GROUPS = (1, 2, 4, 8, 16, 32)


def group(batch_size: int) -> int:
    """The nearest profiled batch size (the smaller on a tie)."""
    return min(GROUPS, key=lambda g: (abs(g - batch_size), g))


def tally(steps) -> dict[int, dict[str, float]]:
    """Per group: decoding steps, row-steps, drafted and generated tokens, milliseconds (decode-only steps)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: {"steps": 0, "rows": 0, "drafted": 0, "tokens": 0, "ms": 0.0})
    for st in steps:
        if not st.batch_size or st.prefill_tokens or st.admitted:
            continue
        t = out[group(st.batch_size)]
        t["steps"] += 1
        t["rows"] += st.batch_size
        t["drafted"] += st.proposed
        t["tokens"] += st.generated
        t["ms"] += 1000 * (st.draft_s + st.verify_s + st.other_s)
    return dict(out)


def fixed_rates(runs: dict[str, list]) -> dict[int, dict[str, float]]:
    """Per group, tokens per ms of each fixed k (and none) over all its runs' decode steps."""
    rates: dict[int, dict[str, float]] = defaultdict(dict)
    for policy, steps in runs.items():
        if policy != "none" and not policy.startswith("fixed:"):
            continue
        for g, t in tally(steps).items():
            if t["ms"] > 0 and t["steps"] >= 3:
                rates[g][policy] = t["tokens"] / t["ms"]
    return dict(rates)


def grid_rates(grid, acceptance: list[float]) -> dict[int, dict[str, float]]:
    """Per group, tokens per ms of each k from a latency grid (linear between its batch sizes, so every group
    has a reference however few sizes the grid measured) and acceptance per draft position."""
    out: dict[int, dict[str, float]] = {}
    for g in GROUPS:
        out[g] = {("none" if k == 0 else f"fixed:{k}"): g * (1 + sum(acceptance[:k])) / ms
                  for k, ms in zip(grid.ks, grid.step_ms(g)) if k <= len(acceptance) and ms > 0}
    return out


def regret(steps, best: dict[int, dict[str, float]]) -> list[dict]:
    """One policy's steps against the reference rates: per group, its mean drafted tokens per row, its tokens
    per ms, the hindsight-best fixed k there and its rate, and the milliseconds lost (positive) or won."""
    rows = []
    for g, t in sorted(tally(steps).items()):
        ref = best.get(g)
        if not ref or not t["ms"]:
            continue
        k_best = max(ref, key=ref.get)
        rate = t["tokens"] / t["ms"]
        rows.append({"batch": g, "steps": t["steps"], "drafted_per_row": t["drafted"] / t["rows"], "rate": rate,
                     "best": k_best, "best_rate": ref[k_best], "lost_ms": t["ms"] - t["tokens"] / ref[k_best]})
    return rows


def markdown(report: dict[str, list[dict]]) -> list[str]:
    """A table per policy: group, steps, drafted per row, tokens/ms against the hindsight-best fixed k's."""
    lines = ["| policy | batch | steps | drafted per row | tokens/ms | best fixed k there | its tokens/ms | time lost |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for policy, rows in report.items():
        for r in rows:
            lines.append(f"| {policy} | {r['batch']} | {r['steps']} | {r['drafted_per_row']:.2f} | {r['rate']:.3f} | "
                         f"{r['best']} | {r['best_rate']:.3f} | {r['lost_ms'] / 1000:+.2f} s |")
        if rows:
            lost = sum(r["lost_ms"] for r in rows) / 1000
            lines.append(f"| {policy} | all | {sum(r['steps'] for r in rows)} | | | | | **{lost:+.2f} s** |")
    return lines
