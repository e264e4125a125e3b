"""Predicted profiles: a roofline model of one engine step, for hardware we cannot reach.

One forward of a decoder moves bytes (every weight once, and each sequence's KV cache for its
context) and does FLOPs (2 per weight per token, and attention over the context). It cannot be
faster than bytes / memory bandwidth (t_mem) nor than FLOPs / peak compute (t_compute). A pure
roofline takes the larger of the two, a sharp corner at the ridge point; a real GEMM's time starts
rising well before it, because memory traffic and math do not overlap perfectly. So the model joins
the two smoothly, with an exponent p (`Overheads.overlap_exponent`, 2 by default; p -> infinity is
the sharp max, p = 1 no overlap at all), and adds what neither counts, a cost per forward: an eager
Hugging Face forward launches a few dozen kernels per decoder layer, each dispatched from Python, and
the engine does its own host work per forward (inputs, masks, the KV cache's bookkeeping, sampling):

    forward_ms = (t_mem^p + t_compute^p)^(1/p) + forward_base_ms + forward_per_layer_ms * layers

A step at speculation length k (as `specserve profile` splits it, serve_app/profiler.py):
    draft_ms  = k draft forwards of 1 token per sequence (0 at k = 0)
    verify_ms = one target forward of k + 1 tokens per sequence
    other_ms  = step_ms + step_per_seq_ms * batch size (acceptance, bookkeeping, detokenizing)
The best-k table then follows from `best_k_table` with an acceptance per position taken from a
measured profile of the same pair, or from an assumed per-token rate a (position i: a^(i+1)).

What it leaves out, on purpose: prefill, activations' traffic, kernels' efficiency at small shapes
beyond one constant per resource, overlap of host and device work. It is a starting point for a
GPU type until `specserve profile` runs there; a measured profile always replaces it.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from serve_app.config import EMBEDDED
from serve_app.pricing import LatencyGrid, best_k_table, ms_per_token
from serve_app.profiling.profiles import Prediction, Profile, fit_acceptance_rate, load_profile

BATCH_SIZES = [1, 2, 4, 8, 16, 32]
PREFILL_TOKENS = 128
"""Prompt length the predicted prefill is priced at (simulators scale it per prompt token)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class GpuSpec(BaseModel):
    """One accelerator's datasheet figures (or a CPU's, as measured here)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Product name as its datasheet gives it."""
    memory_gb_s: float = Field(gt=0)
    """Peak memory bandwidth, GB/s (10^9 bytes per second)."""
    tflops_16bit: float = Field(gt=0)
    """Dense (no sparsity) bfloat16 / float16 tensor throughput with float32 accumulation, TFLOP/s."""
    tflops_fp32: float = Field(gt=0)
    """Dense float32 throughput (not TF32), TFLOP/s: what a float32 model's matmuls get by default."""
    memory_gb: float = Field(gt=0)
    """Device memory, GB as the datasheet states it."""
    source: str
    """Where the figures come from."""

    def tflops(self, dtype: str) -> float:
        if dtype in ("bfloat16", "float16"):
            return self.tflops_16bit
        if dtype == "float32":
            return self.tflops_fp32
        raise ValueError(f"no compute figure for dtype {dtype!r}: predict float32, bfloat16 or float16")


