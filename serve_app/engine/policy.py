"""Policies choose the speculation length k for each engine step.

A policy is a small object with two hooks, used unchanged by the offline engine and the Ray router:
  choose(state) -> k        before the step, from the batch state
  observe(stats) -> None    after the step, with what the step did (proposed / accepted ...)
Policies are pure Python, cheap (well under 1% of a step) and testable without models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from serve_app.pricing import LatencyGrid, best_k_table, context_bucket, expected_tokens
from serve_app.engine.budget import CopyCurves, prices
from serve_app.engine.draftplan import DraftPlan
from serve_app.engine.stats import StepStats


@dataclass(frozen=True)
class BatchState:
    """What a policy may look at when choosing k."""

    batch_size: int
    """Sequences that will decode in this step."""
    max_k: int
    """Upper bound on k (engine configuration)."""
    has_draft: bool = True
    """False when no draft model is loaded: k must be 0."""
    rows: tuple[str, ...] = ()
    """The decoding rows' request ids, in the engine's order (per-row policies keep a record per request)."""
    waiting: int = 0
    """Requests queued or still prefilling: prompts that want a share of the step's token budget."""
    constrained: tuple[bool, ...] = ()
    """Per decoding row: its output is constrained (structured output); empty: none is."""
    contexts: tuple[int, ...] = ()
    """KV tokens each decoding row attends (prompt + generated), in the rows' order: a profile with a context
    axis prices the step at them (`context_for`)."""
    max_copy: int = 0
    """Upper bound on a copying row's drafted tokens under a plan (`EngineConfig.max_copy_tokens`); below max_k:
    max_k."""
    copies: bool = False
    """The draft's rows may copy from their own context (a model draft with prompt lookup): a one-k policy lets
    them go on past its k (`copies_past`)."""

    def context_for(self, grid: LatencyGrid | None) -> float | None:
        """The context this step is priced at under `grid`'s context axis (rows' mean or longest, by the
        attention layout it measured); None without an axis or rows."""
        return None if grid is None else grid.step_context(self.contexts)


class Policy(Protocol):
    name: str

    def choose(self, state: BatchState) -> int | DraftPlan: ...

    def observe(self, stats: StepStats) -> None: ...


class NoSpeculation:
    """k = 0 always: plain decoding by the target (the baseline)."""

    name = "none"

    def choose(self, state: BatchState) -> int:
        return 0

    def observe(self, stats: StepStats) -> None:
        pass


