"""Per-row speculation lengths (`DraftPlan`, the `budget` policy): ragged proposals stay lossless through every
draft kind, seeded text does not move, sampling stays exact when rows stop on the draft's confidence; the walk
and the policy's prices as pure functions."""

import random
from dataclasses import replace

import pytest
import torch

from conftest import IdTokenizer, assert_marginals, exact_marginals, sharp_pair, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.ngram import NgramDraft
from serve_app.engine.budget import Budget, ConfidenceCurve, prices
from serve_app.engine.draftplan import DraftPlan, PlanWalk
from serve_app.engine.policy import AcceptanceEstimate, Adaptive, BatchState, LookupTable, fit_choice
from serve_app.engine.sampling import Warp, noise_key, verify_walk
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import RowOutcomes, StepStats
from serve_app.engine.worker import ModelWorker
from serve_app.pricing import LatencyGrid

PROMPTS = [[1, 2, 3], [5] * 11, list(range(10, 40)), [7, 8], [42], list(range(60, 50, -1))]


class RandomPlans:
    """Every step a new plan: random caps per row (0 included), random prices (so rows also stop on the
    draft's confidence), sometimes a tight token budget."""

    name = "random-plans"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.rows_seen = 0

    def choose(self, state):
        r = self.rng
        return DraftPlan(caps=[r.choice([0, 1, 2, 3, 5, 7]) for _ in range(state.batch_size)],
                         token_value=r.choice([0.0, 0.0, 0.05, 0.3]), forward_value=r.choice([0.0, 0.2]),
                         max_tokens=r.choice([None, None, 3]), copy_value=r.choice([None, None, 0.0, 0.5]),
                         model_depth=r.choice([None, None, 1, 2]))

    def observe(self, stats):
        if stats.rows is not None:
            self.rows_seen += 1
            assert stats.proposed == sum(stats.rows.drafted) and stats.k == max(stats.rows.drafted)
            assert all(a <= n for a, n in zip(stats.rows.accepted, stats.rows.drafted))


def reference(target, prompts, n):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=[])
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def ref20(tiny_target):
    return reference(tiny_target, PROMPTS, 20)


@pytest.fixture(scope="module")
def drafts(tiny_target, tiny_drafts):
    eagle = Eagle3Draft.from_target(tiny_target, torch.arange(0, 97, 3), [0, 1, 2])
    return {"random": tiny_drafts["random"], "near": tiny_drafts["near"], "same": tiny_drafts["same"],
            "eagle3": eagle, "ngram": NgramDraft()}


def make_engine(target, draft, policy, **cfg):
    return Engine(ModelWorker(target, "target"), draft_worker(draft) if draft is not None else None, IdTokenizer(),
                  EngineConfig(**cfg), policy=policy, eos_ids=set())


@pytest.mark.parametrize("kind", ["random", "near", "same", "eagle3", "ngram"])
def test_greedy_identical_to_target_alone_with_ragged_rows(tiny_target, drafts, ref20, kind):
    policy = RandomPlans()
    engine = make_engine(tiny_target, drafts[kind], policy, max_batch_size=4)
    reqs = [engine.submit(p, SamplingParams(max_tokens=20 - 2 * (i % 3))) for i, p in enumerate(PROMPTS)]
    engine.run(reqs)
    for i, r in enumerate(reqs):
        assert r.output_ids == ref20[i][: 20 - 2 * (i % 3)], (i, kind)
    assert policy.rows_seen > 5
    if kind == "same":
        assert all(r.stats.accepted == r.stats.proposed for r in reqs) and sum(r.stats.proposed for r in reqs) > 20


def _seeded(engine, prompts, seeds, n=16):
    reqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.9, seed=s)) for p, s in zip(prompts, seeds)]
    engine.run(reqs)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("kind", ["near", "eagle3", "ngram"])
def test_seeded_text_is_the_same_at_any_per_row_length(tiny_target, drafts, kind):
    seeds = [3, 4, 5, 6]
    alone = [_seeded(make_engine(tiny_target, None, RandomPlans()), [p], [s])[0] for p, s in zip(PROMPTS[:4], seeds)]
    ragged = _seeded(make_engine(tiny_target, drafts[kind], RandomPlans(1), max_batch_size=3), PROMPTS[:4], seeds)
    assert ragged == alone


