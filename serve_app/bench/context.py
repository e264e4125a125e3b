"""`specserve bench context`: the context axis of this machine's profile (`profiling.context`), measured on the
embedded pair (or any `--target`/`--draft`), or on a random Llama at a real shape (`--random llama-3.1-8b:32`,
with a `truncated:N` draft of its first layers), the GPU campaign's pair. With `--into PROFILE` the measured
grid joins that profile's latency grid (`LatencyGrid.context`), so its prices follow the context served."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from serve_app.profiling.context import context_table, measure_chunk_context, measure_context

CHUNK_CONTEXT = 4096
"""The longest prompt the chunk-context pass prefills (the longest context asked, up to this): its line needs
chunks at many held lengths, not the longest."""


def random_models(spec: str, draft_layers: int, device: str, dtype: str):
    """A random Llama of a named shape at `layers` depth (SHAPE:LAYERS) and a draft of its first layers."""
    from serve_app.bench.shapes import SHAPES, random_llama, vocab_tokenizer
    from serve_app.models import DTYPES, LoadedModels, resolve_dtype, truncated_draft

    shape, _, layers = spec.partition(":")
    if shape not in SHAPES:
        raise ValueError(f"--random: unknown shape {shape!r} (known: {sorted(SHAPES)})")
    dtype = resolve_dtype(dtype, device)
    target = random_llama(SHAPES[shape], int(layers or 2), seed=0, dtype=DTYPES[dtype], device=device,
                          quiet_from=draft_layers)
    draft = truncated_draft(target, draft_layers)
    return LoadedModels(target, draft, vocab_tokenizer(SHAPES[shape].vocab_size), f"random-{shape}-x{layers or 2}",
                        f"truncated:{draft_layers}"), dtype


def bench_context(models, batch_sizes: list[int], ks: list[int], contexts: list[int], reps: int,
                  deadline_s: float | None, label: str) -> tuple[dict, str]:
    from serve_app.profiling.profiler import BUDGET

    t0 = time.perf_counter()
    grid = measure_context(models, batch_sizes, ks, contexts, reps, deadline_s=deadline_s)
    chunk = None
    if deadline_s is None or time.perf_counter() - t0 < deadline_s:
        longest = min(max(contexts), CHUNK_CONTEXT)
        chunk = measure_chunk_context(models, longest, BUDGET)
    seconds = round(time.perf_counter() - t0, 1)
    device = str(next(models.target.parameters()).device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    md = (f"# Step parts against context: {label} on {name}\n\nTarget {models.target_name}, draft "
          f"`{models.draft_name}`; contexts asked {contexts}, measured (mean KV tokens per row) {grid.contexts}; "
          f"batch sizes {batch_sizes}; {reps} visits per k (median); {seconds} s.\n\n" + context_table(grid))
    if chunk:
        a, b = chunk["chunk_context_ms"]
        n, s = chunk["budget"], chunk["context"]
        md += (f"\nPrompt chunks (`LatencyGrid.chunk_context_ms`): a chunk of n tokens after s held pays s x ({a:.5f} + "
               f"{b:.7f} n) ms more than at the start: a {n}-token chunk after {s} tokens {s * (a + b * n):.1f} ms, on "
               f"{chunk['at_zero_ms']:.1f} ms at the start (prefilled alone in chunks of {chunk['chunk_sizes']}).\n")
    return {"grid": grid.model_dump(), "chunk_context": chunk, "device": name, "seconds": seconds,
            "contexts_asked": contexts}, md


def merge_into_profile(path: str, grid_json: dict, chunk: dict | None = None) -> None:
    """Put a measured context grid (and the chunks' context price, scaled to the profile's chunk price) into a
    profile file's latency grid (same hardware, pair and dtype assumed: the caller measured it with the
    profile's models)."""
    from serve_app.pricing import ContextGrid
    from serve_app.profiling.context import scaled_to
    from serve_app.profiling.profiles import load_profile, save_profile

    profile = load_profile(path)
    if profile.latency is None:
        raise ValueError(f"{path}: the profile has no latency grid to give a context axis")
    update = {"context": ContextGrid.model_validate(grid_json)}
    if chunk:
        update["chunk_context_ms"] = scaled_to(chunk, profile.latency)
    latency = profile.latency.model_copy(update=update)
    save_profile(profile.model_copy(update={"latency": latency}), Path(path))


__all__ = ["bench_context", "merge_into_profile", "random_models"]
