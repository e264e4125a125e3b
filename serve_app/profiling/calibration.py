"""Online calibration: a profile's latency grid corrected by the steps this replica really takes.

A profile is measured on one machine of a hardware type; another machine of the type can be faster or
slower (clocks, power caps, neighbours, interconnect), and not by one factor: its draft may lose more
than its target. `Calibration` compares each decoding step's measured parts (draft, verification, the
rest: `StepStats`) with what the grid predicts for that batch size and k, and keeps per batch-size
group and part a robust factor: the median of the last `window` log-ratios, after the first `warmup`
steps (a new process runs its first steps slowly). A part's factor scales its whole grid row, every k,
so the k a policy never chooses is priced too. A step that also prefills prompt chunks prices the chunk
instead: its measured time less the (calibrated) decode part, against the grid's chunk price for that
many prompt tokens (`LatencyGrid.chunk_ms`) and for the KV its row held (`chunk_context_cost`). The two are
fitted apart (`split_fit`): the `chunk` part's factor scales every prefill price of the grid (a profile measured
before chunked prefill priced it another way), the `chunk_context` factor the held-KV term (one for every batch
size, as the term is). A machine can run one over its profile and the other under it: this CPU ran a chunk's
base 1.4-1.6x the profile's and its held-KV term at 0.8x, so one factor for both priced a chunk after no held KV
21% under and one after 1,500 held tokens right. The decode parts are kept against the cell at the grid's own
context with the profile's growth to the step's context beside them, so how this machine's draft and verification
grow with context is fitted too (`context_factor`, one per part, the calibrated grid's `ContextGrid.*_excess`).

The factors give the grid this machine's shape; its pace moves faster. A shared machine's speed drifts over
seconds (neighbours, clocks): steps of one shape vary about 10% about their median here, and by runs of steps,
not one at a time. `Calibration.pace` follows it, an exponential average over the last few steps of measured /
predicted (the calibrated grid's price), and `predict_ms` prices the next step with both. A uniform pace moves
every k's price alike, so it changes no policy's choice; it makes a predicted step time true (what `simulate
--validate` judges per step).

`Calibrated` wraps a profile-driven policy (lut, adaptive, budget) and steers it by the calibrated grid: lut's
table is recomputed from it with the acceptance this replica sees (the profile's per-position shape scaled
to a live per-token estimate), adaptive prices goodput with it, budget its per-step prices. Pure
Python; the Router exports the factors and logs drift.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from statistics import median

from serve_app.engine.draftplan import DraftPlan
from serve_app.engine.policy import PROFILE_POLICIES, AcceptanceEstimate, LookupTable
from serve_app.engine.stats import StepStats
from serve_app.pricing import LatencyGrid, _between, best_k_table

PARTS = ("draft", "verify", "other")
CHUNK = "chunk"
CONTEXT_PARTS = ("draft", "verify")
"""The parts whose price grows with the KV a step's rows attend (the context axis)."""
CHUNK_CONTEXT = "chunk_context"
"""The factor of a chunk's price for the KV its row held (`LatencyGrid.chunk_context_ms`), fitted apart."""
CHUNK_FIELDS = ("chunk_step_ms", "chunk_ms_per_token", "chunk_draft_step_ms", "chunk_draft_ms_per_token",
                "prefill_ms", "prefill_draft_ms")
"""The grid's prefill prices: per batch size, all scaled by the `chunk` factor."""


