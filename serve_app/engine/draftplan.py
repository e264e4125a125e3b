"""Per-row speculation lengths: what the `budget` policy asks of the draft for one step, and how the draft
walks it. Pure Python, a few numbers per row; testable without models.

A step's cost grows with what it drafts and verifies; its yield grows with the drafted tokens the target
accepts. A policy that gives every row the same k pays for the rows whose drafts fail as much as for the
rows whose drafts agree. A `DraftPlan` instead prices a drafted token and a draft forward in the step's own
currency (expected accepted tokens, at the step's tokens-per-ms rate), and the draft keeps drafting a row
only while the row's next token is worth its verification:

- value_b(j) = the chance that drafted tokens 0..j of row b are all accepted: the product of the per-token
  estimates e_b(i) = curve(draft confidence at i) x scale_b, for i <= j. The draft's confidence at a
  position is the largest probability of its (warped) distribution there: a function of the prefix only,
  never of the token drawn, so deciding on it keeps rejection sampling exact (a stop that looked at the
  sampled token would bias which tokens get verified). Greedy and seeded rows are exact at any length.
- token j stays in row b's proposal while value_b(j) >= token_value (and j < caps[b]);
- a row stays in the next draft forward while it expects to gain more than its own price there (value_b(j) x
  e_b(j), a one-step look-ahead with e_b(j) standing in for the next estimate, against token_value +
  row_value), and the forward runs while those rows together expect more than its fixed price forward_value;
- at most max_tokens drafted tokens in all (the step's token budget): a position that would pass it keeps
  the rows with the highest values.

Expected accepted tokens of a row = the sum of its values (each drafted token counts when it and every
token before it are accepted), so this is the greedy allocation of verification to the most likely tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

CURVE_BINS = 10
"""The confidence curve's resolution: draft confidence in tenths."""


@dataclass(frozen=True)
class DraftPlan:
    """One step's speculation, row by row (rows in the order the engine passes them to the draft)."""

    caps: list[int]
    """Most tokens row b may draft this step (0: none)."""
    token_value: float = 0.0
    """A drafted token stays in the proposal while the chance that it and every earlier token of its row
    are accepted is at least this: its verification's price in expected accepted tokens."""
    forward_value: float = 0.0
    """Expected accepted tokens another draft forward must promise (its fixed price, same currency)."""
    row_value: float = 0.0
    """What a row adds to a draft forward's price (a forward runs over the rows that still draft)."""
    max_tokens: int | None = None
    """Drafted tokens in all, at most (the step's token budget less the rows' own and the prefills')."""
    scale: list[float] | None = None
    """Per row: its request's own correction of the confidence curve (its drafts agree more or less than
    the curve says); None: 1 for every row."""
    curve: list[float] | None = None
    """Acceptance chance per confidence bin (`CURVE_BINS`, learned online); None: the confidence itself."""
    explore: bool = False
    """Every row with a cap keeps its first token whatever it is worth: the target's verdict on it teaches the
    curve about confidences the prices would never let through."""
    model_depth: int | None = None
    """Rows the draft model drafts stop at this many tokens (the uniform k the step's prices call for);
    rows copying from their own context (prompt lookup) may go on to their caps. None: no such limit."""
    lookup_curve: list[float] | None = None
    """The same for tokens a draft copied from the row's own context (prompt lookup), whose confidence is
    the lookup's own estimate: its copy record's acceptance so far, from a prior that grows with the matched
    suffix's length (`lookup.CopyRecord.estimate`; an n-gram draft's, `NgramDraft.match_confidence`)."""

    constrained: list[bool] | None = None
    """Per row: its output is constrained (a grammar, a forced tool call), so the draft's confidence is measured
    under the mask, where it is near 1 on forced tokens whatever the draft knows; None: no row is."""
    constrained_curve: list[float] | None = None
    """The curve for constrained rows' model drafts (free text and masked text agree differently at the same
    confidence); None: the model curve."""
    history_curve: list[float] | None = None
    """The curve for tokens copied from the suffix history (`engine.history`; confidence: the match's estimate
    per token, `history.history_estimate`); None: the lookup curve."""
    copy_value: float | None = None
    """A copied token (prompt lookup, the suffix history) stays in the proposal while its value is at least this;
    None: token_value. A one-k policy (lut, adaptive) drafts its k from the model whatever the draft's confidence
    (token_value 0, model_depth k) and prices only the copied tokens past k (`policy.copies_past`)."""

    @property
    def k(self) -> int:
        """Draft forwards at most: the longest cap."""
        return max(self.caps, default=0)

    def estimate(self, b: int, conf: float, lookup: bool = False, history: bool = False) -> float:
        """Row b's chance that a drafted token of confidence `conf` is accepted (given the ones before were); a
        `lookup` token was copied (from the row's context, or from the suffix history: `history`)."""
        if lookup and history and self.history_curve is not None:
            curve = self.history_curve
        elif lookup:
            curve = self.lookup_curve
        elif self.constrained is not None and self.constrained[b] and self.constrained_curve is not None:
            curve = self.constrained_curve
        else:
            curve = self.curve
        e = conf if curve is None else curve[min(int(conf * CURVE_BINS), CURVE_BINS - 1)]
        if self.scale is not None:
            e *= self.scale[b]
        return min(max(e, 0.0), 0.999)


