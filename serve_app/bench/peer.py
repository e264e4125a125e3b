"""`specserve bench peer`: this server against vLLM's, the same model, prompts and machine, through HTTP.

Each side is a real server started as a subprocess, one at a time (never two sharing the cores): `specserve
serve` (its default, and `--policy none`) and vLLM's OpenAI server from its own virtual environment (`make peer`
installs vLLM's CPU build into .peer-venv), without and with n-gram speculation. Each round starts every side
in turn, in an order that rotates between rounds, and drives it closed loop at each concurrency with streamed
chat completions (real questions, `ignore_eos`, a fixed number of tokens): output tokens per second, mean
latency, time to first token and inter-token latency (p50, p90). Ratios are taken within a round and reported
as paired ratios with 95% intervals over rounds.

vLLM serves the embedded model from the float32 safetensors copy `specserve` caches, with the config entry that
names the .gguf dropped (vLLM would try to read the .gguf); both serve it in the run's dtype, unless a side names
its own (`vllm@float32`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from serve_app.bench.prompt_sets import BENCH_PROMPTS, CREATIVE_PROMPTS, MORE_CHAT_PROMPTS
from serve_app.bench.rounds import fmt_paired, paired_ratio, rotated
from serve_app.bench.service import free_port, server

SIDES = ("specserve", "specserve-none", "specserve-separate", "vllm", "vllm-ngram")
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def peer_model_dir(source: str, out: Path) -> Path:
    """A directory vLLM can serve the model from: the safetensors copy's files linked, its config without the
    `quantization_config` that names the .gguf it was converted from."""
    src = Path(source)
    if not (src / "model.safetensors").is_file():
        raise ValueError(f"{source}: no model.safetensors (vLLM serves the safetensors copy; run `specserve serve` once)")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def parse_side(side: str, dtype: str) -> tuple[str, str]:
    """(kind, dtype) of a side: a name from SIDES, optionally with `@DTYPE` serving it in another dtype than the
    run's (`vllm@float32`: vLLM's bfloat16 and float32 paths differ by batch size on a CPU without bfloat16)."""
    kind, _, own = side.partition("@")
    return kind, own or dtype


def side_command(side: str, model_dir: Path, dtype: str, port: int, vllm_python: str, max_batch: int) -> list[str]:
    side, dtype = parse_side(side, dtype)
    if side.startswith("specserve"):
        flags = ["--dtype", dtype, "--batch-size", str(max_batch), "--port", str(port), "--drain-timeout", "1",
                 "--metrics-port", str(free_port())]
        flags += ["--policy", "none"] if side.endswith("none") else []
        flags += ["--separate-router"] if side.endswith("separate") else []  # the Router as its own deployment
        return [sys.executable, "-m", "serve_app.cli", "serve", *flags]
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--max-model-len", "4096", "--port", str(port), "--max-num-seqs", str(max_batch),
           "--served-model-name", "peer", "--gpu-memory-utilization", "0.3"]  # on a CPU: the share of RAM it reserves
    if side == "vllm-ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})]
    return cmd


async def _stream(client, url: str, model: str, question: str, params: dict, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **params}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"tokens": tokens, "latency": end - t0, "ttft": (times[0] - t0) if times else end - t0,
            "gaps": [b - a for a, b in zip(times, times[1:])]}


PEER_PROMPTS = BENCH_PROMPTS + MORE_CHAT_PROMPTS
"""The peer benchmark's questions: a server's levels take consecutive slices (from its round's offset), so no
question is asked twice in a server's life while the levels' requests fit (1 + 8 + 32 at one request per
slot): an answer given before would be drafted from specserve's history, which the peers do not have."""


def level_prompts(levels: list[int], round_: int) -> list[list[str]]:
    """Each level's questions (levels: requests per level, in order), consecutive from the round's offset."""
    out, at = [], round_ * 7  # a round starts elsewhere, so a question is not always asked at the same level
    for n in levels:
        out.append([PEER_PROMPTS[(at + i) % len(PEER_PROMPTS)] for i in range(n)])
        at += n
    return out


async def _load(url: str, model: str, concurrency: int, prompts: list[str], params: dict, max_tokens: int) -> dict:
    """One streamed chat per prompt, `concurrency` in flight (closed loop): the figures of one side at one level."""
    import httpx

    queue = list(range(len(prompts)))
    out = []
    async with httpx.AsyncClient(timeout=1800) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                out.append(await _stream(client, url, model, prompts[i], params,
                                         max_tokens))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    gaps = sorted(g for r in out for g in r["gaps"])
    ttfts = sorted(r["ttft"] for r in out)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0  # noqa: E731
    return {"tokens_per_s": sum(r["tokens"] for r in out) / wall, "mean_latency_s": statistics.fmean(r["latency"] for r in out),
            "ttft_p50_s": q(ttfts, 0.5), "ttft_p90_s": q(ttfts, 0.9), "itl_p50_s": q(gaps, 0.5), "itl_p90_s": q(gaps, 0.9),
            "requests": len(out), "tokens": sum(r["tokens"] for r in out)}


METRICS = ("tokens_per_s", "mean_latency_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s")


def bench_peer(model_source: str, vllm_python: str | None, concurrencies: list[int], rounds: int, max_tokens: int,
               modes: list[str], dtype: str, sides: list[str], work_dir: Path, requests_per_level: int = 2,
               ready_s: float = 900.0) -> tuple[dict, str]:
    """Returns (results, markdown report): per round, side, mode and concurrency the figures of `_load`."""
    if any(s.startswith("vllm") for s in sides):
        if not vllm_python or not Path(vllm_python).exists():
            raise ValueError(f"no vLLM interpreter at {vllm_python!r}: run `make peer` (installs vLLM's CPU build into "
                             ".peer-venv) or pass --vllm-python")
    model_dir = peer_model_dir(model_source, work_dir / "peer-model")
    max_batch = max(concurrencies)
    runs: list[dict] = []
    levels = [(m, c) for m in modes for c in concurrencies]
    with tqdm(total=rounds * len(sides) * len(levels), desc="bench peer", unit="level") as bar:
        for r in range(rounds):
            for side in rotated(list(sides), r):
                port = free_port()
                cmd = side_command(side, model_dir, dtype, port, vllm_python or "", max_batch)
                ready = "/readyz" if side.startswith("specserve") else "/health"
                with server(cmd, f"http://127.0.0.1:{port}", ready, ready_s) as (url, model):
                    asyncio.run(_load(url, model, 1, CREATIVE_PROMPTS[:2], MODES["greedy"], 16))  # warm-up, not measured
                    asks = level_prompts([max(requests_per_level * c, 2) for _, c in levels], r)
                    for (mode, c), prompts in zip(levels, asks):
                        bar.set_postfix_str(f"round {r + 1}: {side} {mode} x{c}")
                        fig = asyncio.run(_load(url, model, c, prompts, MODES[mode], max_tokens))
                        runs.append({"round": r, "side": side, "mode": mode, "concurrency": c, **fig})
                        bar.update(1)
    results = {"model": model_source, "dtype": dtype, "max_tokens": max_tokens, "rounds": rounds, "sides": sides,
               "concurrencies": concurrencies, "modes": modes, "runs": runs}
    return results, report(results)


def _series(runs: list[dict], side: str, mode: str, c: int, metric: str) -> list[float]:
    by_round = {x["round"]: x[metric] for x in runs if (x["side"], x["mode"], x["concurrency"]) == (side, mode, c)}
    return [by_round[r] for r in sorted(by_round)]


def report(results: dict) -> str:
    runs, sides = results["runs"], results["sides"]
    ours = [s for s in sides if s.startswith("specserve")]
    peers = [s for s in sides if s.startswith("vllm")]
    lines = [f"# bench peer: {', '.join(sides)}", "",
             f"{results['model']} in {results['dtype']}, {results['max_tokens']} tokens a request (ignore_eos), streamed chat, "
             f"{results['rounds']} rounds, sides rotated; medians over rounds; ratios paired within a round (95% intervals).", ""]
    for mode in results["modes"]:
        lines += [f"## {mode}", "", "| side | in flight | tokens/s | mean latency s | TTFT p50 / p90 s | ITL p50 / p90 ms |",
                  "|---|---|---|---|---|---|"]
        for side in sides:
            for c in results["concurrencies"]:
                med = {m: statistics.median(_series(runs, side, mode, c, m) or [0.0]) for m in METRICS}
                lines.append(f"| {side} | {c} | {med['tokens_per_s']:.1f} | {med['mean_latency_s']:.2f} | "
                             f"{med['ttft_p50_s']:.2f} / {med['ttft_p90_s']:.2f} | "
                             f"{1000 * med['itl_p50_s']:.0f} / {1000 * med['itl_p90_s']:.0f} |")
        if ours and peers:
            lines += ["", "| ours / peer | in flight | tokens/s | mean latency | ITL p50 |", "|---|---|---|---|---|"]
            for a in ours:
                for b in peers:
                    for c in results["concurrencies"]:
                        ratio = lambda m: fmt_paired(paired_ratio(_series(runs, a, mode, c, m), _series(runs, b, mode, c, m)))  # noqa: E731
                        lines.append(f"| {a} / {b} | {c} | {ratio('tokens_per_s')} | {ratio('mean_latency_s')} | "
                                     f"{ratio('itl_p50_s')} |")
            if len(peers) > 1:  # the bar: against whichever peer configuration serves each level fastest
                lines += ["", "| ours / best peer | in flight | best peer | tokens/s | mean latency |", "|---|---|---|---|---|"]
                for a in ours:
                    for c in results["concurrencies"]:
                        b = max(peers, key=lambda p: statistics.median(_series(runs, p, mode, c, "tokens_per_s") or [0.0]))
                        ratio = lambda m: fmt_paired(paired_ratio(_series(runs, a, mode, c, m), _series(runs, b, mode, c, m)))  # noqa: E731
                        lines.append(f"| {a} | {c} | {b} | {ratio('tokens_per_s')} | {ratio('mean_latency_s')} |")
        lines.append("")
    return "\n".join(lines)

