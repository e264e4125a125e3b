"""A short profile measured at startup, on the engine that will serve (`EngineConfig.startup_profile`).

A profile measured on another machine of the type can be 20-35% off (more where contexts differ from the
profiling prompts'), and calibration needs a few hundred steps of real traffic to correct it. A replica
whose store holds no profile measured on its own machine can instead spend a few seconds before serving:
a few batch sizes and k, two rounds of two steps per cell, on its own workers (local or Ray actors alike:
it only drives `Engine.step`), and the draft's acceptance per position at the largest k. The result is a
`measured` profile of this machine that the replica steers by (and calibrates further); it is not pushed
to the store, where it would replace the type's full profile for every machine. A long-context pass (rows of
`LONG_CONTEXT` tokens) gives its grid a two-point context axis, so steps are priced at the context they serve.
"""

from __future__ import annotations

import socket
import statistics
import time

from serve_app.bench.prompt_sets import PROFILE_PROMPTS, chat_prompts
from serve_app.config import SamplingParams
from serve_app.engine.budget import measured_curve
from serve_app.engine.policy import FixedK, FixedPlan
from serve_app.pricing import ContextGrid, LatencyGrid, best_k_table
from serve_app.profiling.measuring import visit
from serve_app.profiling.profiles import Profile, fit_acceptance_rate

BATCH_SIZES = (1, 4, 16)
"""Batch sizes of a startup profile (clipped to the engine's max_batch_size); policies interpolate between."""
KS = (0, 1, 2, 4)
"""Speculation lengths of a startup profile (clipped to the engine's max_k)."""


LONG_CONTEXT = 512
"""Tokens per row of the startup profile's long-context pass (the context axis' second point)."""


def _long_context_pass(engine, sizes: list[int], ks: list[int], prompts: list[list[int]], parts: dict, base: int,
                       seen: list) -> ContextGrid | None:
    """The draft's and verification's cells again with rows of about LONG_CONTEXT tokens (the profiling prompts
    repeated), one round after a warm-up visit per k: with the grid's own cells, a two-point context axis. Batch
    sizes whose rows do not fit the KV pool at that length stay None; None when none fits."""
    long = (sum(prompts, []) * (LONG_CONTEXT // max(1, sum(len(p) for p in prompts)) + 1))[:LONG_CONTEXT]
    per_round = 2 * sum(k + 1 for k in ks) + sum(k + 1 for k in ks) + 2
    draft, verify, measured = [], [], []
    for b in sizes:
        if b * (LONG_CONTEXT + per_round + max(ks) + 2) > engine.kv_capacity or LONG_CONTEXT + per_round >= engine.max_model_len:
            draft.append([None] * len(ks))
            verify.append([None] * len(ks))
            continue
        reqs = [engine.submit(long, SamplingParams(max_tokens=per_round, ignore_eos=True)) for _ in range(b)]
        engine.policy = FixedK(0)
        while any(q.stats.generated_tokens == 0 for q in reqs):
            engine.step()
        cells = {}
        for k in ks:
            kept = visit(engine, FixedK(k), seen).kept  # the dropped first step warms this shape up and pays the switch
            cells[k] = kept
            measured.append(statistics.fmean(len(q.prompt_ids) + q.stats.generated_tokens for q in reqs))
        for q in reqs:
            engine.abort(q)
        engine.step()
        draft.append([round(cells[k].draft_s * 1000, 3) for k in ks])
        verify.append([round(cells[k].verify_s * 1000, 3) for k in ks])
    if not measured or round(statistics.fmean(measured)) <= base:
        return None
    layout = "padded" if engine.kv_pool.get("attention") in (None, "gather") else "paged"
    return ContextGrid(contexts=[base, round(statistics.fmean(measured))], batch_sizes=sizes, ks=ks, layout=layout,
                       backend=engine.kv_pool.get("attention"), draft_ms=[parts["draft_ms"], draft],
                       verify_ms=[parts["verify_ms"], verify])


def short_profile(engine, gpu_type: str, target: str, draft: str, dtype: str, rounds: int = 2,
                  batch_sizes: tuple[int, ...] = BATCH_SIZES, ks: tuple[int, ...] = KS) -> Profile:
    """Measure a small latency grid and the acceptance per position on `engine` (idle: nothing else
    running), then leave it as it was (its policy, no requests). `notes` records what it cost."""
    t0 = time.perf_counter()
    sizes = sorted({min(b, engine.config.max_batch_size) for b in batch_sizes})
    ks = sorted({k for k in ks if k <= engine.config.max_k} | {0})
    if len(ks) < 2:
        raise ValueError("a startup profile needs max_k >= 1")
    prompts = chat_prompts(engine.tokenizer, PROFILE_PROMPTS, max(sizes))
    per_round = 2 * sum(k + 1 for k in ks) + 2
    seen = []
    engine.on_step.append(seen.append)
    policy = engine.policy
    parts = {"draft_ms": [], "verify_ms": [], "other_ms": []}
    accepted, rows, contexts, outcomes = [0] * max(ks), 0, [], []
    try:
        for b in sizes:
            samples = {k: [] for k in ks}
            for r in range(rounds + 1):  # the first round warms up (first calls at this shape): not recorded
                reqs = [engine.submit(prompts[(r * b + j) % len(prompts)],
                                      SamplingParams(max_tokens=per_round, ignore_eos=True)) for j in range(b)]
                engine.policy = FixedK(0)
                while any(q.stats.generated_tokens == 0 for q in reqs):  # prefill (in chunks)
                    engine.step()
                for k in ks:  # two steps per k: the first pays for switching, the second is the cell
                    # the acceptance cell (largest k) records the draft's confidences: the curve budget starts from
                    kept = visit(engine, FixedPlan(k) if k == max(ks) else FixedK(k), seen).kept
                    if r:
                        samples[k].append(kept)
                        contexts.append(statistics.fmean(len(q.prompt_ids) + q.stats.generated_tokens for q in reqs))
                for q in reqs:
                    engine.abort(q)
                engine.step()  # drops them
            for name, attr in (("draft_ms", "draft_s"), ("verify_ms", "verify_s"), ("other_ms", "other_s")):
                parts[name].append([round(statistics.median(getattr(s, attr) for s in samples[k]) * 1000, 3) for k in ks])
            for st in samples[max(ks)]:
                rows += st.batch_size
                for j, n in enumerate(st.accepted_per_position):
                    accepted[j] += n
                if st.rows is not None:
                    outcomes.append(st.rows)
        context = _long_context_pass(engine, sizes, ks, prompts, parts, round(statistics.fmean(contexts)), seen)
    finally:
        engine.on_step.remove(seen.append)
        engine.policy = policy
    grid = LatencyGrid(batch_sizes=sizes, ks=ks, context_tokens=max(1, round(statistics.fmean(contexts))),
                       context=context, **parts)
    acceptance = [round(a / rows, 4) for a in accepted]
    seconds = time.perf_counter() - t0
    return Profile(gpu_type=gpu_type, target=target, draft=draft, dtype=dtype, latency=grid, acceptance=acceptance,
                   confidence_curve=measured_curve(outcomes),
                   acceptance_rate=round(fit_acceptance_rate(acceptance), 4), best_k=best_k_table(grid, acceptance),
                   machine=socket.gethostname(),
                   notes=f"startup profile: measured in {seconds:.1f} s on the serving engine before it served; batch "
                         f"sizes {sizes}, k {ks}, {rounds} rounds after a warm-up round, the second of two steps per "
                         f"cell; acceptance at k={max(ks)} over {rows} rows")
