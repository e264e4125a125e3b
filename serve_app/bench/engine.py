"""`specserve bench engine`: the engine against Hugging Face `generate` on the same prompts, same round.

Sides, each warmed up once, then run once per round in a rotating order:
- HF `generate`, target only, greedy, one prompt at a time over all prompts (timed per prompt, so the
  batch-1 runs and the concurrent runs are each divided by HF's time on exactly their own prompts);
  when the engine runs in bfloat16 or float16 (`--dtype auto` on bf16 hardware), HF `generate`
  on a float32 copy of the target as well: the plain float32 baseline a user starts from;
- the engine at batch 1 (requests one after the other) with `none` and every fixed:K;
- the engine with all `concurrency` requests submitted at once, with `none` and every fixed:K.
Every side generates exactly `max_tokens` tokens per prompt (EOS ignored). Ratios are taken within a
round, then the median over rounds is reported with its range; every output of every run is
compared with HF's. Single-token forward latencies of target and draft are read every round too.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from tqdm import tqdm

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.hardware import sync
from serve_app.models import held_dtype, load_models, load_target
from serve_app.bench.prompt_sets import BENCH_PROMPTS, chat_prompts
from serve_app.engine.scheduler import Engine
from serve_app.bench.rounds import fmt_ratio, rotated, summary


def hf_generate(model, prompts: list[list[int]], max_tokens: int, bar: tqdm) -> tuple[list[float], list[list[int]]]:
    """Target-only greedy `model.generate`, one prompt at a time, exactly max_tokens each; (seconds per prompt, outputs).

    (`min_new_tokens` would be wrong here: it forbids EOS, so HF would pick another token where the engine,
    told to ignore EOS, emits it and goes on.)"""
    times, outs = [], []
    device = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=device)  # [1, S] where the model is (`--device cuda`)
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                eos_token_id=[],  # no EOS: generate past it without suppressing it, as the engine's ignore_eos does
            )
        sync(device)  # on a GPU the last kernels may still run: time them, not their launch
        times.append(time.perf_counter() - t)
        outs.append(out[0, len(p):].tolist())
        bar.update(1)
    return times, outs


@dataclasses.dataclass
class EngineRun:
    seconds: float
    outputs: list[list[int]]
    proposed: int
    accepted: int
    steps: int
    """Decode steps summed over requests (a request's share of each step it was in)."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else 1.0


def engine_run(models, policy: str, prompts: list[list[int]], max_tokens: int, batch: int, bar: tqdm,
               temperature: float = 0.0, seeded: bool = False) -> EngineRun:
    """Engine run (greedy by default; seeded: request i has seed i, the coupled sampler): `batch` 1
    feeds requests one at a time, otherwise all at once. Fresh workers."""
    if policy == "none":
        models = dataclasses.replace(models, draft=None)
    engine = Engine.from_models(models, EngineConfig(policy=policy, max_batch_size=max(batch, 1), max_k=8))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
    groups = [[p] for p in prompts] if batch == 1 else [prompts]
    run = EngineRun(0.0, [], 0, 0, 0)
    for group in groups:
        t = time.perf_counter()
        reqs = [engine.submit(p, params.model_copy(update={"seed": len(run.outputs) + i}) if seeded else params)
                for i, p in enumerate(group)]
        engine.run(reqs)
        run.seconds += time.perf_counter() - t
        run.outputs += [r.output_ids for r in reqs]
        run.proposed += sum(r.stats.proposed for r in reqs)
        run.accepted += sum(r.stats.accepted for r in reqs)
        run.steps += sum(r.stats.steps for r in reqs)
        bar.update(len(group))
    return run


def forward_ms(model, context: int = 64, reps: int = 30) -> float:
    """Median latency of one single-token forward at batch 1 after `context` cached tokens. Inputs are made
    on the model's device, which is synchronized before each clock read: a GPU runs kernels
    asynchronously, and the clock alone would time their launch."""
    from transformers import DynamicCache

    times = []
    device = next(model.parameters()).device  # any draft's, not only a Hugging Face model's `.device`
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        vocab = model.config.vocab_size
        model(torch.arange(1, context + 1, device=device)[None] % vocab, past_key_values=cache, use_cache=True)
        for i in range(reps):
            token = torch.tensor([[7 % vocab]], device=device)  # [1, 1]
            position = torch.tensor([[context + i]], device=device)  # [1, 1]
            sync(device)  # the prefill or the previous step is done before the clock starts
            t = time.perf_counter()
            model(token, position_ids=position, past_key_values=cache, use_cache=True)
            sync(device)
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1000


def bench_engine(mc: ModelConfig, max_tokens: int = 64, num_prompts: int = 4, ks: list[int] = (1, 2, 4),
                 concurrency: int = 16, rounds: int = 3) -> tuple[dict, str]:
    """Run the comparison; returns (results, markdown report)."""
    torch.manual_seed(0)
    models = load_models(mc)
    n_all = max(num_prompts, concurrency)
    prompts = chat_prompts(models.tokenizer, BENCH_PROMPTS, n_all)
    single, many = prompts[:num_prompts], prompts[:concurrency]
    policies = ["none"] + [f"fixed:{k}" for k in ks if models.draft is not None]
    low_precision = held_dtype(models.target) in ("bfloat16", "float16")  # a widened bfloat16 model included
    # a float32 load of the same weights (a GGUF-loaded model refuses `.float()`)
    hf32 = load_target(mc.target, "float32", mc.device)[0] if low_precision else None
    baselines = ["hf"] + (["hf32"] if hf32 is not None else [])
    sides = baselines + [(p, 1) for p in policies] + [(p, concurrency) for p in policies]
    per_round = len(baselines) * n_all + len(policies) * (num_prompts + concurrency)
    runs: dict = {s: [] for s in sides}
    hf_ref: list[list[int]] | None = None
    hf_stable, fwd = True, {"target": [], "draft": []}

    def run_side(side, bar, toks: int, warm: bool):
        if side in baselines:
            return hf_generate(models.target if side == "hf" else hf32, prompts[:2] if warm else prompts, toks, bar)
        policy, batch = side
        chosen = (single if batch == 1 else many)[: 2 if warm and batch == 1 else None]
        return engine_run(models, policy, chosen, toks, batch, bar)

    warm_up = len(baselines) * min(2, n_all) + len(policies) * (min(2, num_prompts) + concurrency)
    with tqdm(total=per_round * rounds + warm_up,
              desc="bench engine", unit="req") as bar:
        bar.set_postfix_str("warm-up")
        for side in sides:  # every side once, short: first-call allocations, thread pools, caches
            run_side(side, bar, 8, warm=True)
        # a draft with a worker of its own (EAGLE-3, n-gram) has no plain causal-LM forward to time alone
        timed_draft = models.draft if models.draft is not None and not hasattr(models.draft, "worker_class") else None
        forward_ms(models.target, reps=3)
        if timed_draft is not None:
            forward_ms(timed_draft, reps=3)
        for r in range(rounds):
            for side in rotated(sides, r):
                bar.set_postfix_str(f"round {r + 1}/{rounds}: {side if side in baselines else f'{side[0]} x{side[1]}'}")
                res = run_side(side, bar, max_tokens, warm=False)
                if side == "hf":
                    hf_stable &= hf_ref is None or res[1] == hf_ref
                    hf_ref = hf_ref or res[1]
                runs[side].append(res)
            fwd["target"].append(forward_ms(models.target))
            if timed_draft is not None:
                fwd["draft"].append(forward_ms(timed_draft))

    hf_time = {n: [sum(times[:n]) for times, _ in runs["hf"]] for n in (num_prompts, concurrency)}
    hf32_time = {n: [sum(times[:n]) for times, _ in runs["hf32"]] for n in (num_prompts, concurrency)} if hf32 is not None else None
    results = {"target": models.target_name, "draft": models.draft_name, "max_tokens": max_tokens,
               "dtype": held_dtype(models.target),
               "num_prompts": num_prompts, "concurrency": concurrency, "rounds": rounds,
               "prompts": "BENCH_PROMPTS", "hf_outputs_stable_over_rounds": hf_stable, "rows": []}
    for n in (num_prompts, concurrency):
        results["rows"].append({"run": f"HF generate, batch 1, {n} prompts (baseline)",
                                "tokens_per_s": summary([n * max_tokens / s for s in hf_time[n]]), "same_as_hf": True})
        if hf32_time is not None:
            results["rows"].append({"run": f"HF generate float32, batch 1, {n} prompts",
                                    "tokens_per_s": summary([n * max_tokens / s for s in hf32_time[n]]),
                                    "vs_hf": summary([h / s for h, s in zip(hf_time[n], hf32_time[n])]),
                                    "same_as_hf": all(o[:n] == hf_ref[:n] for _, o in runs["hf32"])})
    for p, batch in sides[len(baselines):]:
        n = num_prompts if batch == 1 else concurrency
        rs = runs[(p, batch)]
        none = runs[("none", batch)]
        results["rows"].append({
            "run": f"engine {p}, " + ("batch 1" if batch == 1 else f"{concurrency} concurrent"),
            "policy": p, "batch": batch,
            "tokens_per_s": summary([n * max_tokens / x.seconds for x in rs]),
            "vs_hf": summary([h / x.seconds for h, x in zip(hf_time[n], rs)]),
            "vs_engine_none": summary([y.seconds / x.seconds for y, x in zip(none, rs)]),
            **({"vs_hf_float32": summary([h / x.seconds for h, x in zip(hf32_time[n], rs)])} if hf32_time else {}),
            "acceptance": statistics.median(x.acceptance for x in rs) if p != "none" else None,
            "tokens_per_step": statistics.median(x.tokens_per_step for x in rs),
            "same_as_hf": all(x.outputs == hf_ref[:n] for x in rs),
        })
    b1 = [row for row in results["rows"] if row.get("batch") == 1 and row["policy"] != "none"]
    if b1:
        best = max(b1, key=lambda row: row["vs_engine_none"]["median"])
        results["best_fixed_batch1"] = {"policy": best["policy"], "vs_engine_none": best["vs_engine_none"],
                                        "vs_hf": best["vs_hf"],
                                        **({"vs_hf_float32": best["vs_hf_float32"]} if hf32_time else {})}
    if fwd["draft"]:
        results["forward_ms"] = {"target": summary(fwd["target"]), "draft": summary(fwd["draft"]),
                                 "draft_share": summary([d / t for d, t in zip(fwd["draft"], fwd["target"])])}
    return results, engine_markdown(results)


def engine_markdown(res: dict) -> str:
    f32 = any("vs_hf_float32" in row for row in res["rows"])
    lines = [f"# bench engine: target {res['target']}, draft {res['draft']}, {res.get('dtype', 'float32')}", "",
             f"{res['max_tokens']} new tokens per prompt (greedy, EOS ignored), {res['num_prompts']} prompts at batch 1, "
             f"{res['concurrency']} concurrent; {res['rounds']} rounds after a warm-up of every side, sides interleaved "
             "in a rotating order. Ratios are taken within a round; median (range) over rounds.", "",
             "| run | tokens/s | vs HF generate b1 (same prompts) | " + ("vs HF float32 b1 | " if f32 else "")
             + "vs engine none (same batch) | acceptance | tokens/step | identical to HF |",
             "|---|---|---|" + ("---|" if f32 else "") + "---|---|---|---|"]
    for row in res["rows"]:
        tps = row["tokens_per_s"]
        lines.append(f"| {row['run']} | {tps['median']:.1f} (±{50 * tps['spread']:.0f}%) | "
                     f"{fmt_ratio(row['vs_hf']) if 'vs_hf' in row else '1.00x'} | "
                     + (f"{fmt_ratio(row['vs_hf_float32']) if 'vs_hf_float32' in row else ''} | " if f32 else "")
                     + f"{fmt_ratio(row['vs_engine_none']) if 'vs_engine_none' in row else ''} | "
                     f"{'' if row.get('acceptance') is None else format(row['acceptance'], '.2f')} | "
                     f"{format(row['tokens_per_step'], '.2f') if 'tokens_per_step' in row else ''} | {row['same_as_hf']} |")
    lines.append("")
    if "best_fixed_batch1" in res:
        b = res["best_fixed_batch1"]
        lines.append(f"Best fixed k at batch 1: {b['policy']}, {fmt_ratio(b['vs_engine_none'])} engine none, "
                     f"{fmt_ratio(b['vs_hf'])} HF generate"
                     + (f", {fmt_ratio(b['vs_hf_float32'])} HF generate in float32." if "vs_hf_float32" in b else "."))
    if "forward_ms" in res:
        f = res["forward_ms"]
        lines.append(f"Single-token forward at batch 1 (median of 30 per round): target {f['target']['median']:.1f} ms, "
                     f"draft {f['draft']['median']:.1f} ms; draft / target {f['draft_share']['median']:.1%} "
                     f"({f['draft_share']['min']:.1%}-{f['draft_share']['max']:.1%} over rounds).")
    if not res["hf_outputs_stable_over_rounds"]:
        lines.append("WARNING: HF generate's own outputs differed between rounds.")
    if res.get("dtype", "float32") != "float32":
        lines.append(f"In {res['dtype']}, 'identical to HF' compares with HF generate in {res['dtype']}: a verify "
                     "forward over k + 1 tokens rounds differently from k + 1 single-token forwards, so a near-tie "
                     "can flip (see docs/architecture.md, 'In bfloat16').")
    return "\n".join(lines) + "\n"