# Keyed by the hardware type `detect_gpu_type()` gives each card. Sparsity figures halved to dense.
GPUS: dict[str, GpuSpec] = {
    "NVIDIA_H100": GpuSpec(name="NVIDIA H100 SXM5 80GB", memory_gb_s=3350, tflops_16bit=989, tflops_fp32=67, memory_gb=80,
                           source="NVIDIA H100 Tensor Core GPU datasheet, SXM column (BF16 1,979 TFLOPS with sparsity)"),
    "NVIDIA_H200": GpuSpec(name="NVIDIA H200 SXM 141GB", memory_gb_s=4800, tflops_16bit=989, tflops_fp32=67, memory_gb=141,
                           source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (BF16 1,979 TFLOPS with sparsity)"),
    "NVIDIA_A100": GpuSpec(name="NVIDIA A100 SXM4 80GB", memory_gb_s=2039, tflops_16bit=312, tflops_fp32=19.5, memory_gb=80,
                           source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (BF16 624 TFLOPS with sparsity)"),
    "NVIDIA_L40S": GpuSpec(name="NVIDIA L40S", memory_gb_s=864, tflops_16bit=362, tflops_fp32=91.6, memory_gb=48,
                           source="NVIDIA L40S datasheet (BF16 733 TFLOPS with sparsity)"),
    "NVIDIA_L4": GpuSpec(name="NVIDIA L4", memory_gb_s=300, tflops_16bit=121, tflops_fp32=30.3, memory_gb=24,
                         source="NVIDIA L4 Tensor Core GPU datasheet (BF16 242 TFLOPS with sparsity)"),
    "NVIDIA_A10G": GpuSpec(name="NVIDIA A10G", memory_gb_s=600, tflops_16bit=125, tflops_fp32=31.2, memory_gb=24,
                           source="NVIDIA A10 Tensor Core GPU datasheet (BF16 250 TFLOPS with sparsity); the A10G is "
                                  "AWS's variant (EC2 G5) with no datasheet of its own: its compute may be lower"),
    "NVIDIA_GeForce_RTX_4090": GpuSpec(name="NVIDIA GeForce RTX 4090", memory_gb_s=1008, tflops_16bit=165.2,
                                       tflops_fp32=82.6, memory_gb=24,
                                       source="NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090 column "
                                              "(FP16/BF16 tensor with FP32 accumulate, dense)"),
}


def gpu_spec(gpu_type: str) -> GpuSpec:
    """The spec of a hardware type, or a ValueError listing the known ones."""
    if gpu_type not in GPUS:
        raise ValueError(f"unknown GPU type {gpu_type!r} for --predict: known are {', '.join(GPUS)} "
                         "(on the hardware itself, measure a profile instead: `specserve profile`)")
    return GPUS[gpu_type]


class ModelShape(BaseModel):
    """What a decoder's forward costs depend on, from its config.json."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Model name (hub id's last part)."""
    layers: int = Field(ge=1)
    """Decoder layers (num_hidden_layers)."""
    hidden: int = Field(ge=1)
    """Hidden size."""
    intermediate: int = Field(ge=1)
    """MLP width (intermediate_size; OPT: ffn_dim)."""
    heads: int = Field(ge=1)
    """Attention heads."""
    kv_heads: int = Field(ge=1)
    """Key/value heads (grouped-query attention); = heads without it."""
    vocab: int = Field(ge=1)
    """Rows of the output head (a reduced-vocabulary draft's head is smaller than the tokenizer)."""
    head_dim: int | None = None
    """Per-head size where config.json gives it; else hidden / heads."""
    gated_mlp: bool = True
    """Llama-style MLP (gate, up, down: 3 matrices); False: OPT's fc1, fc2 (2)."""
    extra_params: int = 0
    """Weights read once per forward besides the layers and the head (EAGLE-3: its fc over three
    target features and the embedding half of its q/k/v)."""
    source: str = ""
    """Where the numbers come from."""

    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def weight_params(self) -> int:
        """Weights one forward reads: the layers' matrices, the head, the extras (norms, biases and
        embedding rows are under 1% and left out; a tied head is read as the head)."""
        attn = self.hidden * self.dim() * (2 * self.heads + 2 * self.kv_heads)  # q, o + k, v
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden + self.extra_params

    def kv_bytes_per_token(self, dtype: str) -> int:
        """KV cache bytes one token of context holds (keys and values, every layer)."""
        return 2 * self.layers * self.kv_heads * self.dim() * DTYPE_BYTES[dtype]


def _llama(name: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, hub: str) -> ModelShape:
    return ModelShape(name=name, layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                      vocab=49152, source=f"config.json of {hub}")


def _opt(name: str, layers: int, hidden: int, ffn: int, heads: int) -> ModelShape:
    return ModelShape(name=name, layers=layers, hidden=hidden, intermediate=ffn, heads=heads, kv_heads=heads, vocab=50272,
                      gated_mlp=False, source=f"config.json of facebook/{name}")


# Keyed by lower-case name without org and `-instruct` (an instruct model has its base's shape).
SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": _llama("SmolLM2-135M", 30, 576, 1536, 9, 3, "HuggingFaceTB/SmolLM2-135M(-Instruct)"),
    "smollm2-360m": _llama("SmolLM2-360M", 32, 960, 2560, 15, 5, "HuggingFaceTB/SmolLM2-360M(-Instruct)"),
    "smollm2-1.7b": _llama("SmolLM2-1.7B", 24, 2048, 8192, 32, 32, "HuggingFaceTB/SmolLM2-1.7B(-Instruct)"),
    "opt-125m": _opt("opt-125m", 12, 768, 3072, 12),
    "opt-6.7b": _opt("opt-6.7b", 32, 4096, 16384, 32),
}


def _key(name: str) -> str:
    key = name.rstrip("/").split("/")[-1].split("@")[0].lower()
    return key.removesuffix("-instruct")


def model_shape(spec: str) -> ModelShape:
    """The shape of a model spec: `embedded`, a name or hub id in SHAPES, or a local directory with a
    config.json (or a draft directory `specserve distill` wrote)."""
    if spec == EMBEDDED:
        return SHAPES["smollm2-135m"]
    path = Path(spec)
    if (path / "specserve_draft.json").is_file():
        return _draft_dir_shape(path)
    if (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text()), path.name, f"{path}/config.json")
    if _key(spec) in SHAPES:
        return SHAPES[_key(spec)]
    raise ValueError(f"no shape known for model {spec!r} (known: {', '.join(SHAPES)}): pass a local directory "
                     "holding its config.json instead")


