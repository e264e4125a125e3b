"""Counting device-to-host synchronizations: every read of a tensor's values by the host (`.item()`,
`.tolist()`, `.cpu()`, `bool(t)`, `nonzero`, ...) waits for the device's queued work, so on a GPU each one
stalls the stream, as does every explicit wait (`torch.cuda.synchronize`). `SyncCounter` counts both by call
site while it is active; on a CUDA device only reads of CUDA tensors count, on a CPU every read does (an upper
bound: some read tensors that never left the host). `WorkClock` times a worker's device work without waiting.
The engine's budget (tests/test_syncs.py): at most `STEP_BUDGET_PER_POSITION` x (k + 1) per engine step
whatever the batch size, since rows are partitioned on the host and only which rows accepted is read back."""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "__bool__", "__int__", "__float__", "__index__",
         "any", "all", "equal", "unique", "masked_select", "repeat_interleave"}
"""Tensor methods and functions whose result the host needs (any / all count only when `bool()` of their
result is taken: that is the read)."""

STEP_BUDGET_PER_POSITION = 9
"""Most host reads per engine step per speculated position (k + 1), for any batch size."""


WAITS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"))
"""Explicit waits for the device, counted as reads are: the host stalls until the queued work is done."""


class SyncCounter(TorchFunctionMode):
    """with SyncCounter() as c: ...; c.total, c.sites[(name, file, line)]: reads of device values and explicit
    waits (`torch.cuda.synchronize`, an event's or a stream's `synchronize`), by call site."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__()
        self.cuda_only = torch.device(device).type == "cuda"
        self.sites: Counter = Counter()
        self._waits: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and name not in ("any", "all") and args and isinstance(args[0], torch.Tensor) \
                and (not self.cuda_only or args[0].is_cuda):
            self._site(name, 3)
        return func(*args, **(kwargs or {}))

    def _site(self, name: str, depth: int) -> None:
        import traceback

        frame = traceback.extract_stack(limit=depth)[0]
        self.sites[(name, frame.filename.rsplit("/", 1)[-1], frame.lineno)] += 1

    def __enter__(self):
        for owner, attr in WAITS:  # looked up at each call (`torch.cuda.synchronize(...)`): wrapped while active
            real = getattr(owner, attr)
            self._waits.append((owner, attr, real))
            setattr(owner, attr, self._counted(real))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, attr, real in reversed(self._waits):
            setattr(owner, attr, real)
        self._waits.clear()
        return super().__exit__(*exc)

    def _counted(self, real):
        def wait(*args, **kwargs):
            self._site("synchronize", 3)
            return real(*args, **kwargs)
        return wait

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


class WorkClock:
    """Times a worker's device work by kind into its timings dict (`forward_s`, `sample_s`) without waiting for it.
    On a CPU the work is done when the call returns: wall clock, added at once. On CUDA a pair of events around
    it, read once the device has passed them (polled at each span's end, and all in `settle`, which `take_timings`
    calls: one wait there at most), so no forward ends in a `synchronize` of its own. A span of kind `head` (the
    output projection inside the acceptance walk's span) counts as forward time and comes out of sample time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []  # CUDA: (kind, start event, end event), oldest first

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, kind: str, start, timings: dict) -> None:
        if not self.cuda:
            self._add(kind, time.perf_counter() - start, timings)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.spans.append((kind, start, end))
        while self.spans and self.spans[0][2].query():  # done already: read without waiting
            self._read(self.spans.pop(0), timings)

    def settle(self, timings: dict) -> None:
        """Every span read into `timings` (waiting for the last one's end)."""
        if self.spans:
            self.spans[-1][2].synchronize()
            for span in self.spans:
                self._read(span, timings)
            self.spans.clear()

    def _read(self, span, timings: dict) -> None:
        kind, start, end = span
        self._add(kind, start.elapsed_time(end) / 1000, timings)

    @staticmethod
    def _add(kind: str, seconds: float, timings: dict) -> None:
        if kind == "head":
            timings["forward_s"] += seconds
            timings["sample_s"] -= seconds
        else:
            timings[kind] += seconds
