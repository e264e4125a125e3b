"""`specserve selfcheck`: does the engine work, exactly, on this device? Run it on a new GPU node before
deploying (and whenever the project gets a GPU to test on).

Needs only torch, transformers, accelerate, pydantic, numpy and tqdm: no Ray, no network, no model
download (random Llama-shaped models are built on the spot, serve_app/bench/shapes.py), no matplotlib.
The checks, each PASS or FAIL with a one-line reason and its time:

  greedy    greedy output with an independent draft at k = 1, 2, 4 is token for token the output without
            speculation (float32, a few prompts of different lengths decoded together)
  sampled   temperature 1, top_p 0.9 at k = 2 runs and returns valid token ids, as many as asked
  seeded    seeded sampling (the coupled sampler) gives the same text at k = 0, 2 and 4 (float32)
  eagle3    an (untrained) EAGLE-3 head, reading the target's features, drafts at k = 2 and 4, and greedy
            output stays the target's
  attention every attention backend (engine/attention.py) against gather on random paged batches, and greedy
            output with the backend `auto` picks on this device against gather's
  syncs     device-to-host reads per engine step at batch 4 and 16 (k = 4) within the engine's budget
  kv        the KV pool sized from the device's memory (gpu_memory_utilization) and a request run in it
  profile   the profiler's latency grid on a tiny grid (batch 1 and 4, k 0 and 2): ms per step per cell
  step      `bench step`'s in-process run at batch 1 and 32 (greedy, seeded; k = 4)

Exact checks run in float32 whatever `--dtype` says (bfloat16 rounds differently at different batch
shapes, so near-ties may flip); the sampled, profile and step checks run in `--dtype`. The draft of
the exact checks is the target with noise on its weights: a separate model that agrees often but not
always, so acceptance, rejection and rollback all happen. Results go to results/selfcheck-<hardware
type>.json and .md; the command exits 1 if any check fails.
"""

from __future__ import annotations

import copy
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from serve_app.bench.shapes import SHAPES, eagle3_layers, random_llama, random_prompts, vocab_tokenizer
from serve_app.config import EngineConfig, SamplingParams, check_dtype


class SelfCheck(BaseModel):
    """What `specserve selfcheck` runs."""

    model_config = ConfigDict(extra="forbid")

    device: str = "cuda"
    """cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """dtype of the sampled, profile and step checks (the exact ones run in float32): auto, float32,
    bfloat16 or float16."""
    quick: bool = False
    """Small models and few steps (CI, a CPU): the tiny-128k shape instead of llama-3.2-1b / llama-3.1-8b."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        return check_dtype(v)

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        if v.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"--device {v}: torch sees no CUDA device (torch {torch.__version__}, "
                                 f"built for CUDA {torch.version.cuda}); --device cpu checks the CPU")
            index = int(v.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"--device {v}: there are {torch.cuda.device_count()} CUDA device(s)")
        elif v != "cpu":
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {v!r}")
        return v

    @property
    def shape(self) -> str:
        """Shape of the exact checks' target (built with `layers` layers)."""
        return "tiny-128k" if self.quick else "llama-3.2-1b"

    @property
    def layers(self) -> int:
        return 2

    @property
    def max_tokens(self) -> int:
        return 16 if self.quick else 32


@dataclass
class Context:
    """What the checks share: the settings, and models built once on first use."""

    cfg: SelfCheck
    cache: dict = field(default_factory=dict)

    def models(self):
        """(target, draft, tokenizer) in float32: a random target and a noisy copy of it as the draft."""
        if "models" not in self.cache:
            shape = SHAPES[self.cfg.shape]
            target = random_llama(shape, self.cfg.layers, seed=0, device=self.cfg.device, peaked=4.0)
            self.cache["models"] = (target, noisy_copy(target, 0.1), vocab_tokenizer(shape.vocab_size))
        return self.cache["models"]

    def prompts(self) -> list[list[int]]:
        """Four prompts of different lengths: rows are padded differently in every forward."""
        vocab = SHAPES[self.cfg.shape].vocab_size
        return [random_prompts(1, n, vocab, seed=n)[0] for n in (5, 17, 33, 9)]

    @property
    def dtype(self) -> str:
        from serve_app.models import resolve_dtype

        return resolve_dtype(self.cfg.dtype, self.cfg.device)


