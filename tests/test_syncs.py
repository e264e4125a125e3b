"""Device-to-host reads per engine step are held to a budget that does not grow with the batch."""

import pytest
import torch

from conftest import make_tokenizer
from serve_app.config import EngineConfig
from serve_app.engine import syncs
from serve_app.engine.policy import FixedK
from serve_app.engine.scheduler import Engine
from serve_app.engine.syncs import STEP_BUDGET_PER_POSITION, SyncCounter
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
    # and at least one read per position (which rows accepted, or the next tokens): a counter that counted
    # nothing would pass the budget
    assert small >= k + 1 and large >= k + 1, (small, large)
    assert large <= small + 2 * (k + 1), (small, large)  # not per row: acceptance may walk a position more


def test_the_counter_counts_known_reads_by_call_site():
    t = torch.arange(6)
    with SyncCounter() as c:
        t[0].item()
        t.tolist()
        bool(t.sum())
        t.nonzero()
        t.cpu()
        t + 1  # no read: stays on the device
        (t > 2).any()  # no read until bool() of it
    assert c.total == 5, c.sites
    assert {name for name, _, _ in c.sites} == {"item", "tolist", "__bool__", "nonzero", "cpu"}
    assert all(file == "test_syncs.py" for _, file, _ in c.sites)
    with SyncCounter("cuda") as c:  # on a GPU only reads of GPU tensors stall the stream: host tensors do not count
        t.tolist()
    assert c.total == 0
