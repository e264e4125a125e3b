"""The context axis of a profile: what a step's draft and verification cost as the rows' KV grows.

The latency grid is measured at a chat answer's context (tens of tokens). Served rows attend far more: a
document question at 2k tokens, an agent's history at 16k. Attention reads every earlier token, so the
verification of k + 1 tokens per row and each draft forward cost more there, and by how much depends on the
hardware and the attention kernel (a paged kernel pays per row, the CPU's gather pads each group to its
longest row). `measure_context` measures it: for each context c, batch size b and k, b rows whose prompts
are c tokens long decode while k is set; each (c, b) visits every k in a shuffled order, two steps a visit,
the second recorded, as the latency grid does. The result (`ContextGrid`) scales the grid's cells from its
own context to the one a step serves (`LatencyGrid.parts_at(batch, context)`).

Prompts are random token ids (fixed by a seed): timing does not depend on what the tokens say, and no
prompt set holds thousands of tokens per row. Cells whose rows do not fit the KV pool are left None.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time

import torch
from tqdm import tqdm

from serve_app.config import SamplingParams
from serve_app.engine.policy import FixedK
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats
from serve_app.pricing import ContextGrid
from serve_app.profiling.measuring import Visit, clock_of, measuring_engine, part_ms, visit

PREFILL_BUDGET = 8192
"""Tokens per step while the long prompts prefill (chunked): large enough to be quick, small enough that a
16k-token row's logits and activations stay modest."""


def _engine(models, batch: int, max_k: int, need: int, budget: int | None = None) -> Engine:
    """A measuring engine for `batch` rows of up to `need` tokens, `budget` tokens a step (default: PREFILL_BUDGET)."""
    # the context limit the rows need (the engine's default stops at 4k), within what the model allows
    limit = getattr(models.target.config, "max_position_embeddings", None) or need
    budget = max(PREFILL_BUDGET, batch * (max_k + 1)) if budget is None else budget
    return measuring_engine(models, batch, max_k, need, budget, max(min(need, limit), 2))


