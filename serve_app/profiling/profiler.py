"""`specserve profile`: measure one hardware type's speculation costs and write its profile.

Runs the real engine (no Ray: GPU boxes with only torch + transformers can profile) in two parts:
1. Latency grid. For each batch size b, b greedy requests run together while the profiler sets k:
   every round (fresh requests, so contexts stay at a chat answer's length) visits each k = 0..K in a
   shuffled order, two steps per visit; each cell is the median
   over `reps` rounds of the second step's draft, verification and other time (the first step of a
   visit pays for switching k and is recorded apart, as the cost of resuming after k = 0).
   Then the chunked prefill's price per batch size: beside b sequences decoding at k = 0, a chat-length
   prompt and a prompt of a whole chunk (the engine's step budget, `max_num_batched_tokens`, less the
   decoding rows) each prefill in a step; their extra time over a plain step gives a fixed part per
   step that prefills and a part per prompt token (simulators add both to the decode step's time).
2. Acceptance per position: the engine at fixed:K over PROFILE_PROMPTS, a prompt set no distillation
   and no benchmark uses (so the policies are never judged on the prompts that tuned them).
From both it derives the best-k table (lowest latency per generated token per batch size) and
the per-token acceptance rate the adaptive policy starts from, and draws a heatmap.
The profiler's engines keep no prefix cache: a prompt seen before would skip its prefill.
"""

from __future__ import annotations

import random
import socket
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from serve_app.config import ModelConfig, SamplingParams
from serve_app.models import LoadedModels, load_models, model_names, resolve_dtype
from serve_app.engine.budget import measured_curve
from serve_app.engine.policy import FixedK, FixedPlan
from serve_app.bench.prompt_sets import PROFILE_PROMPTS, chat_prompts
from serve_app.hardware import detect_gpu_type
from serve_app.pricing import LatencyGrid, best_k_table, ms_per_token
from serve_app.profiling.context import measure_chunk_context, scaled_to
from serve_app.profiling.measuring import BUDGET, Visit, clock_of, measuring_engine, part_ms, part_s, spread, visit
from serve_app.profiling.profiles import Profile, fit_acceptance_rate, load_profile, save_profile
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats


def _prefill(engine: Engine, reqs: list) -> None:
    """Step until every one of `reqs` is decoding (their prefill done: each has its first token)."""
    while any(r not in engine.running for r in reqs):
        engine.step()


def _total_ms(st: StepStats) -> float:
    return (st.draft_s + st.verify_s + st.other_s) * 1000


def _step_ms(v: Visit, clock: str) -> float:
    """A visit's draft + verification time by `clock` (what `spread` compares between rounds)."""
    return (part_s(v, "draft", clock) + part_s(v, "verify", clock)) * 1000


def _worst(samples: dict[int, list[Visit]], clock: str) -> float:
    """The largest disagreement between repeated visits of one cell so far (`spread`)."""
    return max(spread([_step_ms(v, clock) for v in visits]) for visits in samples.values())


