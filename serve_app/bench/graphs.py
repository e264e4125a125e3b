"""`specserve bench graphs`: what captured CUDA graphs would buy a step, measured before the engine has them.

A step on a GPU is launch-bound when the host queues kernels more slowly than the device runs them: its wall
time is then the host's, and a profile measured from it prices Python, not the GPU. Two passes tell how much:

  step     the engine's steps as they run today, per (batch, k): wall ms per step and its draft / verification
           parts, the device's busy ms in a step (the sum of its kernels' times, from torch.profiler), kernels
           launched, and the host's reads of device values and `synchronize` calls per step.
  forward  one forward per shape captured by hand in a CUDA graph: the verification's (batch x (k + 1) tokens,
           logits at every position) and the draft's (batch x 1). Its eager wall ms (launches + one sync), its
           device busy ms, and the graph's replay ms; the replay's logits are checked against the eager
           forward's on the same inputs (same argmax, max difference).

The replay time is what a captured step's forward costs, with no host in it: eager / replay is what graphs
buy that forward. The rows are real engine rows (prefilled prompts of random ids in the paged pool); a captured
forward writes its keys and values past the rows' committed length, which the engine overwrites later.

On a CPU the same code runs without capture or profiler (a dry run: shapes, plumbing, the report).
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch
from tqdm import tqdm

from serve_app.bench.rounds import fmt_paired
from serve_app.config import SamplingParams
from serve_app.engine.kv import pack
from serve_app.engine.policy import FixedK
from serve_app.engine.syncs import SyncCounter
from serve_app.profiling.context import PREFILL_BUDGET, _random_ids
from serve_app.profiling.measuring import measuring_engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, n: int, device: torch.device) -> float:
    """Median wall ms of fn() followed by a device sync, over n calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(out), 3)


def device_busy(fn, n: int, device: torch.device) -> tuple[float | None, float | None]:
    """(device busy ms, kernels) per call of fn, from torch.profiler's CUDA activity over n calls: the sum of
    the kernels' and copies' own times, so the gaps between them (the host's launching) are not in it. (None,
    None) on a CPU."""
    if device.type != "cuda":
        return None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    return round(busy_us / 1000 / n, 3), round(len(kernels) / n, 1)


def _forward_fn(worker, fed: list[list[int]]):
    """A closure running one packed forward of the worker's rows feeding `fed` (row b's tokens at its
    committed length on), with logits at every fed position ([T, V]); its inputs built once, outside it, as
    a captured graph needs (the same tensors every call)."""
    sids = list(worker.seqs)
    starts = [worker.seqs[s].kv_len for s in sids]
    ids, pos, batch = pack(worker.cache, sids, fed, starts, worker.device)
    index = torch.arange(ids.shape[1], device=worker.device)
    return lambda: worker._packed(ids, pos, batch, index)


