"""Benchmarks: every figure is a ratio against a baseline measured in the same process and run.

`specserve bench engine`: greedy tokens/s of the engine (policy none and fixed:K) at batch 1 against
Hugging Face `generate` on the target alone; and the engine with many concurrent requests against
HF batch-1 sequential decoding. Outputs are also checked token-for-token against HF.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from tqdm import tqdm

from .config import EngineConfig, ModelConfig, SamplingParams
from .models import load_models
from .prompts import encode_chat
from .scheduler import Engine

BENCH_PROMPTS = [
    "Explain why the sky is blue in two short paragraphs.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for staying focused while studying.",
    "Tell a short story about a robot who learns to paint.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the water cycle for a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "Describe the rules of chess in a few sentences.",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright while moving?",
    "Compare cats and dogs as pets.",
    "Explain what a hash table is and when to use one.",
    "Write a polite email asking a colleague for a meeting.",
    "What are the main causes of inflation?",
    "Describe a sunset over the ocean.",
    "Give three arguments for learning a second language.",
]


def bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts (cycled if n exceeds the built-in set), tokenized with the chat template."""
    return [encode_chat(tokenizer, [{"role": "user", "content": BENCH_PROMPTS[i % len(BENCH_PROMPTS)]}]) for i in range(n)]


def hf_generate(model, prompts: list[list[int]], max_tokens: int, bar: tqdm) -> tuple[float, list[list[int]]]:
    """Target-only greedy `model.generate`, one prompt at a time; (seconds, outputs)."""
    outs, total = [], 0.0
    for p in prompts:
        ids = torch.tensor([p])
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0,
            )
        total += time.perf_counter() - t
        outs.append(out[0, len(p):].tolist())
        bar.update(1)
    return total, outs


def engine_run(models, policy: str, prompts: list[list[int]], max_tokens: int, batch: int, bar: tqdm):
    """Greedy engine run: `batch` 1 feeds requests one at a time, otherwise all at once.

    Returns (seconds, outputs, acceptance rate, tokens per decode step). Fresh workers per run.
    """
    if policy == "none":
        models = dataclasses.replace(models, draft=None)
    engine = Engine.from_models(models, EngineConfig(policy=policy, max_batch_size=max(batch, 1), max_k=8))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    groups = [[p] for p in prompts] if batch == 1 else [prompts]
    total, outs, proposed, accepted, steps = 0.0, [], 0, 0, 0
    for group in groups:
        t = time.perf_counter()
        reqs = [engine.submit(p, params) for p in group]
        engine.run(reqs)
        total += time.perf_counter() - t
        outs += [r.output_ids for r in reqs]
        proposed += sum(r.stats.proposed for r in reqs)
        accepted += sum(r.stats.accepted for r in reqs)
        steps += sum(r.stats.steps for r in reqs)
        bar.update(len(group))
    return total, outs, (accepted / proposed if proposed else 0.0), (1 + accepted / steps if steps else 1.0)


