"""What every benchmark shares: interleaved rounds, medians with their spread, and results files.

On a shared, noisy machine a single timing means little. Every side of a comparison is warmed up,
then all sides run once per round in an order that rotates between rounds (so a slow spell hits
each side alike), and a ratio is taken between sides of the SAME round before the median over
rounds is reported, with its range. The benchmark writes what it printed to results/, so every
figure a document quotes points to a committed file and the command that made it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS_DIR = Path("results")


def rotated(items: list, round_no: int) -> list:
    """items in the order for one round: rotated by the round number."""
    r = round_no % len(items)
    return items[r:] + items[:r]


def summary(xs: list[float]) -> dict:
    """Median of a figure over rounds, its range, and spread = (max - min) / median."""
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "spread": (max(xs) - min(xs)) / med if med else 0.0,
            "rounds": list(xs)}


T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
"""Student's t, two-sided 95%, for 1..30 degrees of freedom (1.96 beyond)."""


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """a / b from rounds run in pairs (a[i] and b[i] in the same round): the geometric mean of the per-round
    ratios and its 95% interval (a t-interval on the log ratios), so a slow spell that hits both sides of a
    round cancels. One round: the ratio, no interval."""
    logs = [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not logs:
        return {"ratio": None, "low": None, "high": None, "rounds": 0}
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "low": None, "high": None, "rounds": 1}
    half = (T95[len(logs) - 2] if len(logs) - 1 <= len(T95) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "rounds": len(logs)}


def fmt_paired(r: dict) -> str:
    """`0.93x [0.88, 0.98]`: a paired ratio and its 95% interval."""
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.3f}x" + (f" [{r['low']:.3f}, {r['high']:.3f}]" if r["low"] is not None else "")


def fmt_ratio(s: dict) -> str:
    """`0.93x (0.90-0.95)`: the median ratio and its range over rounds."""
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def default_stem(name: str) -> Path:
    """results/<name>-<hardware type>: where a benchmark writes unless told otherwise."""
    from serve_app.hardware import detect_gpu_type

    return RESULTS_DIR / f"{name}-{detect_gpu_type()}"


def provenance() -> dict:
    """What produced a results file: the command, when, and the torch build and threads it ran with."""
    from serve_app.hardware import detect_gpu_type

    # `specserve ...`, or `python -m serve_app.cli ...` (a copy of the tree run apart from the one being edited)
    run = Path(sys.argv[0])
    argv = sys.argv[1:] if run.name == "specserve" or (run.name == "cli.py" and run.parent.name == "serve_app") else None
    return {"command": "specserve " + " ".join(argv) if argv is not None else None,
            "hardware": detect_gpu_type(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_results(stem: str | Path, data: dict, markdown: str) -> tuple[Path, Path]:
    """stem.json (the data, with provenance) and stem.md (what the benchmark printed)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    data = {**data, "provenance": prov}
    head = f"<!-- written by {prov['command'] or 'serve_app.bench'} on {prov['created']}; data: {stem.name}.json -->\n"
    json_path, md_path = Path(f"{stem}.json"), Path(f"{stem}.md")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md_path.write_text(head + markdown.rstrip() + "\n")
    return json_path, md_path