class FixedK:
    """The same k every step (clamped to the engine's max_k)."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"fixed:K needs K >= 0, got {k}")
        self.k = k
        self.name = f"fixed:{k}"

    def choose(self, state: BatchState) -> int:
        return min(self.k, state.max_k) if state.has_draft else 0

    def observe(self, stats: StepStats) -> None:
        pass


class FixedPlan(FixedK):
    """fixed:k drafted as a per-row plan that prices nothing (every row drafts k tokens): the proposals of
    `FixedK`, with the draft's confidence at each position in the step's row outcomes (`StepStats.rows`), from
    which profiling measures the confidence curve `budget` starts from."""

    def __init__(self, k: int):
        super().__init__(k)
        self.name = f"fixed-plan:{k}"

    def choose(self, state: BatchState) -> int | DraftPlan:
        k = super().choose(state)
        return DraftPlan(caps=[k] * state.batch_size, model_depth=k) if k else 0


def copies_past(k: int, state: BatchState, copy_value: float, curves: CopyCurves | None = None) -> int | DraftPlan:
    """A one-k policy's k as a plan where rows may copy past it: the draft model drafts k tokens for every row,
    as at fixed k, and a row copying from its own context (prompt lookup; the suffix history) goes on to
    `max_copy` while each copied token's chance of acceptance, with every one before it, is worth
    `copy_value` expected tokens (its verification's price). A copy runs no draft forward, so past k it costs
    verification only: a rewrite's row drafts 12 where chat rows draft 2. `curves`: what the copies' estimates
    came to so far (learnt from the rows); None: the estimates themselves. Plain k where no row can copy."""
    if k <= 0 or not state.copies or state.max_copy <= k:
        return k
    return DraftPlan(caps=[state.max_copy] * state.batch_size, model_depth=k, copy_value=copy_value,
                     **(curves.plan() if curves is not None else {}))


class LookupTable:
    """The paper's policy: k = best_k[batch size] from the hardware's profile.

    Between profiled batch sizes the nearest one is used (the smaller on a tie); beyond the ends,
    the end values. With a latency grid, rows that copy from their context may go on past k, each copied
    token priced by the grid (`copies_past`).
    """

    name = "lut"

    def __init__(self, best_k: dict[int, int], latency: LatencyGrid | None = None, acceptance: list[float] | None = None):
        if not best_k:
            raise ValueError("lut needs a profile with a best_k table")
        self.sizes = sorted(best_k)
        self.best_k = dict(best_k)
        # with a context axis the table gains one: the best k per batch size at the live context, from the grid
        self.latency = latency if latency is not None and latency.context is not None and acceptance else None
        self.acceptance = acceptance
        self.copy_grid = latency if latency is not None and acceptance else None  # prices copies past k
        self._tables: dict[int, dict[int, int]] = {}  # context bucket -> best k per profiled batch size
        self._copy_value: dict[tuple, float | None] = {}  # (batch size, context bucket, k) -> copy_value (cache)
        self.copies = CopyCurves()

    def table(self, context: float | None) -> dict[int, int]:
        """The best-k table at a context (the profile's own table without a context axis)."""
        c = context_bucket(context)
        if self.latency is None or c is None:
            return self.best_k
        if c not in self._tables:
            self._tables[c] = best_k_table(self.latency, self.acceptance, c)
        return self._tables[c]

    def reprice(self, latency: LatencyGrid, acceptance: list[float]) -> None:
        """A calibrated grid and the live acceptance: the table (and its context tables) again."""
        self.best_k.update(best_k_table(latency, acceptance))
        self.copy_grid, self.acceptance = latency, acceptance
        self._copy_value.clear()
        if self.latency is not None:
            self.latency = latency
            self._tables.clear()

    def choose(self, state: BatchState) -> int | DraftPlan:
        if not state.has_draft:
            return 0
        b = state.batch_size
        nearest = min(self.sizes, key=lambda s: (abs(s - b), s))
        table = self.table(state.context_for(self.latency))
        k = min(table.get(nearest, self.best_k[nearest]), state.max_k)
        if k <= 0 or not state.copies or self.copy_grid is None:
            return k
        key = (b, context_bucket(state.context_for(self.copy_grid)), k)
        if key not in self._copy_value:
            # what a step at k is worth: its rows' expected tokens (the profile's acceptance per position) per ms
            grid = self.copy_grid
            ms = dict(zip(grid.ks, grid.step_ms(b, key[1]))).get(k)
            self._copy_value[key] = b * (1 + sum(self.acceptance[:k])) / ms * prices(grid, b, key[1], k + 1).token_ms \
                if ms else None
        value = self._copy_value[key]
        return k if value is None else copies_past(k, state, value, self.copies)

    def observe(self, stats: StepStats) -> None:
        self.copies.observe(stats.rows)


class AcceptanceEstimate:
    """Live per-token acceptance a, over roughly the last `half_life` draft-token outcomes.

    Each sequence in a step with k > 0 contributes its accepted tokens as successes and, unless it
    accepted all k, one failure (the rejected token): the likelihood of the geometric model behind
    `pricing.expected_tokens`. The draft's backlog check (tokens committed while it was not
    speculating, each one matched or not) adds successes and failures the same way. Older outcomes
    fade by half every `half_life` new ones; the starting value weighs as much as one half-life.
    """

    def __init__(self, start: float, half_life: float = 128.0):
        if not 0.0 <= start <= 1.0:
            raise ValueError(f"acceptance rate must lie in [0, 1], got {start}")
        self.half_life = half_life
        self.accepted, self.trials = start * half_life, half_life

    @property
    def value(self) -> float:
        return self.accepted / self.trials if self.trials else 0.0

    def observe(self, stats: StepStats) -> None:
        if not stats.k or not stats.batch_size:
            return
        if stats.rows is not None:  # a plan's step: rows drafted different lengths, and copies are not the draft's
            r = stats.rows
            model = [(d, a) for d, a, c in zip(r.drafted, r.accepted, r.lookup or [False] * len(r.ids)) if d and not c]
            successes = sum(a for _, a in model) + stats.backlog_matched
            n = sum(a + (a < d) for d, a in model) + stats.backlog_checked
            if not n:
                return
        else:
            stops = stats.batch_size - stats.accepted_per_position[stats.k - 1]
            successes = stats.accepted + stats.backlog_matched
            n = stats.accepted + stops + stats.backlog_checked
        decay = 0.5 ** (n / self.half_life)
        self.accepted = decay * self.accepted + successes
        self.trials = decay * self.trials + n


class Adaptive:
    """Ours: the k with the highest expected goodput, from the profile's latencies and live acceptance.

    goodput(k) = batch * E[tokens | a, k] / step_ms(batch, k), with E from `pricing.expected_tokens`
    and step_ms interpolated from the profile's latency grid. The acceptance a starts at the
    profile's fitted value and then follows what the steps observe: a moving estimate over roughly
    the last `half_life` draft-token outcomes (`AcceptanceEstimate`), so it tracks a workload
    whose draft agrees more or less than the profiling prompts did. When no k > 0 beats plain
    decoding it chooses 0; then every `probe_every`-th step proposes one token anyway: the draft
    catches up on the tokens it skipped and scores them (StepStats.backlog_*), so the estimate keeps
    learning and speculation comes back when the workload turns agreeable. A probe costs about one
    extra verification token per sequence, partly repaid by what it gets accepted.
    """

    name = "adaptive"

    def __init__(self, grid: LatencyGrid, acceptance_rate: float, half_life: float = 128.0, probe_every: int = 16):
        self.grid, self.probe_every = grid, probe_every
        self.estimate = AcceptanceEstimate(acceptance_rate, half_life)
        self.copies = CopyCurves()  # what the copies past k came to
        self._step_ms: dict[tuple, list[float]] = {}  # (batch size, context bucket) -> step latency per k (cache)
        self._token_ms: dict[tuple, float] = {}  # (batch size, context bucket, k) -> `token_ms` (cache)
        self._since_probe = 0

    @property
    def acceptance_estimate(self) -> float:
        return self.estimate.value

    def goodput(self, batch_size: int, max_k: int, context: float | None = None) -> list[float]:
        """Expected tokens per millisecond for k = 0 .. min(max_k, profiled K), at `context` KV tokens per row."""
        key = (batch_size, context_bucket(context))
        ms = self._step_ms.get(key)
        if ms is None:
            ms = self._step_ms[key] = self.grid.step_ms(batch_size, key[1])
        a = self.acceptance_estimate
        return [batch_size * expected_tokens(a, k) / ms[j] for j, k in enumerate(self.grid.ks) if k <= max_k]

    def choose(self, state: BatchState) -> int | DraftPlan:
        if not state.has_draft:
            return 0
        context = state.context_for(self.grid)
        g = self.goodput(state.batch_size, state.max_k, context)
        j = max(range(len(g)), key=lambda j: (g[j], -j))  # ties: the smaller k
        k = self.grid.ks[j]
        if k == 0 and self.probe_every and state.max_k > 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return 1  # a plain k: the probe's step scores the draft's backlog (a plan's keeps one position)
        if k <= 0 or not state.copies:
            return k
        return copies_past(k, state, g[j] * self.token_ms(state.batch_size, k, context), self.copies)

    def token_ms(self, batch_size: int, k: int, context: float | None) -> float:
        """Verifying one more drafted token at this batch size where a step drafts about k (`budget.prices`' slope
        through k + 1): what a token copied past k costs."""
        key = (batch_size, context_bucket(context), k)
        if key not in self._token_ms:
            self._token_ms[key] = prices(self.grid, batch_size, key[1], k + 1).token_ms
        return self._token_ms[key]

    def observe(self, stats: StepStats) -> None:
        self.copies.observe(stats.rows)
        if stats.k:
            self._since_probe = 0
            self.estimate.observe(stats)

    def refresh(self, grid: LatencyGrid) -> None:
        """A calibrated grid (`calibration.Calibrated`): goodput and copy prices from it."""
        self.grid = grid
        self._step_ms.clear()
        self._token_ms.clear()


POLICY_FORMS = "none | fixed:K | lut | adaptive | budget"
PROFILE_POLICIES = ("lut", "adaptive", "budget")
"""Policies that steer by a profile of the hardware type."""
PER_ROW_POLICIES = ("budget",)
"""Policies that choose a length per row (a DraftPlan), which the one-k simulators do not model (lut's and
adaptive's copies past k, `copies_past`, they do not model either: they simulate those policies' k)."""


def make_policy(spec: str, profile=None) -> Policy:
    """Build a policy from its spec string; unknown specs raise ValueError up front.

    `profile` (a profiles.Profile) is required by the profile-driven policies `lut`, `adaptive`, `budget`.
    """
    spec = spec.strip()
    if spec == "none":
        return NoSpeculation()
    if spec in PROFILE_POLICIES:
        if profile is None:
            raise ValueError(f"policy {spec!r} needs a profile for this hardware type (see profiles/)")
        if spec == "lut":
            return LookupTable(profile.best_k, profile.latency, profile.acceptance)
        if profile.latency is None or profile.acceptance_rate is None:
            raise ValueError(f"policy {spec!r} needs a profile with a latency grid and an acceptance rate; "
                             f"the one for {profile.gpu_type} has only a best-k table (run `specserve profile`)")
        if spec == "budget":
            from serve_app.engine.budget import Budget

            return Budget(profile.latency, profile.acceptance_rate, curve=profile.confidence_curve)
        return Adaptive(profile.latency, profile.acceptance_rate)
    name, _, arg = spec.partition(":")
    if name == "fixed":
        if not arg.isdigit():
            raise ValueError(f"policy {spec!r}: fixed needs a whole number, e.g. fixed:4")
        return FixedK(int(arg))
    raise ValueError(f"unknown policy {spec!r}: expected {POLICY_FORMS}")


def needs_profile(spec: str) -> bool:
    return spec.strip() in PROFILE_POLICIES


def fit_choice(choice: int | DraftPlan, max_k: int, room: int, batch_size: int, max_copy: int = 0) -> int | DraftPlan:
    """A policy's choice within the engine's limits: at most max_k per row (a plan's copying rows: max_copy) and
    `room` drafted tokens in all (the step's token budget less the rows' own tokens and what prefills keep). 0
    when nothing is drafted."""
    if isinstance(choice, DraftPlan):
        caps = [min(c, max(max_k, max_copy)) for c in choice.caps]
        limit = room if choice.max_tokens is None else min(choice.max_tokens, room)
        if limit <= 0 or not any(caps):
            return 0
        depth = max_k if choice.model_depth is None else min(choice.model_depth, max_k)  # model rows: max_k
        return replace(choice, caps=caps, max_tokens=limit, model_depth=depth)
    return max(0, min(choice, max_k, room // batch_size))
