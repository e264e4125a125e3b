"""`specserve bench kv-memory`: KV bytes allocated against the bytes of the tokens held.

One request of 1,800 tokens runs beside 31 of 100-300 (random token ids, a fixed seed) until every
prompt is prefilled and a few decode steps have run; then, per worker: the tokens its sequences hold,
the bytes those tokens need (2 x layers x kv heads x head dim x dtype bytes each), the bytes of the
blocks they hold (at most one partly filled block per sequence beyond that), and the bytes the pool
has allocated. Beside them, what the layout before paging would have allocated for the same batch
(per layer [rows rounded up to a power of two, kv heads, longest row rounded up to 128, head dim]).
Runs in process, no Ray: the embedded pair, or a random model at a real shape with few layers.
"""

from __future__ import annotations

import random

from tqdm import tqdm

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.engine.scheduler import Engine

LENGTHS_SEED = 0


def batch_lengths(n_short: int = 31, long: int = 1800, lo: int = 100, hi: int = 300) -> list[int]:
    rng = random.Random(LENGTHS_SEED)
    return [long] + [rng.randint(lo, hi) for _ in range(n_short)]


def worker_memory(worker) -> dict:
    """What one ModelWorker's KV holds and has allocated (bytes)."""
    cache = worker.cache
    if not cache.keys:
        return {}
    k = cache.keys[0]  # [slots, kv_heads, head_dim]
    per_token = 2 * len(cache.keys) * k.shape[1] * k.shape[2] * k.element_size()
    tokens = sum(s.kv_len for s in worker.seqs.values())
    lengths = [s.kv_len for s in worker.seqs.values()]
    rows = 1 << max(0, (len(lengths) - 1).bit_length())
    before = rows * (-(-max(lengths) // 128) * 128) * per_token
    return {"sequences": len(lengths), "tokens_held": tokens, "bytes_per_token": per_token,
            "token_bytes": tokens * per_token, "held_block_bytes": cache.held_blocks() * cache.block_size * per_token,
            "allocated_bytes": cache.nbytes(), "allocated_over_tokens": cache.nbytes() / (tokens * per_token),
            "held_over_tokens": cache.held_blocks() * cache.block_size / tokens,
            "partial_block_bound_bytes": (tokens + len(lengths) * (cache.block_size - 1)) * per_token,
            "before_paging_bytes": before, "before_over_tokens": before / (tokens * per_token),
            "block_size": cache.block_size, "pool_blocks": cache.num_blocks}


def run_kv_memory(engine: Engine, lengths: list[int], vocab: int, decode_steps: int = 3) -> dict:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    # long enough outputs that no stream ends while the longest prompt prefills; cancelled once measured
    reqs = [engine.submit(p, SamplingParams(max_tokens=1000, ignore_eos=True)) for p in prompts]
    with tqdm(total=sum(lengths), desc="prefill", unit="tok") as bar:
        while engine.waiting or engine.prefilling:
            before = sum(r.prefilled for r in reqs)
            engine.step()
            bar.update(sum(r.prefilled for r in reqs) - before)
    for _ in range(decode_steps):
        engine.step()
    if len(engine.running) != len(lengths):
        raise RuntimeError(f"{len(engine.running)} of {len(lengths)} requests running")
    out = {"lengths": lengths, "target": worker_memory(engine.target)}
    if engine.draft is not None and hasattr(engine.draft, "cache"):
        out["draft"] = worker_memory(engine.draft)
    for r in reqs:
        engine.abort(r)
    engine.step()  # the cancelled leave the batch; their blocks go back
    return out


def kv_memory(target: str = "embedded", shape: str | None = None, layers: int = 2, policy: str = "fixed:4") -> dict:
    """The measurement for the embedded pair (or `target`), or for a random model at `shape`."""
    lengths = batch_lengths()
    cfg = EngineConfig(policy=policy if shape is None else "none", max_batch_size=len(lengths),
                       max_num_batched_tokens=1024)
    if shape is None:
        from serve_app.models import load_models

        models = load_models(ModelConfig(target=target))
        engine = Engine.from_models(models, cfg)
        name = target
    else:
        import torch

        from serve_app.bench.shapes import get_shape, random_llama, vocab_tokenizer
        from serve_app.engine.worker import ModelWorker

        s = get_shape(shape)
        model = random_llama(s, layers, dtype=torch.bfloat16)
        engine = Engine(ModelWorker(model, "target"), None, vocab_tokenizer(s.vocab_size), cfg, eos_ids=set())
        name = f"{shape} ({layers} layers, bfloat16)"
    out = run_kv_memory(engine, lengths, engine.vocab_size)
    out["model"] = name
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| model | worker | tokens held | allocated / tokens | held blocks / tokens | before paging / tokens | bytes per token |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for role in ("target", "draft"):
            m = r.get(role)
            if m:
                lines.append(f"| {r['model']} | {role} | {m['tokens_held']} | {m['allocated_over_tokens']:.3f} | "
                             f"{m['held_over_tokens']:.3f} | {m['before_over_tokens']:.2f} | {m['bytes_per_token']} |")
    return "\n".join(lines) + "\n"


def write(results: list[dict], out: str | None) -> list[str]:
    """OUT.json (with provenance) and OUT.md (default results/kv-memory-<hardware type>)."""
    from serve_app.bench.rounds import default_stem, write_results

    paths = write_results(out or default_stem("kv-memory"), {"runs": results}, markdown(results))
    return [str(p) for p in paths]
