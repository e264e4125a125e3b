"""The alternating low/high load of the paper specserve follows (arXiv 2310.18813).

Phases of light load, where a long speculation length pays, alternate with phases of heavy load,
where a short one (or none) pays: an adaptive k must switch back and forth, and a fixed k is wrong
half of the time. With the defaults: 2 and 16 users, six 100 s phases (10 nominal minutes).
"""

from __future__ import annotations

from loadtest.shapes import ScaledShape


class PaperShape(ScaledShape):
    """low, high, low, high, ...: `phases` phases of `phase_s` nominal seconds each."""

    low_users: int = 2
    """Users in the light phases (small batches: long k)."""
    high_users: int = 16
    """Users in the heavy phases (full batches: short k)."""
    phase_s: float = 100.0
    """Length of one phase in nominal seconds."""
    phases: int = 6
    """Number of phases; the run starts with a light one."""
    spawn_rate: float = 50.0
    """Users started or stopped per nominal second at a phase change."""

    def nominal_s(self) -> float:
        return self.phases * self.phase_s

    def users_at(self, t: float) -> int:
        return self.high_users if int(t // self.phase_s) % 2 else self.low_users
