"""`specserve bench batching`: continuous batching at scale, measured the way the issue states it.

Three scenarios, each printed with its target:

A. Long prompt while decoding (through `specserve serve`, streaming chat requests, as a user sees it).
   `streams` clients each keep one streaming chat request in flight (everyday chat prompts, max_tokens
   at the service's limit; a stream that ends is replaced by the next prompt at once, counted as a
   restart). Once every stream is decoding, `baseline_s` seconds are recorded, then one chat request
   with a ~`long_tokens`-token prompt arrives. Reported: the streams' median gap between text chunks
   before it arrived, their largest gap from its arrival until its first token + `after_s`, the ratio
   (target <= 3x) and the long prompt's time to first token (target <= 20 s). A gap is the time between
   two chunks of one request, so it is what a reader of that stream waits; a chunk holds the tokens
   one engine step accepted for it.
B. Shared system prompt (through two services in turn: prefix caching on, then `--no-prefix-caching`).
   `requests` greedy chat requests share a ~`system_tokens`-token system prompt and ask different short
   questions, one after the other (each when the previous finished). Reported: TTFT of requests 2..N
   relative to the first (median and largest; target <= 0.3x) on both services, the cached prompt
   tokens from `usage.prompt_tokens_details.cached_tokens`, and whether the answers of both services
   are identical (in bfloat16 a near-tie can flip between two chunkings of the same prompt: run with
   `--dtype float32` for a strict comparison).
C. Budget curve (IN PROCESS: an Engine over the loaded models, no Ray, no HTTP, so it is quick and
   isolates the scheduler's trade-off). For every per-step token budget (`max_num_batched_tokens`),
   the same workload as A on a fresh engine: `streams` short requests (EOS ignored) decode, then the
   long prompt arrives. A stream's token times are the ends of the steps that gave it tokens. Reported
   per budget: the long prompt's TTFT, the streams' median gap before it arrived and their median and
   largest gap while it prefilled, the steps to its first token and the most tokens any step
   scheduled (StepStats.scheduled_tokens). The PNG plots TTFT against the largest gap, one point per
   budget. A long prompt that gets no first token within `max_wait_s` is reported as such (a budget
   the decoding rows fill completely leaves no room for prefill).

Services run one at a time, each a `specserve serve` subprocess on free ports, warmed up (a few short
requests and a medium prompt of other text) before anything is timed; C runs after they stopped.
Prompts are real text: the prompt sets (serve_app/bench/prompt_sets.py) and the distillation seed
prompts as material for the long documents, each scenario's document from a different part of it so
no two share a cached prefix beyond the chat template's first block.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm import tqdm

from serve_app.bench.prompt_sets import BENCH_PROMPTS, CREATIVE_PROMPTS, PROFILE_PROMPTS, STRUCTURED_PROMPTS
from serve_app.bench.service import service
from serve_app.config import EngineConfig, ModelConfig, SamplingParams

SCENARIOS = ("A", "B", "C")
TARGETS = {"A_ratio": 3.0, "A_ttft_s": 20.0, "B_ratio": 0.3}
"""The issue's targets: A's largest gap / median gap, A's long-prompt TTFT, B's TTFT ratio."""
LONG_PROMPT_TASK = ("Here is a list of questions people sent to a help desk last week.\n\n{doc}\n\n"
                    "Group them by topic and name the three most common topics.")
SYSTEM_PROMPT = ("You are the help desk assistant of a large public library. For reference, here are "
                 "questions visitors asked before:\n\n{doc}\n\nAnswer the visitor's question in two or three sentences.")
WARMUP_TASK = "Read these notes and say which one is the shortest.\n\n{doc}"
DOC_START = {"A": 0, "B": 1500, "warmup": 3500}
"""Where in the material each scenario's document starts: no two documents share a prefix."""


