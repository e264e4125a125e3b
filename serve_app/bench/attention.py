"""`specserve bench attention`: the attention backends against each other on one layer's paged pool.

Each case is a batch of rows at a context length, each row feeding `fed` tokens (1: decoding; k + 1:
verifying), over a pool whose blocks are shuffled (as a long-running server's are). Per backend: the
median and spread of one layer's attention call over interleaved rounds, its speed-up over gather (the
baseline, run in the same rounds), and the largest difference from gather's output. flex runs compiled
(`torch.compile(flex_attention)`, on a CPU too: the eager path is a dense reference only) and its
compile time is reported apart. flex's block mask is built once per forward, at its first layer, and
reused by the others, so a layer's call here reuses it too. gather-sdpa is gather without its C kernel
(`attention.KERNEL_ON` off): SDPA on the gathered copy for every row, what the kernel replaces on a CPU.
Only torch and a C compiler: runs on a GPU machine as is (there gather-sdpa and gather are the same).
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from serve_app.engine import attention

CASES = {  # name -> (rows, context tokens per row, tokens fed per row)
    "quick": [(4, 256, 1), (4, 256, 5)],
    "cpu": [(16, 1024, 1), (16, 1024, 5), (4, 1024, 5)],
    "gpu": [(32, 2048, 1), (32, 2048, 5), (64, 2048, 5), (32, 8192, 5), (64, 8192, 1)],
}
SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # heads, kv heads, head dim


def _timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


BACKENDS = (*attention.BACKENDS, "gather-sdpa")


def _attend(b: str, q, kp, vp, lay):
    if b != "gather-sdpa":
        return attention.attend(b, q, kp, vp, lay, None)
    attention.KERNEL_ON = False
    try:
        return attention.attend("gather", q, kp, vp, lay, None)
    finally:
        attention.KERNEL_ON = True


def run_case(rows: int, context: int, fed: int, shape: str, device: str, dtype: torch.dtype, rounds: int,
             backends=BACKENDS) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    q, kp, vp, rws, pos, bs, nblk = attention.random_batch([(context - fed, fed)] * rows, heads, kv_heads, head_dim,
                                                           seed=rows + context)
    q, kp, vp = (t.to(device, dtype) for t in (q, kp, vp))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    fns, out, compile_s = {}, {}, {}
    for b in backends:
        lay = attention.move(attention.layout(b.removesuffix("-sdpa"), rws, pos, bs, nblk), device)
        fns[b] = lambda b=b, lay=lay: _attend(b, q, kp, vp, lay)
        compile_s[b] = _timed(lambda b=b: out.__setitem__(b, fns[b]()), sync)  # first call: compiles flex
    times = {b: [] for b in backends}
    for r in range(rounds):
        for b in (backends if r % 2 == 0 else backends[::-1]):
            times[b].append(_timed(fns[b], sync) * 1e3)
    base = statistics.median(times["gather"])
    return {"rows": rows, "context": context, "fed": fed, "shape": shape, "pool_blocks": nblk, "block_size": bs,
            "backends": {b: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                             "speedup_vs_gather": base / statistics.median(t), "first_call_s": compile_s[b],
                             "max_abs_diff": (out[b].float() - out["gather"].float()).abs().max().item()}
                         for b, t in times.items()}}


def bench_attention(cases: str, shape: str, device: str, dtypes: list[str], rounds: int) -> tuple[dict, str]:
    attention.COMPILE_FLEX = True  # timed compiled everywhere: eager flex is a dense reference only
    results = []
    todo = [(c, d) for c in CASES[cases] for d in dtypes]
    for (rows, context, fed), d in tqdm(todo, desc="attention cases"):
        r = run_case(rows, context, fed, shape, device, getattr(torch, d), rounds)
        results.append({**r, "dtype": d})
    lines = [f"# Attention backends: one layer's call on a paged pool ({shape} heads, {device}, {rounds} rounds)", "",
             "Command: `specserve bench attention " + f"--cases {cases} --shape {shape} --device {device} "
             f"--dtypes {','.join(dtypes)} --rounds {rounds}`. Median ms (min-max) per call; speed-up over gather "
             "in the same rounds; flex compiled (first-call time includes compiling).", "",
             "| rows x context, fed | dtype | gather ms | gather-sdpa ms | flex ms | gather-sdpa vs gather "
             "| flex vs gather | flex first call s | max diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        g, f, sd = r["backends"]["gather"], r["backends"]["flex"], r["backends"]["gather-sdpa"]
        span = lambda x: f"{x['median_ms']:.2f} ({x['min_ms']:.2f}-{x['max_ms']:.2f})"  # noqa: E731
        lines.append(f"| {r['rows']} x {r['context']}, {r['fed']} | {r['dtype']} | {span(g)} | {span(sd)} | {span(f)} "
                     f"| {sd['speedup_vs_gather']:.2f}x | {f['speedup_vs_gather']:.2f}x | {f['first_call_s']:.1f} "
                     f"| {max(f['max_abs_diff'], sd['max_abs_diff']):.1e} |")
    return {"shape": shape, "device": device, "rounds": rounds, "cases": results}, "\n".join(lines) + "\n"
