"""`specserve simulate`: run each policy through the step or the fleet engine, write summary.md,
results.json and k_batch.png."""

from __future__ import annotations

from serve_app.profiling.profiles import Profile
from serve_app.sim.simulate import simulate


def run_simulations(fleet: dict[str, int], profiles: dict[str, Profile], policies: list[str], out_dir: str,
                    engine: str = "auto", **kwargs) -> tuple[dict, str]:
    """Every policy on the same fleet and arrivals (same seed); writes out_dir/{results.json, summary.md,
    k_batch.png}. `engine`: step (every engine step an event), fleet (vectorised ticks, `fleetsim.py`)
    or auto (fleet above 32 replicas). Returns (results, markdown)."""
    import json
    import os
    import time

    from tqdm import tqdm

    from serve_app.bench.rounds import provenance
    from serve_app.sim.fleetsim import simulate_fleet

    if engine == "auto":
        engine = "fleet" if sum(fleet.values()) > 32 else "step"
    if engine not in ("step", "fleet"):
        raise ValueError(f"unknown engine {engine!r}: expected auto, step or fleet")
    tick_s = kwargs.pop("tick_s", 0.1)
    route = kwargs.pop("route", "least-loaded")
    os.makedirs(out_dir, exist_ok=True)
    results, runs = {}, {}
    for policy in tqdm(policies, desc=f"simulate ({engine})", unit="policy"):
        t = time.perf_counter()
        if engine == "fleet":
            res = simulate_fleet(fleet, profiles, policy, tick_s=tick_s, route=route, **kwargs)
        else:
            res = simulate(fleet, profiles, policy, route=route, **kwargs)
        wall = time.perf_counter() - t
        s = res.summary()
        s["wall_s"] = round(wall, 2)
        s["steps"] = int(res.steps)
        served = res.by_hardware()
        s["by_hardware"] = {g: served.get(g, {"requests": 0, "mean_latency_s": None}) for g in fleet}
        results[policy], runs[policy] = s, res
    _plot(runs, os.path.join(out_dir, "k_batch.png"))
    fleet_text = ", ".join(f"{n} x {g}" for g, n in fleet.items())
    lines = [f"# specserve simulate: {fleet_text}", "",
             f"Engine: {engine}" + (f" (ticks of {tick_s} s)" if engine == "fleet" else " (every engine step)")
             + f"; routing: {route}.", "",
             "| policy | requests | mean latency (s) | e2e p50 / p90 / p99 (s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             "| goodput (tokens/s) | simulated steps | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for p, s in results.items():
        lines.append(f"| {p} | {s['finished']} | {s['mean_latency_s']:.3f} | {s['e2e_p50_s']:.2f} / {s['e2e_p90_s']:.2f} / "
                     f"{s['e2e_p99_s']:.2f} | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} | "
                     f"{s['tpot_p50_s'] * 1000:.1f} / {s['tpot_p99_s'] * 1000:.1f} | {s['goodput_tokens_per_s']:.1f} | "
                     f"{s['steps']} | {s['wall_s']} |")
    lines += ["", "Requests and mean latency (s) per hardware type:", "", "| policy | " + " | ".join(fleet) + " |",
              "|---|" + "---|" * len(fleet)]
    for p, s in results.items():
        cells = [s["by_hardware"][g] for g in fleet]
        lines.append(f"| {p} | " + " | ".join("-" if not c["requests"] else f"{c['requests']} / {c['mean_latency_s']:.3f}"
                                             for c in cells) + " |")
    lines += ["", "![k and batch size over time](k_batch.png)"]
    markdown = "\n".join(lines) + "\n"
    prov = provenance()
    markdown = f"<!-- written by {prov['command'] or 'run_simulations()'} on {prov['created']} -->\n" + markdown
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"fleet": fleet, "engine": engine, "route": route, "policies": results, "provenance": prov}, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown)
    return results, markdown


def _plot(runs: dict, path: str) -> None:
    """Mean batch size and mean k of busy replicas per second, a colour per policy, a line style per
    hardware type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ["-", "--", ":", "-."]
    fig, (ax_b, ax_k) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    for c, (policy, res) in enumerate(runs.items()):
        series = res.series()
        for i, (group, (xs, batch, ks)) in enumerate(sorted(series.items())):
            label = policy if len(series) == 1 else f"{policy} @ {group}"
            kw = dict(color=f"C{c % 10}", linestyle=styles[i % len(styles)], linewidth=1.2)
            ax_b.plot(xs, batch, label=label, **kw)
            ax_k.plot(xs, ks, label=label, **kw)
    ax_b.set(ylabel="mean batch size", title="simulated: batch size and k chosen, per second (busy replicas)")
    ax_k.set(ylabel="mean k", xlabel="simulated seconds")
    for ax in (ax_b, ax_k):
        ax.grid(alpha=0.3)
    ax_k.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below: the lines stay visible
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