def measure_latency(models: LoadedModels, batch_sizes: list[int], ks: list[int], reps: int, bar: tqdm,
                    seed: int = 0, copy_ks: list[int] = (), chunk_prefill: bool = True, agree: float | None = None,
                    max_reps: int | None = None) -> LatencyGrid:
    """Median draft / verify / other time of a step for every (batch size, k), and the chunked prefill's price.

    b greedy requests run together while the profiler sets k, b fresh ones every round (so contexts
    stay at the prompt plus one round's tokens). Each of `reps` rounds (after a warm-up round) visits
    every k once, in a shuffled order, so each k sees the same mix of context lengths and
    predecessors. A visit is two steps at that k: the first pays for the switch (after a k = 0 visit,
    the draft feeds the tokens it skipped) and is kept out of the cell, which records the second, the
    cost a policy that stays at k pays every step. The switch cost is real but belongs to switching:
    `resume_ms` records it for steps that resume speculation after k = 0. The grid's engine has a step
    budget that fits every (b, k) and a round's prompts in one step: the grid is the cost of (b, k)
    itself; the engine lowers k to its budget when serving, and so do the simulators.
    `copy_ks` (past ks[-1]) are visited too, only their verification kept (`LatencyGrid.copy_verify_ms`): the
    draft drafts them with its model here, a copying row without one when serving. `chunk_prefill`: False
    leaves the chunked prefill's price out (`remeasure_copies`).
    On a GPU the draft and verification cells are the workers' device time by CUDA events (`LatencyGrid.clock`),
    the host's wall clock kept beside them (`host_draft_ms`, `host_verify_ms`); on a CPU, the wall clock.
    `agree`: rounds go on past `reps`, up to `max_reps`, until every cell's repeated visits agree within it
    (`measuring.spread` of its draft + verification time; each cell's final spread is in `LatencyGrid.spread`).
    """
    prompts = chat_prompts(models.tokenizer, PROFILE_PROMPTS, max(batch_sizes))
    rounds = reps + 1  # one warm-up round per batch size, not recorded
    visits = list(ks) + list(copy_ks)
    per_round = 2 * sum(k + 1 for k in visits) + 2  # tokens one round can generate per sequence
    rng = random.Random(seed)
    cells = {name: [[0.0] * len(ks) for _ in batch_sizes] for name in ("draft_ms", "verify_ms", "other_ms")}
    copy_verify = [[0.0] * len(copy_ks) for _ in batch_sizes]
    resume_ms, contexts, spreads = [], [], []
    host = {"host_draft_ms": [], "host_verify_ms": []}
    max_reps = max(reps, max_reps or reps) if agree is not None else reps
    chunk: dict[str, list[float]] = {name: [] for name in ("chunk_step_ms", "chunk_ms_per_token", "chunk_draft_step_ms",
                                                           "chunk_draft_ms_per_token")}
    chunk_prompt = None
    longest = max(len(p) for p in prompts)
    for i, b in enumerate(batch_sizes):
        need = longest + per_round + max(visits) + 1
        engine = measuring_engine(models, b, max(visits), need, max(BUDGET, b * (max(visits) + 1), b * longest))
        if need > engine.max_model_len:
            raise ValueError(f"profiling k up to {max(visits)} needs {need} tokens of context; "
                             f"the model allows {engine.max_model_len}: lower --max-k")
        seen: list[StepStats] = []
        engine.on_step.append(seen.append)
        params = SamplingParams(max_tokens=per_round, ignore_eos=True)
        clock = clock_of(engine)
        samples: dict[int, list[Visit]] = {k: [] for k in visits}
        resumes: list[tuple[int, StepStats]] = []  # (k, switch step) right after a k = 0 visit
        prev = r = 0
        # with `agree`: at least two recorded rounds (one visit agrees with nothing), then on while a cell disagrees
        while r < rounds or (r <= max_reps and (r < 3 or _worst(samples, clock) > agree)):
            if r >= rounds:
                bar.total += len(visits)  # a round past `reps`: the cells do not agree yet
            # Fresh requests every round: contexts stay at a chat answer's length (prompt + up to one
            # round's tokens) instead of growing over the rounds; attention reads every earlier token.
            reqs = [engine.submit(prompts[(r * b + j) % len(prompts)], params) for j in range(b)]
            engine.policy = FixedK(0)
            _prefill(engine, reqs)  # one step (the budget fits the prompts), not recorded
            order = list(visits)
            rng.shuffle(order)
            for k in order:
                v = visit(engine, FixedK(k), seen)
                if r:
                    samples[k].append(v)
                    contexts.append(statistics.fmean(len(q.context()) for q in reqs))
                    if prev == 0 and 0 < k <= ks[-1]:
                        resumes.append((k, v.switch))
                prev = k
                bar.update(1)
            for q in reqs:
                engine.abort(q)
            engine.step()  # drops them: frees their KV
            r += 1
        for j, k in enumerate(ks):
            cells["draft_ms"][i][j] = part_ms(samples[k], "draft", clock)
            cells["verify_ms"][i][j] = part_ms(samples[k], "verify", clock)
            cells["other_ms"][i][j] = round(statistics.median(v.kept.other_s for v in samples[k]) * 1000, 3)
        host["host_draft_ms"].append([part_ms(samples[k], "draft", "wall") for k in ks])
        host["host_verify_ms"].append([part_ms(samples[k], "verify", "wall") for k in ks])
        spreads.append([round(spread([_step_ms(v, clock) for v in samples[k]]), 4) for k in ks])
        for j, k in enumerate(copy_ks):
            copy_verify[i][j] = part_ms(samples[k], "verify", clock)
        steady = {k: host["host_draft_ms"][i][j] for j, k in enumerate(ks)}  # the switch steps are wall-clock too
        extra = [s.draft_s * 1000 - steady[k] for k, s in resumes]
        resume_ms.append(round(max(statistics.median(extra), 0.0), 3) if extra else 0.0)
        if chunk_prefill:
            *price, chunk_prompt = measure_chunk_prefill(models, prompts, b, reps, engine.max_model_len)
            for name, v in zip(chunk, price):
                chunk[name].append(round(v, 4))
        bar.update(1)
    if not chunk_prefill:
        chunk = {name: None for name in chunk}
    return LatencyGrid(batch_sizes=batch_sizes, ks=ks, resume_ms=resume_ms, chunk_budget=BUDGET if chunk_prefill else None,
                       chunk_prompt_tokens=chunk_prompt, **chunk,
                       copy_ks=list(copy_ks) or None, copy_verify_ms=copy_verify if copy_ks else None,
                       context_tokens=round(statistics.fmean(contexts)) if contexts else None, clock=clock,
                       spread=spreads, **(host if clock == "events" else {}), **cells)


