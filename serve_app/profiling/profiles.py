"""Speculation profiles per hardware type: schema, load/save, the goodput model, hardware-type detection.

A profile holds, for one (hardware type, target, draft, dtype), what `specserve profile` measured:
step latency over batch size x speculation length (draft, target verification, engine overhead),
acceptance per draft position on a prompt set, and the best-k table derived from both. The `lut`
policy reads the table; the `adaptive` policy reads the latency grid. Routers get profiles from the
shared ProfileStore.

The goodput model: with per-token acceptance a, a step of speculation length k generates
E[tokens | a, k] = 1 + a + a^2 + ... + a^k tokens per sequence (each draft token is accepted only if
all before it were; one target token - recovered or bonus - always comes), so a step at batch size b
yields b * E tokens in step_ms(b, k).
"""

from __future__ import annotations

import json
import math
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ContextGrid(BaseModel):
    """Step parts at several contexts: how the draft's and the verification's time grow with the KV tokens each
    row attends, per (batch size, k). The latency grid is measured at one (short) context; this grid scales
    its cells to the context a step really serves (`scale`), so calibration and the policies price context
    apart from the machine's own speed."""

    model_config = ConfigDict(extra="forbid")

    contexts: list[int] = Field(min_length=1)
    """Mean KV tokens per row (prompt + generated) in the recorded steps of each context measured, ascending."""
    batch_sizes: list[int] = Field(min_length=1)
    """Batch sizes measured, ascending."""
    ks: list[int] = Field(min_length=1)
    """Speculation lengths measured, ascending from 0."""
    draft_ms: list[list[list[float | None]]]
    """draft_ms[c][i][j]: the draft's time of a step at contexts[c], batch_sizes[i], ks[j] (None: not measured,
    e.g. a KV pool too small for that many long rows)."""
    verify_ms: list[list[list[float | None]]]
    """verify_ms[c][i][j]: the verification's time there."""
    layout: Literal["padded", "paged"] = "paged"
    """How attention pays for a batch of rows of different lengths: `paged` per row (a paged / flex kernel: the
    step's context is the rows' mean), `padded` at the longest row (the gather backend pads each group)."""
    backend: str | None = None
    """The attention backend measured (`gather`, `flex`)."""

    @model_validator(mode="after")
    def _shape(self) -> "ContextGrid":
        for name, seq in (("contexts", self.contexts), ("batch_sizes", self.batch_sizes), ("ks", self.ks)):
            if seq != sorted(set(seq)) or seq[0] < (0 if name == "ks" else 1):
                raise ValueError(f"context grid: {name} must be ascending, distinct and positive")
        for name in ("draft_ms", "verify_ms"):
            cube = getattr(self, name)
            if len(cube) != len(self.contexts) or any(len(rows) != len(self.batch_sizes) or any(
                    len(r) != len(self.ks) for r in rows) for rows in cube):
                raise ValueError(f"context grid: {name} needs [contexts][batch sizes][ks] values")
        return self

    def context_of(self, contexts: list[int]) -> float:
        """The context a step of rows with these KV lengths is priced at: their mean (paged) or longest (padded)."""
        if not contexts:
            return 0.0
        return float(max(contexts)) if self.layout == "padded" else sum(contexts) / len(contexts)

    def at(self, part: str, batch_size: int, k: float, context: float) -> float | None:
        """A part's milliseconds at any (batch, k, context): linear between measured points in each, extended
        linearly past the longest context (attention's cost grows linearly in the KV tokens), flat below the
        shortest. None where the batch size's cells lack a measured context on both sides."""
        cube = getattr(self, f"{part}_ms")
        i0, i1, wb = _between(self.batch_sizes, batch_size)
        j0, j1, wk = _between(self.ks, k) if k > 0 else (0, 0, 0.0)
        points = []
        for c, rows in zip(self.contexts, cube):
            cells = [rows[i][j] for i in (i0, i1) for j in (j0, j1)]
            if any(v is None for v in cells):
                continue
            a, b, x, y = cells
            lo, hi = a + wk * (b - a), x + wk * (y - x)
            points.append((c, lo + wb * (hi - lo)))
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        cs, vs = [p[0] for p in points], [p[1] for p in points]
        for i in range(len(vs) - 2, -1, -1):  # more KV never makes a step cheaper: a shorter context's cell above a
            vs[i] = min(vs[i], vs[i + 1])   # longer one's is noise (a slow spell), bounded by the longer cell
        c0, c1, w = _between(cs, context)
        return max(vs[c0] + w * (vs[c1] - vs[c0]), 1e-3)

    def scale(self, part: str, batch_size: int, k: float, context: float | None, base: float | None) -> float:
        """How much longer (or shorter) a part takes at `context` than at `base` (the latency grid's own context),
        at this batch size and k: 1 where either is unknown."""
        if context is None or base is None or context <= 0:
            return 1.0
        at, ref = self.at(part, batch_size, k, context), self.at(part, batch_size, k, base)
        return at / ref if at is not None and ref and ref > 0 else 1.0