class BatchingBench(BaseModel):
    """What `bench batching` runs (full scale by default; `quick()` for a smoke run)."""

    model_config = ConfigDict(extra="forbid")

    scenarios: list[str] = list(SCENARIOS)
    """Which of A, B, C to run."""
    policy: str = "adaptive"
    """Speculation policy of the service (A, B) and the engine (C); `specserve serve`'s default."""
    batch_size: int = Field(32, ge=2)
    """max_batch_size of the service and of C's engines: at least streams + 1 (the long prompt needs a slot)."""
    max_num_batched_tokens: int = Field(EngineConfig.model_fields["max_num_batched_tokens"].default, ge=1)
    """The services' per-step token budget (A, B); C sweeps `budgets`."""
    streams: int = Field(16, ge=1)
    """A, C: requests decoding when the long prompt arrives."""
    long_tokens: int = Field(2000, ge=32)
    """A, C: tokens of the long prompt (chat template included), about."""
    baseline_s: float = Field(10.0, gt=0)
    """A: seconds of decoding recorded before the long prompt arrives."""
    after_s: float = Field(2.0, ge=0)
    """A: the window for the largest gap runs until the long prompt's first token + this."""
    system_tokens: int = Field(1500, ge=32)
    """B: tokens of the shared system prompt, about."""
    requests: int = Field(16, ge=2)
    """B: requests sharing it, sent one after the other."""
    max_tokens: int = Field(48, ge=1)
    """B: tokens per answer (greedy)."""
    budgets: list[int] = [48, 64, 96, 128, 192, 256, 512, 2048]
    """C: per-step token budgets (max_num_batched_tokens), each at least batch_size."""
    rounds: int = Field(1, ge=1)
    """C: rounds over all budgets (order rotated per round); medians over rounds."""
    baseline_steps: int = Field(4, ge=1)
    """C: decode steps of all streams before the long prompt arrives."""
    after_steps: int = Field(2, ge=0)
    """C: steps after the long prompt's first token still in its window."""
    max_wait_s: float = Field(180.0, gt=0)
    """A, C: give up waiting for the long prompt's first token after this long."""
    port: int = Field(0, ge=0, le=65535)
    """HTTP port of the services; 0: a free one."""

    @field_validator("scenarios")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        v = [s.strip().upper() for s in v if s.strip()]
        if not v or not set(v) <= set(SCENARIOS):
            raise ValueError(f"scenarios: a subset of {','.join(SCENARIOS)}, got {v!r}")
        return [s for s in SCENARIOS if s in v]

    @model_validator(mode="after")
    def _fits(self) -> "BatchingBench":
        if self.batch_size < self.streams + 1:
            raise ValueError(f"batch_size ({self.batch_size}) must be at least streams + 1 ({self.streams + 1}): "
                             "the long prompt needs a slot beside the decoding streams")
        small = [b for b in self.budgets if b < self.batch_size]
        if "C" in self.scenarios and (not self.budgets or small):
            raise ValueError(f"budgets must each be at least batch_size ({self.batch_size}); got {small or 'none'}")
        return self

    @classmethod
    def quick(cls, **overrides) -> "BatchingBench":
        """A smoke run (QUICK): few streams, short prompts, two budgets (minutes on a 2-core CPU)."""
        return cls(**{**QUICK, **overrides})


QUICK = {"batch_size": 8, "streams": 4, "long_tokens": 300, "baseline_s": 3.0, "after_s": 1.0, "system_tokens": 200,
         "requests": 4, "max_tokens": 16, "budgets": [16, 256], "baseline_steps": 2, "after_steps": 1, "max_wait_s": 60.0}
"""`--quick`: the settings a smoke run (and its test) changes."""


# ---- prompts ---------------------------------------------------------------------------------
def material() -> list[str]:
    """Real request texts to build long documents from: the evaluation and profile prompt sets, then
    the distillation seed prompts (thousands of distinct questions)."""
    from serve_app.drafting.distill import seed_prompts

    return [*BENCH_PROMPTS, *CREATIVE_PROMPTS, *STRUCTURED_PROMPTS, *PROFILE_PROMPTS, *seed_prompts(0)]


def document(tokenizer, task: str, n_tokens: int, start: int) -> str:
    """`task` with {doc} filled by numbered questions from material()[start:] until the whole user message,
    as a chat prompt, has about n_tokens tokens."""
    from serve_app.prompts import encode_chat

    texts = material()
    lines: list[str] = []
    have = len(encode_chat(tokenizer, [{"role": "user", "content": task.format(doc="")}]))
    i = start
    while have < n_tokens:
        line = f"{len(lines) + 1}. {texts[i % len(texts)]}"
        have += len(tokenizer.encode(line + "\n", add_special_tokens=False))
        lines.append(line)
        i += 1
    return task.format(doc="\n".join(lines))