class Calibration:
    """This machine's step time per (part, profiled batch size) against the profile's, robust to outliers
    and warm-up: per k where steps ran at two or more k (a line through their medians: a machine can
    differ from the profile in what each drafted token costs, not only in a fixed factor), else one
    factor for the whole row."""

    def __init__(self, grid: LatencyGrid, warmup: int = 16, window: int = 64, min_samples: int = 8,
                 pace_weight: float = 0.3, regrid_every: int = 16):
        self.base, self.warmup, self.window, self.min_samples = grid, warmup, window, min_samples
        self.pace_weight, self.regrid_every = pace_weight, regrid_every
        self.pace = 0.0
        """log(measured / predicted) of recent steps, each weighing `pace_weight` against all before it."""
        self._grid, self._grid_at = grid, 0  # the calibrated grid the pace is measured against, and when made
        self._made: tuple[int, LatencyGrid] | None = None  # (samples used, the grid they made)
        self._fit: tuple[int, tuple[list[float], float]] | None = None  # (samples used, `_chunk_fit`'s answer)
        self._excess: tuple[int, dict[str, float]] | None = None  # (samples used, `context_factor` per part)
        # decode parts: (k index, log measured / the cell at the grid's own context, the profile's growth to the
        # step's context - 1; `_logs` makes them log measured / predicted); chunk: raw steps (see _chunk)
        self.samples = {(part, i): deque(maxlen=window) for part in PARTS + (CHUNK,) for i in range(len(grid.batch_sizes))}
        self.steps = 0  # decoding steps seen (warm-up included)
        self.used = 0  # steps that gave samples

    def observe(self, st: StepStats) -> bool:
        """Take one step's measured parts; True when it gave samples."""
        ks = self.base.ks
        # a step at a k between (or a little past) the profiled ones is priced between its columns: a startup
        # profile measures k in {0, 1, 2, 4}, plans run any length up to max_k
        forwards = st.draft_forwards or st.k  # a draft that runs no model (n-gram) is priced by its k
        if forwards > 2 * ks[-1] or not (st.batch_size or st.prefill_tokens):
            return False
        self.steps += 1
        self._follow_pace(st)
        if self.steps <= self.warmup:
            return False
        j = min(range(len(ks)), key=lambda j: (abs(ks[j] - st.k), j))  # the nearest profiled k (chunk steps)
        i0, i1, w = _between(self.base.batch_sizes, max(st.batch_size, 1))
        group = i0 if w < 0.5 else i1  # the nearest profiled batch size
        if st.prefill_tokens:
            return self._chunk(st, j, (i0, i1, w), group)
        took = False
        # a per-row plan drafts st.k forwards but verifies fewer tokens: its verification and the rest are
        # priced at the mean drafted length, between the grid's k columns
        k_rows = st.proposed / st.batch_size if st.rows is not None else st.k
        context = self.base.step_context(st.contexts)  # None without a context axis: cells stand for every context
        for part, seconds in zip(PARTS, (st.draft_s, st.verify_s, st.other_s)):
            # the draft by the forwards it ran (a grid cell at k ran k), the rest by the tokens verified, each at
            # the context this step served: kept as (k index, log measured / the cell at the grid's own context,
            # the profile's growth there - 1), so the machine's factor and its growth with context fit apart
            kk = forwards if part == "draft" else k_rows
            if part == "draft" and not forwards:
                # no draft forward ran: what the part took (a served draft's commit held back for the next call,
                # ~0) says nothing of drafting's price, though the profile's k = 0 cell can pass the floor below;
                # at a large batch most steps are plain, and they priced drafting at a tenth of its cost
                continue
            cell = self.base.part_at(part, st.batch_size, kk)
            predicted = self.base.part_at(part, st.batch_size, kk, context) if context is not None else cell
            if predicted > 0.05 and cell > 0.05 and seconds > 0:  # a part the grid prices at ~0 says nothing
                self.samples[(part, group)].append((self._column(part, kk), math.log(seconds * 1000 / cell),
                                                    predicted / cell - 1))
                took = True
        self.used += took
        return took

    def _column(self, part: str, k: float) -> int:
        """The grid column a part's sample at (mean) drafted length k is kept in: the nearest profiled k, or past
        the longest, for the verification, the nearest measured copy length (`LatencyGrid.copy_ks`: index
        len(ks) + its index), so a copy's price is calibrated on copies, not on the longest k's steps."""
        ks, copies = self.base.ks, self.base.copy_ks
        if part == "verify" and copies and k > ks[-1]:
            c0, c1, w = _between([ks[-1]] + copies, k)
            c = c0 if w < 0.5 else c1
            return len(ks) - 1 + c  # c = 0: the longest k itself
        j0, j1, w = _between(ks, k) if k > 0 else (0, 0, 0.0)
        return j0 if w < 0.5 else j1

    def _follow_pace(self, st: StepStats) -> None:
        if st.prefill_tokens or not st.batch_size:  # a prefill's error is its chunk price's, not the machine's pace
            return
        measured, predicted = 1000 * (st.draft_s + st.verify_s + st.other_s), step_cost_ms(self._current(), st)
        if measured > 0 and predicted > 0.05:
            w = self.pace_weight
            self.pace = (1 - w) * self.pace + w * math.log(measured / predicted)

    def _current(self) -> LatencyGrid:
        """The calibrated grid, made again every `regrid_every` steps (making it reads every sample)."""
        if self.steps - self._grid_at >= self.regrid_every and self.used:
            self._grid, self._grid_at = self.grid(), self.steps
        return self._grid

    def predict_ms(self, st: StepStats) -> float:
        """What a step like `st` takes on this machine now: the calibrated grid's price at its pace."""
        return step_cost_ms(self._current(), st) * math.exp(self.pace)

    def _chunk(self, st: StepStats, j: int, between, group: int) -> bool:
        """A step that prefilled: what it took beyond its decode part (priced by the calibrated grid, as a
        simulator prices it) against the grid's chunk price."""
        predicted = self.base.chunk_ms(max(st.batch_size, 1), st.prefill_tokens, st.draft_s > 0)
        if not predicted or predicted < 0.5:
            return False
        held = self.base.chunk_context_cost(st.chunks)  # the factors measure the machine, not the context
        i0, i1, w = between if st.batch_size else (0, 0, 0.0)  # prefill alone: a k = 0 step at batch 1
        jj = j if st.batch_size else 0  # (as `simulate.Replica.step` prices it)
        decode = tuple(rows[i0][jj] + w * (rows[i1][jj] - rows[i0][jj])
                       for rows in (self.base.draft_ms, self.base.verify_ms, self.base.other_ms))
        # kept raw: the decode part is priced with the factors known when the chunk's factor is asked for
        self.samples[(CHUNK, group)].append((1000 * (st.draft_s + st.verify_s + st.other_s), decode, group, jj,
                                             predicted, held))
        self.used += 1
        return True

    def _evidence(self, part: str, i: int):
        """The samples of the group nearest to i that has `min_samples` (the smaller on a tie: how far a
        machine is off its profile changes with the batch), and that group; (None, None) without any."""
        known = [g for g in range(len(self.base.batch_sizes)) if len(self.samples[(part, g)]) >= self.min_samples]
        if not known:
            return None, None
        g = min(known, key=lambda g: (abs(g - i), g))
        return self.samples[(part, g)], g

    def _logs(self, part: str, samples) -> list[tuple[int, float]]:
        """A decode part's samples as (k index, log measured / predicted), predicted at the step's context with the
        growth with context calibrated (`context_factor`)."""
        excess = self.context_factor(part) if part in CONTEXT_PARTS else 1.0
        return [(jj, r - math.log(max(1 + excess * x, 0.05))) for jj, r, x in samples]

    def context_factor(self, part: str) -> float:
        """How this machine's draft (verification) grows with context against the profile's: 1 + x growth becomes
        1 + factor x. Fitted (`split_fit`) over every batch size's steps, each normalised by its (batch size, k)
        median: steps at alike contexts tell nothing, so 1 where their growths do not spread."""
        if self._excess is not None and self._excess[0] == self.used:
            return self._excess[1][part]
        found = {}
        for name in CONTEXT_PARTS:
            excess = 1.0
            for _ in range(2):  # each (batch size, k)'s level with the growth so far, then the growth again
                points = []
                for g in range(len(self.base.batch_sizes)):
                    by_k: dict[int, list] = {}
                    for jj, r, x in self.samples[(name, g)]:
                        by_k.setdefault(jj, []).append((r, x))
                    for seen in by_k.values():
                        if len(seen) >= 3:
                            level = median(r - math.log(max(1 + excess * x, 0.05)) for r, x in seen)
                            points += [(math.exp(r - level), 1.0, x) for r, x in seen if x > -0.9]
                if not points:
                    break
                a, c = split_fit(points)
                excess = min(max(c / a, 0.25), 4.0)
            found[name] = excess
        self._excess = (self.used, found)
        return found[part]

    def ratio(self, part: str, i: int, j: int) -> float:
        """Measured / profiled time of one decode part at profiled batch size index i and k index j."""
        samples, g = self._evidence(part, i)
        if samples is None:
            return 1.0
        samples = self._logs(part, samples)
        by_k: dict[int, list[float]] = {}
        for jj, r in samples:
            by_k.setdefault(jj, []).append(r)
        enough = max(2, self.min_samples // 2)
        factor = math.exp(median(r for _, r in samples))
        ks = self.base.ks
        if j >= len(ks):  # a copy's verification (`_column`): its own steps' factor, else the longest k's
            own = by_k.get(j, [])
            return (min(max(math.exp(median(own)), factor / 2), factor * 2) if len(own) >= enough
                    else self.ratio(part, i, len(ks) - 1))
        points = [(jj, median(v)) for jj, v in by_k.items() if jj < len(ks) and len(v) >= enough]
        if len(points) < 2:  # one k seen: one factor for the row
            return factor
        rows = getattr(self.base, f"{part}_ms")[g]
        # a line through the measured medians, in milliseconds against k, then as a ratio to the profile
        xs = [ks[jj] for jj, _ in points]
        ys = [rows[jj] * math.exp(r) for jj, r in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        at = my + slope * (ks[j] - mx)
        # the line refines the group's one factor, within 2x of it either way (a line extrapolated far from the
        # k it saw can run to nonsense; the factor itself is measured, however far off the profile was)
        return min(max(at / rows[j], factor / 2), factor * 2) if rows[j] > 0.05 else factor

    def factor(self, part: str, i: int) -> float:
        """One number per part and profiled batch size (what /metrics shows): the median measured /
        profiled ratio of the group's evidence; for `chunk`, of the prefill price (`split_fit`'s base factor)."""
        if part == CHUNK:
            return self._chunk_fit()[0][i]
        samples, _ = self._evidence(part, i)
        return math.exp(median(r for _, r in self._logs(part, samples))) if samples is not None else 1.0

    def _chunk_fit(self) -> tuple[list[float], float]:
        """([chunk factor per profiled batch size], the held-KV term's factor): `split_fit` over every group's
        chunk steps for the held-KV term (one pair of prices serves every batch size), then each group's base
        factor with that term fixed. Made once per sample count (each point reads its group's decode ratios)."""
        if self._fit is not None and self._fit[0] == self.used:
            return self._fit[1]
        n = len(self.base.batch_sizes)
        points = {g: self._chunk_points(self.samples[(CHUNK, g)]) for g in range(n)}
        pooled = [p for g in range(n) if len(points[g]) >= self.min_samples for p in points[g]]
        held = split_fit(pooled)[1] if pooled else 1.0
        base = []
        for i in range(n):
            samples, g = self._evidence(CHUNK, i)
            base.append(split_fit(points[g], held)[0] if samples is not None and points[g] else 1.0)
        self._fit = (self.used, (base, held))
        return base, held

    def _chunk_points(self, samples) -> list[tuple[float, float, float]]:
        """(the chunk's measured ms beyond its calibrated decode part, its base price, its held-KV price) per chunk
        step whose rest is positive."""
        out, ratios = [], {}  # a ratio reads every sample of its group: once per (part, group, k)
        for total, decode, group, j, predicted, held in samples:
            for part in PARTS:
                if (part, group, j) not in ratios:
                    ratios[(part, group, j)] = self.ratio(part, group, j)
            rest = total - sum(d * ratios[(part, group, j)] for d, part in zip(decode, PARTS))
            if rest > 0:
                out.append((rest, predicted, held))
        return out

    def grid(self) -> LatencyGrid:
        """The profile's grid with every decode cell and prefill price calibrated (made again only once samples
        came since: the pace and a `Calibrated` policy both ask for it)."""
        if self._made is not None and self._made[0] == self.used:
            return self._made[1]
        scaled = {f"{part}_ms": [[v * self.ratio(part, i, j) for j, v in enumerate(row)]
                                 for i, row in enumerate(getattr(self.base, f"{part}_ms"))] for part in PARTS}
        if self.base.copy_verify_ms is not None:  # a copy's verification by its copies' steps (else the longest k's)
            n = len(self.base.ks)
            scaled["copy_verify_ms"] = [[v * self.ratio("verify", i, n + c) for c, v in enumerate(row)]
                                        for i, row in enumerate(self.base.copy_verify_ms)]
        chunk, held = self._chunk_fit()
        for name in CHUNK_FIELDS:
            values = getattr(self.base, name)
            if values is not None:
                scaled[name] = [v * chunk[i] for i, v in enumerate(values)]
        if self.base.chunk_context_ms is not None:  # one pair for every batch size, as its factor
            scaled["chunk_context_ms"] = [v * held for v in self.base.chunk_context_ms]
        if self.base.context is not None:
            ctx = self.base.context  # the samples' growth was the base's: the factor scales its excess
            scaled["context"] = ctx.model_copy(update={f"{part}_excess": getattr(ctx, f"{part}_excess")
                                                       * self.context_factor(part) for part in CONTEXT_PARTS})
        grid = self.base.model_copy(update=scaled)
        self._made = (self.used, grid)
        return grid

    def factors(self) -> dict[str, dict[int, float]]:
        """{part: {profiled batch size: factor}} (what /metrics and stats() show; `chunk`: prefill prices)."""
        out = {part: {b: round(self.factor(part, i), 4) for i, b in enumerate(self.base.batch_sizes)}
               for part in PARTS + (CHUNK,)}
        out[CHUNK_CONTEXT] = {b: round(self._chunk_fit()[1], 4) for b in self.base.batch_sizes}
        for part in CONTEXT_PARTS:  # one for every batch size, as `chunk_context`
            out[f"{part}_context"] = {b: round(self.context_factor(part), 4) for b in self.base.batch_sizes}
        return out

    def drift(self) -> float:
        """How far this replica is from its profile: the largest |calibrated / profiled - 1| of a whole
        step over the profiled cells (0 before any group has enough samples)."""
        new = self.grid().total_ms()
        return max((abs(n / o - 1) for nr, orow in zip(new, self.base.total_ms()) for n, o in zip(nr, orow) if o > 0),
                   default=0.0)


SPLIT_MIN_SPREAD = 0.15
"""`split_fit` fits two factors only where the held-KV term's share of the chunk price spreads this much (its
interquartile range): chunks that all held about as much KV as each other tell the two apart no better than one."""


SPLIT_MAX_POINTS = 96
"""`split_fit`'s line reads at most this many points (evenly spaced through them): its pairs grow with the square."""


def split_fit(points, held: float | None = None) -> tuple[float, float]:
    """(a, c) of points (measured, base price, extra price) where measured = base x a + extra x c: a chunk step's
    base and held-KV prices (`_chunk_fit`), or a decode part's level and its growth with context (`context_factor`).
    With the share s = extra / (base + extra) of each price, measured / price = a + (c - a) s, a line in s fitted
    robustly (Theil-Sen: the median slope over pairs, the median intercept), so a few steps a neighbour slowed do
    not tilt it. `held` given: c is that and a the median of what each point says. One factor for both (the median
    ratio) where the shares do not spread (`SPLIT_MIN_SPREAD`) or no extra was priced; each within 3x of it (a
    line's end past every point can run far)."""
    if not points:
        return 1.0, held if held is not None else 1.0
    r = [m / (b + h) for m, b, h in points]
    s = [h / (b + h) for m, b, h in points]
    f = math.exp(median(math.log(x) for x in r))
    clamp = lambda x: min(max(x, f / 3), 3 * f)  # noqa: E731
    if held is not None:
        says = [(x - held * y) / (1 - y) for x, y in zip(r, s) if y < 0.9]
        says = [x for x in says if x > 0]
        return (clamp(math.exp(median(math.log(x) for x in says))) if says else f), held
    q = sorted(s)
    stride = -(-len(r) // SPLIT_MAX_POINTS)  # pairs grow with the square: every stride-th point (a window's worth)
    r, s = r[::stride], s[::stride]
    if q[(3 * len(q)) // 4] - q[len(q) // 4] < SPLIT_MIN_SPREAD:
        return f, f
    slopes = [(r[i] - r[j]) / (s[i] - s[j]) for i in range(len(r)) for j in range(i) if abs(s[i] - s[j]) >= 0.05]
    if not slopes:
        return f, f
    slope = median(slopes)
    a = median(x - slope * y for x, y in zip(r, s))
    return clamp(a), clamp(a + slope)


def step_parts_ms(grid: LatencyGrid, st: StepStats) -> tuple[float, float, float]:
    """What the grid says a step's parts took (draft, verification with the prompt chunks it fed, the rest), priced
    the way calibration prices them: the draft by the forwards it ran, verification and the rest by the mean tokens
    drafted per row, each at the step's context, plus the chunked prefill's price for the prompt tokens it fed, at
    the KV their rows held."""
    b = st.batch_size
    draft = st.draft_s > 0 or st.draft_forwards > 0 or st.k > 0
    prefill = ((grid.chunk_ms(max(b, 1), st.prefill_tokens, draft) or 0.0) + grid.chunk_context_cost(st.chunks)
               if st.prefill_tokens else 0.0)
    if not b:  # a prefill alone still runs a whole forward: a k = 0 step at batch 1 and the chunk (as calibration
        d, v, o = (grid.part_at(part, 1, 0) for part in PARTS)  # and `simulate` price it)
        return d, v + prefill, o
    context = grid.step_context(st.contexts)
    forwards = st.draft_forwards or st.k
    k_rows = st.proposed / b
    return (grid.part_at("draft", b, forwards, context), grid.part_at("verify", b, k_rows, context) + prefill,
            grid.part_at("other", b, k_rows))


def step_cost_ms(grid: LatencyGrid, st: StepStats) -> float:
    """What the grid says a step took (`step_parts_ms`, summed): the cost model of `bench replay`'s virtual clock."""
    return sum(step_parts_ms(grid, st))


class Calibrated:
    """A profile-driven policy (lut, adaptive) steered by the grid its Calibration keeps: every
    `refresh_every` useful steps the policy gets the calibrated grid (lut: its best-k table again)."""

    def __init__(self, inner, profile, refresh_every: int = 16, explore_every: int = 8, **calibration):
        if profile.latency is None:
            raise ValueError("calibration needs a profile with a latency grid")
        self.inner, self.profile, self.refresh_every = inner, profile, refresh_every
        self.explore_every, self._chosen = explore_every, 0
        self.name = inner.name
        self.calibration = Calibration(profile.latency, **calibration)
        self._since = 0
        # lut's table is the paper's (batch size -> k), but priced with the acceptance this replica sees, not
        # only the profiling prompts': a workload whose draft agrees less than the profile's wants smaller k
        self.live = AcceptanceEstimate(profile.acceptance_rate) \
            if isinstance(inner, LookupTable) and profile.acceptance_rate else None

    def choose(self, state):
        choice = self.inner.choose(state)
        plan = isinstance(choice, DraftPlan)
        k = choice.model_depth if plan and choice.copy_value is not None else choice  # lut's, adaptive's k in a plan
        if not self.explore_every or not state.has_draft or not isinstance(k, int) or k < 0:
            return choice
        # Every explore_every-th step runs a neighbouring k (up and down by turns): a policy that keeps one k per
        # batch size would show the calibration one column only, and a machine can differ from its profile in
        # what each drafted token and forward costs (contexts longer than the profiling prompts', a slower
        # draft), which only two columns measure. From k = 0 too (it runs k = 1): a batch size where the profile
        # says speculation never pays would show k = 0 only, and its one factor would price every k there by
        # the plain step's, so a machine whose plain step is the slow part would never speculate there again.
        # Not from k = 0 for a policy that probes there on its own (budget, adaptive): its probes give that
        # column, and a uniform k = 1 every 8th step besides cost a batch of 8 here a few percent of its tokens (each pays
        # the draft's catch-up over every row's tokens since the last). Costs a few percent of steps near the best k.
        self._chosen += 1
        if self._chosen % self.explore_every or (k == 0 and getattr(self.inner, "probe_every", 0)):
            return choice
        top = min(state.max_k, max(self.profile.latency.ks))
        step = 1 if (self._chosen // self.explore_every) % 2 else -1  # up and down by turns
        for alt in (k + step, k - step):
            if 1 <= alt <= top:
                return replace(choice, model_depth=alt) if plan else alt
        return choice

    def observe(self, stats: StepStats) -> None:
        self.inner.observe(stats)
        if self.live is not None:
            self.live.observe(stats)
        if self.calibration.observe(stats):
            self._since += 1
            if self._since >= self.refresh_every:
                self._since = 0
                self.refresh()

    def refresh(self) -> None:
        grid = self.calibration.grid()
        if hasattr(self.inner, "refresh"):  # budget, adaptive: prices and goodput from the calibrated latencies
            self.inner.refresh(grid)
        elif self.profile.acceptance:  # lut: the paper's table, from the calibrated grid and live acceptance
            acceptance = self.profile.acceptance
            if self.live is not None:  # the profile's per-position shape, scaled to the live per-token rate
                r = self.live.value / self.profile.acceptance_rate if self.profile.acceptance_rate else 1.0
                acceptance = [min(a * r ** (j + 1), 1.0) for j, a in enumerate(acceptance)]
            self.inner.reprice(grid, acceptance)

    def __getattr__(self, name):  # acceptance_estimate and the like: the inner policy's
        if name == "inner":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def calibrated(policy, profile):
    """`policy`, calibrating online when it steers by a profile with a latency grid (lut, adaptive)."""
    if policy.name in PROFILE_POLICIES and profile is not None and profile.latency is not None:
        return Calibrated(policy, profile)
    return policy


def calibrated_profile(profile, calibration: Calibration, machine: str):
    """What a replica shares with the others of its type: its profile with the calibrated grid (and the
    lut table recomputed from it), marked `calibrated` on `machine`."""
    from serve_app.profiling.profiles import Profile

    grid = calibration.grid()
    return Profile.model_validate({
        **profile.model_dump(), "latency": grid.model_dump(), "source": "calibrated", "prediction": None,
        "best_k": best_k_table(grid, profile.acceptance) if profile.acceptance else profile.best_k,
        "machine": machine,
        "notes": f"calibrated online on {machine} ({calibration.used} steps) from the {profile.source} profile "
                 f"created {profile.created}; {profile.notes}"})


def steering_profile(held, shared, machine: str):
    """The profile a replica on `machine` steers by: a measured profile of this very machine; else a
    calibrated one another replica of the type shared (it ran here, or on a machine like this one);
    else the held one (measured elsewhere, or predicted)."""
    if held is not None and held.source == "measured" and held.machine == machine:
        return held
    return shared if shared is not None else held