def probe_forward(worker, fed: list[list[int]], reps: int) -> dict:
    """One forward shape: eager wall ms, device busy ms and kernels, and (on CUDA) the captured graph's
    replay ms with its logits checked against the eager forward's."""
    device = worker.device
    fn = _forward_fn(worker, fed)
    with torch.inference_mode():
        for _ in range(3):  # compile, autotune, allocator: not timed
            fn()
        _sync(device)
        row = {"tokens": sum(len(f) for f in fed), "eager_ms": _median_ms(fn, reps, device)}
        row["busy_ms"], row["kernels"] = device_busy(fn, 3, device)
        if device.type != "cuda":
            return row
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.cuda.graph(graph):
                captured = fn()
            graph.replay()
            _sync(device)
            eager = fn().float()
            got = captured.float()
            row["same_argmax"] = bool((eager.argmax(-1) == got.argmax(-1)).all().item())
            row["max_abs_diff"] = round((eager - got).abs().max().item(), 5)
            row["graph_ms"] = _median_ms(graph.replay, reps, device)
            row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
            del graph, captured
        except Exception as e:  # noqa: BLE001 - a failed capture is a finding, not the end of the run
            row["capture_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def probe_steps(engine, k: int, steps: int, device: torch.device) -> dict:
    """Steady decoding at fixed k: per-step wall, draft and verification ms (medians), host reads and
    synchronize calls per step, and the device's busy ms and kernels in a step."""
    engine.policy = FixedK(k)
    seen = []
    engine.on_step.append(seen.append)
    try:
        for _ in range(2):  # the switch to k and a shape's first call: not recorded
            engine.step()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1000)
        kept = seen[-steps:]
        # counted apart: the counter sees every torch call in Python, which would slow the timed steps
        with SyncCounter(device) as counted:  # reads of device values, and waits (`synchronize`)
            for _ in range(2):
                engine.step()
        waits = sum(n for (name, _, _), n in counted.sites.items() if name == "synchronize")
        row = {"k": k, "wall_ms": round(statistics.median(walls), 3),
               "draft_ms": round(statistics.median(s.draft_s for s in kept) * 1000, 3),
               "verify_ms": round(statistics.median(s.verify_s for s in kept) * 1000, 3),
               "tokens_per_step": round(statistics.fmean(s.generated for s in kept), 2),
               "reads_per_step": round((counted.total - waits) / 2, 1), "syncs_per_step": round(waits / 2, 1)}
        row["busy_ms"], row["kernels"] = device_busy(engine.step, 2, device)
        row["static"] = static_ab(engine, steps)
    finally:
        engine.on_step.remove(seen.append)
    return row


def static_ab(engine, steps: int) -> dict | None:
    """The engine's steps with static steps (`engine/static.py`: captured graphs on CUDA) against without, in
    alternating pairs, order rotated: wall ms of each (medians) and off / on paired with its 95% interval. Workers
    without them get eager ones where their attention is flex (a CPU's dry run); None where neither has flex."""
    from serve_app.bench.rounds import paired_ratio
    from serve_app.engine.static import StaticSteps

    held = {w: w.static for w in (engine.target, engine.draft) if w is not None and hasattr(w, "static")}
    fixed = {w: st or StaticSteps(w.device, capture=False) for w, st in held.items() if w.cache.attention == "flex"}
    if not fixed:
        return None

    def step(on: bool) -> float:
        for w, st in fixed.items():
            w.static = st if on else None
        t0 = time.perf_counter()
        engine.step()
        return (time.perf_counter() - t0) * 1000

    walls: dict[bool, list[float]] = {True: [], False: []}
    try:
        for on in (True, False, True):  # each side's shapes first called (on: captured), not timed
            step(on)
        for i in range(steps):
            for on in ((True, False) if i % 2 else (False, True)):
                walls[on].append(step(on))
    finally:
        for w, st in held.items():
            w.static = st
    ab = paired_ratio(walls[False], walls[True])
    st = next(iter(fixed.values()))
    return {"on_ms": round(statistics.median(walls[True]), 3), "off_ms": round(statistics.median(walls[False]), 3),
            "off_over_on": ab, "captured": st.capture, "graphs": st.captured, "replays": st.replays}


