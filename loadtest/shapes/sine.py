"""Diurnal load: users follow a sine between a night-time low and a day-time peak.

With the defaults: 1 to 16 users, a 5-minute "day" repeated twice (10 nominal minutes). A smooth
rise and fall shows how closely the chosen k tracks a slowly changing batch size.
"""

from __future__ import annotations

import math

from loadtest.shapes import ScaledShape


class SineShape(ScaledShape):
    """users(t) = min + (max - min) * (1 - cos(2 pi t / period)) / 2: starts at the low point."""

    min_users: int = 1
    """Users at the low point of each period ("night")."""
    max_users: int = 16
    """Users at the high point, half a period in ("midday")."""
    period_s: float = 300.0
    """Length of one period ("day") in nominal seconds."""
    periods: int = 2
    """How many periods the run lasts."""
    spawn_rate: float = 5.0
    """Users started or stopped per nominal second; the curve itself changes more slowly."""

    def nominal_s(self) -> float:
        return self.periods * self.period_s

    def users_at(self, t: float) -> float:
        phase = (1 - math.cos(2 * math.pi * t / self.period_s)) / 2
        return self.min_users + (self.max_users - self.min_users) * phase
