"""The `budget` policy: speculation length per row, under prices the hardware's profile sets per step.

The paper's k is one number per step, from the batch size. But the rows of one batch differ: a JSON answer or
a rewrite that copies its prompt drafts far better than open prose, and within one answer the draft is sure
of some tokens and guessing at others. `Budget` prices speculation per step from the (calibrated) latency
grid at this batch size (`Prices`: what one more drafted token costs to verify, what one more draft forward
costs, the fixed cost of speculating at all) and the step's worth (tokens per ms at the best uniform k,
with the live acceptance). The draft then gives each row tokens while they are worth their verification
(`draftplan.PlanWalk`): row by row, position by position, from the draft's own confidence, mapped to an
acceptance chance by a curve learned online from what the target accepted (`ConfidenceCurve`, one for the
model draft, one for tokens copied by prompt lookup), and corrected by each request's own record
(`RequestRecord.scale`). A row whose drafts keep failing drafts nothing; a step where nothing is worth the
fixed cost speculates not at all (probing now and then, as `adaptive` does). And where the prices and the outcome
disagree, the outcome wins: a batch size whose speculating steps keep making fewer tokens than plain steps would
have made in their time runs plain, probing (`losing`).

Greedy stays identical and sampling exact whatever lengths result (the walk decides on the draft's
distribution, never on the token it drew); only a few numbers per row go to the draft's actor.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.engine.draftplan import CURVE_BINS, DraftPlan
from serve_app.engine.stats import RowOutcomes, StepStats
from serve_app.pricing import LatencyGrid, context_bucket, line


RECORD_TTL_STEPS = 256
"""A request's record is dropped once it has not decoded for this many steps (it finished, or left)."""

POSITION_PRIOR = 4.0
"""Outcomes' worth of the position before it (the first position: the profile's acceptance) that a draft
position's acceptance starts from."""

POSITION_FADE = 0.5 ** (1 / 64.0)
"""Per row judged at a position, older outcomes there weigh this much less: about the last 64 rows count."""

GUARD_FADE = 0.5 ** (1 / 32.0)
"""Per speculating step at a batch size, older steps weigh this much less in its guard: about the last 32 count."""

GUARD_STEPS = 8.0
"""Speculating steps' worth (faded) a batch size's guard waits for before it judges."""

GUARD_PROBE_BACKOFF = 4
"""Where a batch size's guard holds its steps at k = 0, probes come this many times less often."""

GUARD_MARGIN = 0.97
"""A batch size's speculating steps must have made at least this share of the tokens plain steps would have made
in their time, or its steps run at k = 0 (probes aside)."""


@dataclass(frozen=True)
class Prices:
    """What speculation costs at one batch size, in milliseconds (lines through the grid's k >= 1 cells)."""

    base_ms: float
    """A step at k = 0."""
    on_ms: float
    """Fixed extra of a step that speculates at all, beyond its draft forwards and its drafted tokens."""
    forward_ms: float
    """One more draft forward over the whole batch."""
    token_ms: float
    """Verifying one more drafted token."""
    forward_fixed_ms: float = 0.0
    """A draft forward's part that does not grow with its rows (a forward over fewer rows: the rows that
    still draft): forward over n rows = forward_fixed_ms + n x forward_row_ms."""
    forward_row_ms: float = 0.0
    """A draft forward's part per row in it."""

    def step_ms(self, batch_size: int, k: int) -> float:
        """A step where every row drafts k tokens."""
        return self.base_ms + (self.on_ms + k * (self.forward_ms + batch_size * self.token_ms) if k else 0.0)


def _forward_line(grid: LatencyGrid) -> tuple[float, float]:
    """(fixed, per row) milliseconds of one draft forward: a line through each profiled batch size's forward
    price (the draft part's slope against k) against the batch size."""
    js = [j for j, k in enumerate(grid.ks) if k >= 1]
    if len(js) < 2:
        return 0.0, 0.0
    ks = [float(grid.ks[j]) for j in js]
    per_batch = [max(line(ks, [row[j] for j in js])[1], 0.0) for row in grid.draft_ms]
    if len(grid.batch_sizes) < 2:
        return per_batch[0], 0.0
    fixed, per_row = line([float(b) for b in grid.batch_sizes], per_batch)
    per_row = max(per_row, 0.0)
    return max(fixed, 0.0), per_row


