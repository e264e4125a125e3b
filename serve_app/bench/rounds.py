"""What every benchmark shares: interleaved rounds, medians with their spread, and results files.

On a shared, noisy machine a single timing means little. Every side of a comparison is warmed up,
then all sides run once per round in an order that rotates between rounds (so a slow spell hits
each side alike), and a ratio is taken between sides of the SAME round before the median over
rounds is reported, with its range. The benchmark writes what it printed to results/, so every
figure a document quotes points to a committed file and the command that made it.
"""

from __future__ import annotations

import json
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


def fmt_ratio(s: dict) -> str:
    """`0.93x (0.90-0.95)`: the median ratio and its range over rounds."""
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def default_stem(name: str) -> Path:
    """results/<name>-<hardware type>: where a benchmark writes unless told otherwise."""
    from serve_app.profiling.profiles import detect_gpu_type

    return RESULTS_DIR / f"{name}-{detect_gpu_type()}"


def provenance() -> dict:
    """What produced a results file: the command, when, and the torch build and threads it ran with."""
    from serve_app.profiling.profiles import detect_gpu_type

    argv = sys.argv[1:] if Path(sys.argv[0]).name == "specserve" else None
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
