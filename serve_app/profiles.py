"""Speculation profiles per hardware type: schema, load/save, and hardware-type detection.

A profile says, for one (hardware type, target, draft), which k to use at each batch size. The
profiler (its own issue) measures it; routers read it from the shared ProfileStore.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Profile(BaseModel):
    """The best speculation length per batch size for one hardware type and model pair."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str = Field(min_length=1)
    """Hardware type the numbers were measured on, as `detect_gpu_type()` names it (file stem too)."""
    target: str
    """Target model the profile is for (display name or spec)."""
    draft: str
    """Draft model the profile is for."""
    best_k: dict[int, int] = Field(min_length=1)
    """Batch size -> speculation length that gave the lowest latency per token there."""
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    """When the profile was measured (UTC, ISO 8601)."""

    @field_validator("best_k")
    @classmethod
    def _positive(cls, v: dict[int, int]) -> dict[int, int]:
        if any(b < 1 for b in v) or any(k < 0 for k in v.values()):
            raise ValueError("best_k needs batch sizes >= 1 and k >= 0")
        return dict(sorted(v.items()))


def detect_gpu_type() -> str:
    """`NVIDIA_H100`-style name of the first CUDA device, else `cpu-<N>core`.

    Only the vendor and model words are kept (`NVIDIA A100-SXM4-80GB` -> `NVIDIA_A100`) so one
    profile serves every memory variant; CPUs include the core count since speed scales with it.
    """
    try:
        import torch

        if torch.cuda.is_available():
            words = re.split(r"[\s-]+", torch.cuda.get_device_name(0))
            return "_".join(words[:2])
    except Exception:  # no usable CUDA: profile as CPU
        pass
    return f"cpu-{os.cpu_count()}core"


def load_profile(path: str | Path) -> Profile:
    try:
        return Profile.model_validate(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"profile {path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def load_profiles(directory: str | Path) -> dict[str, Profile]:
    """Every profiles/*.json, keyed by gpu_type; a malformed file is an error, not skipped."""
    out: dict[str, Profile] = {}
    for path in sorted(Path(directory).glob("*.json")):
        prof = load_profile(path)
        out[prof.gpu_type] = prof
    return out
