"""`bench step --runs serve`: the same random models behind `specserve serve`, as a client sees them.

The models are saved to a temporary directory and served by a real `specserve serve` (local Ray, the
Router and its worker actors, the OpenAI ingress, Serve's proxy) with the step benchmark's policy and
the largest batch size; for each mix, that many concurrent streaming completions (token-id prompts)
run to a fixed length. Per stream, the time per output token over the middle of its stream (all
streams in the batch then) is the step time when every step makes one token per sequence, which the
peaked heads ensure; the Router's own mean step time comes from its `specserve_step_seconds` metric.
Needs Ray, httpx and a free port; a black-box check of the whole service, not a split of the step.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from serve_app.bench.service import service
from serve_app.bench.shapes import save_eagle3_dir, save_model_dir

STREAM_TOKENS = 48
"""Tokens per stream; the first and last TRIM are left out (admission, the batch emptying)."""
TRIM = 8
MIX_PARAMS = {"greedy": {"temperature": 0}, "top_p1": {"temperature": 1.0}, "top_p09": {"temperature": 1.0, "top_p": 0.9},
              "seeded": {"temperature": 1.0, "seed": 1}, "logprobs": {"temperature": 0, "logprobs": 5}}


def _quiet_eos(model, eos: int) -> None:
    """No end of stream at random: the EOS row of the head at zero, far below a peaked head's maximum."""
    head = model.get_output_embeddings()
    if head is not None and eos < head.weight.shape[0]:
        with torch.no_grad():
            head.weight[eos] = 0


def _step_metric(port: int) -> tuple[float, float]:
    """(sum, count) of the Routers' specserve_step_seconds on the Ray metrics port."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0, 0.0
    grab = lambda name: sum(float(v) for v in re.findall(rf"^ray_specserve_step_seconds_{name}{{[^}}]*}} (\S+)", text, re.M))
    return grab("sum"), grab("count")


async def _streams(url: str, mix: str, prompts: list[list[int]]) -> list[list[float]]:
    """Arrival times of each stream's text chunks."""
    import httpx

    async def one(client, i, prompt):
        body = {"model": "target", "prompt": prompt, "max_tokens": STREAM_TOKENS, "stream": True, **MIX_PARAMS[mix]}
        if "seed" in body:
            body["seed"] = 1000 + i
        times = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice.get("text"):
                        times.append(time.perf_counter())
        return times

    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))


def run_serve(cfg, models, prompts: list[list[int]], port: int = 8321, metrics_port: int = 8322) -> list[dict]:
    """One row per mix at the largest batch size: per-stream TPOT (median, range) and the Router's step."""
    batch = max(cfg.batch_sizes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="specserve-bench-serve-") as root:
        eos = models.tokenizer.eos_token_id
        _quiet_eos(models.target, eos)
        target = save_model_dir(models.target, models.tokenizer, Path(root) / "target")
        if cfg.draft == "eagle3":
            draft = save_eagle3_dir(models.draft, models.target, Path(root) / "draft")
        else:
            _quiet_eos(models.draft, eos)
            draft = save_model_dir(models.draft, models.tokenizer, Path(root) / "draft")
        flags = ["--target", target, "--draft", draft, "--dtype", models.dtype, "--device", cfg.device,
                 "--policy", f"fixed:{cfg.k}", "--batch-size", str(batch)]
        with service(flags, port, ready_s=300, metrics_port=metrics_port) as (url, _):
            asyncio.run(_streams(url, "greedy", prompts[:batch]))  # warm-up: first forwards, allocations
            for mix in cfg.mixes:
                time.sleep(6)  # Ray's metrics export lags a few seconds
                s0, c0 = _step_metric(metrics_port)
                streams = asyncio.run(_streams(url, mix, prompts[:batch]))
                time.sleep(6)
                s1, c1 = _step_metric(metrics_port)
                tpot = [(t[-TRIM - 1] - t[TRIM]) / (len(t) - 2 * TRIM - 1) for t in streams if len(t) > 2 * TRIM + 2]
                rows.append({"run": "serve", "batch": batch, "mix": mix, "streams": len(streams), "timed_streams": len(tpot),
                             "tpot_ms": {"median": 1e3 * statistics.median(tpot), "min": 1e3 * min(tpot), "max": 1e3 * max(tpot)}
                             if tpot else None,
                             "router_step_ms": 1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else None})
    greedy = next((r for r in rows if r["mix"] == "greedy" and r["tpot_ms"]), None)
    for r in rows:
        if greedy and r["tpot_ms"]:
            r["vs_greedy"] = r["tpot_ms"]["median"] / greedy["tpot_ms"]["median"]
    return rows


def serve_markdown(rows: list[dict]) -> str:
    lines = ["## serve (`specserve serve`, concurrent streaming completions)", "",
             "Per stream: time per output token over the middle of its stream (one token per step, so the step "
             "as a client sees it); the Router's mean step from its metric (including admission steps).", "",
             "| batch | mix | TPOT ms (median, range over streams) | x greedy | Router step ms | streams timed |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tpot_ms"]
        tpot = f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})" if t else "-"
        ratio = f"{r['vs_greedy']:.2f}" if r.get("vs_greedy") else "-"
        step = f"{r['router_step_ms']:.1f}" if r["router_step_ms"] else "-"
        lines.append(f"| {r['batch']} | {r['mix']} | {tpot} | {ratio} | {step} | {r['timed_streams']}/{r['streams']} |")
    return "\n".join(lines) + "\n"
