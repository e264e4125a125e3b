"""`specserve bench acceptance`: how well a draft agrees with its target where it was not trained.

Acceptance and tokens per step (accepted + 1) at fixed:K, greedy, on each evaluation prompt set
(serve_app/bench/prompt_sets.py: none of them a distillation or profiling prompt). Counts, not timings:
the same on a busy machine as on a quiet one.
"""

from __future__ import annotations

from tqdm import tqdm

from serve_app.config import ModelConfig
from serve_app.models import load_models
from serve_app.bench.prompt_sets import EVAL_SETS, chat_prompts
from serve_app.bench.engine import engine_run


def bench_acceptance(mc: ModelConfig, k: int, max_tokens: int, batch: int, temperature: float = 0.0) -> tuple[dict, str]:
    """Returns (results, markdown report); results["sets"][name] = {acceptance, tokens_per_step, ...}.

    temperature > 0: each set runs twice, unseeded (rejection sampling) and seeded (the coupled
    sampler seeded requests use), so the two acceptance rates compare on the same prompts and k.
    """
    models = load_models(mc)
    samplers = ["greedy"] if temperature == 0 else ["rejection", "coupled"]
    res = {"target": models.target_name, "draft": models.draft_name, "k": k, "max_tokens": max_tokens,
           "batch": batch, "temperature": temperature, "sets": {}}
    total = sum(len(v) for v in EVAL_SETS.values()) * len(samplers)
    with tqdm(total=total, desc="bench acceptance", unit="req") as bar:
        for name, texts in EVAL_SETS.items():
            for sampler in samplers:
                run = engine_run(models, f"fixed:{k}", chat_prompts(models.tokenizer, texts), max_tokens, batch, bar,
                                 temperature, seeded=sampler == "coupled")
                key = name if sampler == "greedy" else f"{name} ({sampler})"
                res["sets"][key] = {"prompts": len(texts), "proposed": run.proposed, "accepted": run.accepted,
                                    "acceptance": run.acceptance, "tokens_per_step": run.tokens_per_step}
    how = "greedy" if temperature == 0 else (f"temperature {temperature:g}: unseeded requests (rejection sampling) "
                                            "and seeded ones (coupled sampler)")
    lines = [f"# bench acceptance: target {res['target']}, draft {res['draft']}", "",
             f"fixed:{k}, {how}, up to {max_tokens} tokens per prompt, batch {batch}; counts, not timings.", "",
             "| prompt set | prompts | proposed | accepted | acceptance | tokens/step |", "|---|---|---|---|---|---|"]
    for name, s in res["sets"].items():
        lines.append(f"| {name} | {s['prompts']} | {s['proposed']} | {s['accepted']} | {s['acceptance']:.3f} | "
                     f"{s['tokens_per_step']:.2f} |")
    return res, "\n".join(lines) + "\n"