def forward_ms(model, context: int = 64, reps: int = 30) -> float:
    """Median latency of one single-token forward at batch 1 after `context` cached tokens."""
    from transformers import DynamicCache

    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.arange(1, context + 1)[None], past_key_values=cache, use_cache=True)
        for i in range(reps):
            t = time.perf_counter()
            model(torch.tensor([[7]]), position_ids=torch.tensor([[context + i]]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1000


def bench_engine(mc: ModelConfig, max_tokens: int, num_prompts: int, ks: list[int], concurrency: int, out: str | None):
    torch.manual_seed(0)
    models = load_models(mc)
    prompts = bench_prompts(models.tokenizer, max(num_prompts, concurrency))
    single, many = prompts[:num_prompts], prompts[:concurrency]
    work = 1 + num_prompts * (2 + len(ks)) + concurrency * 2
    rows = []
    with tqdm(total=work, desc="bench engine", unit="req") as bar:
        engine_run(models, "none", single[:1], 8, 1, bar)  # warm-up: first-call allocations
        hf_s, hf_out = hf_generate(models.target, single, max_tokens, bar)
        hf_tps = num_prompts * max_tokens / hf_s
        rows.append(("HF generate, batch 1 (baseline)", hf_tps, 1.0, "", "", True))
        best = ("none", 0.0)
        for policy in ["none"] + [f"fixed:{k}" for k in ks]:
            s, outs, acc, tps_step = engine_run(models, policy, single, max_tokens, 1, bar)
            tps = num_prompts * max_tokens / s
            best = max(best, (policy, tps), key=lambda x: x[1]) if policy != "none" else best
            spec = policy != "none"
            rows.append((f"engine {policy}, batch 1", tps, tps / hf_tps, f"{acc:.2f}" if spec else "",
                         f"{tps_step:.2f}" if spec else "1.00", outs == hf_out))
        for policy in ["none", best[0]] if best[0] != "none" else ["none"]:
            s, outs, acc, tps_step = engine_run(models, policy, many, max_tokens, concurrency, bar)
            tps = concurrency * max_tokens / s
            same = outs[:num_prompts] == hf_out
            spec = policy != "none"
            rows.append((f"engine {policy}, {concurrency} concurrent", tps, tps / hf_tps, f"{acc:.2f}" if spec else "",
                         f"{tps_step:.2f}" if spec else "1.00", same))
    target_ms = forward_ms(models.target)
    draft_ms = forward_ms(models.draft) if models.draft is not None else float("nan")
    print(f"\ntarget {models.target_name}, draft {models.draft_name}, {max_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'run':<40} {'tokens/s':>9} {'vs HF b1':>9} {'accept':>7} {'tok/step':>8} {'same as HF':>10}")
    for name, tps, ratio, acc, tps_step, same in rows:
        print(f"{name:<40} {tps:>9.1f} {ratio:>8.2f}x {acc:>7} {tps_step:>8} {str(same):>10}")
    none_tps = rows[1][1]
    if best[0] != "none":
        print(f"best fixed k at batch 1: {best[0]}, {best[1] / none_tps:.2f}x engine none, {best[1] / hf_tps:.2f}x HF generate")
    print(f"single-token forward at batch 1: target {target_ms:.1f} ms, draft {draft_ms:.1f} ms "
          f"({draft_ms / target_ms:.1%} of the target)")
    if out:
        keys = ["run", "tokens_per_s", "ratio_vs_hf_b1", "acceptance", "tokens_per_step", "same_as_hf"]
        with open(out, "w") as f:
            json.dump({"rows": [dict(zip(keys, r)) for r in rows], "target_forward_ms": target_ms,
                       "draft_forward_ms": draft_ms}, f, indent=1)
    return rows


def bench_acceptance(mc: ModelConfig, k: int, max_tokens: int, batch: int) -> list[tuple[str, float, float]]:
    """How well a draft agrees with its target where it was not trained: tokens per step (accepted + 1)
    and acceptance at fixed:k, greedy, on three prompt sets the default distillation never sees: the
    benchmark prompts, the creative ones, and the last 16 seed prompts (in the style of the training
    prompts; the default recipe uses the first 2,400 of 5,256). Counts, not timings: noise-free."""
    from .bench_policies import CREATIVE_PROMPTS
    from .distill import seed_prompts

    models = load_models(mc)
    sets = {"benchmark": BENCH_PROMPTS, "creative": CREATIVE_PROMPTS, "held-out seed prompts": seed_prompts()[-16:]}
    rows = []
    with tqdm(total=sum(len(v) for v in sets.values()), desc="bench acceptance", unit="req") as bar:
        for name, texts in sets.items():
            prompts = [encode_chat(models.tokenizer, [{"role": "user", "content": t}]) for t in texts]
            _, _, acc, per_step = engine_run(models, f"fixed:{k}", prompts, max_tokens, batch, bar)
            rows.append((name, acc, per_step))
    print(f"\ntarget {models.target_name}, draft {models.draft_name}, fixed:{k}, greedy, {max_tokens} tokens, batch {batch}")
    print(f"{'prompts':<24} {'acceptance':>10} {'tokens/step':>11}")
    for name, acc, per_step in rows:
        print(f"{name:<24} {acc:>10.3f} {per_step:>11.2f}")
    return rows


def bench_http(mc: ModelConfig, policy: str, max_tokens: int, concurrency: int, n_requests: int, port: int):
    """Tokens/s through the HTTP endpoint (local Ray Serve) vs the offline engine, same concurrency.

    Both runs are greedy on the same prompts, `concurrency` requests in flight (closed loop), and
    happen in this one process one after the other; outputs are compared for equality too.
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from deployments.app import served_name
    from deployments.config import AppConfig
    from deployments.local import start, stop

    app_args = {"model": mc.model_dump(), "engine": {"policy": policy, "max_batch_size": concurrency},
                "profiles_dir": None, "max_queue": max(64, n_requests)}
    name = served_name(AppConfig.model_validate(app_args))
    texts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n_requests)]
    with tqdm(total=2 * n_requests + 1, desc="bench http", unit="req") as bar:
        url = start(app_args, port=port)
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

            def ask(text: str) -> tuple[str, int]:
                r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": text}],
                                                   max_tokens=max_tokens, temperature=0)
                bar.update(1)
                return r.choices[0].message.content, r.usage.completion_tokens

            ask(texts[0])  # warm-up
            t = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                http = list(pool.map(ask, texts))
            http_s = time.perf_counter() - t
        finally:
            stop()

        models = load_models(mc if policy != "none" else mc.model_copy(update={"draft": "none"}))
        engine = Engine.from_models(models, EngineConfig(policy=policy, max_batch_size=concurrency))
        params = SamplingParams(max_tokens=max_tokens)

        async def offline() -> list[tuple[str, int]]:
            gate = asyncio.Semaphore(concurrency)

            async def one(text: str) -> tuple[str, int]:
                async with gate:
                    ids = encode_chat(models.tokenizer, [{"role": "user", "content": text}])
                    parts, n = [], 0
                    async for out in engine.generate(ids, params):
                        parts.append(out.text)
                        n += len(out.token_ids)
                    bar.update(1)
                    return "".join(parts), n

            return await asyncio.gather(*(one(x) for x in texts))

        t = time.perf_counter()
        local = asyncio.run(offline())
        local_s = time.perf_counter() - t
    http_tps = sum(n for _, n in http) / http_s
    local_tps = sum(n for _, n in local) / local_s
    same = [a for a, _ in http] == [b for b, _ in local]
    print(f"\ntarget {models.target_name}, policy {policy}, {n_requests} requests, concurrency {concurrency}, "
          f"max_tokens {max_tokens}")
    print(f"{'run':<34} {'tokens/s':>9} {'ratio':>7}")
    print(f"{'offline engine (baseline)':<34} {local_tps:>9.1f} {1.0:>6.2f}x")
    print(f"{'HTTP via Ray Serve + openai client':<34} {http_tps:>9.1f} {http_tps / local_tps:>6.2f}x")
    print(f"identical texts: {same}")
    return http_tps / local_tps, same
