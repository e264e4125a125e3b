"""The measured half of the GPU campaign (`specserve selfcheck --full`), after the checks: on random Llama models
at real shapes and full depth, the attention backends, this device's profile and a short `bench policies` with it.

The random target's layers past the draft's write quietly into its residual stream (`shapes.QUIET`), so a
draft made of its first layers (`truncated:N`, sharing its weights) agrees with it often: a pair that prices steps at the real
shape (an 8B target's forwards, a 128k-vocabulary head) and accepts drafts at a rate between a weak and a good
draft's, with no download. The profile's best-k table then steers `lut` and `adaptive` in the policies run:
the product's own loop (profile, then choose k per step) on the device, end to end. Only torch, transformers,
pydantic, numpy and tqdm: runs on a GPU machine with the wheels `make gpu-wheels` builds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from serve_app.bench.shapes import SHAPES, random_llama, vocab_tokenizer

PLANS = {  # quick (a CPU, the suite): tiny shapes; full (a GPU): a whole-depth random Llama-3.1-8B
    True: {"target": ("tiny-128k", 4), "draft_layers": 1, "batches": [1, 4], "max_k": 2, "reps": 1,
           "acceptance_prompts": 4, "policies_at": [1, 4], "scale": 0.02,
           "contexts": [64, 256], "context_batches": [1, 4], "context_ks": [0, 1, 2],
           "replay_parts": ["e"], "replay_scale": 0.1, "replay_seeds": 1, "replay_policies": ["fixed:1", "fixed:2", "budget"],
           "grid_batches": [2], "grid_contexts": [128]},
    False: {"target": ("llama-3.1-8b", 32), "draft_layers": 2, "batches": [1, 8, 32, 64], "max_k": 6, "reps": 4,
            "acceptance_prompts": 32, "policies_at": [1, 8, 32], "scale": 0.1,
            "contexts": [512, 4096, 16384], "context_batches": [1, 8, 32], "context_ks": [0, 1, 2, 4],
            "replay_parts": ["e"], "replay_scale": 0.3, "replay_seeds": 1,
            "replay_policies": ["fixed:1", "fixed:2", "fixed:3", "fixed:4", "lut", "adaptive", "budget"],
            "grid_batches": [1, 8], "grid_contexts": [512, 3072]},
}
"""What each stage runs. On the first lent H100 (results/selfcheck-NVIDIA_H100-*), with the gather backend pinned,
the 8B grid's neighbouring cells came out up to 10x apart (flex's, the day before, within 10%): leave the backend
to `auto`; four visits per cell, their median. The replay at scale 0.5 ran ~55 s per policy there, at 0.3 13-30 s.
The replay reads the campaign's documents ((e) and the grid: the embedded target's corpus ids, which the vocabulary
tokenizer keeps); (b) and (d) are chat and JSON text, which it reads as <unk>."""

STAGES = ("attention", "profile", "context", "replay", "policies")
"""The campaign's stages in order: `bench attention` at 8B heads; this device's profile of the random pair; its
context axis (`bench context` merged into the profile); `bench replay` of (e) and the grid on that profile's cost
model; a short wall-clock `bench policies` (a, b). Each writes its results files as it ends."""


def random_pair(device: str, dtype: str, quick: bool):
    """A random target at its real depth and a truncated draft of its first layers (shared weights)."""
    from serve_app.models import DTYPES, LoadedModels, truncated_draft

    plan = PLANS[quick]
    shape, layers = plan["target"]
    target = random_llama(SHAPES[shape], layers, seed=0, dtype=DTYPES[dtype], device=device,
                          quiet_from=plan["draft_layers"])
    draft = truncated_draft(target, plan["draft_layers"])
    name = f"random-{shape}-x{layers}"
    return LoadedModels(target, draft, vocab_tokenizer(SHAPES[shape].vocab_size), name, f"truncated:{plan['draft_layers']}")


def run_campaign(device: str, dtype: str, quick: bool, stem: str | None, stages: list[str],
                 deadline_s: float | None = None) -> None:
    """The campaign's `stages` (of STAGES, in their order), each writing its results files beside `stem` (the
    checks' stem, default results/selfcheck-<hardware type>) as it ends, so a run cut short keeps what it finished. A stage that
    starts past `deadline_s` seconds is skipped (said on stderr); the context axis stops starting cells at it."""
    from serve_app.bench.rounds import default_stem, write_results
    from serve_app.models import resolve_dtype

    if unknown := [s for s in stages if s not in STAGES]:
        raise ValueError(f"unknown stage(s) {unknown}: use some of {', '.join(STAGES)}")
    start = time.monotonic()
    base = Path(stem) if stem else default_stem("selfcheck")
    plan, dtype = PLANS[quick], resolve_dtype(dtype, device)
    models = profile = None
    profile_path = base.with_name(base.name + "-profile.json")

    def left() -> float | None:
        return None if deadline_s is None else deadline_s - (time.monotonic() - start)

    def write(suffix: str, results: dict, markdown: str) -> None:
        print("\n" + markdown)
        paths = write_results(base.with_name(base.name + suffix), results, markdown)
        print(f"results: {paths[0]}, {paths[1]}  ({time.monotonic() - start:.0f} s into the campaign)", flush=True)

    for stage in (s for s in STAGES if s in stages):
        if (remaining := left()) is not None and remaining <= 0:
            print(f"campaign: {stage} skipped (past the {deadline_s:.0f} s deadline)", file=sys.stderr, flush=True)
            continue
        if stage == "attention":
            from serve_app.bench.attention import bench_attention

            cuda = device.startswith("cuda")
            write("-attention", *bench_attention("gpu" if cuda else "quick" if quick else "cpu",
                                                 "llama-3.1-8b" if cuda else "smollm2-135m", device,
                                                 ["bfloat16"] if cuda else ["float32"], 5))
            continue
        if models is None:
            models = random_pair(device, dtype, quick)
        if stage == "profile":
            profile = _profile(models, dtype, device, plan, profile_path)
            write("-campaign", _profile_summary(profile, models, device, dtype), _profile_markdown(profile, models, device, dtype, base))
        elif profile is None:
            profile = _existing_profile(profile_path, models, dtype)
        if stage == "context":
            from serve_app.bench.context import bench_context, merge_into_profile
            from serve_app.profiling.profiles import load_profile

            results, markdown = bench_context(models, plan["context_batches"], plan["context_ks"], plan["contexts"], plan["reps"],
                                              left(), models.target_name)
            write("-context", results, markdown)
            merge_into_profile(str(profile_path), results["grid"], results["chunk_context"])
            profile = load_profile(profile_path)
        elif stage == "replay":
            from serve_app.bench import replay as rp

            policies = plan["replay_policies"]
            res = rp.run_replay(models, profile, policies, plan["replay_parts"], plan["replay_scale"], 0,
                                plan["replay_seeds"])
            write("-replay", res, rp.markdown(res, policies))
            if (remaining := left()) is not None and remaining <= 0:  # the parts are written: the grid can wait
                print("campaign: the replay's grid skipped (past the deadline)", file=sys.stderr, flush=True)
                continue
            res = rp.run_replay(models, profile, policies, [], 0.0, batches=plan["grid_batches"],
                                contexts=plan["grid_contexts"], grid_rounds=2, deadline_s=left())
            write("-replay-grid", res, rp.markdown(res, policies))
        elif stage == "policies":
            from serve_app.bench.policies import bench_policies

            ks = [k for k in (1, 2, 4) if k <= plan["max_k"]]
            out_dir = base.with_name(base.name + "-policies")
            bench_policies(models, profile, str(out_dir), plan["policies_at"], max_k=plan["max_k"], scale=plan["scale"],
                           parts="ab", policies=["none", *(f"fixed:{k}" for k in ks), "lut", "adaptive"],
                           plots=_can_plot())


def _profile(models, dtype: str, device: str, plan: dict, path: Path):
    from serve_app.profiling.profiler import copy_ks_for, measure_profile
    from serve_app.profiling.profiles import save_profile

    profile = measure_profile(models, models.target_name, models.draft_name, dtype, device, plan["batches"],
                              plan["max_k"], plan["reps"], plan["acceptance_prompts"], 32,
                              copy_ks=copy_ks_for(plan["max_k"], 16), agree=0.05, max_reps=2 * plan["reps"])
    save_profile(profile, path)
    return profile


def _existing_profile(path: Path, models, dtype: str):
    """The profile an earlier run of the profile stage saved, for later stages run on their own."""
    from serve_app.profiling.profiles import load_profile

    if not path.is_file():
        raise ValueError(f"{path}: no profile of this pair yet: run the campaign's profile stage first")
    profile = load_profile(path)
    if (profile.target, profile.draft, profile.dtype) != (models.target_name, models.draft_name, dtype):
        raise ValueError(f"{path} profiles {profile.target} / {profile.draft} ({profile.dtype}), not this pair")
    return profile


def _profile_summary(profile, models, device: str, dtype: str) -> dict:
    return {"profile": profile.model_dump(), "device": device, "dtype": dtype, "target": models.target_name}


def _profile_markdown(profile, models, device: str, dtype: str, base: Path) -> str:
    lines = [f"# GPU campaign: profile on {profile.gpu_type} ({device}, {dtype})", "",
             f"Target {models.target_name} (random weights), draft `{models.draft_name}` (its first layers). "
             f"Acceptance per position {profile.acceptance}, best k per batch size {profile.best_k}. "
             f"Profile: {base.name}-profile.json; later stages: {base.name}-context, -replay, -policies/.", ""]
    grid = profile.latency
    lines += ["ms per step (draft + verify + other):", "", "| batch | " + " | ".join(f"k = {k}" for k in grid.ks) + " |",
              "|---|" + "---|" * len(grid.ks)]
    for i, b in enumerate(grid.batch_sizes):
        lines.append(f"| {b} | " + " | ".join(f"{grid.draft_ms[i][j]:.1f} + {grid.verify_ms[i][j]:.1f} + "
                                              f"{grid.other_ms[i][j]:.1f}" for j in range(len(grid.ks))) + " |")
    return "\n".join(lines) + "\n"


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a bare GPU box: the policies run writes its results and summary, no PNGs
        return False
    return True


__all__ = ["PLANS", "STAGES", "random_pair", "run_campaign"]
