"""Speculation profiles per hardware type: the stored schema and load/save.

A profile holds, for one (hardware type, target, draft, dtype), what `specserve profile` measured:
step latency over batch size x speculation length (draft, target verification, engine overhead; a
`pricing.LatencyGrid`, optionally with a context axis), acceptance per draft position on a prompt set, and
the best-k table derived from both. The `lut` policy reads the table; `adaptive` and `budget` price steps
with the grid (`serve_app/pricing.py`). Routers get profiles from the shared ProfileStore.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serve_app.engine.draftplan import CURVE_BINS
from serve_app.pricing import LatencyGrid


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
    """Hardware type the numbers were measured on, as `hardware.detect_gpu_type()` names it (file stem too)."""
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
    confidence_curve: list[float] | None = None
    """The draft model's acceptance chance per confidence bin (tenths of its top probability) over the
    positions the target judged while `acceptance` was measured: where `budget`'s curve starts before the
    served traffic teaches it (None, as in profiles from before this field: at the confidence itself)."""
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
        if self.confidence_curve is not None and (len(self.confidence_curve) != CURVE_BINS
                                                  or any(not 0 <= a <= 1 for a in self.confidence_curve)):
            raise ValueError(f"confidence_curve needs {CURVE_BINS} values in [0, 1] (one per tenth of confidence)")
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


def fit_acceptance_rate(acceptance: list[float]) -> float:
    """Per-token acceptance a that best explains acceptance-per-position at k = len(acceptance).

    Maximum likelihood for the geometric model: accepted tokens / (accepted tokens + stops before k),
    where acceptance[i] = P(more than i accepted); stops before k happen with 1 - acceptance[k-1].
    """
    if not acceptance:
        return 0.0
    accepted = sum(acceptance)
    return accepted / (accepted + 1.0 - acceptance[-1]) if accepted + 1.0 - acceptance[-1] > 0 else 1.0


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
