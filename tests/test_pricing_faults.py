"""How `budget` and calibration price and learn from a step, fault by fault (each failed before its fix):
1. a step's draft is priced by the forwards it ran (copy rows run none), counted in StepStats;
2. steps at a k between the profiled ones (3, 5-8 against a startup profile's 0, 1, 2, 4) calibrate too;
3. a plan whose walk kept nothing still ran its first forward, and says so;
4. copies do not move the model draft's acceptance (the step's worth);
5. constrained rows (grammar, forced tool calls) learn a curve of their own;
6. a request missing from one step (its predicted output drafted for it) keeps its record."""

import random

import pytest

from conftest import IdTokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.engine.budget import Budget
from serve_app.engine.draftplan import DraftPlan
from serve_app.engine.lookup import CopyRecord
from serve_app.engine.policy import BatchState
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import RowOutcomes, StepStats
from serve_app.engine.worker import ModelWorker
from serve_app.profiling.calibration import Calibration
from serve_app.pricing import LatencyGrid

KS = [0, 1, 2, 4]
GRID = LatencyGrid(batch_sizes=[1, 8], ks=KS, draft_ms=[[0.5 + 3 * k for k in KS], [0.5 + 6 * k for k in KS]],
                   verify_ms=[[20 + 2 * k for k in KS], [30 + 8 * k for k in KS]], other_ms=[[1.0] * 4, [1.0] * 4])


def test_calibration_prices_the_draft_by_its_forwards_and_takes_every_k():
    cal = Calibration(GRID, warmup=0, min_samples=4)
    for i in range(24):
        k = (3, 5, 4)[i % 3]  # plan steps between and past the profiled ks, each with one forward (rows copy)
        st = StepStats(batch_size=8, k=k, draft_forwards=1, proposed=8 * k,
                       draft_s=GRID.draft_ms[1][1] / 1000, verify_s=(30 + 8 * k) / 1000,  # the grid's verification is linear in k
                       other_s=0.001)
        assert cal.observe(st)
    assert cal.factor("draft", 1) == pytest.approx(1.0, abs=1e-6)  # one forward, priced as one
    assert cal.factor("verify", 1) == pytest.approx(1.0, abs=1e-6)


def drafting_engine(policy, prompt_lookup=False):
    target, draft = tiny_llama(97, layers=2, seed=0), tiny_llama(97, layers=1, seed=1)
    return Engine(ModelWorker(target, "target"), draft_worker(draft, prompt_lookup=prompt_lookup), IdTokenizer(),
                  EngineConfig(max_batch_size=4, max_k=6), policy=policy, eos_ids=set())


class Plans:
    name = "plans"

    def __init__(self, plan):
        self.plan, self.seen = plan, []

    def choose(self, state):
        return self.plan(state.batch_size)

    def observe(self, stats):
        self.seen.append(stats)


def test_steps_count_the_draft_forwards_they_ran(monkeypatch):
    # a plan whose prices keep nothing: k = 0 reported, but the first forward ran over every row
    nothing = Plans(lambda b: DraftPlan(caps=[4] * b, token_value=1.5))
    engine = drafting_engine(nothing)
    engine.run([engine.submit([1, 2, 3], SamplingParams(max_tokens=6)), engine.submit([4, 5], SamplingParams(max_tokens=6))])
    decoding = [s for s in nothing.seen if s.batch_size]
    assert decoding and all(s.k == 0 and s.draft_forwards == 1 for s in decoding)
    # fixed k = 4 with every row copying from its context after the first position: one forward, not four
    monkeypatch.setattr(CopyRecord, "estimate", lambda self, n: 1.0)
    fixed = Plans(lambda b: 4)
    engine = drafting_engine(fixed, prompt_lookup=True)
    engine.run([engine.submit([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=12))])
    copied = [s for s in fixed.seen if s.k == 4]
    assert copied and min(s.draft_forwards for s in copied) == 1
    assert max(s.draft_forwards for s in copied) <= 4


def rows(copied=False, constrained=False, accepted=0):
    return RowOutcomes(list("ab"), [2, 2], [accepted] * 2, [[0.95, 0.95]] * 2, [copied] * 2, [constrained] * 2)


def test_copies_do_not_move_the_model_drafts_acceptance():
    pol = Budget(GRID, 0.5)
    before = pol.acceptance_estimate
    for _ in range(50):
        pol.observe(StepStats(batch_size=2, k=2, proposed=4, accepted=4, rows=rows(copied=True, accepted=2)))
    assert pol.acceptance_estimate == pytest.approx(before)
    assert pol.lookup_curve(0.95) > 0.9  # the copies' own curve learned them
    for _ in range(50):
        pol.observe(StepStats(batch_size=2, k=2, proposed=4, accepted=0, rows=rows()))
    assert pol.acceptance_estimate < before


