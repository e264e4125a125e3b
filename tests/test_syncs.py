"""Device-to-host reads per engine step are held to a budget that does not grow with the batch."""

import pytest

from conftest import make_tokenizer
from serve_app.config import EngineConfig
from serve_app.engine import syncs
from serve_app.engine.policy import FixedK
from serve_app.engine.scheduler import Engine
from serve_app.engine.syncs import STEP_BUDGET_PER_POSITION
from serve_app.engine.worker import ModelWorker


def reads_per_step(target, draft, batch: int, k: int) -> float:
    """Host reads per engine step, in steady decoding, over a batch mixing greedy, seeded and sampled rows."""
    cfg = EngineConfig(policy=f"fixed:{k}", max_batch_size=batch, max_k=max(k, 1))
    engine = Engine(ModelWorker(target, "target"), ModelWorker(draft, "draft") if k else None, make_tokenizer(), cfg, FixedK(k))
    return syncs.reads_per_step(engine, [list(range(3, 9 + i)) for i in range(batch)], max_tokens=40)


@pytest.mark.parametrize("k", [0, 4])
def test_host_reads_per_step_stay_within_budget_at_any_batch_size(tiny_target, tiny_drafts, k):
    """Counted on the CPU (every read counts: an upper bound of a GPU's syncs), at batch 3 and 24. Before
    rows were partitioned on the host, k = 4 took 113-125 reads a step (k = 0: 16-23), growing with the batch; now 31-33 (k = 0: 7)."""
    budget = STEP_BUDGET_PER_POSITION * (k + 1)
    small, large = (reads_per_step(tiny_target, tiny_drafts["near"], b, k) for b in (3, 24))
    assert small <= budget and large <= budget, (small, large, budget)
    assert large <= small + 2 * (k + 1), (small, large)  # not per row: acceptance may walk a position more