class LatencyGrid(BaseModel):
    """Median step latency in milliseconds for every (batch size, k) measured."""

    model_config = ConfigDict(extra="forbid")

    batch_sizes: list[int] = Field(min_length=1)
    """Batch sizes measured, ascending (1, 2, 4, ... up to the max batch)."""
    ks: list[int] = Field(min_length=1)
    """Speculation lengths measured, ascending from 0."""
    draft_ms: list[list[float]]
    """draft_ms[i][j]: draft time of one step (propose ks[j] tokens, commit) at batch_sizes[i]."""
    verify_ms: list[list[float]]
    """verify_ms[i][j]: the target's verification forward of ks[j] + 1 tokens per sequence."""
    other_ms: list[list[float]]
    """other_ms[i][j]: the rest of the step (acceptance, bookkeeping, detokenizing)."""
    resume_ms: list[float] | None = None
    """resume_ms[i]: extra draft time of the first speculating step after steps at k = 0 (the draft
    feeds the tokens it skipped), over the steady-state cell; a switch cost, not part of the cells."""
    chunk_step_ms: list[float] | None = None
    """chunk_step_ms[i]: the fixed part of what prefilling in chunks adds to a step that decodes
    batch_sizes[i] sequences (at k = 0), whatever the chunk's length: the draft's own prefill forward,
    admission, bookkeeping. The engine's chunked prefill gives each step's budget
    (`EngineConfig.max_num_batched_tokens`) to the decoding rows first, the rest to prompt chunks;
    simulators add chunk_step_ms + chunk tokens x chunk_ms_per_token to the decode step's time."""
    chunk_ms_per_token: list[float] | None = None
    """chunk_ms_per_token[i]: the part per prompt token fed (the target's packed forward grows). Both are
    fitted to two measurements beside the decoding batch: a `chunk_prompt_tokens`-token prompt, and a
    prompt of a whole chunk (`chunk_budget` less the decoding rows), each prefilled in one step."""
    chunk_draft_step_ms: list[float] | None = None
    """chunk_draft_step_ms[i]: the draft's part of chunk_step_ms[i] (what an engine without a draft saves)."""
    chunk_draft_ms_per_token: list[float] | None = None
    """chunk_draft_ms_per_token[i]: the draft's part of chunk_ms_per_token[i]."""
    chunk_budget: int | None = Field(None, ge=1)
    """The step's token budget (`max_num_batched_tokens`) the chunk price was measured with."""
    chunk_prompt_tokens: int | None = Field(None, ge=1)
    """Length of the short prompt (a chat prompt's) the chunk price was measured with."""
    prefill_ms: list[float] | None = None
    """Profiles from before chunked prefill (and predicted ones): prefill_ms[i] is admitting
    batch_sizes[i] new requests of `prefill_tokens` prompt tokens each in a forward of their own (the
    target's forward over the prompts, the draft's prefill and first commit), over the k = 0 step the
    same engine step also ran. Simulators read it, per prompt token, where `chunk_ms_per_token` is absent."""
    prefill_tokens: int | None = Field(None, ge=1)
    """Mean prompt length, in tokens, of the requests `prefill_ms` admitted."""
    context_tokens: int | None = Field(None, ge=1)
    """Mean context (prompt + generated tokens) of the sequences in the recorded steps: step time
    grows with it, since attention reads every earlier token."""
    prefill_draft_ms: list[float] | None = None
    """prefill_draft_ms[i]: the draft's part of prefill_ms[i] (what an engine without a draft saves)."""
    context: ContextGrid | None = None
    """The draft's and the verification's time at several contexts (`specserve profile --contexts`): the cells
    above are scaled from `context_tokens` to the context a step serves. None (older profiles): one context."""

    @model_validator(mode="after")
    def _shape(self) -> "LatencyGrid":
        for name, seq in (("batch_sizes", self.batch_sizes), ("ks", self.ks)):
            if seq != sorted(set(seq)) or seq[0] < (1 if name == "batch_sizes" else 0):
                raise ValueError(f"{name} must be ascending, distinct and >= {1 if name == 'batch_sizes' else 0}")
        if self.ks[0] != 0:
            raise ValueError("ks must start at 0 (plain decoding is the baseline every k is compared with)")
        if self.resume_ms is not None and (len(self.resume_ms) != len(self.batch_sizes) or min(self.resume_ms) < 0):
            raise ValueError(f"resume_ms needs one latency >= 0 per batch size {self.batch_sizes}")
        if self.prefill_ms is not None and (len(self.prefill_ms) != len(self.batch_sizes) or min(self.prefill_ms) < 0
                                            or self.prefill_tokens is None):
            raise ValueError(f"prefill_ms needs one latency >= 0 per batch size {self.batch_sizes}, and prefill_tokens")
        if self.prefill_draft_ms is not None and (self.prefill_ms is None or len(self.prefill_draft_ms) != len(self.prefill_ms)):
            raise ValueError("prefill_draft_ms needs prefill_ms and one latency per batch size")
        chunk = {name: getattr(self, name) for name in ("chunk_step_ms", "chunk_ms_per_token", "chunk_draft_step_ms",
                                                         "chunk_draft_ms_per_token")}
        if any(v is not None for v in chunk.values()):
            for name, v in chunk.items():
                if v is None and "draft" not in name:
                    raise ValueError(f"{name} is missing: the chunk price needs chunk_step_ms and chunk_ms_per_token")
                if v is not None and (len(v) != len(self.batch_sizes) or min(v) < 0):
                    raise ValueError(f"{name} needs one value >= 0 per batch size {self.batch_sizes}")
            if (chunk["chunk_draft_step_ms"] is None) != (chunk["chunk_draft_ms_per_token"] is None):
                raise ValueError("chunk_draft_step_ms and chunk_draft_ms_per_token come together")
        for name in ("draft_ms", "verify_ms", "other_ms"):
            rows = getattr(self, name)
            if len(rows) != len(self.batch_sizes):
                raise ValueError(f"{name} has {len(rows)} rows for {len(self.batch_sizes)} batch sizes "
                                 f"{self.batch_sizes}: a batch size is missing")
            for b, row in zip(self.batch_sizes, rows):
                if len(row) != len(self.ks) or any(not v >= 0 for v in row):
                    raise ValueError(f"{name} at batch size {b} needs {len(self.ks)} latencies >= 0 (one per k)")
        return self

    def total_ms(self) -> list[list[float]]:
        """[batch size][k] whole-step latency: draft + verification + the rest."""
        return [[d + v + o for d, v, o in zip(*r)] for r in zip(self.draft_ms, self.verify_ms, self.other_ms)]

    def prefill_at(self, batch_size: int, prompt_tokens: int, draft: bool = True) -> float | None:
        """Milliseconds to admit `batch_size` requests with `prompt_tokens` prompt tokens in all (linear
        between measured batch sizes, scaled by prompt tokens), less the draft's part when there is no
        draft; None without a measured prefill."""
        if self.prefill_ms is None or self.prefill_tokens is None:
            return None
        ms = self.prefill_ms if draft or not self.prefill_draft_ms else \
            [max(t - d, 0.0) for t, d in zip(self.prefill_ms, self.prefill_draft_ms)]
        per_token = [m / (b * self.prefill_tokens) for b, m in zip(self.batch_sizes, ms)]
        return _interpolate(self.batch_sizes, per_token, batch_size) * prompt_tokens

    def chunk_ms(self, batch_size: int, prompt_tokens: int, draft: bool = True) -> float | None:
        """Milliseconds that prefilling `prompt_tokens` prompt tokens in chunks adds to a step decoding
        `batch_size` sequences: chunk_step_ms + tokens x chunk_ms_per_token (linear between measured
        batch sizes), less the draft's part when there is no draft; 0 for no tokens. Profiles from
        before chunked prefill: their per-token prefill price at that batch size (`prefill_at`, from
        a forward of its own). None when neither was measured."""
        if self.chunk_ms_per_token is None or self.chunk_step_ms is None:
            return self.prefill_at(batch_size, prompt_tokens, draft)
        if prompt_tokens <= 0:
            return 0.0
        fixed, per_token = self.chunk_step_ms, self.chunk_ms_per_token
        if not draft and self.chunk_draft_step_ms is not None and self.chunk_draft_ms_per_token is not None:
            fixed = [max(t - d, 0.0) for t, d in zip(fixed, self.chunk_draft_step_ms)]
            per_token = [max(t - d, 0.0) for t, d in zip(per_token, self.chunk_draft_ms_per_token)]
        return (_interpolate(self.batch_sizes, fixed, batch_size)
                + _interpolate(self.batch_sizes, per_token, batch_size) * prompt_tokens)

    def step_ms(self, batch_size: int, context: float | None = None) -> list[float]:
        """Step latency per k at any batch size: linear between measured sizes, extended beyond them; at
        `context` KV tokens per row (`ContextGrid.context_of`) where the grid has a context axis."""
        return [max(d + v + o, 1e-3) for d, v, o in zip(*self.parts_at(batch_size, context))]

    def parts_at(self, batch_size: int, context: float | None = None) -> tuple[list[float], list[float], list[float]]:
        """(draft, verify, other) milliseconds per k at any batch size, interpolated like `step_ms`; the draft
        and verification scaled to `context` (`context_scales`)."""
        i0, i1, w = _between(self.batch_sizes, batch_size)
        draft, verify, other = ([max(x0 + w * (x1 - x0), 0.0) for x0, x1 in zip(rows[i0], rows[i1])]
                                for rows in (self.draft_ms, self.verify_ms, self.other_ms))
        sd, sv = self.context_scales(batch_size, context)
        return [d * s for d, s in zip(draft, sd)], [v * s for v, s in zip(verify, sv)], other

    def step_context(self, contexts) -> float | None:
        """The context a step whose rows attend these KV lengths is priced at (their mean or longest, by the
        attention layout the context axis measured); None without an axis, its reference context, or rows."""
        if self.context is None or self.context_tokens is None or not contexts:
            return None
        return self.context.context_of(list(contexts))

    def part_at(self, part: str, batch_size: float, k: float, context: float | None = None) -> float:
        """One part's milliseconds (draft, verify, other) at any batch size and k (linear between the measured
        ones, k between its columns: a plan's mean drafted length, a startup profile's missing k), scaled to
        `context` where the grid has a context axis."""
        rows = getattr(self, f"{part}_ms")
        i0, i1, w = _between(self.batch_sizes, max(batch_size, 1))
        j0, j1, wk = _between(self.ks, k) if k > 0 else (0, 0, 0.0)
        lo, hi = (r[j0] + wk * (r[j1] - r[j0]) for r in (rows[i0], rows[i1]))
        v = max(lo + w * (hi - lo), 0.0)
        if context is not None and part != "other" and self.context is not None and self.context_tokens is not None:
            v *= self.context.scale(part, batch_size, k, context, self.context_tokens)
        return v

    def context_scales(self, batch_size: int, context: float | None) -> tuple[list[float], list[float]]:
        """Per k, the draft's and the verification's time at `context` over their time at the grid's own context
        (`context_tokens`): all 1 without a context axis or a context."""
        if self.context is None or context is None or self.context_tokens is None:
            return [1.0] * len(self.ks), [1.0] * len(self.ks)
        return tuple([self.context.scale(part, batch_size, k, context, self.context_tokens) for k in self.ks]
                     for part in ("draft", "verify"))

    def resume_at(self, batch_size: int) -> float:
        """Extra milliseconds of a step that resumes speculation after k = 0 (0 when not measured)."""
        return _interpolate(self.batch_sizes, self.resume_ms, batch_size) if self.resume_ms else 0.0