@dataclass
class Prompts:
    shorts: list[str]
    """A, C: the streams' user messages."""
    long: str
    """A, C: the long prompt's user message."""
    system: str
    """B: the shared system prompt."""
    questions: list[str]
    """B: the user questions, one per request."""
    warmup: str
    """A medium prompt of other text, to warm a service up."""


def make_prompts(tokenizer, cfg: BatchingBench) -> Prompts:
    shorts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(max(cfg.streams, len(BENCH_PROMPTS)))]
    questions = [STRUCTURED_PROMPTS[i % len(STRUCTURED_PROMPTS)] for i in range(cfg.requests)]
    return Prompts(shorts=shorts, long=document(tokenizer, LONG_PROMPT_TASK, cfg.long_tokens, DOC_START["A"]),
                   system=document(tokenizer, SYSTEM_PROMPT, cfg.system_tokens, DOC_START["B"]), questions=questions,
                   warmup=document(tokenizer, WARMUP_TASK, min(600, cfg.long_tokens), DOC_START["warmup"]))


# ---- gaps ------------------------------------------------------------------------------------
def gaps(times: list[float]) -> list[tuple[float, float]]:
    """(start, end) of the waits between consecutive arrivals."""
    return list(zip(times, times[1:]))


def gaps_within(streams: list[list[float]], lo: float, hi: float) -> list[float]:
    """Gap lengths that lie wholly in [lo, hi]."""
    return [b - a for t in streams for a, b in gaps(t) if a >= lo and b <= hi]


def gaps_overlapping(streams: list[list[float]], lo: float, hi: float) -> list[float]:
    """Gap lengths that overlap (lo, hi): a reader was waiting at some moment of it."""
    return [b - a for t in streams for a, b in gaps(t) if b > lo and a < hi]


def stall_summary(streams: list[list[float]], base_lo: float, arrival: float, window_hi: float) -> dict:
    """The streams' median gap before `arrival` (from base_lo) and their gaps over (arrival, window_hi)."""
    before = gaps_within(streams, base_lo, arrival)
    during = gaps_overlapping(streams, arrival, window_hi)
    med = statistics.median(before) if before else None
    worst = max(during) if during else None
    return {"baseline_gap_ms": 1e3 * med if med is not None else None, "baseline_gaps": len(before),
            "prefill_gap_ms": {"median": 1e3 * statistics.median(during), "max": 1e3 * worst} if during else None,
            "prefill_gaps": len(during), "ratio": worst / med if med and worst is not None else None}


# ---- C: in process ---------------------------------------------------------------------------
def run_budget(engine, shorts: list[list[int]], long: list[int], baseline_steps: int = 4, after_steps: int = 2,
               max_wait_s: float = 180.0) -> dict:
    """One budget's run on a fresh engine: the short streams decode, the long prompt arrives, steps until its
    first token (or max_wait_s) + after_steps. Token times are the ends of the steps that produced them."""
    steps = []
    engine.on_step.append(steps.append)
    room = engine.max_model_len - max(len(p) for p in shorts) - 1
    streams = [engine.submit(p, SamplingParams(max_tokens=room, ignore_eos=True)) for p in shorts]
    times: dict[str, list[float]] = {r.id: [] for r in streams}

    def step() -> None:
        outs = engine.step()
        now = time.perf_counter()
        for req, out in outs:
            if out.token_ids and req.id in times:
                times[req.id].append(now)

    t0 = time.perf_counter()
    while any(not r.output_ids for r in streams) and time.perf_counter() - t0 < max_wait_s:
        step()
    base_lo = time.perf_counter()  # every stream decoding: the baseline's gaps end at the next steps
    for _ in range(baseline_steps + 1):
        step()
    first_step = len(steps)
    arrival = time.perf_counter()
    lreq = engine.submit(long, SamplingParams(max_tokens=after_steps + 1, ignore_eos=True))
    while not lreq.output_ids and time.perf_counter() - arrival < max_wait_s:
        step()
    got = bool(lreq.output_ids)
    window = steps[first_step:]
    for _ in range(after_steps):
        step()
    hi = time.perf_counter()
    for r in [*streams, lreq]:
        engine.abort(r)
    return {"ttft_s": lreq.stats.ttft_s if got else None, "long_prompt_tokens": len(long),
            "steps_to_first_token": len(window) if got else None,
            **stall_summary(list(times.values()), base_lo, arrival, hi),
            "max_scheduled_tokens": max(st.scheduled_tokens for st in steps), "steps": len(steps),
            "prefill_steps": sum(st.prefill_tokens > 0 for st in window),
            "step_fields": STEP_FIELDS, "steps_from_arrival": [_step_row(st) for st in steps[first_step:]],
            "k": sorted({st.k for st in window if st.batch_size})}