def noisy_copy(model, rel: float, seed: int = 1):
    """A copy of `model` with Gaussian noise of `rel` times each weight matrix's own spread: a draft that
    agrees with it often (about half the time at rel 0.1 on the shapes here), not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * p.std() * rel)
    return draft


def generate(target, draft, tokenizer, prompts: list[list[int]], params: list[SamplingParams], k: int,
             attention_backend: str = "auto") -> tuple[list[list[int]], int, int]:
    """Every prompt through a fresh engine at once: (outputs, draft tokens proposed, accepted). k = 0: no draft at all."""
    from serve_app.drafting import draft_worker
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.engine.worker import ModelWorker

    pad = tokenizer.pad_token_id or 0
    dw = draft_worker(draft, pad) if k > 0 else None
    config = EngineConfig(policy=f"fixed:{k}" if k else "none", max_batch_size=len(prompts), max_k=max(k, 1),
                          attention_backend=attention_backend)
    engine = Engine(ModelWorker(target, "target", pad), dw, tokenizer, config, FixedK(k))
    reqs = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    engine.run(reqs)
    return [r.output_ids for r in reqs], sum(r.stats.proposed for r in reqs), sum(r.stats.accepted for r in reqs)


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        j = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        if x != y:
            return f"prompt {i} differs at token {j}"
    return "different numbers of outputs"


def _same_at_every_k(ctx: Context, draft, params: list[SamplingParams], ks: list[int], target=None,
                     need_accepted: bool = True) -> tuple[bool, str, dict]:
    """Output at each k > 0 against k = 0 (no draft); fails on the first difference, when nothing was
    proposed, or (need_accepted) when nothing was ever accepted: acceptance and rollback went untested.
    target: the shared one if None."""
    shared, _, tok = ctx.models()
    target = target if target is not None else shared
    prompts = ctx.prompts()
    ref, _, _ = generate(target, None, tok, prompts, params, 0)
    acceptance, proposed = {}, 0
    for k in ks:
        out, n, accepted = generate(target, draft, tok, prompts, params, k)
        proposed += n
        acceptance[k] = accepted / n if n else 0.0
        if out != ref:
            return False, f"k = {k} differs from k = 0: {_first_difference(out, ref)}", {"acceptance": acceptance}
    if not proposed:
        return False, "the draft proposed nothing: the check tested nothing", {"acceptance": acceptance}
    if need_accepted and not any(acceptance.values()):
        return False, "no draft token was ever accepted: the check tested nothing", {"acceptance": acceptance}
    shown = ", ".join(f"k={k} {a:.0%}" for k, a in acceptance.items())
    return True, f"{len(prompts)} prompts x {params[0].max_tokens} tokens identical at k = 0 and {ks} (acceptance {shown})", \
        {"acceptance": acceptance}


# ---- the checks: each returns (passed, one-line reason, details) ---------------------------------------
def check_greedy(ctx: Context):
    params = [SamplingParams(max_tokens=ctx.cfg.max_tokens, ignore_eos=True)] * 4
    return _same_at_every_k(ctx, ctx.models()[1], params, [1, 2, 4])


def check_sampled(ctx: Context):
    from serve_app.models import DTYPES

    target, draft, tok = ctx.models()
    dtype = DTYPES[ctx.dtype]
    target, draft = copy.deepcopy(target).to(dtype), copy.deepcopy(draft).to(dtype)
    n = ctx.cfg.max_tokens
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, top_p=0.9)] * 4
    out, proposed, accepted = generate(target, draft, tok, ctx.prompts(), params, 2)
    acceptance = accepted / proposed if proposed else 0.0
    vocab = target.get_output_embeddings().weight.shape[0]
    bad = [t for o in out for t in o if not 0 <= t < vocab]
    if bad or any(len(o) != n for o in out):
        return False, f"lengths {[len(o) for o in out]} (asked {n}), ids outside the vocabulary: {bad[:3]}", {}
    return True, f"{len(out)} x {n} valid tokens at k = 2 in {ctx.dtype} (acceptance {acceptance:.0%})", \
        {"acceptance": acceptance, "dtype": ctx.dtype}


def check_seeded(ctx: Context):
    params = [SamplingParams(max_tokens=ctx.cfg.max_tokens, ignore_eos=True, temperature=1.0, seed=100 + i) for i in range(4)]
    return _same_at_every_k(ctx, ctx.models()[1], params, [2, 4])


def check_eagle3(ctx: Context):
    from serve_app.drafting.eagle3 import Eagle3Draft

    # a copy: capturing features hooks the target's layers for good, and the later checks copy it
    target = copy.deepcopy(ctx.models()[0])
    vocab = target.config.vocab_size
    # An untrained head over a random target agrees with it about never (acceptance ~0): the check is
    # that its feature path runs on this device and never changes the output, not how well it drafts.
    draft = Eagle3Draft.from_target(target, torch.arange(min(32000, vocab)), eagle3_layers(target.config.num_hidden_layers))
    params = [SamplingParams(max_tokens=ctx.cfg.max_tokens, ignore_eos=True)] * 4
    return _same_at_every_k(ctx, draft.to(target.device), params, [2, 4], target, need_accepted=False)


def check_profile(ctx: Context):
    from tqdm import tqdm

    from serve_app.models import DTYPES, LoadedModels
    from serve_app.profiling.profiler import measure_latency

    target, draft, tok = ctx.models()
    dtype = DTYPES[ctx.dtype]
    models = LoadedModels(copy.deepcopy(target).to(dtype), copy.deepcopy(draft).to(dtype), tok, "random", "random")
    batches, ks, reps = [1, 4], [0, 2], 2
    with tqdm(total=len(batches) * ((reps + 1) * len(ks) + 1), desc="selfcheck profile", unit="cell", leave=False) as bar:
        grid = measure_latency(models, batches, ks, reps, bar)
    ms = {f"b{b} k{k}": round(grid.draft_ms[i][j] + grid.verify_ms[i][j] + grid.other_ms[i][j], 2)
          for i, b in enumerate(batches) for j, k in enumerate(ks)}
    if not all(math.isfinite(v) and v > 0 for v in ms.values()):
        return False, f"latency cells not all positive: {ms}", {"ms_per_step": ms}
    worst = max(max(r) for r in grid.spread)
    return True, (f"ms per step ({grid.clock}) " + ", ".join(f"{c} {v:.1f}" for c, v in ms.items())
                  + f"; repeated visits within {worst:.0%}"), {"ms_per_step": ms, "clock": grid.clock, "spread": grid.spread,
                                                             "host_verify_ms": grid.host_verify_ms}


def check_step(ctx: Context):
    from serve_app.bench.step import StepBench, run_inprocess

    quick = ctx.cfg.quick
    cfg = StepBench(shape="tiny-128k" if quick else "llama-3.1-8b", layers=1 if quick else 2,
                    batch_sizes=[1, 32], k=4, mixes=["greedy", "seeded"], steps=2 if quick else 5,
                    warmup=1 if quick else 2, prompt_tokens=32 if quick else 128, dtype=ctx.cfg.dtype,
                    device=ctx.cfg.device)
    rows = run_inprocess(cfg)
    for r in rows:
        step, device = r["step_ms"]["median"], r["forward_ms"]["median"] + r["other_device_ms"]["median"]
        if not (step > 0 and 0 <= device <= step * 1.05 and r["tokens_per_step"] >= 1):
            return False, f"batch {r['batch']} {r['mix']}: step {step:.1f} ms, device {device:.1f} ms, " \
                          f"{r['tokens_per_step']} tokens/step", {"rows": rows}
    big = [r for r in rows if r["batch"] == 32]
    shown = ", ".join(f"{r['mix']} {r['step_ms']['median']:.1f} ms (device {r['forward_ms']['median']:.1f} + "
                      f"{r['other_device_ms']['median']:.1f})" for r in big)
    return True, f"{cfg.shape} x {cfg.layers}, batch 32, k 4: {shown}", {"rows": rows, "shape": cfg.shape}


def check_attention(ctx: Context):
    """Every attention backend against gather on this device (random pools: GQA, ragged rows, prefill chunks,
    a shared prefix), then greedy speculative output with the one `auto` picks here against gather's."""
    from serve_app.engine import attention

    cases = [[(30, 5), (3, 2), (47, 4), (16, 1)], [(0, 37), (16, 20), (40, 3)], [(32, 1), (40, 1), (70, 1)]]
    worst = {b: max(attention.probe(b, ctx.cfg.device, seed=i, rows_spec=spec, shared_prefix_blocks=i % 2)
                    for i, spec in enumerate(cases)) for b in attention.BACKENDS}
    bad = {b: e for b, e in worst.items() if e > 1e-4}
    if bad:
        return False, f"backends differ from gather (float32): {bad}", {"max_abs_diff": worst}
    chosen = attention.choose("auto", ctx.cfg.device)
    target, draft, tok = ctx.models()
    params = [SamplingParams(max_tokens=ctx.cfg.max_tokens, ignore_eos=True)] * 4
    outs = {}
    for b in {"gather", chosen}:
        outs[b], _, _ = generate(target, draft, tok, ctx.prompts(), params, 2, attention_backend=b)
    if outs[chosen] != outs["gather"]:
        return False, f"greedy output with {chosen} differs from gather: {_first_difference(outs[chosen], outs['gather'])}", \
            {"max_abs_diff": worst, "auto": chosen}
    shown = ", ".join(f"{b} {e:.1e}" for b, e in worst.items())
    return True, f"largest difference from gather: {shown}; auto picks {chosen} here, greedy output identical", \
        {"max_abs_diff": worst, "auto": chosen}


