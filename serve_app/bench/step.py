"""`specserve bench step`: one engine step at real model shapes, and where its time goes.

Random Llama models of a real shape (serve_app/bench/shapes.py) with a few layers, a draft
(`independent`: a second random model; `eagle3`: a random EAGLE-3 head reading the target's
features), fixed:K. For every batch size and request mix, B requests are submitted at once, the
engine runs `warmup` steps (the first admits and prefills them) and then `steps` timed steps, each
one decode step of the whole batch. Per timed step:

- step: the wall time of `Engine.step()`;
- device forwards / device other: what the workers report (`take_timings()`): model forwards, and
  the vocabulary-sized work beside them (sampling, warping, the coupled sampler's noise, top-N,
  logprobs), summed over target and draft (the engine calls them one after the other);
- outside = step - device work: the engine, serialization, transfer between actors, Python;
- bytes crossed (Ray only): serialized call arguments and results between the engine and both
  actors, plus what one worker handed another directly (EAGLE-3 features);
- tokens per step per sequence.

Runs: `inprocess` (the engine over two local workers, as `specserve generate` runs), `ray` (the
same engine over TargetWorker/DraftWorker actors through RemoteWorker, as a Router runs it: the workers'
channels) and `ray-calls` (the same over Ray task calls). With
two or more, every (batch, mix) cell runs on both sides at once and their timed steps alternate, so a slow
spell of a shared machine hits both alike; the ray/in-process ratio of the outside time, taken per
pair of steps run back to back, is the price of the actor boundary. Models are random and peaked (shapes.py), so an independent
draft's tokens are rejected: one token per step, the same work at every step.

Without Ray: `run_inprocess(StepBench(...))`; Ray is imported only by the `ray` run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from serve_app.bench.rounds import fmt_ratio, rotated, summary
from serve_app.bench.shapes import (get_shape, random_eagle3, random_llama, random_prompts, save_eagle3_dir,
                                    save_model_dir, vocab_tokenizer)
from serve_app.config import EngineConfig, ModelConfig, SamplingParams, check_dtype
from serve_app.engine.allocator import allocator_env
from serve_app.engine.policy import FixedK
from serve_app.engine.scheduler import Engine

MIXES: dict[str, dict] = {
    "greedy": {},
    "top_p1": {"temperature": 1.0, "top_p": 1.0},
    "top_p09": {"temperature": 1.0, "top_p": 0.9},
    "seeded": {"temperature": 1.0},  # + seed = the request's index: the coupled sampler
    "logprobs": {"logprobs": 5},  # greedy + the top 5 alternatives of every emitted token
}
"""Request mixes: every request of a cell gets these sampling settings."""
RUNS = ("inprocess", "ray", "ray-calls", "serve")


class StepBench(BaseModel):
    """What `bench step` runs."""

    model_config = ConfigDict(extra="forbid")

    shape: str = "tiny-128k"
    """Target shape, a key of serve_app.bench.shapes.SHAPES."""
    layers: int = Field(2, ge=1)
    """Decoder layers of the target (few: the shape's width and vocabulary are what matter per layer)."""
    draft: str = "independent"
    """`independent`: a second random model of `draft_shape`; `eagle3`: a random EAGLE-3 head for the target."""
    draft_shape: str | None = None
    """Shape of an independent draft; None: the target shape's default (ModelShape.draft)."""
    draft_layers: int = Field(1, ge=1)
    """Decoder layers of an independent draft."""
    batch_sizes: list[int] = [1, 8, 32]
    """Batch sizes measured (all requests of a cell run together)."""
    k: int = Field(4, ge=0, le=8)
    """Speculation length, fixed (policy fixed:K)."""
    mixes: list[str] = list(MIXES)
    """Request mixes (keys of MIXES)."""
    steps: int = Field(5, ge=1)
    """Timed steps per cell; the figures are medians over them."""
    warmup: int = Field(2, ge=1)
    """Untimed steps before them (the first admits and prefills the batch)."""
    prompt_tokens: int = Field(128, ge=1)
    """Tokens per prompt (random ids)."""
    peaked: float = Field(8.0, ge=0.0)
    """Head scaled so logits have about this standard deviation (0: the random init's, nearly uniform)."""
    dtype: str = "auto"
    """float32, bfloat16, float16, or auto (models.resolve_dtype)."""
    device: str = "cpu"
    """cpu, cuda or cuda:N (both actors of the ray run on it too)."""
    seed: int = 0
    """Seed of the weights and prompts."""

    @field_validator("draft")
    @classmethod
    def _known_draft(cls, v: str) -> str:
        if v not in ("independent", "eagle3"):
            raise ValueError(f"draft must be independent or eagle3, got {v!r}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        return check_dtype(v)

    @field_validator("mixes")
    @classmethod
    def _known_mixes(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in MIXES]
        if bad or not v:
            raise ValueError(f"unknown mix(es) {bad}: use some of {', '.join(MIXES)}")
        return v

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1:
            raise ValueError("batch sizes must be >= 1")
        return sorted(set(v))

    @property
    def max_tokens(self) -> int:
        """Enough that no request finishes before the last timed step, whatever gets accepted."""
        return (self.warmup + self.steps + 1) * (self.k + 1) + 1


@dataclass
class StepModels:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    dtype: str


@dataclass
class Side:
    """One way of running the engine: its workers, and the proxies whose bytes are counted."""

    name: str
    engine: Engine
    workers: list  # target, draft: each has take_timings()
    remotes: list = field(default_factory=list)  # RemoteWorker proxies (ray run)
    seen: list = field(default_factory=list)  # StepStats of every step (engine.on_step)


def build_models(cfg: StepBench) -> StepModels:
    from serve_app.models import DTYPES, resolve_dtype

    dtype = resolve_dtype(cfg.dtype, cfg.device)
    shape = get_shape(cfg.shape)
    target = random_llama(shape, cfg.layers, cfg.seed, DTYPES[dtype], cfg.device, cfg.peaked)
    if cfg.draft == "eagle3":
        draft = random_eagle3(target, cfg.seed + 1, peaked=cfg.peaked)
    else:
        dshape = get_shape(cfg.draft_shape or shape.draft)
        if dshape.vocab_size != shape.vocab_size:
            raise ValueError(f"draft shape {cfg.draft_shape} has another vocabulary than {cfg.shape}")
        draft = random_llama(dshape, cfg.draft_layers, cfg.seed + 1, DTYPES[dtype], cfg.device, cfg.peaked)
    return StepModels(target, draft, vocab_tokenizer(shape.vocab_size), dtype)


def _engine_config(cfg: StepBench) -> EngineConfig:
    batch, bs = max(cfg.batch_sizes), EngineConfig.model_fields["block_size"].default
    per_request = -(-(cfg.prompt_tokens + cfg.max_tokens + max(cfg.k, 1) + 1) // bs) * bs + bs  # whole blocks + headroom
    return EngineConfig(policy=f"fixed:{cfg.k}", max_batch_size=batch, max_k=max(cfg.k, 1),
                        max_num_tokens=batch * per_request + bs,  # every request admitted at once
                        max_num_batched_tokens=max(batch * (cfg.k + 1), 256))  # the timed steps run at k


@contextlib.contextmanager
def inprocess_side(cfg: StepBench, models: StepModels):
    """The engine over two local workers (the draft's own worker class for EAGLE-3)."""
    from serve_app.drafting import draft_worker
    from serve_app.engine.worker import ModelWorker

    target = ModelWorker(models.target, "target", 0)
    draft = draft_worker(models.draft, 0)
    yield Side("inprocess", Engine(target, draft, models.tokenizer, _engine_config(cfg), FixedK(cfg.k)), [target, draft])


@contextlib.contextmanager
def ray_side(cfg: StepBench, models: StepModels, call_timeout_s: float = 600.0, channel: bool = True):
    """The engine here over TargetWorker/DraftWorker actors, as a Router runs it: the models are saved
    to a temporary directory and each actor loads its own from there; its calls over the workers' channels
    (`ray`) or as Ray task calls (`ray-calls`, channel False). Starts a local Ray if none runs (and stops it
    afterwards)."""
    import ray

    from deployments.workers import DraftWorker, RemoteWorker, TargetWorker

    with tempfile.TemporaryDirectory(prefix="specserve-bench-step-") as root:
        target_dir = save_model_dir(models.target, models.tokenizer, Path(root) / "target")
        if cfg.draft == "eagle3":
            draft_dir = save_eagle3_dir(models.draft, models.target, Path(root) / "draft")
        else:
            draft_dir = save_model_dir(models.draft, models.tokenizer, Path(root) / "draft")
        mc = ModelConfig(target=target_dir, draft=draft_dir, dtype=models.dtype, device=cfg.device).model_dump()
        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        gpus = 0.01 if cfg.device.startswith("cuda") else 0  # both actors share the one device
        env = {"env_vars": allocator_env()} if cfg.device == "cpu" else None
        actors = [cls.options(num_cpus=1, num_gpus=gpus, max_concurrency=1, runtime_env=env).remote(mc)
                  for cls in (TargetWorker, DraftWorker)]
        try:
            ray.get([a.start.remote() for a in actors], timeout=call_timeout_s)  # both models loaded
            target, draft = (RemoteWorker(a, call_timeout_s, count_bytes=True, channel=channel) for a in actors)
            target.features_to = lambda: draft
            engine = Engine(target, draft, models.tokenizer, _engine_config(cfg), FixedK(cfg.k))
            yield Side("ray" if channel else "ray-calls", engine, [target, draft], [target, draft])
        finally:
            for a in actors:
                ray.kill(a)
            if started:
                ray.shutdown()


def _params(mix: str, i: int, max_tokens: int) -> SamplingParams:
    extra = dict(MIXES[mix])
    if mix == "seeded":
        extra["seed"] = i
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def _crossed(side: Side) -> int:
    return sum(w.bytes_sent + w.bytes_received for w in side.remotes)


def start_cell(side: Side, cfg: StepBench, batch: int, mix: str) -> list:
    """Submit `batch` requests of `mix` and run the warm-up steps (the first admits and prefills them)."""
    engine = side.engine
    prompts = random_prompts(batch, cfg.prompt_tokens, engine.vocab_size, cfg.seed + batch)
    reqs = [engine.submit(p, _params(mix, i, cfg.max_tokens)) for i, p in enumerate(prompts)]
    for _ in range(cfg.warmup):
        engine.step()
    for _ in range(10 * batch):  # prefills run in chunks within the step's token budget: finish them
        if not (engine.waiting or engine.prefilling):
            break
        engine.step()
    if len(engine.running) != batch:
        raise RuntimeError(f"{side.name}: {len(engine.running)} of {batch} requests running after the warm-up")
    return reqs


def timed_step(side: Side, batch: int) -> dict:
    """One decode step of the whole batch, timed: seconds (step, forwards, other device work, outside),
    bytes crossed, tokens per sequence, and the engine's own split (StepStats)."""
    for w in side.workers:
        w.take_timings()  # drop what the warm-up (or the last step's bookkeeping) accumulated
    b0 = _crossed(side)
    t = time.perf_counter()
    side.engine.step()
    step_s = time.perf_counter() - t
    crossed = _crossed(side) - b0
    timings = [w.take_timings() for w in side.workers]
    st = side.seen[-1]
    if st.batch_size != batch or st.prefilled or st.prefill_tokens:
        raise RuntimeError(f"{side.name}: a timed step decoded {st.batch_size} of {batch} (prefilled {st.prefilled})")
    forward = sum(x["forward_s"] for x in timings)
    other = sum(x["sample_s"] for x in timings)
    return {"step_s": step_s, "forward_s": forward, "sample_s": other, "outside_s": step_s - forward - other,
            "bytes": crossed + sum(x["direct_bytes"] for x in timings), "router_bytes": crossed,
            "direct_bytes": sum(x["direct_bytes"] for x in timings), "tokens": st.generated / batch,
            "draft_s": st.draft_s, "verify_s": st.verify_s, "engine_other_s": st.other_s}


def end_cell(side: Side, reqs: list) -> None:
    for r in reqs:
        side.engine.abort(r)
    side.engine.step()  # evicts them: both workers free their rows


def measure_cell(sides: list[Side], cfg: StepBench, batch: int, mix: str, steps: int) -> list[list[dict]]:
    """One (batch, mix) cell on every side at once: all start, then their timed steps alternate (the
    order rotating from step to step), so a slow spell of the machine hits every side alike. Per side,
    one dict per timed step (timed_step)."""
    reqs = [start_cell(side, cfg, batch, mix) for side in sides]
    out: list[list[dict]] = [[] for _ in sides]
    for i in range(steps):
        for j in rotated(list(range(len(sides))), i):
            out[j].append(timed_step(sides[j], batch))
    for side, r in zip(sides, reqs):
        end_cell(side, r)
    return out


def _row(side: Side, cfg: StepBench, batch: int, mix: str, samples: list[dict]) -> dict:
    def ms(key):
        return summary([s[key] * 1000 for s in samples])

    return {
        "run": side.name, "batch": batch, "mix": mix, "k": cfg.k, "steps": len(samples),
        "step_ms": ms("step_s"), "forward_ms": ms("forward_s"), "other_device_ms": ms("sample_s"),
        "outside_ms": ms("outside_s"),
        "kb_per_step": summary([s["bytes"] / 1024 for s in samples]) if side.remotes else None,
        # of which: through the engine's process (the Router's, in the service), and actor to actor directly
        "router_kb_per_step": summary([s["router_bytes"] / 1024 for s in samples]) if side.remotes else None,
        "direct_kb_per_step": summary([s["direct_bytes"] / 1024 for s in samples]) if side.remotes else None,
        "tokens_per_step": statistics.median(s["tokens"] for s in samples),
        # the engine's own view (StepStats): wall time of its draft and target calls, and the rest
        "engine_draft_ms": ms("draft_s"), "engine_verify_ms": ms("verify_s"), "engine_other_ms": ms("engine_other_s"),
    }


def measure(sides: list[Side], cfg: StepBench) -> list[dict]:
    """Every (batch, mix) cell, every side in it (measure_cell). With an in-process and a ray side, the
    ray row gets `outside_ratio`: its outside time over the in-process one's, per pair of steps taken
    back to back, median and range over the pairs."""
    for side in sides:
        side.engine.on_step.append(side.seen.append)
    cells = [(b, m) for b in cfg.batch_sizes for m in cfg.mixes]
    rows = []
    with tqdm(total=len(cells) + 1, desc="bench step", unit="cell") as bar:
        bar.set_postfix_str("warm-up")
        # first calls: allocations, thread pools, the actors' first forwards
        measure_cell(sides, cfg, cfg.batch_sizes[0], cfg.mixes[0], 1)
        bar.update(1)
        for batch, mix in cells:
            bar.set_postfix_str(f"batch {batch} {mix}")
            samples = measure_cell(sides, cfg, batch, mix, cfg.steps)
            cell_rows = [_row(side, cfg, batch, mix, ss) for side, ss in zip(sides, samples)]
            names = [side.name for side in sides]
            for name in [n for n in ("ray", "ray-calls") if n in names and "inprocess" in names]:
                base, ray = samples[names.index("inprocess")], samples[names.index(name)]
                cell_rows[names.index(name)]["outside_ratio"] = summary(
                    [r["outside_s"] / b["outside_s"] for r, b in zip(ray, base) if b["outside_s"] > 0])
                cell_rows[names.index(name)]["step_ratio"] = summary([r["step_s"] / b["step_s"] for r, b in zip(ray, base)])
            rows += cell_rows
            bar.update(1)
    return rows


def run_inprocess(cfg: StepBench, models: StepModels | None = None) -> list[dict]:
    """The in-process run alone (no Ray): one row per (batch, mix)."""
    models = models or build_models(cfg)
    with inprocess_side(cfg, models) as side:
        return measure([side], cfg)


def run_ray(cfg: StepBench, models: StepModels | None = None) -> list[dict]:
    """The run through Ray worker actors alone: one row per (batch, mix)."""
    models = models or build_models(cfg)
    with ray_side(cfg, models) as side:
        return measure([side], cfg)


def bench_step(cfg: StepBench, runs: list[str] = RUNS) -> tuple[dict, str]:
    """Build the models once, run the chosen sides interleaved; returns (results, markdown report)."""
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        raise ValueError(f"unknown run(s) {bad}: use inprocess, ray, ray-calls and/or serve")
    if {"ray", "ray-calls", "serve"} & set(runs) and importlib.util.find_spec("ray") is None:
        raise ValueError("the ray and serve runs need Ray, which is not installed here: --runs inprocess")
    models = build_models(cfg)
    engine_runs = [r for r in runs if r != "serve"]
    rows = []
    if engine_runs:
        with contextlib.ExitStack() as stack:
            sides = [stack.enter_context(inprocess_side(cfg, models) if r == "inprocess"
                                         else ray_side(cfg, models, channel=r == "ray")) for r in engine_runs]
            rows = measure(sides, cfg)
    serve_rows = []
    if "serve" in runs:  # after the others: its own service, on the whole machine
        from serve_app.bench.serve_step import run_serve

        batch = max(cfg.batch_sizes)
        serve_rows = run_serve(cfg, models, random_prompts(batch, cfg.prompt_tokens, get_shape(cfg.shape).vocab_size,
                                                           cfg.seed + batch))
    results = {**cfg.model_dump(), "dtype": models.dtype, "runs": list(runs), "max_tokens": cfg.max_tokens,
               "draft_shape": cfg.draft_shape or (None if cfg.draft == "eagle3" else get_shape(cfg.shape).draft),
               "rows": rows, "serve_rows": serve_rows}
    return results, step_markdown(results)


def _kb(r: dict) -> str:
    """KB crossed per step; with direct transfers (EAGLE-3 features), how much went through the engine's
    process and how much from actor to actor."""
    direct = (r.get("direct_kb_per_step") or {}).get("median", 0)
    if not direct:
        return _fmt(r["kb_per_step"])
    return f"{_fmt(r['kb_per_step'])}: {r['router_kb_per_step']['median']:.1f} via engine + {direct:.1f} direct"


def _layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")


def _fmt(s: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if s is None:
        return ""
    return f"{s['median'] * scale:.{digits}f} (±{50 * s['spread']:.0f}%)"


def step_markdown(res: dict) -> str:
    draft = (f"independent {res['draft_shape']} x {_layers(res['draft_layers'])}" if res["draft"] == "independent"
             else "EAGLE-3 head (random)")
    lines = [f"# bench step: {res['shape']} x {_layers(res['layers'])}, draft {draft}, fixed:{res['k']}, "
             f"{res['dtype']} on {res['device']}", "",
             f"{res['prompt_tokens']}-token random prompts, every request of a cell with the same mix; {res['warmup']} "
             f"warm-up steps, then {res['steps']} timed steps per cell; median (± half the range) over the timed "
             "steps. Device: the workers' own timings (forwards; other = sampling, warping, noise, top-N, logprobs) "
             "summed over target and draft; outside = step - device (engine, serialization, transfer, Python). "
             f"Peaked heads (logit std {res['peaked']:g}). Both runs take their timed steps in turn; the "
             "ray / in-process ratio is per pair of steps taken back to back: median (range).", ""]
    for run in [r for r in res["runs"] if r != "serve"]:
        rows = [r for r in res["rows"] if r["run"] == run]
        ray = run.startswith("ray")
        lines += [f"## {run}", "",
                  "| batch | mix | step ms | device forward ms | device other ms | outside ms | "
                  + ("KB crossed | " if ray else "") + "tokens/step | "
                  + ("ray / in-process outside | ray / in-process step |" if ray else ""),
                  "|---|---|---|---|---|---|---|" + ("---|---|---|" if ray else "")]
        for r in rows:
            ratio = fmt_ratio(r["outside_ratio"]) if "outside_ratio" in r else ""
            ratio += " | " + (fmt_ratio(r["step_ratio"]) if "step_ratio" in r else "")
            lines.append(f"| {r['batch']} | {r['mix']} | {_fmt(r['step_ms'])} | {_fmt(r['forward_ms'])} | "
                         f"{_fmt(r['other_device_ms'])} | {_fmt(r['outside_ms'])} | "
                         + (f"{_kb(r)} | " if ray else "")
                         + f"{r['tokens_per_step']:.2f} |" + (f" {ratio} |" if ray else ""))
        lines.append("")
    if res.get("serve_rows"):
        from serve_app.bench.serve_step import serve_markdown

        lines.append(serve_markdown(res["serve_rows"]))
    return "\n".join(lines)


def plot_step(res: dict, path: str | Path) -> Path | None:
    """Stacked bars at the largest batch: device forwards, other device work and outside time, one bar
    per run side by side for every mix. None when matplotlib is missing (a bare GPU box)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = max(res["batch_sizes"])
    runs, mixes = [r for r in res["runs"] if r != "serve"], res["mixes"]
    if not runs:
        return None
    by = {(r["run"], r["mix"]): r for r in res["rows"] if r["batch"] == batch}
    width = 0.8 / len(runs)
    parts = [("forward_ms", "device: forwards", "#4C72B0"), ("other_device_ms", "device: other (sampling, ...)", "#DD8452"),
             ("outside_ms", "outside (engine, transfer, Python)", "#8C8C8C")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(mixes) * len(runs) + 2), 4.8))
    for j, run in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(mixes))]
        bottom = [0.0] * len(mixes)
        for key, label, color in parts:
            vals = [max(by[(run, m)][key]["median"], 0.0) for m in mixes]
            ax.bar(xs, vals, width * 0.92, bottom=bottom, color=color, label=label if j == 0 else None,
                   hatch="//" if run.startswith("ray") else None, edgecolor="white")
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, top in zip(xs, bottom):
            ax.text(x, top, f"{run}\n{top:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(mixes)), mixes)
    ax.set_ylabel("ms per step (median of each part)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the labels above the bars
    ax.set_title(f"bench step: {res['shape']} x {_layers(res['layers'])}, draft {res['draft']}, batch {batch}, "
                 f"fixed:{res['k']}, {res['dtype']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
