"""Counting device-to-host synchronizations: every read of a tensor's values by the host (`.item()`,
`.tolist()`, `.cpu()`, `bool(t)`, `nonzero`, ...) waits for the device's queued work, so on a GPU each one
stalls the stream. `SyncCounter` counts them by call site while it is active; on a CUDA device only reads
of CUDA tensors count, on a CPU every read does (an upper bound: some read tensors that never left the host).
The engine's budget (tests/test_syncs.py): at most `STEP_BUDGET_PER_POSITION` x (k + 1) per engine step
whatever the batch size, since rows are partitioned on the host and only which rows accepted is read back."""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "__bool__", "__int__", "__float__", "__index__",
         "any", "all", "equal", "unique", "masked_select", "repeat_interleave"}
"""Tensor methods and functions whose result the host needs (any / all count only when `bool()` of their
result is taken: that is the read)."""

STEP_BUDGET_PER_POSITION = 9
"""Most host reads per engine step per speculated position (k + 1), for any batch size."""


class SyncCounter(TorchFunctionMode):
    """with SyncCounter() as c: ...; c.total, c.sites[(name, file, line)]."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__()
        self.cuda_only = torch.device(device).type == "cuda"
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and name not in ("any", "all") and args and isinstance(args[0], torch.Tensor) \
                and (not self.cuda_only or args[0].is_cuda):
            import traceback

            frame = traceback.extract_stack(limit=2)[0]
            self.sites[(name, frame.filename.rsplit("/", 1)[-1], frame.lineno)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())


MIXED = ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9})
"""The row kinds the budget is measured over, in turn: greedy, seeded (the coupled sampler), sampled with top-p."""


def reads_per_step(engine, prompts: list[list[int]], max_tokens: int, device="cpu", steps: int = 4) -> float:
    """Host reads per engine step in steady decoding: `prompts` submitted as MIXED kinds in turn, run until all
    are admitted and prefilled (and one step more), then `steps` steps counted."""
    from serve_app.config import SamplingParams

    for i, p in enumerate(prompts):
        engine.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **MIXED[i % len(MIXED)]))
    while engine.waiting or engine.prefilling:
        engine.step()
    engine.step()
    with SyncCounter(device) as c:
        for _ in range(steps):
            engine.step()
    return c.total / steps
