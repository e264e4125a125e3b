"""What every profiling pass shares: the engine it measures on and its visit at one k.

The latency grid (profiler.py), the context axis (context.py) and the startup profile (startup.py) all time
steps the same way; this module sits below them so none of them has to import another for it.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from serve_app.config import EngineConfig
from serve_app.engine.policy import FixedK, Policy
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats
from serve_app.models import LoadedModels

BUDGET = EngineConfig.model_fields["max_num_batched_tokens"].default
"""The engine's per-step token budget: the chunked prefill is priced at it."""


def measuring_engine(models: LoadedModels, batch: int, max_k: int, need: int, budget: int = BUDGET,
                     max_model_len: int | None = None) -> Engine:
    """An engine to measure with: room for `batch` requests of up to `need` KV tokens each (prompt +
    max_tokens + max_k + 1) admitted at once, `budget` tokens a step, no prefix cache, k = 0 until set."""
    bs = EngineConfig.model_fields["block_size"].default
    pool = batch * (-(-need // bs) + 1) * bs  # whole blocks + the block of headroom admission keeps per request
    return Engine.from_models(models, EngineConfig(max_batch_size=batch, max_k=max_k, max_num_tokens=pool,
                                                   max_num_batched_tokens=max(budget, batch), prefix_caching=False,
                                                   max_model_len=max_model_len), FixedK(0))


class Visit(NamedTuple):
    """One visit at a k: its two steps' stats and the device work of the second (the one a cell records)."""

    switch: StepStats
    """The first step: pays for the switch to k and a shape's first call."""
    kept: StepStats
    """The second: what staying at k costs every step."""
    draft_device_s: float
    """Seconds of the draft worker's device work in the kept step (forwards and the vocabulary-sized work beside
    them, by its `WorkClock`: CUDA events on a GPU, so launch time the device hid is not in it)."""
    verify_device_s: float
    """Likewise, the target worker's."""


def device_seconds(engine: Engine) -> tuple[float, float]:
    """(draft, target) device work since the last call, from the workers' clocks (`take_timings`), which it resets."""
    def took(worker) -> float:
        t = worker.take_timings()
        return t["forward_s"] + t["sample_s"]
    return (took(engine.draft) if engine.draft is not None else 0.0), took(engine.target)


def visit(engine: Engine, policy: Policy, seen: list[StepStats]) -> Visit:
    """Set `policy` (its k) on `engine` and run two steps; return both steps' stats and the second's device work.

    The first step at a new k is not what staying at k costs: it pays for the switch (after a k = 0 visit the
    draft first feeds the tokens it skipped) and for a shape's first call, so a cell drops it and records the
    second, the cost a policy that stays at k pays every step. `seen` is the list the engine's `on_step`
    appends each step's stats to."""
    engine.policy = policy
    engine.step()
    switch = seen[-1]
    device_seconds(engine)  # drop what the first step (and anything before) accumulated
    engine.step()
    return Visit(switch, seen[-1], *device_seconds(engine))


def clock_of(engine: Engine) -> str:
    """How a grid measured on `engine` times its cells (`LatencyGrid.clock`): CUDA events on a GPU, where the host
    runs ahead of the device and its wall clock measures launches; the wall clock on a CPU, the host being the device."""
    return "events" if engine.target.device.type == "cuda" else "wall"


def part_s(v: Visit, part: str, clock: str) -> float:
    """One visit's `part` (`draft` or `verify`) in seconds: device work by the workers' clocks with `clock` = events,
    the host's wall clock around the engine's call otherwise."""
    return getattr(v, f"{part}_device_s") if clock == "events" else getattr(v.kept, f"{part}_s")


def part_ms(visits: list[Visit], part: str, clock: str) -> float:
    """The median of `part` over `visits` (`part_s`), in ms."""
    return round(statistics.median(part_s(v, part, clock) for v in visits) * 1000, 3)


def spread(values: list[float]) -> float:
    """How far repeated visits of one cell disagree: |median of the even-numbered visits - median of the odd| over
    the median of all (0 for fewer than two). A cell whose halves agree within 5% has been visited enough."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    gap = abs(statistics.median(values[0::2]) - statistics.median(values[1::2]))
    return gap / mid if mid > 0 else 0.0
