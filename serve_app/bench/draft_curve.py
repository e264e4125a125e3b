"""Tokens per step against training tokens: the curve that sizes the next draft-training step.

`python -m serve_app.bench.draft_curve OUT_STEM POINT [POINT ...]`, POINT = `LABEL=TOKENS:EPOCHS:ACCEPTANCE.json`
(TOKENS: distinct generated tokens the draft was trained on; EPOCHS: passes over them; the JSON written by
`specserve bench acceptance`). Writes OUT_STEM.json, OUT_STEM.md and OUT_STEM.png (tokens per step at
fixed:K per evaluation set, against training tokens on a log axis).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_points(specs: list[str]) -> list[dict]:
    points = []
    for spec in specs:
        label, rest = spec.split("=", 1)
        tokens, epochs, path = rest.split(":", 2)
        res = json.loads(Path(path).read_text())
        points.append({"label": label, "generated_tokens": int(tokens), "epochs": float(epochs), "source": path,
                       "k": res["k"], "draft": res["draft"],
                       "tokens_per_step": {name: round(s["tokens_per_step"], 3) for name, s in res["sets"].items()}})
    return points


def write(points: list[dict], stem: str) -> str:
    sets = list(points[0]["tokens_per_step"])
    lines = [f"# Draft quality against training tokens (tokens per step at fixed:{points[0]['k']}, greedy, "
             "held-out evaluation sets)", "",
             "| draft | generated tokens trained on | epochs | " + " | ".join(sets) + " | source |",
             "|---|---|---|" + "---|" * len(sets) + "---|"]
    for p in points:
        lines.append(f"| {p['label']} | {p['generated_tokens']:,} | {p['epochs']:g} | "
                     + " | ".join(f"{p['tokens_per_step'][s]:.2f}" for s in sets) + f" | {Path(p['source']).name} |")
    md = "\n".join(lines) + "\n"
    Path(stem + ".md").write_text(md)
    Path(stem + ".json").write_text(json.dumps(points, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in sets:
        xs = [p["generated_tokens"] for p in points]
        ax.plot(xs, [p["tokens_per_step"][s] for p in points], "o-", label=s)
    for p in points:
        ax.annotate(f"{p['label']}\n{p['epochs']:g} ep", (p["generated_tokens"], min(p["tokens_per_step"].values())),
                    textcoords="offset points", xytext=(0, -26), ha="center", fontsize=7)
    ax.axhline(2.0, color="grey", ls="--", lw=1)
    ax.text(ax.get_xlim()[0], 2.0, " target 2.0", va="bottom", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("distinct generated tokens trained on")
    ax.set_ylabel(f"tokens per step at k = {points[0]['k']}")
    ax.set_title("EAGLE-3 draft for the embedded target: quality vs training text")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    return md


if __name__ == "__main__":
    print(write(load_points(sys.argv[2:]), sys.argv[1]))