def measure_chunk_prefill(models: LoadedModels, prompts: list[list[int]], batch: int, reps: int, max_model_len: int,
                          budget: int = BUDGET) -> tuple[float, float, float, float, int]:
    """What prefilling in chunks adds to a step that decodes `batch` sequences at k = 0, with the engine's
    step budget: (ms per step that prefills, ms per prompt token, the draft's parts of both, the short
    prompt's tokens).

    `batch` requests decode at k = 0; then, `max(3, reps)` times: a plain step, a short prompt (a chat
    prompt's mean length) submitted with max_tokens = 1 and prefilled in one step, a plain step, and a
    prompt of a whole chunk (the budget less the decoding rows) likewise. The median extra time of
    each kind over the median plain step gives two points, extra = fixed + tokens x per token."""
    n = max(3, reps)
    full = max(1, min(budget - batch, max_model_len - 2))
    short = max(1, min(round(statistics.fmean(len(p) for p in prompts)), full))
    first = -(-sum(len(prompts[j % len(prompts)]) for j in range(batch)) // budget)  # steps its prefill may take
    max_tokens = 4 * n + first + 4  # the decoding batch never finishes while measured
    need = max(max(len(p) for p in prompts[:batch]) + max_tokens, full + 1) + 2
    engine = measuring_engine(models, batch + 1, 1, need, budget)
    pool = [t for p in prompts for t in p] * ((full + n) // sum(len(p) for p in prompts) + 1)
    seen: list[StepStats] = []
    engine.on_step.append(seen.append)
    decoding = [engine.submit(prompts[j % len(prompts)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for j in range(batch)]
    _prefill(engine, decoding)
    base: list[StepStats] = []
    chunked: dict[int, list[StepStats]] = {short: [], full: []}
    for r in range(n):
        for length in (short, full):
            engine.step()
            base.append(seen[-1])
            start = len(seen)
            req = engine.submit(pool[r: r + length], SamplingParams(max_tokens=1, ignore_eos=True))
            while not req.finished:
                engine.step()
            chunked[length] += seen[start:]
    for q in decoding:
        engine.abort(q)
    engine.step()

    def fit(ms) -> tuple[float, float]:  # (fixed, per token) through the two kinds' median extra times
        plain = statistics.median(ms(s) for s in base)
        extra = {length: statistics.median(ms(s) - plain for s in steps) for length, steps in chunked.items()}
        per_token = max((extra[full] - extra[short]) / (full - short), 0.0) if full > short else 0.0
        fixed = max(extra[short] - short * per_token, 0.0)
        return fixed, per_token

    fixed, per_token = fit(_total_ms)
    draft_fixed, draft_per_token = fit(lambda s: s.draft_s * 1000)
    return fixed, per_token, min(draft_fixed, fixed), min(draft_per_token, per_token), short


def measure_acceptance(models: LoadedModels, k: int, num_prompts: int, max_tokens: int,
                       bar: tqdm) -> tuple[list[float], list[float] | None]:
    """acceptance[i] = share of (sequence, step) pairs at fixed k where draft token i was accepted; and the
    draft's acceptance per confidence bin over the same steps (`budget.measured_curve`)."""
    batch = min(8, num_prompts)
    prompts = chat_prompts(models.tokenizer, PROFILE_PROMPTS, num_prompts)
    engine = measuring_engine(models, batch, k, max(len(p) for p in prompts) + max_tokens + k + 1,
                              max(BUDGET, batch * (k + 1)))
    engine.policy = FixedPlan(k)  # fixed k, the draft's confidences recorded
    accepted, seqs, outcomes = [0] * k, 0, []

    def count(st: StepStats) -> None:
        nonlocal seqs
        if st.k == k and st.batch_size:
            seqs += st.batch_size
            for i, n in enumerate(st.accepted_per_position):
                accepted[i] += n
            if st.rows is not None:
                outcomes.append(st.rows)

    engine.on_step.append(count)
    params = SamplingParams(max_tokens=max_tokens)
    for start in range(0, len(prompts), batch):
        engine.run([engine.submit(p, params) for p in prompts[start:start + batch]])
        bar.update(len(prompts[start:start + batch]))
    return ([round(a / seqs, 4) for a in accepted] if seqs else [0.0] * k), measured_curve(outcomes)


def run_profile(mc: ModelConfig, out: str | None, batch_sizes: list[int], max_k: int, reps: int,
                num_prompts: int, max_tokens: int, copy_ks: list[int] = (), agree: float | None = None,
                max_reps: int | None = None) -> tuple[Profile, Path]:
    models = load_models(mc)
    if models.draft is None:
        raise ValueError("profiling needs a draft model (--draft): without one there is no k to choose")
    out_path = Path(out or f"profiles/{detect_gpu_type()}.json")
    target, draft = model_names(mc)
    profile = measure_profile(models, target, draft, resolve_dtype(mc.dtype, mc.device), mc.device, batch_sizes, max_k,
                              reps, num_prompts, max_tokens, copy_ks, agree, max_reps)
    save_profile(profile, out_path)
    plot_profile(profile, out_path.with_suffix(".png"))
    return profile, out_path


def _pair_of(profile: Profile, mc: ModelConfig, what: str) -> LoadedModels:
    """The models of `mc`, checked to be the profile's own pair and dtype (a ValueError naming `what` without a
    draft): a profile measured again in part keeps what it was measured with."""
    models = load_models(mc)
    if models.draft is None:
        raise ValueError(f"{what} needs a draft model (--draft)")
    target, draft = model_names(mc)
    profile.check_pair(target, draft, resolve_dtype(mc.dtype, mc.device))
    return models


def remeasure_acceptance(mc: ModelConfig, path: str | None, num_prompts: int, max_tokens: int) -> tuple[Profile, Path]:
    """`specserve profile --acceptance-only`: an existing measured profile's acceptance side measured again on
    its own pair and dtype (per position at its k, the fitted rate, the confidence curve, and the best-k table
    from its latency grid, which stays as measured). For a profile from before the confidence curve, or a pair
    whose acceptance moved (a retrained draft of the same shape), without timing the grid again."""
    out_path = Path(path or f"profiles/{detect_gpu_type()}.json")
    profile = load_profile(out_path)
    if profile.source != "measured" or not profile.acceptance:
        raise ValueError(f"{out_path} is not a measured profile with acceptance: measure it whole (`specserve profile`)")
    models = _pair_of(profile, mc, "measuring acceptance")
    k = len(profile.acceptance)
    torch.manual_seed(0)
    with tqdm(total=num_prompts, desc=f"acceptance {profile.gpu_type}", unit="prompt") as bar:
        acceptance, curve = measure_acceptance(models, k, num_prompts, max_tokens, bar)
    note = (f"; acceptance and confidence curve measured again by `specserve profile --acceptance-only` on "
            f"{socket.gethostname()} at {datetime.now(timezone.utc).isoformat(timespec='seconds')}: k={k} over "
            f"{num_prompts} PROFILE_PROMPTS x {max_tokens} tokens")
    profile = profile.model_copy(update={
        "acceptance": acceptance, "acceptance_rate": round(fit_acceptance_rate(acceptance), 4),
        "confidence_curve": curve, "notes": profile.notes + note,
        "best_k": best_k_table(profile.latency, acceptance) if profile.latency is not None else profile.best_k})
    profile = Profile.model_validate(profile.model_dump())
    save_profile(profile, out_path)
    plot_profile(profile, out_path.with_suffix(".png"))
    return profile, out_path


def copy_ks_for(max_k: int, max_copy: int) -> list[int]:
    """The copy columns a profile measures past k = max_k: halfway to `max_copy` (a copy's longest) and `max_copy`
    itself; none where copies stop at max_k."""
    if max_copy <= max_k:
        return []
    return sorted({max_k + (max_copy - max_k + 1) // 2, max_copy} - {max_k})


def remeasure_copies(mc: ModelConfig, path: str | None, copy_ks: list[int], reps: int,
                     anchors: int = 3) -> tuple[Profile, Path, dict]:
    """`specserve profile --copies-only`: add the verification at `copy_ks` (past the grid's longest k) to an existing
    measured profile, its grid otherwise kept. This machine runs today at its own speed (on a shared machine 20-60%
    off the day the grid was measured), so the new columns are measured beside the grid's last `anchors` k, in the
    same rounds, and scaled per batch size by the median of profiled / measured over those anchors: a copy column
    keeps its ratio to the columns the profile has. Returns the profile, its path and the factors."""
    out_path = Path(path or f"profiles/{detect_gpu_type()}.json")
    profile = load_profile(out_path)
    grid = profile.latency
    if profile.source != "measured" or grid is None:
        raise ValueError(f"{out_path} is not a measured profile with a latency grid: measure it whole (`specserve profile`)")
    if not copy_ks or min(copy_ks) <= grid.ks[-1]:
        raise ValueError(f"copy columns must lie past the grid's longest k, {grid.ks[-1]}")
    models = _pair_of(profile, mc, "measuring the copies' verification")
    shared = [k for k in grid.ks if k >= 1][-anchors:]
    torch.manual_seed(0)
    with tqdm(total=len(grid.batch_sizes) * ((reps + 1) * (1 + len(shared) + len(copy_ks)) + 1),
              desc=f"copies {profile.gpu_type}", unit="cell") as bar:
        now = measure_latency(models, grid.batch_sizes, [0] + shared, reps, bar, copy_ks=copy_ks, chunk_prefill=False)
    factors = [statistics.median(grid.verify_ms[i][grid.ks.index(k)] / now.verify_ms[i][j + 1]
                                 for j, k in enumerate(shared) if now.verify_ms[i][j + 1] > 0)
               for i in range(len(grid.batch_sizes))]
    columns = [[round(v * f, 3) for v in row] for row, f in zip(now.copy_verify_ms, factors)]
    note = (f"; verification at k = {', '.join(map(str, copy_ks))} (copies) measured by `specserve profile --copies-only` "
            f"on {socket.gethostname()} at {datetime.now(timezone.utc).isoformat(timespec='seconds')} beside k = "
            f"{', '.join(map(str, shared))}, scaled per batch size to the grid by profiled / measured over those "
            f"(factors {', '.join(f'{f:.2f}' for f in factors)}; mean context {now.context_tokens} tokens)")
    latency = grid.model_copy(update={"copy_ks": list(copy_ks), "copy_verify_ms": columns})
    profile = Profile.model_validate(profile.model_dump() | {"latency": latency.model_dump(), "notes": profile.notes + note})
    save_profile(profile, out_path)
    plot_profile(profile, out_path.with_suffix(".png"))
    return profile, out_path, {"factors": factors, "measured": now.model_dump()}


def remeasure_chunk_context(mc: ModelConfig, path: str | None, context: int) -> tuple[Profile, Path, dict]:
    """`specserve profile --chunk-context-only`: add what a prompt chunk pays for the KV its row holds
    (`LatencyGrid.chunk_context_ms`, `profiling.context.measure_chunk_context` on a prompt of `context` tokens) to
    an existing measured profile, scaled to its chunk price (this machine runs today at its own speed)."""
    out_path = Path(path or f"profiles/{detect_gpu_type()}.json")
    profile = load_profile(out_path)
    grid = profile.latency
    if profile.source != "measured" or grid is None or grid.chunk_ms_per_token is None:
        raise ValueError(f"{out_path} is not a measured profile with a chunk price: measure it whole (`specserve profile`)")
    models = _pair_of(profile, mc, "measuring the chunks' context price")
    torch.manual_seed(0)
    found = measure_chunk_context(models, context, grid.chunk_budget or BUDGET)
    pair = scaled_to(found, grid)
    note = (f"; chunk_context_ms measured by `specserve profile --chunk-context-only` on {socket.gethostname()} at "
            f"{datetime.now(timezone.utc).isoformat(timespec='seconds')} (a {context}-token prompt in chunks of "
            f"{found['chunk_sizes']}; a whole chunk at the start {found['at_zero_ms']} ms there, scaled to the grid's)")
    latency = grid.model_copy(update={"chunk_context_ms": pair})
    profile = Profile.model_validate(profile.model_dump() | {"latency": latency.model_dump(), "notes": profile.notes + note})
    save_profile(profile, out_path)
    return profile, out_path, found


def measure_profile(models: LoadedModels, target: str, draft: str, dtype: str, device: str, batch_sizes: list[int],
                    max_k: int, reps: int, num_prompts: int, max_tokens: int, copy_ks: list[int] = (),
                    agree: float | None = None, max_reps: int | None = None) -> Profile:
    """This machine's profile of a loaded pair (named target / draft): latency grid (with the verification at
    `copy_ks`; rounds past `reps` up to `max_reps` while its cells' visits disagree by more than `agree`),
    acceptance, best-k table."""
    gpu_type = detect_gpu_type()
    ks = list(range(max_k + 1))
    torch.manual_seed(0)
    total = len(batch_sizes) * ((reps + 1) * (len(ks) + len(copy_ks)) + 1) + num_prompts
    with tqdm(total=total, desc=f"profile {gpu_type}", unit="cell") as bar:
        grid = measure_latency(models, batch_sizes, ks, reps, bar, copy_ks=copy_ks, agree=agree, max_reps=max_reps)
        acceptance, curve = measure_acceptance(models, max_k, num_prompts, max_tokens, bar)
    return Profile(
        gpu_type=gpu_type, target=target, draft=draft, dtype=dtype, latency=grid, acceptance=acceptance,
        confidence_curve=curve,
        acceptance_rate=round(fit_acceptance_rate(acceptance), 4), best_k=best_k_table(grid, acceptance),
        machine=socket.gethostname(),
        notes=(f"specserve profile: greedy; latency: {reps} rounds after a warm-up round"
               + (f" (up to {max(reps, max_reps or reps)} until repeated visits of every cell agree within "
                  f"{agree:.0%}; worst spread {max(max(r) for r in grid.spread):.1%})" if agree is not None else "")
               + f", cells timed by {'CUDA events (device work; the host wall clock beside them)' if grid.clock == 'events' else 'the wall clock'}"
               + ", fresh requests each round "
               f"(mean context {grid.context_tokens} tokens), k visited in a shuffled order, two steps per visit, "
               "the second recorded (median over rounds); chunked prefill: "
               f"{grid.chunk_prompt_tokens}-token and whole-chunk prompts ({grid.chunk_budget}-token step budget) "
               "beside each batch decoding at k = 0; torch threads "
               f"{torch.get_num_threads()}, device {device}; acceptance at k={max_k} over {num_prompts} "
               f"PROFILE_PROMPTS x {max_tokens} tokens"
               + (f"; verification also at k = {', '.join(map(str, copy_ks))} (copies)" if copy_ks else "")),
    )


def plot_profile(profile: Profile, path: str | Path) -> None:
    """Heatmap of ms per generated token over (batch size, k) with each row's best k boxed, and
    acceptance per position beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    g = profile.latency
    grid = ms_per_token(g, profile.acceptance or [])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(g.batch_sizes) + 3),
                                  gridspec_kw={"width_ratios": [3, 1.3]})
    im = ax.imshow(grid, cmap="viridis_r", norm=LogNorm(), aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.1f}" if v >= 1 else f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if v > (min(row) * max(row)) ** 0.5 else "black")
        j = g.ks.index(profile.best_k[g.batch_sizes[i]])
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(g.ks)), g.ks)
    ax.set_yticks(range(len(g.batch_sizes)), g.batch_sizes)
    ax.set_xlabel("speculation length k (0 = plain decoding)")
    ax.set_ylabel("batch size")
    ax.set_title("latency per generated token (ms); red box = best k")
    fig.colorbar(im, ax=ax, label="ms per token")
    acc = profile.acceptance or []
    ax2.bar(range(len(acc)), acc, color="tab:blue", label="measured" if profile.source == "measured" else "assumed")
    a = profile.acceptance_rate or 0.0
    ax2.plot(range(len(acc)), [a ** (i + 1) for i in range(len(acc))], "o-", color="tab:orange",
             label=f"model a^(i+1), a={a:.2f}")
    ax2.set_xticks(range(len(acc)))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("P(draft token i accepted)")
    ax2.set_title(f"acceptance; E[tokens/step] at k={len(acc)}: {1 + sum(acc):.2f}")
    ax2.legend(fontsize=8)
    kind = "\nPREDICTED by the roofline model (serve_app/profiling/roofline.py), not measured" if profile.source == "predicted" else ""
    fig.suptitle(f"{profile.gpu_type}: target {profile.target}, draft {profile.draft} ({profile.dtype}, {profile.created[:10]}){kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