def _between(sizes: list[int], x: float) -> tuple[int, int, float]:
    """(i0, i1, w): x lies w of the way from sizes[i0] to sizes[i1] - linear between measured sizes,
    extended beyond the largest, flat below the smallest (latency does not shrink below batch 1)."""
    if len(sizes) == 1:
        return 0, 0, 0.0
    i = next((i for i, s in enumerate(sizes[1:], 1) if x <= s), len(sizes) - 1)
    return i - 1, i, max(0.0, (x - sizes[i - 1]) / (sizes[i] - sizes[i - 1]))


def _interpolate(sizes: list[int], values: list[float], x: float) -> float:
    i0, i1, w = _between(sizes, x)
    return max(values[i0] + w * (values[i1] - values[i0]), 0.0)


class Prediction(BaseModel):
    """How a predicted profile was made (`serve_app/profiling/roofline.py`): the inputs, so a reader can judge it."""

    model_config = ConfigDict(extra="forbid")

    hardware: str
    """The hardware spec the roofline model used (a `roofline.GPUS` name, or this CPU as measured)."""
    hardware_source: str
    """Where the hardware figures come from (the vendor datasheet, or a measurement here)."""
    memory_gb_s: float = Field(gt=0)
    """Memory bandwidth from the spec, GB/s (before `memory_efficiency`)."""
    tflops: float = Field(gt=0)
    """Peak dense compute for the profile's dtype from the spec, TFLOP/s (before `compute_efficiency`)."""
    memory_efficiency: float = Field(gt=0, le=1)
    """Share of the spec's bandwidth a forward is assumed to reach."""
    compute_efficiency: float = Field(gt=0, le=1)
    """Share of the spec's peak compute a forward's matmuls are assumed to reach."""
    overlap_exponent: float | None = Field(None, ge=1)
    """p joining a forward's memory and compute time, (t_mem^p + t_compute^p)^(1/p): an assumption
    (`roofline.Overheads`). Absent in profiles predicted before it existed: those used the sharp max."""
    forward_base_ms: float = Field(ge=0)
    """Fixed cost of every forward besides bytes and FLOPs (the engine's per-forward host work)."""
    forward_per_layer_ms: float = Field(ge=0)
    """Cost per decoder layer of every forward besides bytes and FLOPs (eager kernel launches)."""
    step_ms: float = Field(ge=0)
    """`other_ms` of a step: fixed part (acceptance, bookkeeping)."""
    step_per_seq_ms: float = Field(ge=0)
    """`other_ms` of a step: part per sequence in the batch (detokenizing, streaming)."""
    context_tokens: int = Field(ge=0)
    """Tokens already in each sequence's KV cache, assumed for every cell (the KV read per forward)."""
    acceptance_from: str
    """Where `acceptance` comes from: a measured profile of the same pair, or an assumed rate."""