def probe_graphs(models, batch_sizes: list[int], ks: list[int], context: int, steps: int, reps: int,
                 deadline_s: float | None = None, seed: int = 0, on_batch=None) -> dict:
    """Both passes at each batch size, on rows of `context` random tokens. on_batch(result so far) after each
    batch (the caller writes its files, so a cut-off run keeps what it measured)."""
    rng = random.Random(seed)
    device = next(models.target.parameters()).device
    vocab = models.target.config.vocab_size
    start = time.perf_counter()
    res: dict = {"context": context, "batches": []}
    for b in tqdm(batch_sizes, desc="graphs probe", unit="batch"):
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            res["batches"].append({"batch": b, "skipped": "deadline"})
            continue
        need = context + (len(ks) * (steps + 6) + 8) * (max(ks) + 1) + 4 * (max(ks) + 2)
        engine = measuring_engine(models, b, max(ks), need, max(PREFILL_BUDGET, b * (max(ks) + 1)), need)
        params = SamplingParams(max_tokens=need - context, ignore_eos=True)
        reqs = [engine.submit(_random_ids(rng, vocab, context), params) for _ in range(b)]
        while any(r not in engine.running for r in reqs):
            engine.step()
        entry = {"batch": b, "steps": [], "forwards": []}
        for k in ks:
            entry["steps"].append(probe_steps(engine, k, steps, device))
        tok = [[_random_ids(rng, vocab, 1)[0]] for _ in range(b)]
        for k in ks:
            row = probe_forward(engine.target, [t * (k + 1) for t in tok], reps)
            entry["forwards"].append({"role": "target", "width": k + 1, **row})
        if engine.draft is not None and getattr(engine.draft, "model", None) is not None:
            row = probe_forward(engine.draft, tok, reps)
            entry["forwards"].append({"role": "draft", "width": 1, **row})
        res["batches"].append(entry)
        for r in reqs:
            engine.abort(r)
        engine.step()
        del engine, reqs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_batch:
            on_batch(res)
    res["seconds"] = round(time.perf_counter() - start, 1)
    return res


def graphs_markdown(res: dict, label: str) -> str:
    def f(v):
        return "" if v is None else str(v)

    lines = [f"# What captured graphs would buy: {label} on {res.get('device', '?')}", "",
             f"Rows of {res['context']} random tokens of context.", "", "## Engine steps as they run today", "",
             "| batch | k | wall ms | draft ms | verify ms | device busy ms | busy / wall | kernels | tokens/step "
             "| host reads | synchronize |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["batches"]:
        for s in e.get("steps", []):
            share = "" if s["busy_ms"] is None else f"{s['busy_ms'] / s['wall_ms']:.2f}"
            lines.append(f"| {e['batch']} | {s['k']} | {s['wall_ms']} | {s['draft_ms']} | {s['verify_ms']} | "
                         f"{f(s['busy_ms'])} | {share} | {f(s['kernels'])} | {s['tokens_per_step']} | "
                         f"{s['reads_per_step']} | {s['syncs_per_step']} |")
    lines += ["", "## Static steps on against off (`static_steps`: captured graphs on CUDA; eager on a CPU)", "",
              "| batch | k | on ms | off ms | off / on, paired | captured | graphs | replays |", "|---|---|---|---|---|---|---|---|"]
    for e in res["batches"]:
        for s in e.get("steps", []):
            a = s.get("static")
            if a:
                lines.append(f"| {e['batch']} | {s['k']} | {a['on_ms']} | {a['off_ms']} | {fmt_paired(a['off_over_on'])} | "
                             f"{a['captured']} | {a['graphs']} | {a['replays']} |")
    lines += ["", "## One forward, eager against captured by hand", "",
              "| batch | role | tokens per row | eager ms | device busy ms | kernels | graph replay ms | eager / graph "
              "| same argmax | max abs diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["batches"]:
        for r in e.get("forwards", []):
            graph = r.get("graph_ms", r.get("capture_error", ""))
            lines.append(f"| {e['batch']} | {r['role']} | {r['width']} | {r['eager_ms']} | {f(r['busy_ms'])} | "
                         f"{f(r['kernels'])} | {graph} | {f(r.get('speedup'))} | {f(r.get('same_argmax'))} | "
                         f"{f(r.get('max_abs_diff'))} |")
        if e.get("skipped"):
            lines.append(f"| {e['batch']} | skipped: {e['skipped']} | | | | | | | | |")
    return "\n".join(lines) + "\n"


__all__ = ["device_busy", "graphs_markdown", "probe_forward", "probe_graphs", "probe_steps"]