def test_sampling_stays_exact_when_rows_stop_on_the_drafts_confidence():
    """Tokens 2 and 3, decided by drafts whose lengths follow the draft's confidence, keep the target's marginals."""
    vocab, trials = 6, 3000
    target, draft = sharp_pair(vocab, 40)
    prompt = [1, 2, 3]
    t2, t3 = exact_marginals(target, prompt, vocab)

    class Confident:  # rows draft on while the draft's confidence holds: lengths depend on the draft's state
        name = "confident"

        def choose(self, state):
            return DraftPlan(caps=[3] * state.batch_size, token_value=0.35)

        def observe(self, stats):
            pass

    engine = make_engine(target, draft, Confident(), max_batch_size=64, max_num_tokens=100_000)
    reqs = [engine.submit(prompt, SamplingParams(max_tokens=3, temperature=1.0)) for _ in range(trials)]
    lengths = []
    engine.on_step.append(lambda st: st.rows and lengths.extend(st.rows.drafted))
    engine.run(reqs)
    assert len(set(lengths)) >= 3  # the confidence really made rows differ
    assert sum(r.stats.accepted for r in reqs) > 0.05 * sum(r.stats.proposed for r in reqs)
    assert_marginals(reqs, t2, t3, vocab)


def test_walk_gives_rows_past_their_length_the_bonus_token():
    """Greedy rows drafted 3 / 1 / 0 of 3 tokens, all agreeing with the target: each accepts what it drafted
    and gets the target's next token there."""
    vocab = 8
    target = [[3, 1, 4, 5], [3, 1, 4, 5], [3, 1, 4, 5]]
    logits = torch.full((3, 4, vocab), -5.0)
    for b, row in enumerate(target):
        for j, t in enumerate(row):
            logits[b, j, t] = 5.0
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4], [3, 1, 4]])
    w = Warp(torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    keys = torch.full((3, 4), -1, dtype=torch.int32)
    n, nxt = verify_walk(logits, drafts, torch.ones(3, dtype=torch.bool), keys, torch.zeros(3, dtype=torch.bool), w,
                         None, None, torch.zeros(3, 3), None, torch.tensor([3, 1, 0]))
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [5, 1, 3]
    # sampled (unseeded) rows: a row past its length takes the bonus from p, never a rejection test
    p = torch.softmax(torch.randn(2, 3, vocab) * 3, -1)
    q_ids = torch.arange(vocab).repeat(2, 2, 1).int()
    keys = torch.tensor([[noise_key(b, j) for j in range(3)] for b in range(2)], dtype=torch.int32)
    w = Warp(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2))
    n, _ = verify_walk(p.log(), torch.tensor([[1, 2], [1, 2]]), torch.zeros(2, dtype=torch.bool), keys,
                       torch.zeros(2, dtype=torch.bool), w, p[:, :2].clone(), q_ids, torch.full((2, 2), 0.999),
                       None, torch.tensor([0, 1]))
    assert n.tolist() == [0, 1]  # q == p accepts every drafted token, and only those


