"""The price of a decoding step: what a profile measured, read the way the engine's policies and the cost model
need it. A floor below both: `profiling/` measures and stores these grids, `engine/` (lut, adaptive, budget),
calibration, the simulators and the replay's virtual clock read them.

`LatencyGrid`: a step's parts (draft, verification, the rest) over batch size x speculation length at one
context, with chunked-prefill prices; `ContextGrid` (its optional axis): how the draft and the verification grow
with the KV tokens each row attends. The goodput model: with per-token acceptance a, a step of speculation length
k generates E[tokens | a, k] = 1 + a + a^2 + ... + a^k tokens per sequence (each draft token is accepted only if all
before it were; one target token - recovered or bonus - always comes), so a step at batch size b yields b * E
tokens in step_ms(b, k).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


PAD_GROUP_CONTEXT = 256
"""The gather backend's grouping of decoding rows (`engine.attention.gather_layout`): rows whose contexts sit within
twice max(this, the group's shortest) share one padded attention call, padded to the group's longest; a longer row
opens the next group. The `padded` layout prices a step the way that pads it (`padded_context`)."""


def pad_groups(lengths: list[int]) -> list[list[int]]:
    """The indices of `lengths` (rows' contexts) in ascending order of length, split into the groups the gather
    backend pads together: a row longer than twice max(`PAD_GROUP_CONTEXT`, its group's shortest) opens the next."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and lengths[i] <= 2 * max(PAD_GROUP_CONTEXT, lengths[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_context(contexts) -> float:
    """KV tokens a row pays for, on the mean, when the gather backend pads each group of rows of alike context to its
    longest (`pad_groups`): three chat rows of 100 tokens beside one document of 1,700 pay (3 x 100 + 1,700) / 4
    = 500, not 1,700 each (one call would pad them all to it; the backend makes two)."""
    contexts = list(contexts)
    return sum(len(g) * contexts[g[-1]] for g in pad_groups(contexts)) / len(contexts)


class ContextGrid(BaseModel):
    """Step parts at several contexts: how the draft's and the verification's time grow with the KV tokens each
    row attends, per (batch size, k). The latency grid is measured at one (short) context; this grid scales
    its cells to the context a step really serves (`scale`), so calibration and the policies price context
    apart from the machine's own speed."""

    model_config = ConfigDict(extra="forbid")

    contexts: list[int] = Field(min_length=1)
    """Mean KV tokens per row (prompt + generated) in the recorded steps of each context measured, ascending."""
    batch_sizes: list[int] = Field(min_length=1)
    """Batch sizes measured, ascending."""
    ks: list[int] = Field(min_length=1)
    """Speculation lengths measured, ascending from 0."""
    draft_ms: list[list[list[float | None]]]
    """draft_ms[c][i][j]: the draft's time of a step at contexts[c], batch_sizes[i], ks[j] (None: not measured,
    e.g. a KV pool too small for that many long rows)."""
    verify_ms: list[list[list[float | None]]]
    """verify_ms[c][i][j]: the verification's time there."""
    layout: Literal["padded", "paged"] = "paged"
    """How attention pays for a batch of rows of different lengths: `paged` per row (a paged / flex kernel: the
    step's context is the rows' mean), `padded` at each group's longest row (the gather backend pads each group of
    alike contexts: `padded_context`)."""
    backend: str | None = None
    """The attention backend measured (`gather`, `flex`)."""
    clock: Literal["wall", "events"] = "wall"
    """How the draft and verification cells were timed: `wall`, the host's clock from call to return (on a CPU the
    host is the device); `events`, the workers' CUDA events around their device work (`WorkClock`), so a step's
    launch time the device hid behind its own work is not in them (`LatencyGrid` keeps the host's beside them)."""
    draft_excess: float = Field(1.0, gt=0)
    """What the draft's growth with context comes to on this machine, over this grid's (`scale`: a part at a context
    costs 1 + excess x (measured growth - 1) times its cell): set by calibration (`Calibration.context_factor`),
    1 as measured."""
    verify_excess: float = Field(1.0, gt=0)
    """The same for the verification."""

    @model_validator(mode="after")
    def _shape(self) -> "ContextGrid":
        for name, seq in (("contexts", self.contexts), ("batch_sizes", self.batch_sizes), ("ks", self.ks)):
            if seq != sorted(set(seq)) or seq[0] < (0 if name == "ks" else 1):
                raise ValueError(f"context grid: {name} must be ascending, distinct and positive")
        for name in ("draft_ms", "verify_ms"):
            cube = getattr(self, name)
            if len(cube) != len(self.contexts) or any(len(rows) != len(self.batch_sizes) or any(
                    len(r) != len(self.ks) for r in rows) for rows in cube):
                raise ValueError(f"context grid: {name} needs [contexts][batch sizes][ks] values")
        return self

    def context_of(self, contexts: list[int]) -> float:
        """The context a step of rows with these KV lengths is priced at: their mean (paged), or their mean as each
        group of alike contexts pads to its longest (padded)."""
        if not contexts:
            return 0.0
        return padded_context(contexts) if self.layout == "padded" else sum(contexts) / len(contexts)

    def at(self, part: str, batch_size: int, k: float, context: float) -> float | None:
        """A part's milliseconds at any (batch, k, context): between measured batch sizes and k linear, in the
        context a least-squares line through the measured contexts (never falling: more KV never makes a step
        cheaper). Attention's cost grows linearly in the KV tokens; a line through every context measured also
        averages each one's noise, where joining them point to point carried one slow spell into every price
        (this CPU's profile measured its shortest context's verification at twice the latency grid's own). One
        context measured: its value; None where none was (a KV pool too small for those rows)."""
        cube = getattr(self, f"{part}_ms")
        i0, i1, wb = _between(self.batch_sizes, batch_size)
        j0, j1, wk = _between(self.ks, k) if k > 0 else (0, 0, 0.0)
        cs, vs = [], []
        for c, rows in zip(self.contexts, cube):
            cells = [rows[i][j] for i in (i0, i1) for j in (j0, j1)]
            if any(v is None for v in cells):
                continue
            a, b, x, y = cells
            lo, hi = a + wk * (b - a), x + wk * (y - x)
            cs.append(c)
            vs.append(lo + wb * (hi - lo))
        if len(cs) < 2:
            return vs[0] if vs else None
        intercept, slope = line(cs, vs)
        value = intercept + slope * context if slope > 0 else sum(vs) / len(vs)  # a falling line: flat, its mean
        return max(value, 1e-3)

    def scale(self, part: str, batch_size: int, k: float, context: float | None, base: float | None) -> float:
        """How much longer (or shorter) a part takes at `context` than at `base` (the latency grid's own context),
        at this batch size and k: 1 where either is unknown."""
        if context is None or base is None or context <= 0:
            return 1.0
        # past the longest k measured the longest's ratio holds: extended in k, a short context's cells (whose
        # verification hardly grows with k and is noisy) reach near zero, and the ratio over them blows up (a
        # copy of 16 tokens at 1,024 tokens of context came out 500x its price)
        k = min(k, self.ks[-1])
        at, ref = self.at(part, batch_size, k, context), self.at(part, batch_size, k, base)
        if at is None or not ref or ref <= 0:
            return 1.0
        excess = self.draft_excess if part == "draft" else self.verify_excess
        return max(1.0 + excess * (at / ref - 1.0), 0.05)


class LatencyGrid(BaseModel):
    """Median step latency in milliseconds for every (batch size, k) measured."""

    model_config = ConfigDict(extra="forbid")

    batch_sizes: list[int] = Field(min_length=1)
    """Batch sizes measured, ascending (1, 2, 4, ... up to the max batch)."""
    ks: list[int] = Field(min_length=1)
    """Speculation lengths measured, ascending from 0."""
    draft_ms: list[list[float]]
    """draft_ms[i][j]: draft time of one step (propose ks[j] tokens, commit) at batch_sizes[i]."""
    verify_ms: list[list[float]]
    """verify_ms[i][j]: the target's verification forward of ks[j] + 1 tokens per sequence."""
    other_ms: list[list[float]]
    """other_ms[i][j]: the rest of the step (acceptance, bookkeeping, detokenizing)."""
    resume_ms: list[float] | None = None
    """resume_ms[i]: extra draft time of the first speculating step after steps at k = 0 (the draft
    feeds the tokens it skipped), over the steady-state cell; a switch cost, not part of the cells."""
    chunk_step_ms: list[float] | None = None
    """chunk_step_ms[i]: the fixed part of what prefilling in chunks adds to a step that decodes
    batch_sizes[i] sequences (at k = 0), whatever the chunk's length: the draft's own prefill forward,
    admission, bookkeeping. The engine's chunked prefill gives each step's budget
    (`EngineConfig.max_num_batched_tokens`) to the decoding rows first, the rest to prompt chunks;
    simulators add chunk_step_ms + chunk tokens x chunk_ms_per_token to the decode step's time."""
    chunk_ms_per_token: list[float] | None = None
    """chunk_ms_per_token[i]: the part per prompt token fed (the target's packed forward grows). Both are
    fitted to two measurements beside the decoding batch: a `chunk_prompt_tokens`-token prompt, and a
    prompt of a whole chunk (`chunk_budget` less the decoding rows), each prefilled in one step."""
    chunk_draft_step_ms: list[float] | None = None
    """chunk_draft_step_ms[i]: the draft's part of chunk_step_ms[i] (what an engine without a draft saves)."""
    chunk_draft_ms_per_token: list[float] | None = None
    """chunk_draft_ms_per_token[i]: the draft's part of chunk_ms_per_token[i]."""
    chunk_context_ms: list[float] | None = None
    """[per held token, per held token x chunk token]: what a prompt chunk pays for the KV its row already holds
    (its earlier chunks, a cached prefix), beyond the chunk price above (measured from context 0): a chunk of n
    tokens after s held adds s * (first + second * n) ms. Attention reads the held tokens once per chunk (the
    gather backend copies them) and once per chunk token. On this CPU a 128-token chunk after 2,700 tokens cost
    3.6x one at the start (`profiling.context.measure_chunk_context`). None: chunks priced as at context 0."""
    chunk_budget: int | None = Field(None, ge=1)
    """The step's token budget (`max_num_batched_tokens`) the chunk price was measured with."""
    chunk_prompt_tokens: int | None = Field(None, ge=1)
    """Length of the short prompt (a chat prompt's) the chunk price was measured with."""
    prefill_ms: list[float] | None = None
    """Profiles from before chunked prefill (and predicted ones): prefill_ms[i] is admitting
    batch_sizes[i] new requests of `prefill_tokens` prompt tokens each in a forward of their own (the
    target's forward over the prompts, the draft's prefill and first commit), over the k = 0 step the
    same engine step also ran. Simulators read it, per prompt token, where `chunk_ms_per_token` is absent."""
    prefill_tokens: int | None = Field(None, ge=1)
    """Mean prompt length, in tokens, of the requests `prefill_ms` admitted."""
    context_tokens: int | None = Field(None, ge=1)
    """Mean context (prompt + generated tokens) of the sequences in the recorded steps: step time
    grows with it, since attention reads every earlier token."""
    prefill_draft_ms: list[float] | None = None
    """prefill_draft_ms[i]: the draft's part of prefill_ms[i] (what an engine without a draft saves)."""
    copy_ks: list[int] | None = None
    """Speculation lengths past ks[-1] where the verification was measured too, ascending: a row copying its prompt
    (prompt lookup) drafts up to `max_copy_tokens` without a draft forward, and verifying that many tokens is not a
    line through k <= ks[-1] (on this CPU 17 tokens cost 6-21% more than the line through k <= 8 said). None: the
    line extends past ks[-1]."""
    copy_verify_ms: list[list[float]] | None = None
    """copy_verify_ms[i][j]: the verification's time at batch_sizes[i], copy_ks[j]."""
    clock: Literal["wall", "events"] = "wall"
    """How the draft and verification cells were timed: `wall`, the host's clock from call to return (on a CPU the
    host is the device); `events`, the workers' CUDA events around their device work (`WorkClock`), so a step's
    launch time the device hid behind its own work is not in them (the host's beside them: `host_draft_ms`)."""
    host_draft_ms: list[list[float]] | None = None
    """With `clock` = events: host_draft_ms[i][j] is the host's wall clock around the same steps' draft calls (the
    cells' device time plus what launching and waiting add). A cell far below its host time is launch-bound."""
    host_verify_ms: list[list[float]] | None = None
    """Likewise around the verification calls."""
    spread: list[list[float]] | None = None
    """spread[i][j]: how far repeated visits of the cell disagree, |median of the even rounds' - median of the odd
    rounds'| / median of all, over its draft + verification time (`profiling.measuring.spread`): the profiler visits
    until every cell is within its `--agree` or its `--max-reps` run out."""
    context: ContextGrid | None = None
    """The draft's and the verification's time at several contexts (`specserve profile --contexts`): the cells
    above are scaled from `context_tokens` to the context a step serves. None (older profiles): one context."""

    @model_validator(mode="after")
    def _shape(self) -> "LatencyGrid":
        for name, seq in (("batch_sizes", self.batch_sizes), ("ks", self.ks)):
            if seq != sorted(set(seq)) or seq[0] < (1 if name == "batch_sizes" else 0):
                raise ValueError(f"{name} must be ascending, distinct and >= {1 if name == 'batch_sizes' else 0}")
        if self.ks[0] != 0:
            raise ValueError("ks must start at 0 (plain decoding is the baseline every k is compared with)")
        if self.resume_ms is not None and (len(self.resume_ms) != len(self.batch_sizes) or min(self.resume_ms) < 0):
            raise ValueError(f"resume_ms needs one latency >= 0 per batch size {self.batch_sizes}")
        if self.prefill_ms is not None and (len(self.prefill_ms) != len(self.batch_sizes) or min(self.prefill_ms) < 0
                                            or self.prefill_tokens is None):
            raise ValueError(f"prefill_ms needs one latency >= 0 per batch size {self.batch_sizes}, and prefill_tokens")
        if self.prefill_draft_ms is not None and (self.prefill_ms is None or len(self.prefill_draft_ms) != len(self.prefill_ms)):
            raise ValueError("prefill_draft_ms needs prefill_ms and one latency per batch size")
        chunk = {name: getattr(self, name) for name in ("chunk_step_ms", "chunk_ms_per_token", "chunk_draft_step_ms",
                                                         "chunk_draft_ms_per_token")}
        if any(v is not None for v in chunk.values()):
            for name, v in chunk.items():
                if v is None and "draft" not in name:
                    raise ValueError(f"{name} is missing: the chunk price needs chunk_step_ms and chunk_ms_per_token")
                if v is not None and (len(v) != len(self.batch_sizes) or min(v) < 0):
                    raise ValueError(f"{name} needs one value >= 0 per batch size {self.batch_sizes}")
            if (chunk["chunk_draft_step_ms"] is None) != (chunk["chunk_draft_ms_per_token"] is None):
                raise ValueError("chunk_draft_step_ms and chunk_draft_ms_per_token come together")
        if self.chunk_context_ms is not None and (len(self.chunk_context_ms) != 2 or min(self.chunk_context_ms) < 0):
            raise ValueError("chunk_context_ms needs two values >= 0: ms per held token, per held token x chunk token")
        if (self.copy_ks is None) != (self.copy_verify_ms is None):
            raise ValueError("copy_ks and copy_verify_ms come together")
        if self.copy_ks is not None:
            if self.copy_ks != sorted(set(self.copy_ks)) or not self.copy_ks or self.copy_ks[0] <= self.ks[-1]:
                raise ValueError(f"copy_ks must be ascending, distinct and past the longest k {self.ks[-1]}")
            if len(self.copy_verify_ms) != len(self.batch_sizes) or any(
                    len(r) != len(self.copy_ks) or any(not v >= 0 for v in r) for r in self.copy_verify_ms):
                raise ValueError(f"copy_verify_ms needs {len(self.copy_ks)} latencies >= 0 (one per copy k) "
                                 f"per batch size {self.batch_sizes}")
        if self.clock == "wall" and (self.host_draft_ms is not None or self.host_verify_ms is not None):
            raise ValueError("host_draft_ms / host_verify_ms go with clock = events (wall-clock cells are the host's)")
        for name in ("draft_ms", "verify_ms", "other_ms", "host_draft_ms", "host_verify_ms", "spread"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != len(self.batch_sizes):
                raise ValueError(f"{name} has {len(rows)} rows for {len(self.batch_sizes)} batch sizes "
                                 f"{self.batch_sizes}: a batch size is missing")
            for b, row in zip(self.batch_sizes, rows):
                if len(row) != len(self.ks) or any(not v >= 0 for v in row):
                    raise ValueError(f"{name} at batch size {b} needs {len(self.ks)} latencies >= 0 (one per k)")
        return self

    def total_ms(self) -> list[list[float]]:
        """[batch size][k] whole-step latency: draft + verification + the rest."""
        return [[d + v + o for d, v, o in zip(*r)] for r in zip(self.draft_ms, self.verify_ms, self.other_ms)]

    def prefill_at(self, batch_size: int, prompt_tokens: int, draft: bool = True) -> float | None:
        """Milliseconds to admit `batch_size` requests with `prompt_tokens` prompt tokens in all (linear
        between measured batch sizes, scaled by prompt tokens), less the draft's part when there is no
        draft; None without a measured prefill."""
        if self.prefill_ms is None or self.prefill_tokens is None:
            return None
        ms = self.prefill_ms if draft or not self.prefill_draft_ms else \
            [max(t - d, 0.0) for t, d in zip(self.prefill_ms, self.prefill_draft_ms)]
        per_token = [m / (b * self.prefill_tokens) for b, m in zip(self.batch_sizes, ms)]
        return _interpolate(self.batch_sizes, per_token, batch_size) * prompt_tokens

    def chunk_ms(self, batch_size: int, prompt_tokens: int, draft: bool = True) -> float | None:
        """Milliseconds that prefilling `prompt_tokens` prompt tokens in chunks adds to a step decoding
        `batch_size` sequences: chunk_step_ms + tokens x chunk_ms_per_token (linear between measured
        batch sizes), less the draft's part when there is no draft; 0 for no tokens. Profiles from
        before chunked prefill: their per-token prefill price at that batch size (`prefill_at`, from
        a forward of its own). None when neither was measured."""
        if self.chunk_ms_per_token is None or self.chunk_step_ms is None:
            return self.prefill_at(batch_size, prompt_tokens, draft)
        if prompt_tokens <= 0:
            return 0.0
        fixed, per_token = self.chunk_step_ms, self.chunk_ms_per_token
        if not draft and self.chunk_draft_step_ms is not None and self.chunk_draft_ms_per_token is not None:
            fixed = [max(t - d, 0.0) for t, d in zip(fixed, self.chunk_draft_step_ms)]
            per_token = [max(t - d, 0.0) for t, d in zip(per_token, self.chunk_draft_ms_per_token)]
        return (_interpolate(self.batch_sizes, fixed, batch_size)
                + _interpolate(self.batch_sizes, per_token, batch_size) * prompt_tokens)

    def chunk_context_cost(self, chunks) -> float:
        """Milliseconds the chunks (KV tokens their row held, tokens fed) pay for what their rows held, beyond
        `chunk_ms` (`chunk_context_ms`); 0 where it was not measured."""
        if not self.chunk_context_ms:
            return 0.0
        per_held, per_pair = self.chunk_context_ms
        return sum(held * (per_held + per_pair * n) for held, n in chunks)

    def step_ms(self, batch_size: int, context: float | None = None) -> list[float]:
        """Step latency per k at any batch size: linear between measured sizes, extended beyond them; at
        `context` KV tokens per row (`ContextGrid.context_of`) where the grid has a context axis."""
        return [max(d + v + o, 1e-3) for d, v, o in zip(*self.parts_at(batch_size, context))]

    def parts_at(self, batch_size: int, context: float | None = None) -> tuple[list[float], list[float], list[float]]:
        """(draft, verify, other) milliseconds per k at any batch size, interpolated like `step_ms`; the draft
        and verification scaled to `context` (`context_scales`)."""
        i0, i1, w = _between(self.batch_sizes, batch_size)
        draft, verify, other = ([max(x0 + w * (x1 - x0), 0.0) for x0, x1 in zip(rows[i0], rows[i1])]
                                for rows in (self.draft_ms, self.verify_ms, self.other_ms))
        sd, sv = self.context_scales(batch_size, context)
        return [d * s for d, s in zip(draft, sd)], [v * s for v, s in zip(verify, sv)], other

    def step_context(self, contexts) -> float | None:
        """The context a step whose rows attend these KV lengths is priced at (their mean or longest, by the
        attention layout the context axis measured); None without an axis, its reference context, or rows."""
        if self.context is None or self.context_tokens is None or not contexts:
            return None
        return self.context.context_of(list(contexts))

    def part_at(self, part: str, batch_size: float, k: float, context: float | None = None) -> float:
        """One part's milliseconds (draft, verify, other) at any batch size and k (linear between the measured
        ones, k between its columns: a plan's mean drafted length, a startup profile's missing k), scaled to
        `context` where the grid has a context axis."""
        rows = getattr(self, f"{part}_ms")
        i0, i1, w = _between(self.batch_sizes, max(batch_size, 1))
        top = self.ks[-1]
        if k > top and part == "verify" and self.copy_ks is not None:  # a copy's verification, measured past top
            ks = [top] + self.copy_ks
            j0, j1, wk = _between(ks, k)
            lo, hi = ((r[j0] + wk * (r[j1] - r[j0])) for r in ([rows[i][-1]] + self.copy_verify_ms[i] for i in (i0, i1)))
        else:
            j0, j1, wk = _between(self.ks, min(k, top)) if k > 0 else (0, 0, 0.0)
            lo, hi = (r[j0] + wk * (r[j1] - r[j0]) + ((k - top) * _k_slope(self.ks, r) if k > top else 0.0)
                      for r in (rows[i0], rows[i1]))  # the slope only past the grid (a copy): part_at runs every step
        v = max(lo + w * (hi - lo), 0.0)
        if context is not None and part != "other" and self.context is not None and self.context_tokens is not None:
            v *= self.context.scale(part, batch_size, k, context, self.context_tokens)
        return v

    def context_scales(self, batch_size: int, context: float | None) -> tuple[list[float], list[float]]:
        """Per k, the draft's and the verification's time at `context` over their time at the grid's own context
        (`context_tokens`): all 1 without a context axis or a context."""
        if self.context is None or context is None or self.context_tokens is None:
            return [1.0] * len(self.ks), [1.0] * len(self.ks)
        return tuple([self.context.scale(part, batch_size, k, context, self.context_tokens) for k in self.ks]
                     for part in ("draft", "verify"))

    def resume_at(self, batch_size: int) -> float:
        """Extra milliseconds of a step that resumes speculation after k = 0 (0 when not measured)."""
        return _interpolate(self.batch_sizes, self.resume_ms, batch_size) if self.resume_ms else 0.0


def _between(sizes: list[int], x: float) -> tuple[int, int, float]:
    """(i0, i1, w): x lies w of the way from sizes[i0] to sizes[i1] - linear between measured sizes,
    extended beyond the largest, flat below the smallest (latency does not shrink below batch 1)."""
    if len(sizes) == 1:
        return 0, 0, 0.0
    i = next((i for i, s in enumerate(sizes[1:], 1) if x <= s), len(sizes) - 1)
    return i - 1, i, max(0.0, (x - sizes[i - 1]) / (sizes[i] - sizes[i - 1]))


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0
    return my - slope * mx, slope


def _k_slope(ks: list[int], row: list[float]) -> float:
    """Milliseconds per k past the longest measured (a copy drafts up to max_copy): the least-squares slope
    through the k >= 1 cells, never negative. The last two cells' slope is noise at small batches (at batch 1
    on this CPU verifying 8 tokens measured 3 ms less than 7; extended to 16, a step cost less than k = 0)."""
    pts = [(float(k), v) for k, v in zip(ks, row) if k >= 1]
    return max(line([k for k, _ in pts], [v for _, v in pts])[1], 0.0) if len(pts) >= 2 else 0.0


def _interpolate(sizes: list[int], values: list[float], x: float) -> float:
    i0, i1, w = _between(sizes, x)
    return max(values[i0] + w * (values[i1] - values[i0]), 0.0)


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """E[tokens per sequence per step] = 1 + a + ... + a^k (accepted prefix plus one target token)."""
    return sum(acceptance_rate**i for i in range(k + 1))


def ms_per_token(grid: LatencyGrid, acceptance: list[float], context: float | None = None) -> list[list[float]]:
    """[batch size][k] latency per generated token with the measured acceptance per position
    (E[tokens | k] = 1 + sum of acceptance[:k]); inf for k beyond the measured positions. At `context` KV tokens
    per row where the grid has a context axis (else at its own context)."""
    rows = grid.total_ms() if context is None else [grid.step_ms(b, context) for b in grid.batch_sizes]
    return [[ms / (b * (1 + sum(acceptance[:k]))) if k <= len(acceptance) else float("inf")
             for k, ms in zip(grid.ks, row)] for b, row in zip(grid.batch_sizes, rows)]


def best_k_table(grid: LatencyGrid, acceptance: list[float], context: float | None = None) -> dict[int, int]:
    """Per batch size, the k with the lowest measured latency per generated token (ties: smaller k), at `context`."""
    return {b: min(zip(row, grid.ks))[1] for b, row in zip(grid.batch_sizes, ms_per_token(grid, acceptance, context))}


def context_bucket(context: float | None, per_octave: int = 4) -> int | None:
    """A context rounded to a `per_octave`-th of a power of two (4: 64, 76, 90, 108, 128, ...): what price caches key
    on, a few % apart, so a cache holds a few dozen entries however contexts vary (the step simulator, which runs
    tens of thousands of steps a second, keys on 32 per octave: ~1% apart)."""
    if context is None or context <= 0:
        return None
    return round(2 ** (round(per_octave * math.log2(context)) / per_octave))
