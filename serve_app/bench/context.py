"""`specserve bench context`: the context axis of this machine's profile (`profiling.context`), measured on the
embedded pair (or any `--target`/`--draft`), or on a random Llama at a real shape (`--random llama-3.1-8b:32`,
with a `truncated:N` draft of its first layers), the GPU campaign's pair. With `--into PROFILE` the measured
grid joins that profile's latency grid (`LatencyGrid.context`), so its prices follow the context served."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from serve_app.profiling.context import context_table, measure_context


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
    t0 = time.perf_counter()
    grid = measure_context(models, batch_sizes, ks, contexts, reps, deadline_s=deadline_s)
    seconds = round(time.perf_counter() - t0, 1)
    device = str(next(models.target.parameters()).device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    md = (f"# Step parts against context: {label} on {name}\n\nTarget {models.target_name}, draft "
          f"`{models.draft_name}`; contexts asked {contexts}, measured (mean KV tokens per row) {grid.contexts}; "
          f"batch sizes {batch_sizes}; {reps} visits per k (median); {seconds} s.\n\n" + context_table(grid))
    return {"grid": grid.model_dump(), "device": name, "seconds": seconds, "contexts_asked": contexts}, md


def merge_into_profile(path: str, grid_json: dict) -> None:
    """Put a measured context grid into a profile file's latency grid (same hardware, pair and dtype assumed:
    the caller measured it with the profile's models)."""
    from serve_app.pricing import ContextGrid
    from serve_app.profiling.profiles import load_profile, save_profile

    profile = load_profile(path)
    if profile.latency is None:
        raise ValueError(f"{path}: the profile has no latency grid to give a context axis")
    latency = profile.latency.model_copy(update={"context": ContextGrid.model_validate(grid_json)})
    save_profile(profile.model_copy(update={"latency": latency}), Path(path))


__all__ = ["bench_context", "merge_into_profile", "random_models"]