def test_plan_walk_keeps_rows_while_their_tokens_are_worth_it():
    plan = DraftPlan(caps=[4, 4, 1, 0], token_value=0.2)
    walk = PlanWalk(plan)
    assert walk.position(0, [0.9, 0.3, 0.9, 0.9])  # rows 0, 1, 2 keep token 0; row 3 drafts nothing
    # row 1 keeps its token (0.3 >= 0.2) but leaves the next forward: its next is worth 0.3 x 0.3 < 0.2
    assert walk.lengths == [1, 1, 1, 0] and walk.active == [True, False, False, False]
    walk.position(1, [0.9, 0.5, 0.0, 0.0])
    assert walk.lengths == [2, 1, 1, 0] and walk.value[0] == pytest.approx(0.81)
    # a row's share of the next forward's price
    walk = PlanWalk(DraftPlan(caps=[4, 4], row_value=0.5))
    assert walk.position(0, [0.9, 0.6]) and walk.active == [True, False]  # 0.81 > 0.5 > 0.36
    # a tight budget keeps the most valuable rows
    walk = PlanWalk(DraftPlan(caps=[3, 3, 3], max_tokens=4))
    walk.position(0, [0.5, 0.9, 0.7])
    walk.position(1, [0.5, 0.9, 0.9])
    assert walk.lengths == [1, 2, 1] and walk.total == 4
    # another forward only when the rows still drafting expect more than its price
    walk = PlanWalk(DraftPlan(caps=[5, 5], forward_value=1.0))
    assert not walk.position(0, [0.6, 0.6])  # expected 0.36 + 0.36 < 1.0
    # the learned curve and each row's scale turn confidence into an acceptance chance
    plan = DraftPlan(caps=[2, 2], token_value=0.5, curve=[0.9] * 10, scale=[1.0, 0.5])
    walk = PlanWalk(plan)
    walk.position(0, [0.1, 0.1])
    assert walk.lengths == [1, 0]
    # rows the model drafts stop at the step's uniform depth; a row copying from its context goes on
    walk = PlanWalk(DraftPlan(caps=[6, 6], model_depth=1))
    assert not walk.position(0, [0.99, 0.99], [False, True])  # no forward: the model row is done
    walk.position(1, [0.99, 0.99], [False, True])
    assert walk.lengths == [1, 2] and walk.active == [False, True]


def test_fit_choice_keeps_plans_within_the_engine_limits():
    assert fit_choice(9, 8, 20, 4) == 5 and fit_choice(3, 8, -1, 4) == 0
    plan = fit_choice(DraftPlan(caps=[9, 2]), 4, 5, 2)
    assert plan.caps == [4, 2] and plan.max_tokens == 5
    assert fit_choice(DraftPlan(caps=[0, 0]), 4, 5, 2) == 0 and fit_choice(DraftPlan(caps=[2]), 4, 0, 1) == 0


def hand_grid(on: float = 3.0, scale: float = 1.0) -> LatencyGrid:
    """draft: 2 ms per forward at batch 1 (4 at 8); verify: +1 ms per drafted token at batch 1, +0.5 per token at 8;
    k = 0 costs 10 / 20 ms; speculating at all costs `on` ms more; `scale` scales what speculation costs."""
    ks = [0, 1, 2, 3, 4]
    draft = [[0] + [2.0 * scale * k for k in ks[1:]], [0] + [4.0 * scale * k for k in ks[1:]]]
    verify = [[10] + [10 + on + scale * 1.0 * k for k in ks[1:]], [20] + [20 + on + scale * 4.0 * k for k in ks[1:]]]
    return LatencyGrid(batch_sizes=[1, 8], ks=ks, draft_ms=draft, verify_ms=verify, other_ms=[[0] * 5, [0] * 5])


def test_prices_read_the_grid():
    p1, p8 = prices(hand_grid(), 1), prices(hand_grid(), 8)
    assert (p1.base_ms, p1.on_ms, p1.forward_ms, p1.token_ms) == pytest.approx((10, 3, 2, 1))
    assert (p8.base_ms, p8.on_ms, p8.forward_ms, p8.token_ms) == pytest.approx((20, 3, 4, 0.5))
    assert p8.step_ms(8, 2) == pytest.approx(20 + 3 + 2 * (4 + 4))


def test_budget_plans_by_price_and_learns_from_outcomes():
    pol = Budget(hand_grid(), 0.6)
    plan = pol.choose(BatchState(8, 6, True, tuple("abcdefgh")))
    assert isinstance(plan, DraftPlan) and plan.caps == [6] * 8
    rate = pol.rate(8)
    assert plan.token_value == pytest.approx(rate * 0.5)
    # forwards: 2 ms at batch 1, 4 at batch 8: 2 / 7 ms per row on top of 12 / 7
    assert plan.forward_value == pytest.approx(rate * 12 / 7) and plan.row_value == pytest.approx(rate * 2 / 7)
    assert plan.model_depth == max(pol.uniform(8)[0], 1)
    # drafts that always fail: the curve and the requests' records learn it, and speculation stops
    for _ in range(200):
        st = StepStats(batch_size=8, k=2, proposed=16, accepted=0, accepted_per_position=[0, 0],
                       rows=RowOutcomes(list("abcdefgh"), [2] * 8, [0] * 8, [[0.95, 0.95]] * 8, [False] * 8))
        pol.observe(st)
        pol.choose(BatchState(8, 6, True, tuple("abcdefgh")))
    assert pol.curve(0.95) < 0.1 and pol.requests["a"].scale < 0.5
    choices = [pol.choose(BatchState(8, 6, True, tuple("abcdefgh"))) for _ in range(32)]
    assert choices.count(0) >= 30  # but it probes now and then
    assert not pol.choose(BatchState(8, 6, False))


