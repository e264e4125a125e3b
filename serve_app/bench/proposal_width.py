"""What a sampled row's top-N proposal costs in acceptance, exactly, and what the coupled sampler's noise
costs against ideal noise: `specserve bench proposal-width [--out STEM]`.

The engine (fixed:1, temperature 1) runs the evaluation prompts on the embedded pair; at every step the
draft's logits and the target's logits at the drafted position are recorded, row by row. From those
(p, q) pairs, with no sampling noise: the expected rejection-sampling acceptance sum_x min(p, q) with
the draft's full distribution and with it restricted to its top N (renormalized, as the draft sends
it), and the share of q's mass in its top N. And, over many seeds: how often the target's and the
draft's coupled choices agree with the engine's counter-based block noise and with iid Gumbel noise
from torch's generator (the same law: the figures must agree within Monte-Carlo error).
"""

from __future__ import annotations

import torch


def collect(prompts: int = 16, max_tokens: int = 48, dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [R, V], draft logits [R, V]) at the drafted position of R engine rows."""
    import serve_app.engine.worker as worker
    from serve_app.bench.prompt_sets import BENCH_PROMPTS, chat_prompts
    from serve_app.config import EngineConfig, ModelConfig, SamplingParams
    from serve_app.engine.scheduler import Engine
    from serve_app.models import load_models

    drafts, targets = [], []
    draft_choice, verify_walk = worker.draft_choice, worker.verify_walk

    def spy_draft(logits, *args, **kw):
        drafts.append(logits.float().clone())
        return draft_choice(logits, *args, **kw)

    def spy_verify(logits, drafted, *args, **kw):
        if drafted.shape[1] == 1:  # a k = 1 step (not a prefill): position 0 is the drafted one
            rows = torch.arange(drafted.shape[0])
            targets.append((logits(rows, 0) if callable(logits) else logits[:, 0]).float().clone())
        return verify_walk(logits, drafted, *args, **kw)

    worker.draft_choice, worker.verify_walk = spy_draft, spy_verify
    try:
        models = load_models(ModelConfig(dtype=dtype))
        engine = Engine.from_models(models, EngineConfig(policy="fixed:1", max_batch_size=8))
        reqs = [engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=1.0))
                for p in chat_prompts(models.tokenizer, BENCH_PROMPTS)[:prompts]]
        engine.run(reqs)
    finally:
        worker.draft_choice, worker.verify_walk = draft_choice, verify_walk
    pairs = [(p, q) for p, q in zip(targets, drafts) if p.shape == q.shape]
    return torch.cat([p for p, _ in pairs]), torch.cat([q for _, q in pairs])


def measure(p_logits: torch.Tensor, q_logits: torch.Tensor, widths=(16, 64, 256, 1024), seeds: int = 64) -> dict:
    from serve_app.engine.sampling import gumbel_argmax, noise_key

    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    out = {"rows": len(p), "acceptance_full_q": torch.minimum(p, q).sum(-1).mean().item(), "top_n": []}
    for n in widths:
        vals, ids = q_logits.topk(n, dim=-1)
        qn = torch.zeros_like(q).scatter_(-1, ids, vals.softmax(-1))
        out["top_n"].append({"n": n, "acceptance": torch.minimum(p, qn).sum(-1).mean().item(),
                             "q_mass": q.gather(-1, ids).sum(-1).mean().item()})
    g = torch.Generator().manual_seed(0)
    block = iid = 0.0
    for s in range(seeds):
        keys = torch.tensor([noise_key(1000 + s, r) for r in range(len(p))], dtype=torch.int32)
        block += (gumbel_argmax(p_logits, keys) == gumbel_argmax(q_logits, keys)).float().mean().item()
        noise = -torch.log(-torch.log(torch.rand(p_logits.shape, generator=g).clamp(1e-12, 1 - 1e-7)))
        iid += ((p_logits + noise).argmax(-1) == (q_logits + noise).argmax(-1)).float().mean().item()
    out.update(coupled_agreement_block_noise=block / seeds, coupled_agreement_iid_gumbel=iid / seeds, seeds=seeds)
    return out


def markdown(res: dict) -> str:
    full = res["acceptance_full_q"]
    lines = ["# A sampled row's top-N proposal and the coupled sampler's noise (embedded pair, temperature 1)", "",
             f"{res['rows']} (target, draft) distribution pairs at the drafted position of real engine steps "
             "(fixed:1, the benchmark prompts); exact expectations, no sampling noise.", "",
             "| draft proposal | expected acceptance sum min(p, q) | vs full q | q's mass in it |", "|---|---|---|---|",
             f"| full distribution | {full:.4f} | 1.000 | 1.000 |"]
    for r in res["top_n"]:
        lines.append(f"| top {r['n']}, renormalized | {r['acceptance']:.4f} | {r['acceptance'] / full:.3f} | {r['q_mass']:.3f} |")
    lines += ["", f"Coupled sampler (seeded requests), draft and target choosing with the same noise, agreement over "
                  f"{res['seeds']} seeds: counter-based block noise {res['coupled_agreement_block_noise']:.4f}, "
                  f"iid Gumbel noise {res['coupled_agreement_iid_gumbel']:.4f}.", ""]
    return "\n".join(lines)


def run(prompts: int = 16, max_tokens: int = 48, dtype: str = "auto", out: str | None = None) -> int:
    """`specserve bench proposal-width`: measure, print, write results/proposal-width-<hardware>.json/.md."""
    from serve_app.bench.rounds import default_stem, write_results

    res = measure(*collect(prompts, max_tokens, dtype))
    md = markdown(res)
    print(md)
    json_path, md_path = write_results(out or default_stem("proposal-width"), res, md)
    print(f"results: {json_path}, {md_path}")
    return 0