def _random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n random token ids away from both ends of the vocabulary (special tokens sit there)."""
    return [rng.randrange(min(100, vocab // 4), max(vocab - 100, vocab // 2)) for _ in range(n)]


def measure_context(models, batch_sizes: list[int], ks: list[int], contexts: list[int], reps: int = 2,
                    seed: int = 0, deadline_s: float | None = None) -> ContextGrid:
    """The draft's and the verification's median milliseconds per (context, batch size, k). A cell whose rows
    cannot be admitted (KV pool, context limit) or that is not reached by `deadline_s` stays None."""
    # the model draft's own cost: rows copying from their context (prompt lookup) would run no forwards
    models = dataclasses.replace(models, prompt_lookup=False)
    rng = random.Random(seed)
    vocab = models.target.config.vocab_size
    steps_per_round = sum(2 * (k + 1) for k in ks) + 2
    warmup = sum(k + 1 for k in ks)
    start = time.perf_counter()
    measured: list[float] = []
    draft = [[[None] * len(ks) for _ in batch_sizes] for _ in contexts]
    verify = [[[None] * len(ks) for _ in batch_sizes] for _ in contexts]
    backend, clock = None, "wall"
    with tqdm(total=len(contexts) * len(batch_sizes), desc="context grid", unit="cell") as bar:
        for c_i, c in enumerate(contexts):
            seen_ctx: list[float] = []
            for b_i, b in enumerate(batch_sizes):
                bar.update(1)
                if deadline_s is not None and time.perf_counter() - start > deadline_s:
                    continue
                need = c + reps * steps_per_round + warmup + max(ks) + 2
                try:
                    engine = _engine(models, b, max(ks), need)
                    backend = backend or engine.kv_pool.get("attention")
                    params = SamplingParams(max_tokens=reps * steps_per_round + warmup, ignore_eos=True)
                    if b * need > engine.kv_capacity:  # the rows would wait for each other's KV forever
                        raise ValueError(f"{b} rows of {need} tokens need more KV than the pool's "
                                         f"{engine.kv_capacity} tokens")
                    reqs = [engine.submit(_random_ids(rng, vocab, c), params) for _ in range(b)]
                    seen: list[StepStats] = []
                    engine.on_step.append(seen.append)
                    while any(r not in engine.running for r in reqs):
                        engine.step()
                        if len(seen) > 4 * (b * c // PREFILL_BUDGET + b + 4):  # admission stuck: never hang
                            raise RuntimeError("the rows were not all admitted")
                except (ValueError, RuntimeError) as e:  # more KV than the pool holds (or the device), past the context
                    tqdm.write(f"context {c}, batch {b}: not measured ({type(e).__name__}: {str(e)[:200]})")
                    engine = reqs = seen = None
                    gc.collect()
                    continue
                for k in ks:  # warm-up, not recorded: a new engine's first steps at each k run slow
                    engine.policy = FixedK(k)
                    engine.step()
                samples: dict[int, list[Visit]] = {k: [] for k in ks}
                clock = clock_of(engine)
                for _ in range(reps):
                    order = list(ks)
                    rng.shuffle(order)
                    for k in order:
                        samples[k].append(visit(engine, FixedK(k), seen))
                        seen_ctx.append(statistics.fmean(r.context_len for r in reqs))
                for j, k in enumerate(ks):
                    draft[c_i][b_i][j] = part_ms(samples[k], "draft", clock)
                    verify[c_i][b_i][j] = part_ms(samples[k], "verify", clock)
                for r in reqs:
                    engine.abort(r)
                engine.step()
                del engine, reqs, seen
                gc.collect()  # the engine's pool goes before the next one is sized from free memory
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            measured.append(round(statistics.fmean(seen_ctx)) if seen_ctx else c)
    kept = [i for i, cube in enumerate(verify) if any(v is not None for row in cube for v in row)]
    if not kept:
        raise ValueError("no context cell could be measured (KV pool or context limit too small)")
    ctx = [measured[i] for i in kept]
    # contexts must ascend and differ: two requested contexts that ran alike keep the first
    keep = [i for n, i in enumerate(kept) if n == 0 or ctx[n] > ctx[n - 1]]
    layout = "padded" if backend in (None, "gather") else "paged"
    return ContextGrid(contexts=[measured[i] for i in keep], batch_sizes=batch_sizes, ks=ks,
                       draft_ms=[draft[i] for i in keep], verify_ms=[verify[i] for i in keep], layout=layout,
                       backend=backend, clock=clock)


def measure_chunk_context(models, context: int, budget: int, seed: int = 0, reps: int = 3) -> dict:
    """`LatencyGrid.chunk_context_ms`: a prompt of `context` random tokens prefilled alone, in chunks of `budget`
    tokens (at most context / 8) and of budget / 4, `reps` times each (interleaved, after a warm-up pass); each
    chunk step's time against the KV its row held before it gives a line per pass, and the two chunk sizes' median
    slopes (ms per held token) give the parts: a chunk of n tokens after s held pays s * (a + b * n). Also a whole
    chunk's price at context 0 (the lines' median intercept: `at_zero_ms`), by which a merge scales the pair to a
    profile (`scaled_to`)."""
    from serve_app.pricing import line

    rng = random.Random(seed)
    vocab = models.target.config.vocab_size
    budget = max(min(budget, context // 8), 4)  # 8 chunks or more for each line
    sizes = (budget, max(budget // 4, 1))
    slopes: dict[int, list[float]] = {n: [] for n in sizes}
    intercepts: list[float] = []
    for rep in range(reps + 1):
        for size in sizes:
            prompt = _random_ids(rng, vocab, context)
            engine = _engine(models, 1, 0, context + 2, size)
            seen: list[StepStats] = []
            engine.on_step.append(seen.append)
            engine.submit(prompt if rep else prompt[: 4 * size], SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_work():
                engine.step()
            del engine
            gc.collect()
            if not rep:  # the warm-up pass: a fresh process's first forwards run slow
                continue
            # whole chunks past the first (a new engine's first forward runs slow)
            points = [(st.chunks[0][0], 1000 * (st.draft_s + st.verify_s + st.other_s)) for st in seen
                      if len(st.chunks) == 1 and st.chunks[0][1] == size][1:]
            if len(points) < 3:
                raise ValueError(f"{context} tokens in chunks of {size} give {len(points)} chunks past the first: "
                                 f"too few for a line (a longer context)")
            intercept, slope = line([p[0] for p in points], [p[1] for p in points])
            slopes[size].append(slope)
            if size == budget:
                intercepts.append(intercept)
    whole, part = (max(statistics.median(slopes[n]), 0.0) for n in sizes)
    per_pair = max((whole - part) / (sizes[0] - sizes[1]), 0.0)
    per_held = max(whole - per_pair * sizes[0], 0.0)
    return {"chunk_context_ms": [per_held, per_pair], "at_zero_ms": round(max(statistics.median(intercepts), 1e-3), 3),
            "budget": budget, "context": context, "slopes": {n: [round(x, 6) for x in v] for n, v in slopes.items()},
            "chunk_sizes": list(sizes)}


def scaled_to(measured: dict, grid) -> list[float]:
    """A measured chunk-context pair (`measure_chunk_context`) in the units of a latency grid measured on another
    day or machine: scaled by the grid's price of a whole chunk prefilled alone at context 0 (the chunk and a k = 0
    step's forward, as `calibration.step_cost_ms` prices it) over the one measured beside it."""
    price = grid.chunk_ms(1, measured["budget"]) if grid.chunk_ms_per_token is not None else None
    if price:
        price += sum(grid.part_at(part, 1, 0) for part in ("draft", "verify", "other"))
    ratio = price / measured["at_zero_ms"] if price and measured["at_zero_ms"] > 0 else 1.0
    return [round(v * ratio, 8) for v in measured["chunk_context_ms"]]


def context_table(grid: ContextGrid) -> str:
    """Markdown: verification and draft ms per (context, batch) at each k, and each k's verify cost relative to
    the shortest context."""
    lines = [f"Attention backend `{grid.backend}` ({grid.layout}). Cells: draft + verify ms per step.", "",
             "| context | batch | " + " | ".join(f"k = {k}" for k in grid.ks) + " | verify k=0 vs shortest |",
             "|---|---|" + "---|" * (len(grid.ks) + 1)]
    for c_i, c in enumerate(grid.contexts):
        for b_i, b in enumerate(grid.batch_sizes):
            d, v = grid.draft_ms[c_i][b_i], grid.verify_ms[c_i][b_i]
            if v[0] is None:
                continue
            base = grid.verify_ms[0][b_i][0]
            rel = f"{v[0] / base:.2f}x" if base else "-"
            lines.append(f"| {c} | {b} | " + " | ".join(f"{x:.1f} + {y:.1f}" for x, y in zip(d, v)) + f" | {rel} |")
    return "\n".join(lines) + "\n"


__all__ = ["PREFILL_BUDGET", "context_table", "measure_chunk_context", "measure_context", "scaled_to"]