def test_budget_runs_plain_where_its_speculating_steps_lose_to_plain_ones():
    """The prices say speculate (acceptance 0.9); the steps that did made fewer tokens than k = 0 steps would have
    in their time (the Router's regret table, served at 8 in flight on 2 cores): that batch size runs plain but for
    probes, until speculating steps pay again. Other batch sizes keep their own record."""
    pol = Budget(hand_grid(), 0.9, probe_every=16)
    at8 = lambda: pol.choose(BatchState(8, 4, True, tuple("abcdefgh")))
    assert isinstance(at8(), DraftPlan)
    for _ in range(10):  # 10 tokens in 40 ms where plain steps make 8 in 20 (the grid): 16 in that time
        pol.observe(StepStats(batch_size=8, k=1, proposed=8, generated=10, verify_s=0.040))
        assert pol.losing(8) == (pol._guard[8][2] >= 8)
    choices = [at8() for _ in range(128)]  # probes a quarter as often as elsewhere: every 64th step
    assert choices.count(0) == 126 and all(isinstance(c, DraftPlan) and c.explore for c in choices if c)
    assert not pol.losing(1) and isinstance(pol.choose(BatchState(1, 4, True, ("x",))), DraftPlan)
    pol.observe(StepStats(batch_size=8, k=1, proposed=8, generated=100, verify_s=0.040, prefill_tokens=64))
    assert pol.losing(8)  # a step that also prefilled prices its chunk: not judged
    for _ in range(40):  # speculating steps that pay: 20 tokens in 25 ms where plain ones make 10
        pol.observe(StepStats(batch_size=8, k=2, proposed=16, generated=20, verify_s=0.025))
    assert not pol.losing(8) and isinstance(at8(), DraftPlan)


def test_budget_speculates_where_its_best_uniform_k_pays():
    """Whether a step speculates at all read a geometric acceptance (a^i at position i) while the step's worth
    read it per position: drafts that got going keep agreeing (a document's), so a per-token a of 2/3 undersold
    the second position, and budget ran k = 0 where its own best uniform k was 2 (the replay's batch-1 document
    cell). Both read the same per-position chances now."""
    pol = Budget(hand_grid(), 0.5, probe_every=0)
    for i in range(300):  # every row: the first two drafts accepted, the third not
        pol.observe(StepStats(batch_size=1, k=4, proposed=4, accepted=2, accepted_per_position=[1, 1, 0, 0],
                              rows=RowOutcomes([f"r{i}"], [4], [2], [[0.9] * 4], [False])))
    k, rate = pol.uniform(1)
    assert k == 2 and rate > 1 / 10  # 3 tokens in 19 ms beat 1 in 10
    assert pol.worth_it(1, 4, [1.0], rate, pol.prices(1, None, k + 1))
    assert isinstance(pol.choose(BatchState(1, 4, True, ("new",))), DraftPlan)


def test_confidence_curve_starts_at_the_confidence_and_follows_outcomes():
    c = ConfidenceCurve(prior=8)
    assert c(0.33) == pytest.approx(0.35) and c(1.0) == pytest.approx(0.95)
    for _ in range(100):
        c.add(0.33, True)
    assert c(0.33) > 0.9 and c(0.05) == pytest.approx(0.05)


