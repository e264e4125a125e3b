"""Spike/burst load: a steady base load with sudden bursts of many users arriving at once.

With the defaults: 2 users, a 60 s burst to 24 users at minute 3 and a short 20 s burst at minute
7 (10 nominal minutes). Shows queueing (queue depth, TTFT) and how fast k drops and recovers.
"""

from __future__ import annotations

from loadtest.shapes import ScaledShape


class SpikeShape(ScaledShape):
    """`base_users`, except during each (start_s, length_s) burst in `bursts`: `burst_users`."""

    base_users: int = 2
    """Users outside the bursts."""
    burst_users: int = 24
    """Users during a burst (more than max_batch_size, so requests queue)."""
    bursts: tuple[tuple[float, float], ...] = ((180.0, 60.0), (420.0, 20.0))
    """Bursts as (start, length) in nominal seconds."""
    duration_s: float = 600.0
    """Length of the whole run in nominal seconds."""
    spawn_rate: float = 100.0
    """Users started or stopped per nominal second: a burst arrives almost at once."""

    def nominal_s(self) -> float:
        return self.duration_s

    def users_at(self, t: float) -> int:
        in_burst = any(start <= t < start + length for start, length in self.bursts)
        return self.burst_users if in_burst else self.base_users