def prices(grid: LatencyGrid, batch_size: int, context: float | None = None, upto: int | None = None) -> Prices:
    """The grid's prices at a batch size (and a context, where the grid has a context axis): the draft part
    grows with the forwards (k), the verification with the tokens (batch x k); lines through k >= 1 smooth
    the cells' noise; k = 0 is the base. `upto`: the lines go through k <= upto only (at least two columns):
    the prices where the step will draft, not a slope set by long k it never runs (verification jumps where
    a kernel changes shape: at 1,024 tokens on this CPU k = 1-4 verify within 5%, k = 7 costs 40% more). A
    forward over fewer rows is priced by the line of forward prices against batch size (`_forward_line`),
    scaled to the context like the whole forward."""
    draft, verify, other = grid.parts_at(batch_size, context)
    js = [j for j, k in enumerate(grid.ks) if k >= 1]
    if upto is not None and len(js) > 2:
        js = js[:max(2, sum(grid.ks[j] <= upto for j in js))]
    base = draft[0] + verify[0] + other[0]
    if len(js) < 2:  # a grid with one k > 0: all of its extra is fixed
        j = js[0] if js else 0
        return Prices(base, max(draft[j] + verify[j] + other[j] - base, 0.0), 0.0, 0.0)
    ks = [float(grid.ks[j]) for j in js]
    d0, forward = line(ks, [draft[j] for j in js])
    v0, per_k = line(ks, [verify[j] for j in js])
    forward, token = max(forward, 0.0), max(per_k, 0.0) / batch_size
    rest = sum(other[j] for j in js) / len(js)
    on = max(d0 + v0 + rest - base, 0.0)
    fixed, per_row = _forward_line(grid)
    if context is not None and grid.context is not None:  # the forward line was fitted at the grid's own context
        plain = grid.parts_at(batch_size)[0]
        at_k = [draft[j] / plain[j] for j in js if plain[j] > 0]
        scale = sum(at_k) / len(at_k) if at_k else 1.0
        fixed, per_row = fixed * scale, per_row * scale
    return Prices(base, on, forward, token, fixed, per_row)


class ConfidenceCurve:
    """Acceptance chance per draft-confidence bin, from the verified positions (a drafted token whose earlier
    tokens were all accepted, so the target judged it). Starts at the bin's own confidence, worth `prior`
    outcomes; older outcomes fade by half every `half_life` new ones in the bin."""

    def __init__(self, prior: float = 8.0, half_life: float = 512.0, start: list[float] | None = None):
        start = start or [(i + 0.5) / CURVE_BINS for i in range(CURVE_BINS)]
        self.hits = [prior * p for p in start]
        self.trials = [prior] * CURVE_BINS
        self.decay = 0.5 ** (1.0 / half_life)

    @staticmethod
    def bin(conf: float) -> int:
        return min(max(int(conf * CURVE_BINS), 0), CURVE_BINS - 1)

    def __call__(self, conf: float) -> float:
        i = self.bin(conf)
        return self.hits[i] / self.trials[i]

    def add(self, conf: float, accepted: bool) -> None:
        i = self.bin(conf)
        self.hits[i] = self.hits[i] * self.decay + accepted
        self.trials[i] = self.trials[i] * self.decay + 1.0

    def values(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.trials)]


class CopyCurves:
    """What copied tokens' estimates come to: acceptance per estimate bin for tokens copied from the row's own
    context (prompt lookup) and from the suffix history, learnt from the rows' outcomes, for a one-k policy's
    copies past k (`policy.copies_past`; `Budget` keeps its own beside its per-request records). A copy record's
    estimate starts from a prior on the matched suffix's length: a document's copies in the replay's batch-8 cell
    were accepted 32% of the time where their estimates said more."""

    def __init__(self):
        self.lookup, self.history = ConfidenceCurve(), ConfidenceCurve()

    def observe(self, rows: RowOutcomes | None) -> None:
        if rows is None or not rows.lookup or not rows.conf:
            return
        history = rows.history or [False] * len(rows.ids)
        for n, acc, cs, copied, past in zip(rows.drafted, rows.accepted, rows.conf, rows.lookup, history):
            if copied:
                curve = self.history if past else self.lookup
                for j in range(min(acc + 1, n, len(cs))):  # the positions the target judged
                    curve.add(cs[j], j < acc)

    def plan(self) -> dict[str, list[float]]:
        """The `DraftPlan` fields that carry them."""
        return {"lookup_curve": self.lookup.values(), "history_curve": self.history.values()}


