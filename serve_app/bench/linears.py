"""`specserve bench linears`: a decode step's linears, float32 weights through oneDNN against bfloat16 weights through
`engine/bf16_linear`, by rows per call.

The model's shapes (default: the embedded SmolLM2-135M: q/k/v and gate/up fused as packing fuses them, o, down, 30
layers, and the head) with random weights; each round times both formats at every row count, in an order that
rotates between rounds; the report gives each format's median ms for one pass over all the linears and the paired
ratio bf16 / float32 with its 95% interval. What a batch-1 decode step waits on, without the rest of the forward.
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from serve_app.bench.rounds import fmt_paired, paired_ratio, rotated
from serve_app.engine import bf16_linear, packing

SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""(out, in) of one SmolLM2-135M layer's linears, fused as packing fuses them; its head is 49,152 x 576."""
FORMATS = {"float32": (packing._packed, lambda x, p: packing._linear(x, p, None)),
           "bf16": (bf16_linear.to_bits, lambda x, p: bf16_linear.linear(x, p, None))}


def _pass_ms(call, packs: list, rows: int, reps: int) -> float:
    xs = [torch.randn(rows, p[1]) for p in packs]
    with torch.inference_mode():
        call(xs[0], packs[0][0])  # warm-up: oneDNN builds its primitive for this shape
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for x, (p, _) in zip(xs, packs):
                call(x, p)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_linears(rows: list[int], rounds: int, layers: int = 30, head: int = 49152, reps: int = 5,
                  shapes: dict = SMOLLM2) -> tuple[dict, str]:
    if not bf16_linear.available():
        raise ValueError("the bfloat16 kernel does not run here (needs AVX2, FMA and a C compiler)")
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.02 for _ in range(layers) for o, i in shapes.values()]
    weights.append(torch.randn(head, next(iter(shapes.values()))[1]) * 0.02)
    packs = {name: [(prep(w), w.shape[1]) for w in weights] for name, (prep, _) in FORMATS.items()}
    runs = []
    with tqdm(total=rounds * len(rows) * len(FORMATS), desc="bench linears", unit="pass") as bar:
        for r in range(rounds):
            for n in rows:
                for name in rotated(list(FORMATS), r + n):
                    runs.append({"round": r, "rows": n, "format": name,
                                 "ms": _pass_ms(FORMATS[name][1], packs[name], n, reps)})
                    bar.update(1)
    params = sum(w.numel() for w in weights)
    results = {"rows": rows, "rounds": rounds, "layers": layers, "params": params, "threads": torch.get_num_threads(),
               "runs": runs}
    return results, report(results)


def report(results: dict) -> str:
    runs = results["runs"]
    series = lambda f, n: [x["ms"] for x in sorted(runs, key=lambda x: x["round"]) if (x["format"], x["rows"]) == (f, n)]  # noqa: E731
    lines = ["# bench linears: bfloat16 weights (engine/bf16_linear) against float32 (oneDNN, packed)", "",
             f"{results['params'] / 1e6:.1f} M weights ({results['layers']} layers and the head), {results['threads']} "
             f"threads, {results['rounds']} rounds, formats rotated; ms for one pass over every linear (median over "
             "rounds); ratio paired within a round (95% interval).", "",
             "| rows | float32 ms | bf16 ms | bf16 / float32 | weights read, bf16 |", "|---|---|---|---|---|"]
    for n in results["rows"]:
        f32, b16 = series("float32", n), series("bf16", n)
        gbs = 2 * results["params"] / (statistics.median(b16) / 1000) / 1e9
        lines.append(f"| {n} | {statistics.median(f32):.1f} | {statistics.median(b16):.1f} | "
                     f"{fmt_paired(paired_ratio(b16, f32))} | {gbs:.1f} GB/s |")
    return "\n".join(lines) + "\n"