class PlanWalk:
    """The draft's side of a plan: call `position(j, conf)` after drafting position j of the active rows;
    it says which rows keep their token and whether another forward is worth running."""

    def __init__(self, plan: DraftPlan):
        self.plan = plan
        n = len(plan.caps)
        self.lengths = [0] * n  # tokens kept per row
        self.value = [1.0] * n  # chance that the row's kept tokens are all accepted
        self.active = [c > 0 for c in plan.caps]  # rows still drafting
        self.estimates: list[list[float]] = [[] for _ in range(n)]  # e_b(i) of the kept tokens
        self.total = 0

    def position(self, j: int, conf: list[float], lookup: list[bool] | None = None,
                 history: list[bool] | None = None) -> bool:
        """Position j was drafted with confidence conf[b] for every row (inactive rows' are ignored; lookup[b]:
        row b copies, from its context or, history[b], from the suffix history). Returns whether another forward
        of the draft model is worth it (for the rows it drafts; copying rows need none)."""
        p = self.plan
        cand = []
        for b, on in enumerate(self.active):
            if not on:
                continue
            copying = bool(lookup and lookup[b])
            e = p.estimate(b, conf[b], copying, bool(history and history[b]))
            v = self.value[b] * e
            bar = p.copy_value if copying and p.copy_value is not None else p.token_value
            if (v >= bar or (p.explore and j == 0)) and j < p.caps[b]:
                cand.append((v, b, e))
            else:
                self.active[b] = False
        if p.max_tokens is not None and self.total + len(cand) > p.max_tokens:
            cand.sort(reverse=True)
            for _, b, _ in cand[max(p.max_tokens - self.total, 0):]:
                self.active[b] = False
            cand = cand[: max(p.max_tokens - self.total, 0)]
        gain, drafting = 0.0, False
        for v, b, e in cand:
            self.lengths[b] = j + 1
            self.value[b] = v
            self.estimates[b].append(e)
            self.total += 1
            net = v * e - p.token_value - p.row_value  # what drafting its next token should earn it
            copying = bool(lookup and lookup[b])
            if j + 1 >= p.caps[b] or (not copying and p.model_depth is not None and j + 1 >= p.model_depth):
                self.active[b] = False
            elif copying:  # a copying row goes on without the draft's forwards
                continue
            elif net > 0:
                gain += net
                drafting = True
            else:
                self.active[b] = False
        if p.max_tokens is not None and self.total >= p.max_tokens:
            return False
        return drafting and gain >= p.forward_value