def measured_curve(outcomes: list[RowOutcomes], prior: float = 2.0) -> list[float] | None:
    """The model draft's acceptance chance per confidence bin over the positions the target judged in these
    steps' row outcomes (free text only: no copied or grammar-constrained rows), each bin shrunk to its own
    confidence by `prior` outcomes: what a profile measures for `ConfidenceCurve` to start from. None when no
    position was judged."""
    hits, trials = [0.0] * CURVE_BINS, [0.0] * CURVE_BINS
    for rows in outcomes:
        conf = rows.conf or [[] for _ in rows.ids]
        free = [not (c or m) for c, m in zip(rows.lookup or [False] * len(rows.ids),
                                             rows.constrained or [False] * len(rows.ids))]
        for n, acc, cs, ok in zip(rows.drafted, rows.accepted, conf, free):
            for j in range(min(acc + 1, n, len(cs)) if ok else 0):  # the positions the target judged
                i = ConfidenceCurve.bin(cs[j])
                hits[i] += j < acc
                trials[i] += 1
    if not any(trials):
        return None
    return [round((h + prior * (i + 0.5) / CURVE_BINS) / (t + prior), 4) for i, (h, t) in enumerate(zip(hits, trials))]


@dataclass
class RequestRecord:
    """One request's drafts so far: how they fared against what the curve predicted."""

    predicted: float = 0.0
    """Sum of the curve's estimates over its verified positions."""
    accepted: float = 0.0
    """Of those positions, how many were accepted."""

    PRIOR = 4.0  # positions of evidence before a request's own record moves its scale much

    @property
    def scale(self) -> float:
        """Its drafts' acceptance against the curve's (shrunk to 1 while it has little evidence)."""
        return min(max((self.accepted + self.PRIOR) / (self.predicted + self.PRIOR), 0.25), 2.0)


