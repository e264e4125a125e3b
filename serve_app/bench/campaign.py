"""The measured half of the GPU campaign (`specserve selfcheck --full`), after the checks: on random Llama models
at real shapes and full depth, the attention backends, this device's profile and a short `bench policies` with it.

A random target's layers barely move its residual stream (initial weights are small), so a draft made of its
first layers (`truncated:N`, sharing its weights) agrees with it often: a pair that prices steps at the real
shape (an 8B target's forwards, a 128k-vocabulary head) and accepts drafts at a rate between a weak and a good
draft's, with no download. The profile's best-k table then steers `lut` and `adaptive` in the policies run:
the product's own loop (profile, then choose k per step) on the device, end to end. Only torch, transformers,
pydantic, numpy and tqdm: runs on a GPU machine with the wheels `make gpu-wheels` builds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from serve_app.bench.shapes import SHAPES, random_llama, vocab_tokenizer

PLANS = {  # quick (a CPU, the suite): tiny shapes; full (a GPU): a whole-depth random Llama-3.1-8B
    True: {"target": ("tiny-128k", 4), "draft_layers": 1, "batches": [1, 4], "max_k": 2, "reps": 1,
           "acceptance_prompts": 4, "policies_at": [1, 4], "scale": 0.02},
    False: {"target": ("llama-3.1-8b", 32), "draft_layers": 2, "batches": [1, 8, 32, 64], "max_k": 6, "reps": 2,
            "acceptance_prompts": 32, "policies_at": [1, 8, 32], "scale": 0.1},
}


def random_pair(device: str, dtype: str, quick: bool):
    """A random target at its real depth and a truncated draft of its first layers (shared weights)."""
    from serve_app.models import DTYPES, LoadedModels, truncated_draft

    plan = PLANS[quick]
    shape, layers = plan["target"]
    target = random_llama(SHAPES[shape], layers, seed=0, dtype=DTYPES[dtype], device=device)
    draft = truncated_draft(target, plan["draft_layers"])
    name = f"random-{shape}-x{layers}"
    return LoadedModels(target, draft, vocab_tokenizer(SHAPES[shape].vocab_size), name, f"truncated:{plan['draft_layers']}")


def profile_and_policies(device: str, dtype: str, quick: bool, stem: str | None) -> tuple[dict, str]:
    """This device's profile of the random pair (its latency grid, acceptance and best-k table), then `bench
    policies` (a) uniform load and (b) time-varying traffic, short, steered by it. Writes the profile and
    the policies run's files beside `stem`; returns (results, markdown)."""
    from serve_app.bench.policies import bench_policies
    from serve_app.bench.rounds import default_stem
    from serve_app.models import resolve_dtype
    from serve_app.profiling.profiler import measure_profile
    from serve_app.profiling.profiles import save_profile

    plan = PLANS[quick]
    dtype = resolve_dtype(dtype, device)
    models = random_pair(device, dtype, quick)
    profile = measure_profile(models, models.target_name, models.draft_name, dtype, device, plan["batches"],
                              plan["max_k"], plan["reps"], plan["acceptance_prompts"], 32)
    base = Path(stem) if stem else default_stem("bench-campaign")
    save_profile(profile, base.with_name(base.name + "-profile.json"))
    ks = [k for k in (1, 2, 4) if k <= plan["max_k"]]
    policies = ["none", *(f"fixed:{k}" for k in ks), "lut", "adaptive"]
    out_dir = base.with_name(base.name + "-policies")
    res = bench_policies(models, profile, str(out_dir), plan["policies_at"], max_k=plan["max_k"], scale=plan["scale"],
                         parts="ab", policies=policies, plots=_can_plot())
    lines = [f"# GPU campaign: profile and policies on {profile.gpu_type} ({device}, {dtype})", "",
             f"Target {models.target_name} (random weights), draft `{models.draft_name}` (its first layers). Profile: "
             f"acceptance per position {profile.acceptance}, best k per batch size {profile.best_k}. "
             f"Policies (a, b): [{out_dir.name}/summary.md]({out_dir.name}/summary.md).", ""]
    grid = profile.latency
    lines += ["ms per step (draft + verify + other):", "", "| batch | " + " | ".join(f"k = {k}" for k in grid.ks) + " |",
              "|---|" + "---|" * len(grid.ks)]
    for i, b in enumerate(grid.batch_sizes):
        lines.append(f"| {b} | " + " | ".join(f"{grid.draft_ms[i][j]:.1f} + {grid.verify_ms[i][j]:.1f} + "
                                              f"{grid.other_ms[i][j]:.1f}" for j in range(len(grid.ks))) + " |")
    return {"profile": profile.model_dump(), "policies": {k: res[k] for k in ("uniform", "varying") if k in res},
            "device": device, "dtype": dtype}, "\n".join(lines) + "\n"


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a bare GPU box: the policies run writes its results and summary, no PNGs
        return False
    return True


__all__ = ["PLANS", "profile_and_policies", "random_pair"]
