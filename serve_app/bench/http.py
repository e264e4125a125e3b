"""`specserve bench http`: tokens/s and inter-token latency through the HTTP service against the offline engine.

Both sides run in one process on the same prompts, greedy, `concurrency` requests in flight (closed
loop), every request streamed: the service on a local Ray cluster through the openai client (deployed as
`specserve serve` deploys it, the Router inside the ingress), and an
Engine built here whose `generate` outputs are timed as they come. Each side is warmed up (a full wave
of short requests), then both run once per round, alternating which goes first; ratios are taken
within a round: tokens/s as the median over rounds with its range, ITL p50 (the gap between one
streamed piece of text and the next, per request, pooled over the round) as a paired ratio with its
95% interval. Every round's texts are compared with the offline engine's.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.models import load_models
from serve_app.bench.prompt_sets import BENCH_PROMPTS, chat_prompts
from serve_app.engine.scheduler import Engine
from serve_app.bench.rounds import fmt_paired, fmt_ratio, paired_ratio, rotated, summary


def _gaps(stamps: list[float]) -> list[float]:
    """Seconds between consecutive pieces of one stream (the first piece's wait is its TTFT, not an ITL)."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _p50_ms(gaps: list[float]) -> float:
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def bench_http(mc: ModelConfig, policy: str, max_tokens: int, concurrency: int, n_requests: int, port: int,
               rounds: int = 3) -> tuple[dict, str]:
    """Returns (results, markdown report)."""
    if policy in ("lut", "adaptive"):
        raise ValueError("bench http runs the same k on both sides: use none or fixed:K")
    from openai import OpenAI

    from deployments.app import served_name
    from deployments.config import AppConfig
    from deployments.local import start, stop

    app_args = {"model": mc.model_dump(), "engine": {"policy": policy, "max_batch_size": concurrency},
                "profiles_dir": None, "max_queue": max(64, n_requests), "router_in_ingress": True}  # as `specserve serve`
    name = served_name(AppConfig.model_validate(app_args))
    texts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n_requests)]
    models = load_models(mc if policy != "none" else mc.model_copy(update={"draft": "none"}))
    ids = chat_prompts(models.tokenizer, texts)
    engine = Engine.from_models(models, EngineConfig(policy=policy, max_batch_size=concurrency))
    sides: dict[str, list] = {"http": [], "offline": []}
    with tqdm(total=2 * n_requests * rounds + 2 * concurrency, desc="bench http", unit="req") as bar:
        url = start(app_args, port=port)
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

            def ask(text: str, tokens: int) -> tuple[str, int, list[float]]:
                parts, n, stamps = [], 0, []
                for chunk in client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": text}], max_tokens=tokens, temperature=0,
                        stream=True, stream_options={"include_usage": True}):
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        stamps.append(time.perf_counter())
                        parts.append(chunk.choices[0].delta.content)
                bar.update(1)
                return "".join(parts), n, stamps

            def http(batch: list[str], tokens: int) -> list[tuple[str, int, list[float]]]:
                with ThreadPoolExecutor(concurrency) as pool:
                    return list(pool.map(lambda x: ask(x, tokens), batch))

            async def offline(batch: list[list[int]], tokens: int) -> list[tuple[str, int, list[float]]]:
                gate, params = asyncio.Semaphore(concurrency), SamplingParams(max_tokens=tokens)

                async def one(p: list[int]) -> tuple[str, int, list[float]]:
                    async with gate:
                        parts, n, stamps = [], 0, []
                        async for out in engine.generate(p, params):
                            if out.text:
                                stamps.append(time.perf_counter())
                            parts.append(out.text)
                            n += len(out.token_ids)
                        bar.update(1)
                        return "".join(parts), n, stamps

                return await asyncio.gather(*(one(p) for p in batch))

            run = {"http": lambda tokens, k: http(texts[:k], tokens),
                   "offline": lambda tokens, k: asyncio.run(offline(ids[:k], tokens))}
            bar.set_postfix_str("warm-up")
            for side in sides:
                run[side](8, concurrency)
            for r in range(rounds):
                for side in rotated(list(sides), r):
                    bar.set_postfix_str(f"round {r + 1}/{rounds}: {side}")
                    t = time.perf_counter()
                    outs = run[side](max_tokens, n_requests)
                    sides[side].append((time.perf_counter() - t, outs))
        finally:
            stop()
    reference = [text for text, _, _ in sides["offline"][0][1]]
    tps = {s: [sum(n for _, n, _ in outs) / secs for secs, outs in runs] for s, runs in sides.items()}
    itl = {s: [_p50_ms([g for _, _, stamps in outs for g in _gaps(stamps)]) for _, outs in runs]
           for s, runs in sides.items()}
    res = {"target": models.target_name, "policy": policy, "requests": n_requests, "concurrency": concurrency,
           "max_tokens": max_tokens, "rounds": rounds, "prompts": "BENCH_PROMPTS",
           "offline_tokens_per_s": summary(tps["offline"]), "http_tokens_per_s": summary(tps["http"]),
           "http_vs_offline": summary([h / o for h, o in zip(tps["http"], tps["offline"])]),
           "offline_itl_p50_ms": summary(itl["offline"]), "http_itl_p50_ms": summary(itl["http"]),
           "itl_p50_http_vs_offline": paired_ratio(itl["http"], itl["offline"]),
           "identical_texts": all([t for t, _, _ in outs] == reference for runs in sides.values() for _, outs in runs)}
    lines = [f"# bench http: target {res['target']}, policy {policy}", "",
             f"{n_requests} chat requests, {concurrency} in flight, max_tokens {max_tokens}, greedy, streamed; {rounds} "
             "rounds after a warm-up of both sides, alternating which side goes first; tokens/s: median (range) over "
             "rounds; ITL p50: the median gap between streamed pieces of text, per round, and its paired ratio with "
             "a 95% interval.", "",
             "| run | tokens/s | ratio | ITL p50 (ms) | ratio |", "|---|---|---|---|---|",
             f"| offline engine (baseline) | {res['offline_tokens_per_s']['median']:.1f} | 1.00x "
             f"| {res['offline_itl_p50_ms']['median']:.1f} | 1.00x |",
             f"| HTTP via Ray Serve + openai client | {res['http_tokens_per_s']['median']:.1f} "
             f"| {fmt_ratio(res['http_vs_offline'])} | {res['http_itl_p50_ms']['median']:.1f} "
             f"| {fmt_paired(res['itl_p50_http_vs_offline'])} |",
             "", f"Texts identical on both sides in every round: {res['identical_texts']}."]
    return res, "\n".join(lines) + "\n"