class Budget:
    """Per-row speculation under the profile's per-step prices (module docstring)."""

    name = "budget"

    def __init__(self, grid: LatencyGrid, acceptance_rate: float, probe_every: int = 16,
                 curve: list[float] | None = None):
        """`curve`: the model draft's acceptance per confidence bin measured at profiling
        (`Profile.confidence_curve`), where its free-text curve starts; None: at the confidence itself."""
        self.grid, self.probe_every = grid, probe_every
        self.a, self.a_trials = acceptance_rate * 128.0, 128.0  # per-token acceptance (metrics)
        # acceptance per draft position given every earlier one was accepted (the step's worth): a geometric a
        # undersells depth where a draft that got going keeps agreeing (documents, code), so the best uniform k,
        # the depth model rows may reach and whether to speculate at all come from these (`expected`), learnt
        # from the rows
        depth = max(max(grid.ks), 1)
        self.a0 = acceptance_rate
        self.pos_hits, self.pos_trials = [0.0] * depth, [0.0] * depth
        # one curve per (source, constrained): model drafts of free text, model drafts under a grammar's mask
        # (confidence ~1 on forced tokens), tokens copied by prompt lookup (confidence: the copy record's estimate)
        self.curve = ConfidenceCurve(start=curve)
        self.constrained_curve = ConfidenceCurve()
        self.lookup_curve = ConfidenceCurve()
        self.history_curve = ConfidenceCurve()  # tokens copied from the suffix history (confidence: its estimate)
        self.requests: dict[str, RequestRecord] = {}
        self._last_seen: dict[str, int] = {}  # request id -> the step it last decoded in
        self._prices: dict[tuple, Prices] = {}  # (batch size, context bucket) -> prices
        self._step_ms: dict[tuple, list[float]] = {}  # (batch size, context bucket) -> the grid's step per k
        self._steps = 0
        # the guard, per profiled batch size: faded [tokens made, tokens plain steps would have made in the same
        # time, steps] over the steps that speculated there (`losing`)
        self._guard: dict[int, list[float]] = {}

    @property
    def acceptance_estimate(self) -> float:
        return self.a / self.a_trials

    def prices(self, batch_size: int, context: float | None = None, upto: int | None = None) -> Prices:
        """The step's prices here, with their lines through k <= upto (where the step drafts; `prices`)."""
        key = (batch_size, context_bucket(context), upto)
        p = self._prices.get(key)
        if p is None:
            p = self._prices[key] = prices(self.grid, batch_size, key[1], upto)
        return p

    def rates(self, k: int) -> list[float]:
        """Per draft position i < k (up to the depth learnt): the live chance it is accepted, given every earlier one
        was."""
        out, c = [], self.a0
        for j in range(min(k, len(self.pos_hits))):
            # a position with few outcomes leans on the one before it (the first on the profile's a): deeper
            # positions are reached less often, and a capped depth would otherwise never learn the next one
            c = (self.pos_hits[j] + POSITION_PRIOR * c) / (self.pos_trials[j] + POSITION_PRIOR)
            out.append(c)
        return out

    def chances(self, k: int, scale: float = 1.0, rates: list[float] | None = None) -> list[float]:
        """Per draft position i < k (up to the depth learnt): the chance that drafts 0..i are all accepted, from
        `rates` (default: the live ones, `rates(k)`). `scale`: a request's record against the curve
        (`RequestRecord.scale`), applied to each position's chance; a chance so scaled is at most 0.95 (a good
        record never makes a token sure), the live chance itself (scale 1) is left as learnt."""
        out, chance = [], 1.0
        for c in (self.rates(k) if rates is None else rates[:k]):
            chance *= c if scale == 1.0 else min(c * scale, 0.95)
            out.append(chance)
        return out

    def expected(self, k: int) -> float:
        """Tokens a row yields at uniform k with the live acceptance per position: 1 + sum over i < k of the
        chance that drafts 0..i are all accepted."""
        return 1.0 + sum(self.chances(k))

    def uniform(self, batch_size: int, context: float | None = None) -> tuple[int, float]:
        """The best uniform k at this batch size (and context) with the live acceptance, and its tokens per ms
        (what a step here is worth). Priced at the grid's own cells, not `Prices`' lines: a step's time is not
        linear in k (a kernel's shapes: on this CPU verifying 4 tokens costs less than 3), and the lines
        would move the best k off the grid's."""
        key = (batch_size, context_bucket(context))
        ms = self._step_ms.get(key)
        if ms is None:
            ms = self._step_ms[key] = self.grid.step_ms(batch_size, key[1])
        rates = {k: batch_size * self.expected(k) / m for k, m in zip(self.grid.ks, ms)}
        k = max(rates, key=lambda k: (rates[k], -k))
        return k, rates[k]

    def rate(self, batch_size: int, context: float | None = None) -> float:
        """Tokens per ms a step at this batch size is worth: the best uniform k with the live acceptance."""
        return self.uniform(batch_size, context)[1]

    def choose(self, state) -> int | DraftPlan:
        if not state.has_draft or state.max_k <= 0:
            return 0
        b = state.batch_size
        ids = state.rows or tuple(f"#{i}" for i in range(b))
        self._steps += 1
        for rid in ids:
            self._last_seen[rid] = self._steps
            self.requests.setdefault(rid, RequestRecord())
        if len(self.requests) > 4 * b + 64:  # a request absent for a while (finished) goes; one absent a step
            # (its predicted output drafted for it) keeps its record
            for rid in [r for r, t in self._last_seen.items() if self._steps - t > RECORD_TTL_STEPS]:
                self.requests.pop(rid, None)
                self._last_seen.pop(rid, None)
        recs = [self.requests[rid] for rid in ids]
        context = state.context_for(self.grid)
        k_uniform, rate = self.uniform(b, context)
        p = self.prices(b, context, k_uniform + 1)  # the slopes where rows draft: up to one past the uniform k
        token_value = rate * p.token_ms
        # every probe_every-th step every row drafts at least one token, whatever the prices say: the curve
        # and the requests' records keep learning where they would otherwise never draft
        losing = self.losing(b)
        # a batch size whose speculating steps lose probes a quarter as often: a probe there pays the draft's
        # catch-up over every row's tokens since the last one, and verifies drafts that mostly fail
        every = self.probe_every * (GUARD_PROBE_BACKOFF if losing else 1)
        probe = bool(every) and self._steps % every == 0
        if not probe and (losing or not self.worth_it(b, state.max_k, [r.scale for r in recs], rate, p)):
            return 0
        return DraftPlan(caps=[max(state.max_k, state.max_copy)] * b, token_value=token_value, forward_value=rate * p.forward_fixed_ms,
                         row_value=rate * p.forward_row_ms,
                         scale=[r.scale for r in recs], curve=self.curve.values(), explore=probe,
                         lookup_curve=self.lookup_curve.values(), history_curve=self.history_curve.values(),
                         constrained=list(state.constrained) if any(state.constrained) else None,
                         constrained_curve=self.constrained_curve.values(),
                         # a probe looks one deeper: that position learns; copying rows may go on to max_copy
                         model_depth=min(max(k_uniform, 1) + probe, state.max_k))

    def worth_it(self, b: int, max_k: int, scales: list[float], rate: float, p: Prices) -> bool:
        """Whether speculating at all pays this step: for some depth d, the rows' expected accepted tokens (the
        live acceptance per position, as `uniform` reads it, each position's chance x the row's scale) beat the
        price of d forwards, their tokens and the fixed cost. The walk then trims each row to what its draft's
        confidence is worth."""
        rates = self.rates(max_k)  # once for the step: only the scale differs by row
        at = [sum(col) for col in zip(*(self.chances(max_k, s, rates) for s in scales))]  # per position, over the rows
        gain = 0.0
        for d in range(1, max_k + 1):
            gain += at[d - 1] if d <= len(at) else 0.0
            if gain > rate * (p.on_ms + d * (p.forward_ms + b * p.token_ms)):
                return True
        return False

    def losing(self, batch_size: int) -> bool:
        """Whether this batch size's recent speculating steps made fewer tokens than plain steps would have in
        their time (the calibrated grid's k = 0 step, as the Router's regret table prices it), by more than
        GUARD_MARGIN. The prices above are a model of the step; this is its outcome: where they disagree (a draft
        forward dearer beside the target than profiled, verification wider than a line says), the outcome wins
        and the steps there run plain, probing every `probe_every` x GUARD_PROBE_BACKOFF steps to find out when
        speculating pays again."""
        made, plain, steps = self._guard.get(self._group(batch_size), (0.0, 0.0, 0.0))
        return steps >= GUARD_STEPS and made < GUARD_MARGIN * plain

    def _group(self, batch_size: int) -> int:
        return min(self.grid.batch_sizes, key=lambda g: (abs(g - batch_size), g))

    def _judge(self, stats: StepStats) -> None:
        """A decoding step's outcome into its batch size's guard (a step that speculated; prefill steps price
        their chunks, not k), its plain step priced at its rows' context as `uniform` prices it."""
        ms = 1000.0 * (stats.draft_s + stats.verify_s + stats.other_s)
        if not stats.proposed or not stats.batch_size or stats.prefill_tokens or stats.admitted or ms <= 0 \
                or 0 not in self.grid.ks:
            return
        b = stats.batch_size
        key = (b, context_bucket(self.grid.step_context(stats.contexts)))
        if key not in self._step_ms:
            self._step_ms[key] = self.grid.step_ms(b, key[1])
        plain_rate = b / self._step_ms[key][self.grid.ks.index(0)]  # tokens per ms at k = 0
        g = self._guard.setdefault(self._group(b), [0.0, 0.0, 0.0])
        g[0] = g[0] * GUARD_FADE + stats.generated
        g[1] = g[1] * GUARD_FADE + ms * plain_rate
        g[2] = g[2] * GUARD_FADE + 1.0

    def observe(self, stats: StepStats) -> None:
        self._judge(stats)
        rows = stats.rows
        if rows is None:
            return
        conf = rows.conf or [[] for _ in rows.ids]
        lookup = rows.lookup or [False] * len(rows.ids)
        constrained = rows.constrained or [False] * len(rows.ids)
        history = rows.history or [False] * len(rows.ids)
        for rid, n, acc, cs, copied, masked, past in zip(rows.ids, rows.drafted, rows.accepted, conf, lookup, constrained,
                                                         history):
            if not n:
                continue
            rec = self.requests.get(rid)
            curve = (self.history_curve if past else self.lookup_curve) if copied else self.constrained_curve if masked else self.curve
            for j in range(min(acc + 1, n, len(cs))):  # the positions the target judged
                ok = j < acc
                if rec is not None:
                    rec.predicted += curve(cs[j])
                    rec.accepted += ok
                curve.add(cs[j], ok)
            if copied:  # the step's worth is the model draft's: copies (rewrites) would make it look better
                continue
            decay = 0.5 ** ((acc + (acc < n)) / 128.0)
            self.a = self.a * decay + acc
            self.a_trials = self.a_trials * decay + acc + (acc < n)
            for j in range(min(acc + 1, n, len(self.pos_hits))):  # the positions the target judged
                self.pos_hits[j] = self.pos_hits[j] * POSITION_FADE + (j < acc)
                self.pos_trials[j] = self.pos_trials[j] * POSITION_FADE + 1.0

    def refresh(self, grid: LatencyGrid) -> None:
        """A calibrated grid (`calibration.Calibrated`): new prices."""
        self.grid = grid
        self._prices.clear()
        self._step_ms.clear()
