"""Time-varying load shapes, one LoadTestShape per module, chosen by name (`load_shape("paper")`).

Every shape is a pure function of the run time: tick() reads `self.get_run_time()` and nothing
else (not the current user count), so a run can be replayed and the shapes are unit-testable.

Environment variables stretch a shape without editing it (read at every tick):
  LOADTEST_TIME_SCALE  real seconds per nominal second (default 1). A shape's `nominal_s()` is its
                       length at scale 1 (10 minutes for the shapes here), so 0.05 makes a ~30 s
                       smoke run. Spawn rates are divided by the same factor so ramps keep their shape.
  LOADTEST_DURATION_S  alternatively, the real length of the run: the time scale becomes
                       LOADTEST_DURATION_S / nominal_s() for whichever shape is chosen.
  LOADTEST_USER_SCALE  multiplies every user count (default 1; at least 1 user is kept), to fit
                       the shape to the size of the deployment under test.
"""

from __future__ import annotations

import importlib
import math
import os

from locust import LoadTestShape

SHAPES = ("step", "sine", "spike", "paper")
"""Names accepted by load_shape(); each is a module of this package."""


def time_scale() -> float:
    scale = float(os.environ.get("LOADTEST_TIME_SCALE", "1"))
    if scale <= 0:
        raise ValueError(f"LOADTEST_TIME_SCALE must be > 0, got {scale}")
    return scale


def user_scale() -> float:
    scale = float(os.environ.get("LOADTEST_USER_SCALE", "1"))
    if scale <= 0:
        raise ValueError(f"LOADTEST_USER_SCALE must be > 0, got {scale}")
    return scale


class ScaledShape(LoadTestShape):
    """Base of the shapes here: nominal time and user counts, scaled by the variables above."""

    abstract = True  # never picked by Locust itself

    spawn_rate: float = 20.0
    """Users started or stopped per nominal second when the target count changes."""

    def nominal_s(self) -> float:
        """Length of the shape in nominal seconds (at LOADTEST_TIME_SCALE=1)."""
        raise NotImplementedError

    def users_at(self, t: float) -> float:
        """Nominal user count at nominal time t (0 <= t < nominal_s()); tick() scales and rounds it."""
        raise NotImplementedError

    def scale(self) -> float:
        """Real seconds per nominal second (LOADTEST_DURATION_S wins over LOADTEST_TIME_SCALE)."""
        duration = os.environ.get("LOADTEST_DURATION_S")
        if duration:
            if float(duration) <= 0:
                raise ValueError(f"LOADTEST_DURATION_S must be > 0, got {duration}")
            return float(duration) / self.nominal_s()
        return time_scale()

    def tick(self):
        scale = self.scale()
        t = self.get_run_time() / scale
        if t >= self.nominal_s():
            return None  # the shape is over: Locust stops the test
        users = max(1, math.floor(self.users_at(t) * user_scale() + 0.5))  # half up
        return users, self.spawn_rate / scale


def load_shape(name: str) -> type[ScaledShape]:
    """The shape class of module `name` (one of SHAPES)."""
    if name not in SHAPES:
        raise ValueError(f"unknown load shape {name!r}: choose one of {', '.join(SHAPES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, ScaledShape) and not v.abstract and v.__module__ == module.__name__]
    if len(found) != 1:
        raise ValueError(f"{module.__name__} must define exactly one shape class, found {len(found)}")
    return found[0]