def check_syncs(ctx: Context):
    """Device-to-host reads per engine step (on CUDA only reads of CUDA tensors count) at batch 4 and 16,
    a mix of greedy, seeded and sampled rows, k = 4: within the engine's budget, and not growing per row."""
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.engine.syncs import STEP_BUDGET_PER_POSITION, reads_per_step
    from serve_app.engine.worker import ModelWorker
    from serve_app.drafting import draft_worker

    target, draft, tok = ctx.models()
    k, per = 4, {}
    for batch in (4, 16):
        engine = Engine(ModelWorker(target, "target", tok.pad_token_id or 0), draft_worker(draft, tok.pad_token_id or 0),
                        tok, EngineConfig(policy=f"fixed:{k}", max_batch_size=batch, max_k=k), FixedK(k))
        prompts = random_prompts(batch, 12, SHAPES[ctx.cfg.shape].vocab_size, seed=batch)
        per[batch] = reads_per_step(engine, prompts, max_tokens=64, device=ctx.cfg.device)
    budget = STEP_BUDGET_PER_POSITION * (k + 1)
    ok = max(per.values()) <= budget
    return ok, f"host reads per step at k = {k}: batch 4 {per[4]:.1f}, batch 16 {per[16]:.1f} (budget {budget})", \
        {"reads_per_step": per, "budget": budget}