class Profile(BaseModel):
    """What one hardware type does with one model pair: latencies, acceptance and the best-k table."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str = Field(min_length=1)
    """Hardware type the numbers were measured on, as `detect_gpu_type()` names it (file stem too)."""
    target: str
    """Target model the profile is for (`model_names()` display name)."""
    draft: str
    """Draft model the profile is for (`model_names()` display name)."""
    dtype: str = "float32"
    """Weights dtype during profiling."""
    best_k: dict[int, int] = Field(min_length=1)
    """Batch size -> speculation length with the lowest latency per generated token there (the paper's table)."""
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    """When the profile was measured (UTC, ISO 8601)."""
    latency: LatencyGrid | None = None
    """Measured step latencies; needed by `adaptive` (a hand-written `lut` profile may leave it out)."""
    acceptance: list[float] | None = None
    """acceptance[i]: fraction of steps in which draft token i (0-based) was accepted, at k = len(acceptance)."""
    acceptance_rate: float | None = Field(None, ge=0, le=1)
    """Per-token acceptance a of the goodput model fitted to `acceptance` (adaptive's starting estimate)."""
    notes: str = ""
    """How it was measured (prompt set, repetitions, machine), free text."""
    source: Literal["measured", "predicted", "calibrated"] = "measured"
    """`measured` by `specserve profile` on the hardware itself, `predicted` by the roofline model
    (`specserve profile --predict`) for hardware we cannot reach, or `calibrated`: a serving replica's
    grid corrected by its own steps (`profiling.calibration`), shared with the others of its type
    while no measured profile of their own machine exists; a measured one always wins."""

    machine: str | None = None
    """The host a measured profile was measured on, or a calibrated one calibrated on (None: unknown,
    as in profiles from before this field)."""
    prediction: Prediction | None = None
    """For a predicted profile: the model's inputs (hardware figures, overheads, context, acceptance)."""

    @field_validator("best_k")
    @classmethod
    def _positive(cls, v: dict[int, int]) -> dict[int, int]:
        if any(b < 1 for b in v) or any(k < 0 for k in v.values()):
            raise ValueError("best_k needs batch sizes >= 1 and k >= 0")
        return dict(sorted(v.items()))

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        if self.latency is not None:
            missing = sorted(set(self.latency.batch_sizes) - set(self.best_k))
            if missing:
                raise ValueError(f"best_k lacks batch sizes {missing} that the latency grid measured")
        if self.acceptance is not None and any(not 0 <= a <= 1 for a in self.acceptance):
            raise ValueError("acceptance values must lie in [0, 1]")
        if (self.source == "predicted") != (self.prediction is not None):
            raise ValueError("a predicted profile needs `prediction` (how it was made); a measured one has none")
        if self.source == "calibrated" and self.latency is None:
            raise ValueError("a calibrated profile needs the latency grid it calibrated")
        return self

    def check_pair(self, target: str, draft: str, dtype: str) -> None:
        """Refuse to steer a model pair with another pair's numbers, or with numbers measured in another
        dtype (a bfloat16 forward costs about half a float32 one on CPU, so the best k differs)."""
        if (self.target, self.draft) != (target, draft):
            raise ValueError(
                f"profile for {self.gpu_type} was measured with target {self.target!r} and draft {self.draft!r}, "
                f"but this engine runs target {target!r} with draft {draft!r}: profile this pair (`specserve profile`)"
            )
        if self.dtype != dtype:
            raise ValueError(
                f"profile for {self.gpu_type} was measured in {self.dtype}, but this engine runs {dtype}: "
                f"profile in {dtype} (`specserve profile --dtype {dtype}`) or serve with --dtype {self.dtype}"
            )


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """E[tokens per sequence per step] = 1 + a + ... + a^k (accepted prefix plus one target token)."""
    return sum(acceptance_rate**i for i in range(k + 1))


def fit_acceptance_rate(acceptance: list[float]) -> float:
    """Per-token acceptance a that best explains acceptance-per-position at k = len(acceptance).

    Maximum likelihood for the geometric model: accepted tokens / (accepted tokens + stops before k),
    where acceptance[i] = P(more than i accepted); stops before k happen with 1 - acceptance[k-1].
    """
    if not acceptance:
        return 0.0
    accepted = sum(acceptance)
    return accepted / (accepted + 1.0 - acceptance[-1]) if accepted + 1.0 - acceptance[-1] > 0 else 1.0


def ms_per_token(grid: LatencyGrid, acceptance: list[float], context: float | None = None) -> list[list[float]]:
    """[batch size][k] latency per generated token with the measured acceptance per position
    (E[tokens | k] = 1 + sum of acceptance[:k]); inf for k beyond the measured positions. At `context` KV tokens
    per row where the grid has a context axis (else at its own context)."""
    rows = grid.total_ms() if context is None else [grid.step_ms(b, context) for b in grid.batch_sizes]
    return [[ms / (b * (1 + sum(acceptance[:k]))) if k <= len(acceptance) else float("inf")
             for k, ms in zip(grid.ks, row)] for b, row in zip(grid.batch_sizes, rows)]


def best_k_table(grid: LatencyGrid, acceptance: list[float], context: float | None = None) -> dict[int, int]:
    """Per batch size, the k with the lowest measured latency per generated token (ties: smaller k), at `context`."""
    return {b: min(zip(row, grid.ks))[1] for b, row in zip(grid.batch_sizes, ms_per_token(grid, acceptance, context))}


def context_bucket(context: float | None) -> int | None:
    """A context rounded to a quarter of a power of two (64, 76, 90, 108, 128, ...): what price caches key on,
    a few % apart, so a cache holds a few dozen entries however contexts vary."""
    if context is None or context <= 0:
        return None
    return round(2 ** (round(4 * math.log2(context)) / 4))


def detect_gpu_type() -> str:
    """`NVIDIA_H100`-style name of the first CUDA device (`gpu_type_name`), else `cpu-<N>core`."""
    try:
        import torch

        if torch.cuda.is_available():
            return gpu_type_name(torch.cuda.get_device_name(0))
    except Exception:  # no usable CUDA: profile as CPU
        pass
    return f"cpu-{os.cpu_count()}core"


def gpu_type_name(device_name: str) -> str:
    """The hardware type of a CUDA device name: its words up to the first one with a digit in it.

    So memory and form-factor variants share one profile (`NVIDIA A100-SXM4-80GB` -> `NVIDIA_A100`,
    `NVIDIA H100 80GB HBM3` -> `NVIDIA_H100`), while brand words stay in and the model number with
    them (`NVIDIA GeForce RTX 4090` -> `NVIDIA_GeForce_RTX_4090`, not a `NVIDIA_GeForce` every
    GeForce card would share). CPUs are named `cpu-<cores>core` since their speed scales with cores.
    """
    words = [w for w in re.split(r"[\s-]+", device_name) if w]
    n = next((i + 1 for i, w in enumerate(words) if any(c.isdigit() for c in w)), min(len(words), 2))
    return "_".join(words[:n])


def load_profile(path: str | Path) -> Profile:
    try:
        return Profile.model_validate(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise ValueError(f"profile {path}: {where + ': ' if where else ''}{err['msg']}") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(profile.model_dump_json(indent=1) + "\n")


def replaces(held: Profile | None, new: Profile) -> bool:
    """Whether `new` may take `held`'s place for its hardware type: a measured profile always may, a
    predicted one only where no measured one is held (a model never overrides a measurement)."""
    return held is None or new.source == "measured" or held.source == "predicted"


def load_profiles(directory: str | Path) -> dict[str, Profile]:
    """Every profiles/*.json, keyed by gpu_type; a malformed file is an error, not skipped. Where two
    files name one hardware type, a measured profile beats a predicted one, else the later file wins."""
    out: dict[str, Profile] = {}
    for path in sorted(Path(directory).glob("*.json")):
        prof = load_profile(path)
        if replaces(out.get(prof.gpu_type), prof):
            out[prof.gpu_type] = prof
    return out