def shape_from_config(cfg: dict, name: str, source: str) -> ModelShape:
    """A Hugging Face config.json's shape: OPT, or Llama-style (Llama, Mistral, Qwen2, SmolLM, ...)."""
    opt = cfg.get("model_type") == "opt"
    keys = {"layers": "num_hidden_layers", "hidden": "hidden_size", "intermediate": "ffn_dim" if opt else "intermediate_size",
            "heads": "num_attention_heads", "vocab": "vocab_size"}
    missing = [k for k in keys.values() if k not in cfg]
    if missing:
        raise ValueError(f"{source}: no {', '.join(missing)}: not a decoder config this model knows")
    vals = {field: int(cfg[key]) for field, key in keys.items()}
    return ModelShape(name=name, **vals, kv_heads=int(cfg.get("num_key_value_heads") or vals["heads"]),
                      head_dim=cfg.get("head_dim"), gated_mlp=not opt, source=source)


def _draft_dir_shape(path: Path) -> ModelShape:
    """A draft `specserve distill` wrote: an EAGLE-3 head (one layer over the target's features) or
    the target's first layers with a reduced-vocabulary head."""
    meta = json.loads((path / "specserve_draft.json").read_text())
    source = f"{path.name}/specserve_draft.json"
    if "draft_config" in meta:  # EAGLE-3
        c, h = meta["draft_config"], meta["draft_config"]["hidden_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        dim = c.get("head_dim") or h // heads
        fc = len(meta["feature_layers"]) * meta["target_hidden_size"] * h
        embedding_half = h * dim * (heads + 2 * kv)  # q, k, v read [embedding; feature]: 2H wide
        return ModelShape(name=path.name, layers=1, hidden=h, intermediate=c["intermediate_size"], heads=heads,
                          kv_heads=kv, head_dim=dim, vocab=meta["num_tokens"], extra_params=fc + embedding_half,
                          source=source)
    target = model_shape(meta["target"])
    return target.model_copy(update={"name": path.name, "layers": meta["num_layers"], "vocab": meta["num_tokens"],
                                     "source": source})


class Overheads(BaseModel):
    """What the roofline does not count, and how much of the peaks a forward reaches. The defaults are
    for a GPU running this engine (eager Hugging Face forwards); they are assumptions, stated here, not
    measurements (docs/profiles-and-policies.md shows how the OPT/A100 result moves with them)."""

    model_config = ConfigDict(extra="forbid")

    memory_efficiency: float = Field(0.85, gt=0, le=1)
    """Share of the datasheet bandwidth a forward reaches: large reads from HBM reach 80-90%."""
    compute_efficiency: float = Field(0.5, gt=0, le=1)
    """Share of the datasheet tensor peak reached: decoding's matmuls are skinny (32-256 rows at the
    batch sizes profiled), where cuBLAS reaches about 40-65% of peak, not the 70-80% of square ones."""
    overlap_exponent: float = Field(2.0, ge=1)
    """p in (t_mem^p + t_compute^p)^(1/p), how a forward's memory and compute times combine. An
    assumption, not a measurement: near the ridge point a real GEMM neither fully hides its math
    behind its loads (the roofline's max, p -> infinity) nor runs them one after the other (p = 1,
    their sum); p = 2 puts a forward exactly at the ridge 41% above either roof, and within 12% of
    the larger one once it is twice the smaller."""
    forward_base_ms: float = Field(1.0, ge=0)
    """Per forward: the engine's host work (ragged inputs, masks, the KV cache's bookkeeping, sampling)
    and the device sync that reads the tokens back, about 1 ms of Python."""
    forward_per_layer_ms: float = Field(0.1, ge=0)
    """Per decoder layer per forward: an eager layer launches ~25 kernels (norms, projections, rotary,
    attention, MLP) at ~4 us each; Python dispatch runs ahead of the GPU, so launches bound it."""
    step_ms: float = Field(0.2, ge=0)
    """Fixed host work per step outside the forwards (acceptance, bookkeeping): about cpu-2core's."""
    step_per_seq_ms: float = Field(0.08, ge=0)
    """Host work per sequence per step (detokenizing, streaming): cpu-2core measured 0.08 ms."""


def forward_cost(shape: ModelShape, dtype: str, batch: int, tokens: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward of `tokens` new tokens per sequence for `batch` sequences that
    each hold `context` tokens of KV cache: weights once, the cache (with the new rows) per sequence;
    2 FLOPs per weight per token, and q.k plus p.v over the context per token, layer and head."""
    nbytes = shape.weight_params() * DTYPE_BYTES[dtype] + batch * (context + tokens) * shape.kv_bytes_per_token(dtype)
    attention = 4 * shape.layers * shape.heads * shape.dim() * (context + tokens)
    flops = batch * tokens * (2 * shape.weight_params() + attention)
    return nbytes, flops


def forward_ms(shape: ModelShape, hw: GpuSpec, dtype: str, batch: int, tokens: int, context: int,
               overheads: Overheads) -> float:
    """Time of one forward: memory and compute time joined with the smooth corner
    (overlap_exponent), plus its fixed costs."""
    nbytes, flops = forward_cost(shape, dtype, batch, tokens, context)
    memory_ms = nbytes / (hw.memory_gb_s * 1e9 * overheads.memory_efficiency) * 1e3
    compute_ms = flops / (hw.tflops(dtype) * 1e12 * overheads.compute_efficiency) * 1e3
    return (smooth_max(memory_ms, compute_ms, overheads.overlap_exponent) + overheads.forward_base_ms
            + overheads.forward_per_layer_ms * shape.layers)


def smooth_max(a: float, b: float, p: float) -> float:
    """(a^p + b^p)^(1/p), written as hi * (1 + (lo/hi)^p)^(1/p) so a large p cannot overflow and
    p = inf gives max(a, b) exactly."""
    hi, lo = max(a, b), min(a, b)
    if hi == 0:
        return 0.0
    return hi * (1 + (lo / hi) ** p) ** (1 / p)


def predict_grid(target: ModelShape, draft: ModelShape, hw: GpuSpec, dtype: str, overheads: Overheads,
                 context: int, max_k: int, batch_sizes: list[int] = BATCH_SIZES) -> LatencyGrid:
    """The latency grid `specserve profile` would measure, predicted cell by cell (module docstring)."""
    cells: dict[str, list[list[float]]] = {"draft_ms": [], "verify_ms": [], "other_ms": []}
    prefill: dict[str, list[float]] = {"prefill_ms": [], "prefill_draft_ms": []}
    for b in batch_sizes:
        draft_one = forward_ms(draft, hw, dtype, b, 1, context, overheads)
        cells["draft_ms"].append([round(k * draft_one, 3) for k in range(max_k + 1)])
        cells["verify_ms"].append([round(forward_ms(target, hw, dtype, b, k + 1, context, overheads), 3)
                                   for k in range(max_k + 1)])
        cells["other_ms"].append([round(overheads.step_ms + overheads.step_per_seq_ms * b, 3)] * (max_k + 1))
        # Admitting b requests: one target forward and one draft forward over their whole prompts.
        draft_prefill = forward_ms(draft, hw, dtype, b, PREFILL_TOKENS, 0, overheads)
        prefill["prefill_draft_ms"].append(round(draft_prefill, 3))
        prefill["prefill_ms"].append(round(forward_ms(target, hw, dtype, b, PREFILL_TOKENS, 0, overheads) + draft_prefill, 3))
    return LatencyGrid(batch_sizes=batch_sizes, ks=list(range(max_k + 1)), context_tokens=context or None,
                       prefill_tokens=PREFILL_TOKENS, **prefill, **cells)


def acceptance_for(target: str, draft: str, dtype: str, max_k: int, rate: float | None = None,
                   measured: Profile | None = None, measured_name: str = "") -> tuple[list[float], float, str]:
    """(acceptance per position, per-token rate, where it came from) for a predicted profile.

    Acceptance is a property of the model pair and the prompts, not of the hardware, so it comes from a
    measured profile of the same pair and dtype, or from a rate the caller states (an assumption)."""
    if (rate is None) == (measured is None):
        raise ValueError("a predicted profile needs its acceptance from exactly one source: --acceptance-rate A "
                         "(an assumed per-token rate) or --acceptance-from PROFILE.json (a measured profile of the same pair)")
    if rate is not None:
        if not 0 <= rate <= 1:
            raise ValueError(f"--acceptance-rate must lie in [0, 1], got {rate}")
        return [round(rate ** (i + 1), 4) for i in range(max_k)], rate, f"assumed per-token rate {rate} (an assumption, not measured for this pair)"
    if measured.source != "measured" or not measured.acceptance:
        raise ValueError(f"{measured_name or 'the acceptance profile'} holds no measured acceptance: "
                         "take it from a profile `specserve profile` measured")
    if (measured.target, measured.draft, measured.dtype) != (target, draft, dtype):
        raise ValueError(f"{measured_name or 'the acceptance profile'} was measured with target {measured.target!r}, "
                         f"draft {measured.draft!r} in {measured.dtype}, but the prediction is for target {target!r}, "
                         f"draft {draft!r} in {dtype}: acceptance belongs to one pair and dtype")
    rate = measured.acceptance_rate if measured.acceptance_rate is not None else fit_acceptance_rate(measured.acceptance)
    return list(measured.acceptance), rate, f"measured: {measured_name or measured.gpu_type} ({measured.gpu_type})"


def predict_profile(gpu_type: str, hw: GpuSpec, target: tuple[str, ModelShape], draft: tuple[str, ModelShape],
                    dtype: str, acceptance: tuple[list[float], float, str], context: int = 512, max_k: int = 8,
                    batch_sizes: list[int] = BATCH_SIZES, overheads: Overheads | None = None) -> Profile:
    """A profile marked `source: predicted` for (gpu_type, target, draft, dtype): the roofline grid, the
    given acceptance (`acceptance_for`), the best-k table from both, and the inputs in `prediction`."""
    overheads = overheads or Overheads()
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"no prediction for dtype {dtype!r}: use float32, bfloat16 or float16")
    grid = predict_grid(target[1], draft[1], hw, dtype, overheads, context, max_k, batch_sizes)
    per_position, rate, origin = acceptance
    prediction = Prediction(hardware=hw.name, hardware_source=hw.source, memory_gb_s=hw.memory_gb_s,
                            tflops=hw.tflops(dtype), context_tokens=context, acceptance_from=origin,
                            **overheads.model_dump())
    return Profile(
        gpu_type=gpu_type, target=target[0], draft=draft[0], dtype=dtype, latency=grid, acceptance=per_position,
        acceptance_rate=round(rate, 4), best_k=best_k_table(grid, per_position), source="predicted",
        prediction=prediction,
        notes=(f"PREDICTED by the roofline model (serve_app/profiling/roofline.py), not measured: {hw.name} ({hw.source}); "
               f"shapes {target[1].source} and {draft[1].source}; context {context} tokens; acceptance {origin}. "
               "Replace with `specserve profile` on the hardware: a measured profile always wins."),
    )


def predict_for(gpu_type: str, target: str, draft: str | None, dtype: str, context: int, max_k: int,
                batch_sizes: list[int], rate: float | None = None, acceptance_path: str | None = None,
                overheads: Overheads | None = None) -> Profile:
    """`specserve profile --predict`: the predicted profile of model specs (as --target / --draft take
    them) on a GPU type; ValueError for an unknown GPU type or model, or an unusable acceptance source."""
    from serve_app.config import ModelConfig
    from serve_app.models import draft_spec, model_names

    hw = gpu_spec(gpu_type)
    mc = ModelConfig(target=target, draft=draft)
    names, draft_path = model_names(mc), draft_spec(mc)
    if draft_path in ("none", "ngram"):
        raise ValueError(f"--predict needs a draft model (--draft), not {draft_path!r}: with no draft forward there "
                         "is nothing to predict")
    shapes = (model_shape(target), _truncated(target, draft_path) or model_shape(draft_path))
    measured = load_profile(acceptance_path) if acceptance_path else None
    acceptance = acceptance_for(*names, dtype, max_k, rate, measured, acceptance_path or "")
    return predict_profile(gpu_type, hw, (names[0], shapes[0]), (names[1], shapes[1]), dtype, acceptance, context,
                           max_k, batch_sizes, overheads)


def _truncated(target: str, draft: str) -> ModelShape | None:
    """`truncated:N`: the target's first N layers under its own head."""
    if not draft.startswith("truncated:"):
        return None
    n = draft.partition(":")[2]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"draft {draft!r}: truncated needs a layer count, e.g. truncated:4")
    return model_shape(target).model_copy(update={"name": draft, "layers": int(n)})


# ---- checking the model on this machine -----------------------------------------------------------
def measure_hardware(threads: int = 2, reps: int = 5) -> GpuSpec:
    """This CPU as a GpuSpec: read bandwidth of a 512 MiB tensor (sum) and matmul throughput of
    2048-square bf16 and float32 matmuls, best of `reps`, with `threads` torch threads."""
    import os
    import time

    import torch

    torch.set_num_threads(threads)

    def best(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    x = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB: far past any cache
    read_gb_s = x.numel() * 4 / best(lambda: x.sum()) / 1e9
    del x
    n = 2048
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        rates[dtype] = 2 * n**3 / best(lambda: a @ b) / 1e12
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return GpuSpec(name=f"this CPU ({os.cpu_count()} cores, {threads} torch threads)", memory_gb_s=round(read_gb_s, 2),
                   tflops_16bit=round(rates[torch.bfloat16], 4), tflops_fp32=round(rates[torch.float32], 4),
                   memory_gb=round(mem, 1), source="measured here: sum of a 512 MiB tensor; 2048x2048 matmuls")


def fit_overheads(measured: LatencyGrid, target: ModelShape, draft: ModelShape, hw: GpuSpec, dtype: str,
                  context: int, overlap_exponent: float = Overheads().overlap_exponent) -> Overheads:
    """Overheads for hardware whose figures were measured (efficiencies 1, the given overlap_exponent;
    math.inf: the sharp max), fitted to four cells:
    forward_base_ms and forward_per_layer_ms so that the target's batch-1 k=0 verification and the
    draft's batch-1 k=1 forward come out exact (two forwards of different depth: two unknowns), and
    the step's other_ms line through batch 1 and the largest batch at k = 0."""
    raw = Overheads(memory_efficiency=1, compute_efficiency=1, forward_base_ms=0, forward_per_layer_ms=0,
                    step_ms=0, step_per_seq_ms=0, overlap_exponent=overlap_exponent)
    j1 = measured.ks.index(1)
    t_extra = measured.verify_ms[0][0] - forward_ms(target, hw, dtype, measured.batch_sizes[0], 1, context, raw)
    d_extra = measured.draft_ms[0][j1] - forward_ms(draft, hw, dtype, measured.batch_sizes[0], 1, context, raw)
    per_layer = max((t_extra - d_extra) / (target.layers - draft.layers), 0.0) if target.layers != draft.layers else 0.0
    base = max(d_extra - per_layer * draft.layers, 0.0)
    (b0, o0), (b1, o1) = (measured.batch_sizes[0], measured.other_ms[0][0]), (measured.batch_sizes[-1], measured.other_ms[-1][0])
    per_seq = max((o1 - o0) / (b1 - b0), 0.0) if b1 != b0 else 0.0
    return raw.model_copy(update={"forward_base_ms": round(base, 3), "forward_per_layer_ms": round(per_layer, 4),
                                  "step_ms": round(max(o0 - per_seq * b0, 0.0), 3), "step_per_seq_ms": round(per_seq, 4)})


def compare(measured: Profile, predicted: LatencyGrid) -> dict:
    """Per cell relative error of the predicted step time against the measured one, its mean absolute
    value, and both best-k tables (the measured acceptance applied to both grids)."""
    m, p = measured.latency.total_ms(), predicted.total_ms()
    errors = [[round((pv - mv) / mv, 4) for mv, pv in zip(mr, pr)] for mr, pr in zip(m, p)]
    acc = measured.acceptance or []
    best_m, best_p = best_k_table(measured.latency, acc), best_k_table(predicted, acc)

    def part_error(name: str) -> float:  # mean |relative error| of one part, over cells where it is > 0
        pairs = [(mv, pv) for mr, pr in zip(getattr(measured.latency, name), getattr(predicted, name))
                 for mv, pv in zip(mr, pr) if mv > 0.1]
        return round(statistics.mean(abs(pv - mv) / mv for mv, pv in pairs), 4)

    return {"batch_sizes": predicted.batch_sizes, "ks": predicted.ks, "measured_ms": m, "predicted_ms": p,
            "relative_error": errors, "mean_abs_error": round(statistics.mean(abs(e) for r in errors for e in r), 4),
            "mean_abs_error_by_part": {name: part_error(name) for name in ("draft_ms", "verify_ms")},
            "best_k_measured": best_m, "best_k_predicted": best_p,
            "best_k_matches": {b: best_m[b] == best_p[b] for b in best_m},
            "ms_per_token_measured": ms_per_token(measured.latency, acc), "ms_per_token_predicted": ms_per_token(predicted, acc)}


def check_markdown(result: dict, hw: GpuSpec, overheads: Overheads, profile_path: str, context: int,
                   measured_when: str = "") -> str:
    """The check as a report: what was measured and fitted, the error per cell, best k per batch size."""
    ks = result["ks"]
    lines = [f"# Roofline prediction vs measured profile `{profile_path}`", "",
             f"Hardware as measured here: read bandwidth {hw.memory_gb_s} GB/s, matmul {hw.tflops_16bit * 1e3:.0f} GFLOP/s "
             f"bf16 / {hw.tflops_fp32 * 1e3:.0f} GFLOP/s fp32 ({hw.name}; {hw.source}){measured_when}.",
             f"Fitted to four cells (marked *): forward_base_ms {overheads.forward_base_ms}, forward_per_layer_ms "
             f"{overheads.forward_per_layer_ms} (target verification at batch 1, k 0; draft at batch 1, k 1), other_ms "
             f"{overheads.step_ms} + {overheads.step_per_seq_ms} per sequence (k 0 at the smallest and largest batch). "
             f"Memory and compute time joined with overlap_exponent p = {overheads.overlap_exponent} (an assumption). "
             f"Context assumed: {context} tokens per sequence.", "",
             "Step time, predicted / measured ms (relative error of the prediction):", "",
             "| batch | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    fitted = {(0, 0), (0, 1), (len(result["batch_sizes"]) - 1, 0)}
    for i, b in enumerate(result["batch_sizes"]):
        cells = [f"{p:.1f} / {m:.1f} ({e:+.0%}){'*' if (i, j) in fitted else ''}"
                 for j, (p, m, e) in enumerate(zip(result["predicted_ms"][i], result["measured_ms"][i], result["relative_error"][i]))]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    parts = result["mean_abs_error_by_part"]
    lines += ["", f"Mean absolute relative error over all {sum(map(len, result['relative_error']))} cells: "
              f"**{result['mean_abs_error']:.1%}** (by part: draft {parts['draft_ms']:.1%}, verification "
              f"{parts['verify_ms']:.1%}).", "",
              "Best k per batch size (measured acceptance applied to both grids):", "",
              "| batch | measured | predicted | match |", "|---|---|---|---|"]
    for b in result["batch_sizes"]:
        lines.append(f"| {b} | {result['best_k_measured'][b]} | {result['best_k_predicted'][b]} | "
                     f"{'yes' if result['best_k_matches'][b] else 'no'} |")
    n = sum(result["best_k_matches"].values())
    lines += ["", f"Best k matches at {n} of {len(result['best_k_matches'])} batch sizes."]
    alt = result.get("with_default_compute_efficiency")
    if alt:
        lines += ["", f"Not fitted, for comparison: with the compute efficiency the GPU predictions assume "
                  f"({alt['compute_efficiency']} of the matmul rate, for skinny matmuls) instead of 1, the mean absolute "
                  f"error is {alt['mean_abs_error']:.1%} (draft {alt['mean_abs_error_by_part']['draft_ms']:.1%}, "
                  f"verification {alt['mean_abs_error_by_part']['verify_ms']:.1%}) and best k "
                  + ", ".join(f"{b}: {k}" for b, k in alt["best_k_predicted"].items())
                  + f" matches at {sum(alt['best_k_matches'].values())} of {len(alt['best_k_matches'])} batch sizes."]
    sharp = result.get("with_sharp_corner")
    if sharp:
        lines += ["", f"Also for comparison: with the roofline's sharp max (p -> infinity, refitted), the mean absolute "
                  f"error is {sharp['mean_abs_error']:.1%} (draft {sharp['mean_abs_error_by_part']['draft_ms']:.1%}, "
                  f"verification {sharp['mean_abs_error_by_part']['verify_ms']:.1%}) and best k "
                  + ", ".join(f"{b}: {k}" for b, k in sharp["best_k_predicted"].items())
                  + f" matches at {sum(sharp['best_k_matches'].values())} of {len(sharp['best_k_matches'])} batch sizes."]
    return "\n".join(lines) + "\n"


def ratio_table(profile: Profile) -> str:
    """Markdown: predicted ms per generated token over (batch size, k) with each row's best k in bold."""
    g = profile.latency
    rows = ms_per_token(g, profile.acceptance or [])
    out = ["| batch | " + " | ".join(f"k={k}" for k in g.ks) + " |", "|---" * (len(g.ks) + 1) + "|"]
    for b, row in zip(g.batch_sizes, rows):
        best = profile.best_k[b]
        out.append(f"| {b} | " + " | ".join((f"**{v:.2f}**" if k == best else f"{v:.2f}") if math.isfinite(v) else "-"
                                            for k, v in zip(g.ks, row)) + " |")
    return "\n".join(out)


def check_for(profile_path: str, target: str, draft: str | None, context: int | None, threads: int = 2) -> tuple[dict, str]:
    """`specserve profile --check-prediction`: measure this machine, fit its overheads, predict the
    measured profile's grid for its own pair and dtype, and compare cell by cell. context: tokens of
    KV cache per sequence; None takes the mean context the profile recorded."""
    from serve_app.config import ModelConfig
    from serve_app.models import draft_spec, model_names

    measured = load_profile(profile_path)
    if measured.source != "measured" or measured.latency is None:
        raise ValueError(f"{profile_path}: --check-prediction compares with a measured latency grid; this profile has none")
    context = context if context is not None else measured.latency.context_tokens
    if context is None:
        raise ValueError(f"{profile_path} does not record the mean context of its steps: pass --context N")
    mc = ModelConfig(target=target, draft=draft)
    measured.check_pair(*model_names(mc), measured.dtype)  # the shapes below must be this profile's pair
    t, d = model_shape(target), _truncated(target, draft_spec(mc)) or model_shape(draft_spec(mc))
    import os

    hw = measure_hardware(threads)
    load = os.getloadavg()[0]  # other work on the machine lowers what the measurement sees
    overheads = fit_overheads(measured.latency, t, d, hw, measured.dtype, context)
    grid = predict_grid(t, d, hw, measured.dtype, overheads, context, max(measured.latency.ks), measured.latency.batch_sizes)
    result = compare(measured, grid)
    # The same, with the compute efficiency the GPU predictions assume instead of the square-matmul rate.
    gpu_like = overheads.model_copy(update={"compute_efficiency": Overheads().compute_efficiency})
    alt = compare(measured, predict_grid(t, d, hw, measured.dtype, gpu_like, context, max(measured.latency.ks),
                                         measured.latency.batch_sizes))
    result["with_default_compute_efficiency"] = {
        "compute_efficiency": gpu_like.compute_efficiency, "mean_abs_error": alt["mean_abs_error"],
        "mean_abs_error_by_part": alt["mean_abs_error_by_part"], "best_k_predicted": alt["best_k_predicted"],
        "best_k_matches": alt["best_k_matches"]}
    # The same with the old sharp corner (max of memory and compute), its overheads refitted: what p changes.
    sharp_fit = fit_overheads(measured.latency, t, d, hw, measured.dtype, context, overlap_exponent=math.inf)
    sharp = compare(measured, predict_grid(t, d, hw, measured.dtype, sharp_fit, context, max(measured.latency.ks),
                                           measured.latency.batch_sizes))
    result["with_sharp_corner"] = {
        "overheads": sharp_fit.model_dump(exclude={"overlap_exponent"}), "mean_abs_error": sharp["mean_abs_error"],
        "mean_abs_error_by_part": sharp["mean_abs_error_by_part"], "best_k_predicted": sharp["best_k_predicted"],
        "best_k_matches": sharp["best_k_matches"]}
    data = {"profile": profile_path, "profile_created": measured.created, "gpu_type": measured.gpu_type,
            "target": measured.target, "draft": measured.draft, "dtype": measured.dtype, "context_tokens": context,
            "hardware": hw.model_dump(), "load_average_1min": load,
            "overheads": overheads.model_dump(), "shapes": {"target": t.model_dump(), "draft": d.model_dump()}, **result}
    when = f", load average {load:.2f}; against the profile created {measured.created}"
    return data, check_markdown(result, hw, overheads, profile_path, context, when)
