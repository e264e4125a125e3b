"""What every profiling pass shares: the engine it measures on and its visit at one k.

The latency grid (profiler.py), the context axis (context.py) and the startup profile (startup.py) all time
steps the same way; this module sits below them so none of them has to import another for it.
"""

from __future__ import annotations

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


def visit(engine: Engine, policy: Policy, seen: list[StepStats]) -> tuple[StepStats, StepStats]:
    """Set `policy` (its k) on `engine` and run two steps; return both steps' stats: (switch, kept).

    The first step at a new k is not what staying at k costs: it pays for the switch (after a k = 0 visit the
    draft first feeds the tokens it skipped) and for a shape's first call, so a cell drops it and records the
    second, the cost a policy that stays at k pays every step. `seen` is the list the engine's `on_step`
    appends each step's stats to."""
    engine.policy = policy
    engine.step()
    switch = seen[-1]
    engine.step()
    return switch, seen[-1]