def test_constrained_rows_learn_a_curve_of_their_own():
    pol = Budget(GRID, 0.5)
    for _ in range(80):  # forced tokens under a grammar: sure and accepted; free text at the same confidence: not
        pol.observe(StepStats(batch_size=2, k=2, proposed=4, accepted=4, rows=rows(constrained=True, accepted=2)))
        pol.observe(StepStats(batch_size=2, k=2, proposed=4, accepted=0, rows=rows()))
    assert pol.constrained_curve(0.95) > 0.8 and pol.curve(0.95) < 0.2
    plan = pol.choose(BatchState(2, 4, True, ("a", "b"), constrained=(True, False)))
    if isinstance(plan, DraftPlan):  # the plan maps each row's confidence through its own curve
        assert plan.estimate(0, 0.95) > 0.8 > 0.2 > plan.estimate(1, 0.95)
    plain = DraftPlan(caps=[2, 2], curve=[0.1] * 10, constrained=[True, False], constrained_curve=[0.9] * 10)
    assert plain.estimate(0, 0.5) == pytest.approx(0.9) and plain.estimate(1, 0.5) == pytest.approx(0.1)


def test_a_request_missing_from_one_step_keeps_its_record():
    pol = Budget(GRID, 0.5)
    pol.choose(BatchState(2, 4, True, ("a", "b")))
    pol.requests["a"].accepted, pol.requests["a"].predicted = 10.0, 2.0
    pol.choose(BatchState(1, 4, True, ("b",)))  # "a" drafted from its predicted output this step
    pol.choose(BatchState(2, 4, True, ("a", "b")))
    assert pol.requests["a"].accepted == 10.0 and pol.requests["a"].scale > 1.5
    for i in range(400):  # finished requests do not pile up
        pol.choose(BatchState(1, 4, True, (f"r{i}",)))
    assert len(pol.requests) < 400


def test_budget_learns_acceptance_per_position_where_a_geometric_a_misprices_both_ends():
    """A draft that misses its first token half the time but, once right, keeps agreeing (a document): one
    geometric a (about 0.8) overprices the first token (0.8 against 0.5) and underprices the deep ones (a^4 = 0.41
    for the 4th against 0.5 x 0.98^3). The per-position estimates learn 0.5, then about 0.98, and `expected(k)`,
    the step's worth and the depth model rows reach (the best uniform k), follows them."""
    from serve_app.engine.budget import POSITION_PRIOR
    from serve_app.pricing import expected_tokens

    pol = Budget(GRID, 0.5)
    assert pol.expected(3) == pytest.approx(expected_tokens(0.5, 3))  # before any outcome: the profile's a
    rng = random.Random(0)
    for _ in range(400):
        acc = [0 if rng.random() < 0.5 else 4 - (rng.random() < 0.05) for _ in range(2)]
        pol.observe(StepStats(batch_size=2, k=4, proposed=8, accepted=sum(acc),
                              rows=RowOutcomes(list("ab"), [4, 4], acc, [[0.5] * 4] * 2, [False] * 2, [False] * 2)))
    c = [h / t for h, t in zip(pol.pos_hits, pol.pos_trials)]
    assert c[0] == pytest.approx(0.5, abs=0.08) and min(c[1:3]) > 0.9
    a = pol.acceptance_estimate
    assert a == pytest.approx(0.8, abs=0.04)
    fourth = pol.expected(4) - pol.expected(3)
    assert fourth == pytest.approx(c[0] * c[1] * c[2] * c[3], rel=0.05) and fourth > a ** 4 + 0.03
    assert pol.expected(1) < expected_tokens(a, 1) - 0.2
    ms = GRID.step_ms(1)
    assert pol.uniform(1)[0] == max(GRID.ks, key=lambda k: (pol.expected(k) / ms[GRID.ks.index(k)], -k))
    assert POSITION_PRIOR > 0 and pol.expected(8) >= pol.expected(4)  # positions never reached lean on the last one


def test_budget_prices_at_the_grid_cells_not_a_line_through_every_k():
    """A verification whose time is not linear in k (a kernel that changes shape: here k = 3 verifies as fast as
    k = 1 and k = 7-8 jump): the best uniform k is the grid's own, and the walk's token price is the slope where
    the step drafts, not one set by k it never runs. Before: lines through k = 1-8 put k = 3 at 55 ms (the grid
    says 49) and priced a drafted token at over 3x its local cost."""
    ks = list(range(9))
    verify = [39.2, 43.0, 43.9, 41.5, 46.0, 48.3, 49.2, 60.0, 62.0]
    grid = LatencyGrid(batch_sizes=[1, 8], ks=ks, draft_ms=[[2.4 * k for k in ks], [4.0 * k for k in ks]],
                       verify_ms=[verify, [v * 2 for v in verify]], other_ms=[[0.1] * 9, [0.1] * 9])
    pol = Budget(grid, 0.75)
    step = grid.step_ms(1)
    best = max(ks, key=lambda k: (pol.expected(k) / step[k], -k))
    assert best == 3 and pol.uniform(1)[0] == 3
    whole, local = pol.prices(1), pol.prices(1, upto=4)
    assert local.token_ms < whole.token_ms / 3
    plan = pol.choose(BatchState(batch_size=1, has_draft=True, max_k=8))
    assert isinstance(plan, DraftPlan) and plan.model_depth == 3
    assert plan.token_value == pytest.approx(pol.rate(1) * pol.prices(1, upto=4).token_ms)
