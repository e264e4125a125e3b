"""Step load: a few users, then more every step, up to a plateau (capacity search).

With the defaults: 2, 6, 10, 14, 18 users, two nominal minutes each (10 min in all). Each step
shows one batch-size regime; with the lut policy the chosen k falls step by step.
"""

from __future__ import annotations

from loadtest.shapes import ScaledShape


class StepShape(ScaledShape):
    """Users rise by `step_users` every `step_s` nominal seconds, `steps` times."""

    start_users: int = 2
    """Users during the first step."""
    step_users: int = 4
    """Users added at the start of every later step."""
    steps: int = 5
    """Number of steps (the last one is the plateau)."""
    step_s: float = 120.0
    """Length of one step in nominal seconds."""
    spawn_rate: float = 10.0
    """Users started per nominal second at each step up."""

    def nominal_s(self) -> float:
        return self.steps * self.step_s

    def users_at(self, t: float) -> int:
        step = min(int(t // self.step_s), self.steps - 1)
        return self.start_users + step * self.step_users