def test_measured_curve_counts_the_positions_the_target_judged_in_free_text_rows():
    """Per row, positions 0..accepted are judged (the first rejected one included, none after it); copied and
    grammar-constrained rows do not count; a bin with no outcome sits at its own confidence."""
    from serve_app.engine.budget import measured_curve

    rows = RowOutcomes(["a", "b", "c", "d"], [4, 3, 2, 2], [1, 3, 0, 2],
                       [[0.95, 0.15, 0.15, 0.15], [0.95, 0.95, 0.95], [0.55, 0.55], [0.15, 0.15]],
                       [False, False, False, True], [False, False, True, False])
    curve = measured_curve([rows], prior=2.0)
    # 0.9 bin: a's first (accepted), b's three (accepted) -> 4 of 4; 0.1 bin: a's second (rejected) only
    assert curve[9] == pytest.approx((4 + 2 * 0.95) / (4 + 2), abs=1e-4)
    assert curve[1] == pytest.approx((0 + 2 * 0.15) / (1 + 2), abs=1e-4)
    assert curve[5] == pytest.approx(0.55) and curve[0] == pytest.approx(0.05)  # c constrained, d copied
    assert measured_curve([]) is None


def test_budget_starts_from_the_profiles_confidence_curve():
    """A profile's measured curve is where budget's model-draft curve starts (free text only; the others at
    the confidence), and what its first plan carries; served outcomes then move it."""
    from serve_app.engine.policy import make_policy
    from serve_app.profiling.profiles import Profile

    measured = [0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 0.75, 0.8, 0.85, 0.9]
    prof = Profile(gpu_type="cpu-test", target="t", draft="d", best_k={1: 2, 8: 1}, latency=hand_grid(),
                   acceptance=[0.6, 0.36], acceptance_rate=0.6, confidence_curve=measured)
    pol = make_policy("budget", prof)
    assert pol.curve.values() == pytest.approx(measured)
    assert pol.constrained_curve(0.05) == pytest.approx(0.05) and pol.lookup_curve(0.05) == pytest.approx(0.05)
    plan = pol.choose(BatchState(8, 6, True, tuple("abcdefgh")))
    assert plan.curve == pytest.approx(measured) and plan.estimate(0, 0.05) == pytest.approx(0.2)
    for _ in range(50):
        pol.curve.add(0.05, False)
    assert pol.curve(0.05) < 0.05
    assert make_policy("budget", prof.model_copy(update={"confidence_curve": None})).curve(0.05) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="confidence_curve needs 10 values"):
        Profile.model_validate(prof.model_dump() | {"confidence_curve": [0.5] * 9})