STEP_FIELDS = ["scheduled_tokens", "prefill_tokens", "batch_size", "k", "draft_ms", "verify_ms", "other_ms"]
"""C: what each step from the long prompt's arrival on records (`steps_from_arrival`), in this order."""


def _step_row(st) -> list:
    return [st.scheduled_tokens, st.prefill_tokens, st.batch_size, st.k,
            round(1e3 * st.draft_s, 1), round(1e3 * st.verify_s, 1), round(1e3 * st.other_s, 1)]


def budget_curve(make_engine: Callable[[int], object], shorts: list[list[int]], long: list[int], budgets: list[int],
                 rounds: int = 1, baseline_steps: int = 4, after_steps: int = 2, max_wait_s: float = 180.0,
                 bar: tqdm | None = None) -> list[dict]:
    """C: one row per budget, medians over rounds (budget order rotated per round). make_engine(budget)
    returns a fresh Engine with that max_num_batched_tokens."""
    from serve_app.bench.rounds import rotated

    runs: dict[int, list[dict]] = {b: [] for b in budgets}
    for r in range(rounds):
        for b in rotated(list(budgets), r):
            if bar is not None:
                bar.set_postfix_str(f"round {r + 1}/{rounds}: budget {b}")
            runs[b].append(run_budget(make_engine(b), shorts, long, baseline_steps, after_steps, max_wait_s))
            if bar is not None:
                bar.update(1)
    return [_budget_row(b, runs[b]) for b in budgets]


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _budget_row(budget: int, runs: list[dict]) -> dict:
    during = [r["prefill_gap_ms"] for r in runs]
    return {"budget": budget, "ttft_s": _median([r["ttft_s"] for r in runs]),
            "no_first_token": sum(r["ttft_s"] is None for r in runs),
            "baseline_gap_ms": _median([r["baseline_gap_ms"] for r in runs]),
            "prefill_gap_ms": {"median": _median([d["median"] for d in during if d]),
                               "max": _median([d["max"] for d in during if d])},
            "ratio": _median([r["ratio"] for r in runs]),
            "steps_to_first_token": _median([r["steps_to_first_token"] for r in runs]),
            "max_scheduled_tokens": max(r["max_scheduled_tokens"] for r in runs),
            "rounds": runs}


