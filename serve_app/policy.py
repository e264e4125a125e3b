"""Policies choose the speculation length k for each engine step.

A policy is a small object with two hooks, used unchanged by the offline engine and the Ray router:
  choose(state) -> k        before the step, from the batch state
  observe(stats) -> None    after the step, with what the step did (proposed / accepted ...)
Policies are pure Python, cheap (well under 1% of a step) and testable without models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .stats import StepStats


@dataclass(frozen=True)
class BatchState:
    """What a policy may look at when choosing k."""

    batch_size: int
    """Sequences that will decode in this step."""
    max_k: int
    """Upper bound on k (engine configuration)."""
    has_draft: bool = True
    """False when no draft model is loaded: k must be 0."""


class Policy(Protocol):
    name: str

    def choose(self, state: BatchState) -> int: ...

    def observe(self, stats: StepStats) -> None: ...


class NoSpeculation:
    """k = 0 always: plain decoding by the target (the baseline)."""

    name = "none"

    def choose(self, state: BatchState) -> int:
        return 0

    def observe(self, stats: StepStats) -> None:
        pass


class FixedK:
    """The same k every step (clamped to the engine's max_k)."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"fixed:K needs K >= 0, got {k}")
        self.k = k
        self.name = f"fixed:{k}"

    def choose(self, state: BatchState) -> int:
        return min(self.k, state.max_k) if state.has_draft else 0

    def observe(self, stats: StepStats) -> None:
        pass


class LookupTable:
    """The paper's policy: k = best_k[batch size] from the hardware's profile.

    Between profiled batch sizes the nearest one is used (the smaller on a tie); beyond the ends,
    the end values.
    """

    name = "lut"

    def __init__(self, best_k: dict[int, int]):
        if not best_k:
            raise ValueError("lut needs a profile with a best_k table")
        self.sizes = sorted(best_k)
        self.best_k = dict(best_k)

    def choose(self, state: BatchState) -> int:
        if not state.has_draft:
            return 0
        b = state.batch_size
        nearest = min(self.sizes, key=lambda s: (abs(s - b), s))
        return min(self.best_k[nearest], state.max_k)

    def observe(self, stats: StepStats) -> None:
        pass


POLICY_FORMS = "none | fixed:K | lut"


def make_policy(spec: str, profile=None) -> Policy:
    """Build a policy from its spec string; unknown specs raise ValueError up front.

    `profile` (a profiles.Profile) is required by profile-driven policies such as `lut`.
    """
    spec = spec.strip()
    if spec == "none":
        return NoSpeculation()
    if spec == "lut":
        if profile is None:
            raise ValueError("policy 'lut' needs a profile for this hardware type (see profiles/)")
        return LookupTable(profile.best_k)
    name, _, arg = spec.partition(":")
    if name == "fixed":
        if not arg.isdigit():
            raise ValueError(f"policy {spec!r}: fixed needs a whole number, e.g. fixed:4")
        return FixedK(int(arg))
    raise ValueError(f"unknown policy {spec!r}: expected {POLICY_FORMS}")