def test_fixed_plan_drafts_what_fixed_k_drafts_and_reports_the_confidences(tiny_target, drafts, ref20):
    """`FixedPlan(k)` (profiling's acceptance pass): the same tokens drafted and accepted as `FixedK(k)`, every
    row k tokens with its confidence per position in the step's row outcomes."""
    from serve_app.engine.policy import FixedK, FixedPlan

    counts = {}
    for policy in (FixedK(3), FixedPlan(3)):
        engine = make_engine(tiny_target, drafts["near"], policy, max_batch_size=4, max_k=6)
        seen = []
        engine.on_step.append(seen.append)
        reqs = [engine.submit(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref20
        counts[policy.name] = [(st.k, st.proposed, st.accepted_per_position) for st in seen if st.batch_size]
        if isinstance(policy, FixedPlan):
            rows = [st.rows for st in seen if st.batch_size]
            assert all(r is not None and set(r.drafted) == {3} for r in rows)
            assert all(len(c) == 3 and all(0 < x <= 1 for x in c) for r in rows for c in r.conf)
    assert counts["fixed:3"] == counts["fixed-plan:3"] and len(counts["fixed:3"]) > 5


class AfterPause:
    """k = 0 for a few steps (the draft falls behind), then `choice` every step."""

    name = "after-pause"

    def __init__(self, choice, pause: int = 4):
        self.choice, self.pause, self.steps = choice, pause, 0

    def choose(self, state):
        self.steps += 1
        if self.steps <= self.pause:
            return 0
        return self.choice(state.batch_size) if callable(self.choice) else self.choice

    def observe(self, stats):
        pass


@pytest.mark.parametrize("kind", ["near", "eagle3"])
def test_a_plan_step_keeps_one_position_of_the_drafts_first_forward(tiny_target, drafts, ref20, kind, monkeypatch):
    """After steps without speculation the draft feeds its backlog in its first forward. A fixed k scores the
    backlog there (logits at up to 256 / batch positions per row: `adaptive` learns from it); a per-row plan's
    step keeps each row's last position only (its policy learns from row outcomes, and a row that copied 16
    tokens would widen every row's vocabulary-wide logits to 16 positions). Greedy output the same either way."""
    from serve_app.engine.worker import backlog_window

    assert backlog_window([[1] * 16, [2, 3]], 2) == 16 and backlog_window([[1] * 16, [2, 3]], DraftPlan(caps=[2, 2])) == 1
    assert backlog_window([[1] * 40] * 2, 2) == 32 and backlog_window([[1] * 40] * 32, 2) == 8
    worker_cls = type(draft_worker(drafts[kind]))
    name = "_step" if kind == "eagle3" else "_forward"
    real, keeps = getattr(worker_cls, name), []

    def spy(self, *args, **kwargs):
        keeps.append(args[4] if kind == "eagle3" else args[2])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(worker_cls, name, spy)
    for choice, first in ((2, 5), (lambda b: DraftPlan(caps=[2] * b), 1)):
        keeps.clear()
        engine = make_engine(tiny_target, drafts[kind], AfterPause(choice), max_batch_size=4)
        seen = []
        engine.on_step.append(seen.append)
        reqs = [engine.submit(p, SamplingParams(max_tokens=20)) for p in PROMPTS[:4]]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref20[:4]
        kept = [k for k in keeps if isinstance(k, int)]  # the forwards that keep each row's last `keep` positions
        assert kept and max(kept) == first, (kind, kept[:8])
        assert (sum(st.backlog_checked for st in seen) > 0) == (first > 1)


def test_budget_serves_losslessly_and_drafts_more_for_rows_that_agree():
    """Sharp tiny models (a confident draft), speculation priced cheap: a draft identical to the target runs
    long, a random one's rows stop early; both lossless."""
    target, other = tiny_llama(97, layers=2, seed=0), tiny_llama(97, layers=1, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
        other.lm_head.weight.mul_(20)
    ref = reference(target, PROMPTS, 24)
    per_step = []
    for draft in (target, other):
        engine = make_engine(target, draft, Budget(hand_grid(on=0.0, scale=0.1), 0.5), max_batch_size=4, max_k=6)
        reqs = [engine.submit(p, SamplingParams(max_tokens=24)) for p in PROMPTS]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref
        per_step.append(sum(r.stats.proposed for r in reqs) / sum(r.stats.steps for r in reqs))
    assert per_step[0] > 3 and per_step[1] < per_step[0] / 2, per_step


# ---- prompt lookup beside a model draft ------------------------------------------------------------
REPEATS = [[5, 6, 7, 8] * 5, [1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 30)) + list(range(10, 20)), [9, 9, 9, 9, 9, 9]]


def lookup_engine(target, draft, policy, **cfg):
    return Engine(ModelWorker(target, "target"), draft_worker(draft, prompt_lookup=True), IdTokenizer(),
                  EngineConfig(**cfg), policy=policy, eos_ids=set())


class Fixed:
    name = "fixed"

    def __init__(self, k):
        self.k = k

    def choose(self, state):
        return self.k

    def observe(self, stats):
        pass


@pytest.mark.parametrize("kind", ["random", "eagle3"])
@pytest.mark.parametrize("plans", [False, True])
def test_greedy_identical_when_rows_copy_from_their_context(tiny_target, drafts, kind, plans):
    ref = reference(tiny_target, REPEATS, 20)
    engine = lookup_engine(tiny_target, drafts[kind], RandomPlans(2) if plans else Fixed(4), max_batch_size=3)
    copies = []
    engine.on_step.append(lambda st: st.rows and st.rows.lookup and copies.append(sum(st.rows.lookup)))
    worker = engine.draft
    seen = []
    propose = worker.propose
    worker.propose = lambda ids, k: seen.append(propose(ids, k)) or seen[-1]
    reqs = [engine.submit(p, SamplingParams(max_tokens=20)) for p in REPEATS]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == ref
    copied = [p for p in seen if p.lookup and any(p.lookup)]
    assert copied, "no row ever copied"  # a random draft is never as sure as a repeated prompt's copy


def test_copied_drafts_keep_sampling_exact(tiny_target, monkeypatch):
    """Rows that copy whenever their context repeats (one-hot q) still emit the target's marginals."""
    from serve_app.engine.lookup import CopyRecord

    monkeypatch.setattr(CopyRecord, "estimate", lambda self, n: 1.0)
    vocab, trials = 6, 2500
    target = tiny_llama(vocab, layers=2, seed=10)
    draft = tiny_llama(vocab, layers=1, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(10)
    prompt = [1, 2, 3, 1, 2]  # the suffix [1, 2] repeats: the copy proposes 3, 1, 2

    def dist(prefix):
        with torch.no_grad():
            return target(torch.tensor([prefix])).logits[0, -1].softmax(-1)

    p1 = dist(prompt)
    t2 = sum(p1[a] * dist(prompt + [a]) for a in range(vocab))
    engine = lookup_engine(target, draft, Fixed(3), max_batch_size=64, max_num_tokens=100_000)
    reqs = [engine.submit(prompt, SamplingParams(max_tokens=2, temperature=1.0)) for _ in range(trials)]
    engine.run(reqs)
    assert sum(r.stats.accepted for r in reqs) > 0.1 * trials  # copies were proposed and accepted
    f1 = torch.bincount(torch.tensor([r.output_ids[0] for r in reqs]), minlength=vocab).double() / trials
    f2 = torch.bincount(torch.tensor([r.output_ids[1] for r in reqs]), minlength=vocab).double() / trials
    assert (f1 - p1).abs().sum() / 2 < 0.04, (f1, p1)
    assert (f2 - t2).abs().sum() / 2 < 0.04, (f2, t2)
    assert p1[3] < 0.9  # the copy is not simply the target's own choice


@pytest.mark.parametrize("kind", ["near", "eagle3"])
def test_seeded_text_holds_when_rows_copy(tiny_target, drafts, kind):
    seeds = [11, 12, 13, 14]
    alone = [_seeded(make_engine(tiny_target, None, Fixed(0)), [p], [s])[0] for p, s in zip(REPEATS, seeds)]
    copying = _seeded(lookup_engine(tiny_target, drafts[kind], RandomPlans(3), max_batch_size=3), REPEATS, seeds)
    assert copying == alone


# ---- one-k policies (lut, adaptive): rows copying from their context go on past k -------------------------
def test_a_copy_value_prices_copied_tokens_only():
    # token_value 0: the model rows keep k tokens whatever the draft's confidence; the copying row stops once
    # its tokens' joint chance falls under copy_value
    walk = PlanWalk(DraftPlan(caps=[8, 8], model_depth=2, copy_value=0.5))
    for j, c in enumerate([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]):
        walk.position(j, [0.01, c], [False, True])
    assert walk.lengths == [2, 6]  # 0.9^6 = 0.53 >= 0.5 > 0.9^7


def test_lut_and_adaptive_let_copying_rows_go_on_past_their_k():
    grid = hand_grid()
    acceptance = [0.6, 0.3, 0.1, 0.05]
    state = BatchState(8, 6, True, tuple("abcdefgh"), max_copy=16, copies=True)
    lut = LookupTable({1: 3, 8: 2}, grid, acceptance)
    plan = lut.choose(state)
    assert isinstance(plan, DraftPlan) and plan.model_depth == 2 and plan.caps == [16] * 8
    assert plan.token_value == 0 and plan.forward_value == 0
    rate = 8 * (1 + 0.6 + 0.3) / grid.step_ms(8)[2]
    assert plan.copy_value == pytest.approx(rate * prices(grid, 8, None, 3).token_ms)
    # no row can copy (no prompt lookup), or the engine copies no further than k: plain k, as before
    assert lut.choose(BatchState(8, 6, True, tuple("abcdefgh"), max_copy=16)) == 2
    assert lut.choose(BatchState(8, 6, True, tuple("abcdefgh"), max_copy=2, copies=True)) == 2
    assert LookupTable({8: 2}).choose(state) == 2  # a table without a grid prices nothing
    ada = Adaptive(grid, 0.6, probe_every=0)
    plan = ada.choose(state)
    g = ada.goodput(8, 6)
    assert plan.model_depth == grid.ks[g.index(max(g))] and plan.copy_value == pytest.approx(
        max(g) * prices(grid, 8, None, plan.model_depth + 1).token_ms)
    # a probe stays a plain k: its step scores the draft's backlog
    probe = Adaptive(grid, 0.0, probe_every=1)
    assert probe.choose(state) == 1


def test_lut_and_adaptive_learn_what_their_copies_estimates_come_to():
    """A copy record's estimate is a prior (a document's copies came out accepted 32% where their estimates said
    more): lut and adaptive learn, per estimate bin, what copied tokens' estimates came to (the context's copies
    and the suffix history's apart, the model's rows not at all) and hand it to the draft in their plans, so a
    copy past k stops where its learnt chance is no longer worth its verification."""
    grid = hand_grid()
    state = BatchState(8, 6, True, tuple("abcdefgh"), max_copy=16, copies=True)
    for policy in (LookupTable({1: 3, 8: 2}, grid, [0.6, 0.3, 0.1, 0.05]), Adaptive(grid, 0.6, probe_every=0)):
        before = policy.choose(state)
        assert before.lookup_curve[9] == pytest.approx(0.95)  # no outcome yet: the estimate itself
        # row a copied 8 tokens at estimate 0.95 and had the first accepted; row b (the model) drafted 2 at 0.95,
        # both accepted; row c copied from the history, all 4 accepted
        rows = RowOutcomes(list("abc"), [8, 2, 4], [1, 2, 4], [[0.95] * 8, [0.95] * 2, [0.35] * 4],
                           [True, False, True], history=[False, False, True])
        for _ in range(20):
            policy.observe(StepStats(batch_size=3, k=8, proposed=14, accepted=7, rows=rows))
        plan = policy.choose(state)
        assert plan.lookup_curve[9] < 0.6  # 20 hits in 40 judged: the copies' 0.95 came to about 0.5
        assert plan.history_curve[3] > 0.8 and plan.history_curve[9] == pytest.approx(0.95)
        assert plan.curve is None  # the model's rows draft the policy's k whatever their confidence
        walk = PlanWalk(replace(plan, caps=[16]))
        for j in range(16):
            walk.position(j, [0.95], lookup=[True])
        learnt = walk.lengths[0]
        walk = PlanWalk(replace(before, caps=[16]))
        for j in range(16):
            walk.position(j, [0.95], lookup=[True])
        assert learnt < walk.lengths[0]  # the copy stops sooner


def test_acceptance_estimate_counts_the_model_drafts_of_a_plan_step_not_copies():
    est = AcceptanceEstimate(0.5, half_life=8)  # 4 successes in 8 trials to start
    # rows a, b drafted by the model (1 of 3, 0 of 2 accepted); row c copied 12 of 12
    est.observe(StepStats(batch_size=3, k=12, proposed=17, accepted=13,
                          rows=RowOutcomes(list("abc"), [3, 2, 12], [1, 0, 12], None, [False, False, True])))
    # 1 success in 3 trials, the older ones faded by 3 outcomes' worth: the copies' 12 would have pulled it up
    fade = 0.5 ** (3 / 8)
    assert est.accepted == pytest.approx(4 * fade + 1) and est.trials == pytest.approx(8 * fade + 3)
    assert est.value < 0.5


@pytest.mark.parametrize("kind", ["near", "eagle3"])
def test_greedy_identical_when_lut_lets_copying_rows_go_on(tiny_target, drafts, kind):
    ref = reference(tiny_target, REPEATS, 20)
    engine = lookup_engine(tiny_target, drafts[kind], LookupTable({1: 1, 8: 1}, hand_grid(on=0.0, scale=0.1),
                                                                  [0.5, 0.2]), max_batch_size=4)
    rows = []
    engine.on_step.append(lambda st: st.rows and rows.append(st.rows))
    reqs = [engine.submit(p, SamplingParams(max_tokens=20)) for p in REPEATS]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == ref
    model = [n for r in rows for n, c in zip(r.drafted, r.lookup or [False] * len(r.ids)) if not c]
    copied = [n for r in rows for n, c in zip(r.drafted, r.lookup or [False] * len(r.ids)) if c]
    assert model and max(model) <= 1  # the model drafts lut's k
    assert copied and max(copied) > 1  # copies went past it