def curve_markdown(rows: list[dict], streams: int, long_tokens: int, max_wait_s: float) -> str:
    lines = [f"## C. Budget curve (in process): {streams} streams decoding, one {long_tokens}-token prompt arrives", "",
             "Per budget (max_num_batched_tokens), a fresh engine; gaps are between the steps that gave a stream "
             "tokens; medians over rounds.", "",
             "| budget | long prompt TTFT s | steps to it | median gap before ms | median / max gap while it prefilled ms "
             "| max / median before | most tokens in a step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = f"{r['ttft_s']:.2f}" if r["ttft_s"] is not None else f"none in {max_wait_s:g} s"
        d = r["prefill_gap_ms"]
        during = f"{d['median']:.0f} / {d['max']:.0f}" if d["max"] is not None else "-"
        lines.append(f"| {r['budget']} | {ttft} | {_fmt(r['steps_to_first_token'], '.0f')} | "
                     f"{_fmt(r['baseline_gap_ms'], '.0f')} | {during} | {_fmt(r['ratio'], '.1f', 'x')} | "
                     f"{r['max_scheduled_tokens']} |")
    return "\n".join(lines) + "\n"


def _fmt(x, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{format(x, spec)}{unit}"


def plot_curve(rows: list[dict], path: str | Path, title: str) -> Path | None:
    """TTFT of the long prompt (x) against the streams' largest and median gap while it prefilled (y), one
    point per budget, labelled with it. None when matplotlib is missing or no budget got a first token."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r["ttft_s"] is not None and r["prefill_gap_ms"]["max"] is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    xs = [r["ttft_s"] for r in pts]
    ax.plot(xs, [r["prefill_gap_ms"]["max"] for r in pts], "o-", color="#C44E52", label="largest gap while it prefilled")
    ax.plot(xs, [r["prefill_gap_ms"]["median"] for r in pts], "s--", color="#4C72B0", mfc="none",
            label="median gap while it prefilled")
    base = _median([r["baseline_gap_ms"] for r in pts])
    if base:
        ax.axhline(base, color="#8C8C8C", lw=1, ls=":", label=f"median gap before it arrived ({base:.0f} ms)")
    for r in pts:
        ax.annotate(str(r["budget"]), (r["ttft_s"], r["prefill_gap_ms"]["max"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 x 10^n
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("long prompt's time to first token (s)")
    ax.set_ylabel("running streams' gap between tokens (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- A and B: through the service -------------------------------------------------------------
@dataclass
class Stream:
    """One streamed chat request as the client saw it."""

    slot: int = -1
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    """Arrival times of the chunks that carried text."""
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


async def chat(client, url: str, model: str, messages: list[dict], max_tokens: int, rec: Stream) -> Stream:
    """Stream one greedy chat completion into rec (chunk times, text, usage)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    rec.sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            rec.usage = obj.get("usage") or rec.usage
            for choice in obj.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    rec.chunks.append(time.perf_counter())
                    rec.text += content
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    return rec


def _client(connections: int):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=httpx.Limits(max_connections=connections))


async def warm_up(url: str, model: str, prompts: Prompts, concurrency: int) -> None:
    """First forwards, allocations, thread pools: a wave of short requests, then a medium prompt."""
    async with _client(concurrency + 2) as client:
        await asyncio.gather(*(chat(client, url, model, [{"role": "user", "content": prompts.shorts[i]}], 8, Stream())
                               for i in range(concurrency)))
        await chat(client, url, model, [{"role": "user", "content": prompts.warmup}], 4, Stream())


async def long_while_decoding(url: str, model: str, prompts: Prompts, cfg: BatchingBench, stream_tokens: int,
                              bar: tqdm | None = None) -> dict:
    """A: `streams` slots keep a streaming request each in flight; baseline; the long prompt; its window."""
    def phase(text: str) -> None:
        if bar is not None:
            bar.set_postfix_str(text)
            bar.update(1)

    records: list[Stream] = []
    current: list[Stream | None] = [None] * cfg.streams
    async with _client(cfg.streams + 4) as client:
        async def slot(i: int) -> None:
            j = 0
            while True:
                rec = Stream(slot=i)
                records.append(rec)
                current[i] = rec
                text = prompts.shorts[(i + j * cfg.streams) % len(prompts.shorts)]
                await chat(client, url, model, [{"role": "user", "content": text}], stream_tokens, rec)
                j += 1

        def check(tasks) -> None:
            for t in tasks:
                if t.done():
                    t.result()  # a failed request fails the scenario

        tasks = [asyncio.create_task(slot(i)) for i in range(cfg.streams)]
        long = Stream()
        long_task = None
        try:
            start = time.perf_counter()
            while not all(r is not None and len(r.chunks) >= 2 for r in current):
                check(tasks)
                if time.perf_counter() - start > cfg.max_wait_s:
                    raise RuntimeError(f"the {cfg.streams} streams were not all decoding after {cfg.max_wait_s:g} s")
                await asyncio.sleep(0.05)
            phase("baseline")
            base_lo = time.perf_counter()
            await asyncio.sleep(cfg.baseline_s)
            check(tasks)
            phase("long prompt prefilling")
            ask = chat(client, url, model, [{"role": "user", "content": prompts.long}], 16, long)
            long_task = asyncio.create_task(ask)
            await asyncio.sleep(0)  # the task starts: long.sent is the arrival
            arrival = long.sent
            while not long.chunks and not long_task.done() and time.perf_counter() - arrival < cfg.max_wait_s:
                check(tasks)
                await asyncio.sleep(0.02)
            if long_task.done():
                long_task.result()
            phase("after its first token")
            await asyncio.sleep(cfg.after_s)
            check(tasks)
            hi = (long.chunks[0] + cfg.after_s) if long.chunks else time.perf_counter()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(long_task, 120)  # its usage (cached tokens) comes with its last chunk
    streams = [r.chunks for r in records]
    out = {"streams": cfg.streams, "restarts": len(records) - cfg.streams, "baseline_s": cfg.baseline_s,
           "ttft_s": long.ttft_s, "long_prompt_tokens": (long.usage or {}).get("prompt_tokens"),
           "long_cached_tokens": ((long.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
           **stall_summary(streams, base_lo, arrival, hi),
           "gaps": [[round(b - arrival, 3), round(1e3 * (b - a), 1), r.slot] for r in records for a, b in gaps(r.chunks)
                    if b >= base_lo],
           "window_s": [0.0, round(hi - arrival, 3)]}
    return out


async def shared_prefix(url: str, model: str, prompts: Prompts, max_tokens: int, bar: tqdm | None = None) -> list[dict]:
    """B: the requests one after the other; TTFT, answer and cached prompt tokens of each."""
    rows = []
    async with _client(2) as client:
        for q in prompts.questions:
            rec = await chat(client, url, model, [{"role": "system", "content": prompts.system},
                                                  {"role": "user", "content": q}], max_tokens, Stream())
            usage = rec.usage or {}
            rows.append({"ttft_s": rec.ttft_s, "text": rec.text, "prompt_tokens": usage.get("prompt_tokens"),
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
            if bar is not None:
                bar.update(1)
    return rows


def b_summary(rows: list[dict]) -> dict:
    first = rows[0]["ttft_s"]
    ratios = [r["ttft_s"] / first for r in rows[1:]]
    return {"first_ttft_s": first, "later_ttft_s": statistics.median(r["ttft_s"] for r in rows[1:]),
            "ratio": {"median": statistics.median(ratios), "max": max(ratios)},
            "cached_tokens": [r["cached_tokens"] for r in rows], "prompt_tokens": rows[0]["prompt_tokens"],
            "ttft_s": [r["ttft_s"] for r in rows]}


def plot_timeline(a: dict, path: str | Path, title: str) -> Path | None:
    """A: every gap of every stream (end time, length), the long prompt's arrival and first token marked."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not a["gaps"]:
        return None
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    ax.scatter([g[0] for g in a["gaps"]], [g[1] for g in a["gaps"]], s=6, c="#4C72B0", alpha=0.6)
    ax.axvline(0.0, color="#C44E52", lw=1, label="long prompt arrives")
    if a["ttft_s"] is not None:
        ax.axvline(a["ttft_s"], color="#55A868", lw=1, label=f"its first token ({a['ttft_s']:.1f} s)")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the long prompt arrived (gap end)")
    ax.set_ylabel("gap between a stream's chunks (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- the whole benchmark ----------------------------------------------------------------------
def _serve_flags(mc: ModelConfig, cfg: BatchingBench, prefix_caching: bool) -> list[str]:
    flags = ["--target", mc.target, "--dtype", mc.dtype, "--device", mc.device, "--policy", cfg.policy,
             "--batch-size", str(cfg.batch_size), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if mc.draft is not None:
        flags += ["--draft", mc.draft]
    return flags + ([] if prefix_caching else ["--no-prefix-caching"])


def bench_batching(mc: ModelConfig, cfg: BatchingBench, profile=None, stem: str | Path | None = None) -> tuple[dict, str]:
    """Run the chosen scenarios; returns (results, markdown). profile: for a lut/adaptive policy in C
    (the services read theirs from profiles/). stem: where A's timeline PNG goes (stem-a.png)."""
    from serve_app.models import display_name, load_tokenizer

    tokenizer = load_tokenizer(mc.target)
    prompts = make_prompts(tokenizer, cfg)
    res: dict = {"target": display_name(mc.target), "draft": mc.draft, "dtype": mc.dtype, "device": mc.device,
                 "settings": cfg.model_dump(), "targets": TARGETS}
    md = [f"# bench batching: target {res['target']}, policy {cfg.policy}, dtype {mc.dtype}", ""]
    served = [s for s in ("A", "B") if s in cfg.scenarios]
    if served:
        res.update(_served(mc, cfg, prompts))
    if "A" in res:
        md.append(a_markdown(res["A"], cfg))
        if stem is not None:
            png = plot_timeline(res["A"], f"{stem}-a.png", f"A: {cfg.streams} streams, a {res['A']['long_prompt_tokens']}-"
                                f"token prompt arrives (budget {cfg.max_num_batched_tokens})")
            res["A"]["plot"] = str(png) if png else None
        res["A"].pop("gaps")  # thousands of points: the plot shows them, the results keep the summary
    if "B" in res:
        md.append(b_markdown(res["B"], cfg))
    if "C" in cfg.scenarios:
        res["C"] = _curve(mc, cfg, prompts, profile)
        md.append(curve_markdown(res["C"]["rows"], cfg.streams, res["C"]["long_prompt_tokens"], cfg.max_wait_s))
    return res, "\n".join(md)


def _served(mc: ModelConfig, cfg: BatchingBench, prompts: Prompts) -> dict:
    """A and B on a service with prefix caching; B again on one without."""
    from deployments.config import AppConfig

    out: dict = {}
    runs = [True] + ([False] if "B" in cfg.scenarios else [])
    phases = 2 * len(runs) + 3 * ("A" in cfg.scenarios) + cfg.requests * len(runs) * ("B" in cfg.scenarios)
    b_rows: dict[bool, list[dict]] = {}
    with tqdm(total=phases, desc="bench batching (service)", unit="step") as bar:
        for caching in runs:
            bar.set_postfix_str(f"starting specserve serve{'' if caching else ' --no-prefix-caching'}")
            with service(_serve_flags(mc, cfg, caching), cfg.port) as (url, model):
                bar.update(1)
                bar.set_postfix_str("warm-up")
                asyncio.run(warm_up(url, model, prompts, min(cfg.streams, 4)))
                bar.update(1)
                if caching and "A" in cfg.scenarios:
                    limit = AppConfig.model_fields["max_tokens_limit"].default  # the streams run until cancelled
                    out["A"] = asyncio.run(long_while_decoding(url, model, prompts, cfg, limit, bar))
                if "B" in cfg.scenarios:
                    bar.set_postfix_str(f"B: shared system prompt, prefix caching {'on' if caching else 'off'}")
                    b_rows[caching] = asyncio.run(shared_prefix(url, model, prompts, cfg.max_tokens, bar))
    if b_rows:
        on, off = b_rows[True], b_rows[False]
        same = [a["text"] == b["text"] for a, b in zip(on, off)]
        out["B"] = {"requests": cfg.requests, "max_tokens": cfg.max_tokens, "caching": b_summary(on),
                    "no_caching": b_summary(off), "identical": sum(same),
                    "differing": [i for i, s in enumerate(same) if not s],
                    "texts": {"caching": [r["text"] for r in on], "no_caching": [r["text"] for r in off]}}
    return out


def _curve(mc: ModelConfig, cfg: BatchingBench, prompts: Prompts, profile) -> dict:
    import dataclasses

    from serve_app.engine.policy import make_policy
    from serve_app.engine.scheduler import Engine
    from serve_app.models import load_models
    from serve_app.prompts import encode_chat

    if cfg.policy == "none":
        mc = mc.model_copy(update={"draft": "none"})
    models = load_models(mc)
    if cfg.policy == "none":
        models = dataclasses.replace(models, draft=None)
    chat = lambda text: encode_chat(models.tokenizer, [{"role": "user", "content": text}])
    shorts = [chat(t) for t in prompts.shorts[: cfg.streams]]
    long = chat(prompts.long)

    def make_engine(budget: int) -> Engine:
        ec = EngineConfig(policy=cfg.policy, max_batch_size=cfg.batch_size, max_num_batched_tokens=budget)
        return Engine.from_models(models, ec, make_policy(cfg.policy, profile))

    with tqdm(total=len(cfg.budgets) * cfg.rounds + 1, desc="bench batching (C, in process)", unit="run") as bar:
        bar.set_postfix_str("warm-up")
        run_budget(make_engine(max(cfg.budgets)), shorts[:2], long, 1, 0, cfg.max_wait_s)
        bar.update(1)
        rows = budget_curve(make_engine, shorts, long, cfg.budgets, cfg.rounds, cfg.baseline_steps, cfg.after_steps,
                            cfg.max_wait_s, bar)
    return {"streams": cfg.streams, "long_prompt_tokens": len(long), "short_prompt_tokens": [len(p) for p in shorts],
            "rounds": cfg.rounds, "rows": rows}


def a_markdown(a: dict, cfg: BatchingBench) -> str:
    d = a["prefill_gap_ms"] or {}
    ratio_ok = a["ratio"] is not None and a["ratio"] <= TARGETS["A_ratio"]
    ttft_ok = a["ttft_s"] is not None and a["ttft_s"] <= TARGETS["A_ttft_s"]
    lines = [f"## A. Long prompt while decoding (specserve serve, budget {cfg.max_num_batched_tokens}, batch "
             f"{cfg.batch_size})", "",
             f"{cfg.streams} streaming chat requests decode; after {cfg.baseline_s:g} s of baseline a "
             f"{a['long_prompt_tokens']}-token chat prompt arrives ({a['long_cached_tokens']} of its tokens cached). "
             f"Gaps between a stream's chunks, client side; the window runs to its first token + {cfg.after_s:g} s.", "",
             "| median gap before ms | median / largest gap in the window ms | largest / median (target <= 3x) "
             "| long prompt TTFT s (target <= 20 s) |", "|---|---|---|---|",
             f"| {_fmt(a['baseline_gap_ms'], '.0f')} ({a['baseline_gaps']} gaps) | "
             f"{_fmt(d.get('median'), '.0f')} / {_fmt(d.get('max'), '.0f')} ({a['prefill_gaps']} gaps) | "
             f"{_fmt(a['ratio'], '.1f', 'x')} {'PASS' if ratio_ok else 'FAIL'} | "
             f"{_fmt(a['ttft_s'], '.2f')} {'PASS' if ttft_ok else 'FAIL'} |", "",
             f"Streams restarted after ending (EOS): {a['restarts']}."]
    return "\n".join(lines) + "\n"


def b_markdown(b: dict, cfg: BatchingBench) -> str:
    lines = [f"## B. Shared system prompt (specserve serve, {b['requests']} requests one after another, greedy, "
             f"{b['max_tokens']} tokens each)", "",
             f"A {b['caching']['prompt_tokens']}-token prompt (system prompt + question); TTFT of requests 2-"
             f"{b['requests']} relative to the first, on a service with prefix caching and on one without.", "",
             "| service | TTFT first s | TTFT later s (median) | later / first: median (largest) | cached tokens, later (median) |",
             "|---|---|---|---|---|"]
    for name, key in (("prefix caching", "caching"), ("--no-prefix-caching", "no_caching")):
        s = b[key]
        cached = statistics.median(c or 0 for c in s["cached_tokens"][1:])
        mark = lambda x: (" PASS" if x <= TARGETS["B_ratio"] else " FAIL") if key == "caching" else ""
        lines.append(f"| {name} | {s['first_ttft_s']:.2f} | {s['later_ttft_s']:.2f} | {s['ratio']['median']:.2f}x"
                     f"{mark(s['ratio']['median'])} ({s['ratio']['max']:.2f}x{mark(s['ratio']['max'])}) | {cached:.0f} |")
    differing = ", ".join(str(i + 1) for i in b["differing"])
    lines += ["", f"Answers identical with and without prefix caching: {b['identical']}/{b['requests']}"
              + (f" (differing: requests {differing}; in bfloat16 a near-tie can flip between two chunkings of "
                 "the same prompt, --dtype float32 compares strictly)." if differing else ".")]
    return "\n".join(lines) + "\n"