def check_kv(ctx: Context):
    """The KV pool sized from this device's memory (on CUDA: weights + a profiling forward measured; on a CPU
    nothing to size from) and allocated at once."""
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.engine.worker import ModelWorker

    target, _, tok = ctx.models()
    cfg = EngineConfig(max_batch_size=4, max_num_tokens=1 << 20, max_num_batched_tokens=256, gpu_memory_utilization=0.5)
    engine = Engine(ModelWorker(target, "target", tok.pad_token_id or 0), None, tok, cfg, FixedK(0))
    pool = engine.kv_pool
    req = engine.submit(ctx.prompts()[0], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run([req])  # the pool is allocated at its first write
    if len(req.output_ids) != 4:
        return False, f"a request in the sized pool gave {len(req.output_ids)} tokens of 4", {"kv_pool": pool}
    # on CUDA the pool is what memory leaves (the workers' measured rooms), capped at max_num_tokens: a small
    # model's room can exceed the cap, and then the cap is the size
    rooms = pool.get("rooms") or []
    if ctx.cfg.device.startswith("cuda") and (not rooms or pool["tokens"] != min(min(rooms), cfg.max_num_tokens) // cfg.block_size * cfg.block_size):
        return False, f"on {ctx.cfg.device} the pool was not sized from memory: {pool}", {"kv_pool": pool}
    return True, f"{pool['tokens']:,} tokens from {pool['from']} (gpu_memory_utilization 0.5, attention {pool['attention']})", \
        {"kv_pool": pool}


CHECKS: dict[str, Callable[[Context], tuple[bool, str, dict]]] = {
    "greedy": check_greedy, "sampled": check_sampled, "seeded": check_seeded, "eagle3": check_eagle3,
    "attention": check_attention, "syncs": check_syncs, "kv": check_kv, "profile": check_profile, "step": check_step,
}


def device_info(cfg: SelfCheck, dtype: str) -> dict:
    import transformers

    on_gpu = cfg.device.startswith("cuda")
    index = int(cfg.device.partition(":")[2] or 0) if on_gpu else None
    return {
        "device": cfg.device,
        "device_name": torch.cuda.get_device_name(index) if on_gpu else cpu_name(),
        "dtype": dtype, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "quick": cfg.quick,
    }


def cpu_name() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_selfcheck(cfg: SelfCheck, names: list[str] | None = None) -> tuple[dict, str, bool]:
    """Run the checks (all, or `names`), printing each as it ends; returns (results, markdown, all passed)."""
    names = list(CHECKS) if names is None else names
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}: use some of {', '.join(CHECKS)}")
    ctx = Context(cfg)
    info = device_info(cfg, ctx.dtype)
    print(f"specserve selfcheck on {info['device_name']} ({cfg.device}), torch {info['torch']}, "
          f"transformers {info['transformers']}, dtype {info['dtype']}" + (", quick" if cfg.quick else ""), flush=True)
    checks = []
    for name in names:
        t = time.perf_counter()
        try:
            ok, reason, details = CHECKS[name](ctx)
        except Exception as e:  # a crash is a failure of this check, and the others still run
            first = (str(e).splitlines() or [""])[0]  # one line: the traceback goes to the results file
            ok, reason, details = False, f"{type(e).__name__}: {first}", {"traceback": traceback.format_exc()}
        seconds = time.perf_counter() - t
        checks.append({"check": name, "passed": bool(ok), "reason": reason, "seconds": round(seconds, 2), **details})
        print(f"{'PASS' if ok else 'FAIL'} {name:8s} {seconds:6.1f} s  {reason}", flush=True)
    results = {**info, "shape": cfg.shape, "checks": checks, "passed": all(c["passed"] for c in checks)}
    return results, selfcheck_markdown(results), results["passed"]


def selfcheck_markdown(res: dict) -> str:
    lines = [f"# specserve selfcheck: {res['device_name']} ({res['device']})", "",
             f"torch {res['torch']} (CUDA {res['cuda']}), transformers {res['transformers']}, Python {res['python']}; "
             f"{res['dtype']} for the sampled, profile and step checks, float32 for the exact ones; random "
             f"{res['shape']}-shaped models" + (" (quick)" if res["quick"] else "") + ".", "",
             "| check | result | seconds | detail |", "|---|---|---|---|"]
    for c in res["checks"]:
        reason = c["reason"].replace("|", "/")
        lines.append(f"| {c['check']} | {'PASS' if c['passed'] else '**FAIL**'} | {c['seconds']:.1f} | {reason} |")
    lines += ["", "All checks passed." if res["passed"] else "SOME CHECKS FAILED."]
    return "\n".join(lines) + "\n"


def main_selfcheck(cfg: SelfCheck, out: str | None, names: list[str] | None = None) -> int:
    """What the CLI runs: the checks, the results files; 0 if all passed, else 1."""
    from serve_app.bench.rounds import default_stem, write_results

    results, markdown, ok = run_selfcheck(cfg, names)
    json_path, md_path = write_results(out or default_stem("selfcheck"), results, markdown)
    print(f"results: {json_path}, {md_path}", file=sys.stderr)
    return 0 if ok else 1

