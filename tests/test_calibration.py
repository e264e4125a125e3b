"""Online calibration of a profile's latency grid: converges to a machine's true latencies through
warm-up and outliers, prices the k it never chose, and steers lut / adaptive to the k the true
latencies call for (the simulator with replicas deliberately off their profile)."""

import math
import random

import pytest

from serve_app.engine.policy import BatchState, make_policy
from serve_app.engine.stats import StepStats
from serve_app.profiling.calibration import Calibrated, Calibration, calibrated
from serve_app.pricing import LatencyGrid, best_k_table
from serve_app.profiling.profiles import Profile
from serve_app.sim.simulate import simulate

SIZES, KS, ACC = [1, 2, 4, 8, 16, 32], [0, 1, 2, 3, 4], 0.75
GRID = LatencyGrid(batch_sizes=SIZES, ks=KS,
                   draft_ms=[[k * (3 + 0.4 * b) for k in KS] for b in SIZES],
                   verify_ms=[[12 + 0.9 * b * (k + 1) for k in KS] for b in SIZES],
                   other_ms=[[1.0 for _ in KS] for _ in SIZES])
ACCEPTANCE = [ACC ** (i + 1) for i in range(4)]


def profile(grid: LatencyGrid) -> Profile:
    return Profile(gpu_type="sim", target="t", draft="d", best_k=best_k_table(grid, ACCEPTANCE), latency=grid,
                   acceptance=ACCEPTANCE, acceptance_rate=ACC)


def off(draft, verify) -> LatencyGrid:
    """GRID with its draft and verification parts scaled per batch size: a machine off its profile."""
    return GRID.model_copy(update={"draft_ms": [[v * draft(b) for v in row] for b, row in zip(SIZES, GRID.draft_ms)],
                                   "verify_ms": [[v * verify(b) for v in row] for b, row in zip(SIZES, GRID.verify_ms)]})


# 0.7x and 1.4x off, the other way round at large batches: the best k moves both ways
TRUE = off(lambda b: 1.4 if b <= 4 else 0.7, lambda b: 0.7 if b <= 4 else 1.4)


def step_parts(grid: LatencyGrid, b: int, k: int) -> tuple[float, float, float]:
    """(draft, verification, rest) ms of a decode step at (b, k) on `grid`."""
    return tuple(part[grid.ks.index(k)] for part in grid.parts_at(b))


def step(grid: LatencyGrid, b: int, k: int, slow: float = 1.0) -> StepStats:
    d, v, o = step_parts(grid, b, k)
    return StepStats(batch_size=b, k=k, draft_s=slow * d / 1000, verify_s=slow * v / 1000, other_s=slow * o / 1000)


def test_calibration_converges_through_warm_up_and_outliers_and_prices_every_k():
    rng = random.Random(0)
    cal = Calibration(GRID)
    for _ in range(cal.warmup):  # a new process's first steps are slow; they are not evidence
        cal.observe(step(TRUE, 1, 1, slow=5.0))
    for n in range(400):
        b = rng.choice([1, 2, 4, 8, 16, 32])
        k = 1  # one k only, as a policy that has settled would choose
        cal.observe(step(TRUE, b, k, slow=8.0 if n % 10 == 0 else rng.uniform(0.97, 1.03)))  # 10% outliers
    f = cal.factors()
    for b in SIZES:
        assert f["draft"][b] == pytest.approx(1.4 if b <= 4 else 0.7, rel=0.03), (b, f)
        assert f["verify"][b] == pytest.approx(0.7 if b <= 4 else 1.4, rel=0.03), (b, f)
        assert f["other"][b] == pytest.approx(1.0, rel=0.03)
    grid = cal.grid()
    for got, want in zip(grid.total_ms(), TRUE.total_ms()):  # every k, though only k = 1 ran
        assert got == pytest.approx(want, rel=0.03)
    assert best_k_table(grid, ACCEPTANCE) == best_k_table(TRUE, ACCEPTANCE) != best_k_table(GRID, ACCEPTANCE)
    assert 0.3 < cal.drift() < 0.5


def test_a_group_without_evidence_takes_its_nearest_neighbours_factor():
    cal = Calibration(GRID, warmup=0)
    for _ in range(20):
        cal.observe(step(TRUE, 2, 2))
        cal.observe(step(TRUE, 16, 2))
    f = cal.factors()["draft"]
    assert f[1] == pytest.approx(1.4) and f[4] == pytest.approx(1.4) and f[32] == pytest.approx(0.7)
    assert Calibration(GRID).factors()["draft"][8] == 1.0  # nothing seen: the profile as is


def test_unpriced_prefill_steps_and_unprofiled_ks_are_not_evidence():
    cal = Calibration(GRID, warmup=0)
    st = step(TRUE, 4, 1)
    st.prefill_tokens = 100
    assert not cal.observe(st)  # a step that prefilled, where the grid has no chunk price to compare with
    assert not cal.observe(StepStats(batch_size=4, k=9, draft_s=1, verify_s=1, other_s=1))  # a k the grid lacks
    assert cal.used == 0


def test_steps_that_draft_nothing_say_nothing_about_the_drafts_price():
    """A k = 0 step runs no draft forward: its draft part is a served draft's held-back commit (~0) or a local
    draft's bookkeeping, though a measured profile prices that cell (0.09 ms at batch 8 on this CPU). Taken as
    evidence, a replica's plain steps (most of them at a large batch) priced drafting at a tenth of what it
    costs, and its policy speculated where that lost."""
    grid = GRID.model_copy(update={"draft_ms": [[0.1 * b if k == 0 else v for k, v in zip(KS, row)]
                                                for b, row in zip(SIZES, GRID.draft_ms)]})
    cal = Calibration(grid, warmup=0)
    i = SIZES.index(8)
    for n in range(80):
        if n % 8:  # plain steps, their draft part next to nothing
            cal.observe(StepStats(batch_size=8, k=0, draft_s=5e-6, verify_s=grid.verify_ms[i][0] / 1000,
                                  other_s=grid.other_ms[i][0] / 1000))
        else:
            cal.observe(step(grid, 8, 1))
    assert cal.factors()["draft"][8] == pytest.approx(1.0)
    assert cal.grid().draft_ms[i][1:] == pytest.approx(grid.draft_ms[i][1:])
    assert cal.factors()["verify"][8] == pytest.approx(1.0)


def test_a_copys_verification_is_calibrated_on_copies():
    """Copies (a row drafting past the grid's longest k from its context or history) are verified at lengths the
    profile measured once (`copy_ks`); this machine can run them off by another factor than the longest k. Their
    steps calibrate their own cells: kept with the longest k's, the 12- and 16-token copies of a validation run
    were priced 19% under and 12% over, and the longest k's line was bent by them."""
    copies = [6, 8]
    profiled = GRID.model_copy(update={"copy_ks": copies,
                                       "copy_verify_ms": [[12 + 0.9 * b * (k + 1) for k in copies] for b in SIZES]})
    true_copy = {6: 1.3, 8: 0.8}  # this machine: 6-token copies 30% over the profile, 8-token ones 20% under
    cal = Calibration(profiled, warmup=0)
    i = SIZES.index(2)
    for n in range(96):
        k = (4, 6, 8)[n % 3]
        d, v, o = step_parts(GRID, 2, 4)
        if k > 4:  # a copy: one draft forward, then k tokens verified
            d, v = GRID.draft_ms[i][1], profiled.copy_verify_ms[i][copies.index(k)] * true_copy[k]
        cal.observe(StepStats(batch_size=2, k=k, draft_forwards=1 if k > 4 else 4, proposed=2 * k,
                              draft_s=d / 1000, verify_s=v / 1000, other_s=o / 1000))
    grid = cal.grid()
    for c, k in enumerate(copies):
        assert grid.copy_verify_ms[i][c] == pytest.approx(profiled.copy_verify_ms[i][c] * true_copy[k], rel=1e-6)
    assert grid.verify_ms[i][-1] == pytest.approx(GRID.verify_ms[i][-1], rel=1e-6)  # k = 4 untouched by copies
    # a copy length no step ran moves with the longest k (here: as profiled)
    assert Calibration(profiled, warmup=0).grid().copy_verify_ms == profiled.copy_verify_ms


def test_steps_that_prefill_calibrate_the_chunk_price():
    n = len(SIZES)
    priced = GRID.model_copy(update={"chunk_step_ms": [5.0] * n, "chunk_ms_per_token": [0.5] * n})
    cal = Calibration(priced, warmup=0)
    for b in (0, 2, 8):  # with and without decoding rows beside the chunk
        for _ in range(10):
            d, v, o = step_parts(TRUE, max(b, 1), 1 if b else 0)
            chunk = 2.0 * priced.chunk_ms(max(b, 1), 64)  # this machine prefills at half the profiled speed
            cal.observe(StepStats(batch_size=b, k=1 if b else 0, prefill_tokens=64, draft_s=d / 1000,
                                  verify_s=(v + chunk) / 1000, other_s=o / 1000))
        for _ in range(10):
            if b:
                cal.observe(step(TRUE, b, 1))
    assert cal.factors()["chunk"][8] == pytest.approx(2.0, rel=0.05)
    assert cal.grid().chunk_ms(8, 64) == pytest.approx(2 * priced.chunk_ms(8, 64), rel=0.05)


@pytest.mark.parametrize("policy", ["lut", "adaptive"])
def test_calibrated_policies_choose_what_the_true_latencies_call_for(policy):
    """The simulator with a replica 0.7x / 1.4x off its profile (differently at small and large batches):
    after calibration lut and adaptive come within 3% of lut steering by the true latencies."""
    users = lambda t: [1, 6, 24, 2, 12, 32][int(t // 30) % 6]  # noqa: E731: time-varying load
    kw = dict(users_at=users, duration_s=360, seed=3, prompt_tokens=32, output_tokens=(32, 96))
    oracle = simulate({"sim": 1}, {"sim": profile(TRUE)}, "lut", **kw).summary()["mean_latency_s"]
    before = simulate({"sim": 1}, {"sim": profile(GRID)}, policy, true_grids={"sim": TRUE}, **kw)
    after = simulate({"sim": 1}, {"sim": profile(GRID)}, policy, true_grids={"sim": TRUE}, calibrate=True, **kw)
    b, a = before.summary()["mean_latency_s"], after.summary()["mean_latency_s"]
    print(f"{policy}: mean latency / lut on the true latencies: before calibration {b / oracle:.4f}, after {a / oracle:.4f}")
    assert abs(a / oracle - 1) < 0.03
    steered = after.replicas[0].policy
    assert isinstance(steered, Calibrated) and steered.calibration.used > 100
    if policy == "lut":  # the table, recomputed: the true one where the grid's batch sizes were measured
        true_table = best_k_table(TRUE, ACCEPTANCE)
        assert {b: steered.inner.best_k[b] for b in (1, 2, 32)} == {b: true_table[b] for b in (1, 2, 32)}
        assert before.replicas[0].policy.best_k != true_table
    else:  # goodput priced by the calibrated grid: the choices of adaptive steering by the true one
        truth = make_policy("adaptive", profile(TRUE))
        for pol in (truth, before.replicas[0].policy):
            pol.estimate = steered.inner.estimate
        # (not at 4: the true latencies jump between 4 and 8, and the neighbouring-k visits put steps of both
        # sides at different k into group 4's line)
        sizes = (1, 2, 16, 32)
        want = [truth.choose(BatchState(b, 8)) for b in sizes]
        assert [steered.inner.choose(BatchState(b, 8)) for b in sizes] == want  # (less the neighbouring-k visits)
        assert [before.replicas[0].policy.choose(BatchState(b, 8)) for b in sizes] != want


def test_calibrated_wraps_only_profile_driven_policies_and_passes_their_state_through():
    p = profile(GRID)
    assert calibrated(make_policy("fixed:2"), p).name == "fixed:2" and not isinstance(calibrated(make_policy("none"), p), Calibrated)
    adaptive = calibrated(make_policy("adaptive", p), p)
    assert isinstance(adaptive, Calibrated) and adaptive.acceptance_estimate == pytest.approx(ACC)
    assert adaptive.choose(BatchState(1, 8)) == make_policy("adaptive", p).choose(BatchState(1, 8))
    assert math.isfinite(adaptive.calibration.drift())


def test_steering_profile_prefers_this_machines_measurement_then_a_shared_calibration():
    from serve_app.profiling.calibration import calibrated_profile, steering_profile

    here = profile(GRID).model_copy(update={"machine": "node-1"})
    elsewhere = here.model_copy(update={"machine": "node-2"})
    cal = Calibration(GRID, warmup=0)
    for _ in range(10):
        cal.observe(step(TRUE, 1, 1))
    shared = calibrated_profile(elsewhere, cal, "node-3")
    assert shared.source == "calibrated" and shared.machine == "node-3" and shared.best_k[1] == best_k_table(TRUE, ACCEPTANCE)[1]
    assert shared.latency.total_ms()[0] == pytest.approx(TRUE.total_ms()[0])
    assert steering_profile(here, shared, "node-1") is here  # measured on this machine: it wins
    assert steering_profile(elsewhere, shared, "node-1") is shared  # measured elsewhere: the shared calibration
    assert steering_profile(elsewhere, None, "node-1") is elsewhere
    with pytest.raises(ValueError, match="latency grid"):
        Profile(gpu_type="sim", target="t", draft="d", best_k={1: 1}, source="calibrated")


def test_profile_store_keeps_a_shared_calibration_beside_the_measured_profile_until_a_push():
    from deployments.profile_store import ProfileStore

    store = ProfileStore.func_or_class(None)
    measured = profile(GRID).model_dump()
    assert store.push(measured) == 1
    cal = Calibration(GRID, warmup=0)
    for _ in range(10):
        cal.observe(step(TRUE, 2, 1))
    from serve_app.profiling.calibration import calibrated_profile
    shared = calibrated_profile(profile(GRID), cal, "node-9").model_dump()
    assert store.share(shared) == 1 and store.push(shared) == 2  # a calibrated push is a share, not a replacement
    assert store.get("sim")[0] == 1 and store.get("sim")[1]["source"] == "measured"
    assert store.get_calibrated("sim")[0] == 2 and store.get_calibrated("sim")[1]["machine"] == "node-9"
    with pytest.raises(ValueError):
        store.share(measured)
    assert store.push(measured) == 2 and store.get_calibrated("sim") == (0, None)  # what it corrected is gone
    # a share calibrated against version 1, arriving after the push of version 2, is stale and dropped
    assert store.share(shared, base_version=1) == 0 and store.get_calibrated("sim") == (0, None)
    assert store.share(shared, base_version=2) == 1


def test_a_machine_whose_drafted_tokens_cost_differently_is_priced_at_every_k_from_two():
    """Not one factor: here each drafted token costs half the profile's, the verification's per-token
    part 0.6x but its fixed part the same. Steps at k = 1 and k = 3 price k = 0, 2 and 4 too."""
    true = GRID.model_copy(update={"draft_ms": [[0.5 * k * (3 + 0.4 * b) for k in KS] for b in SIZES],
                                   "verify_ms": [[12 + 0.6 * 0.9 * b * (k + 1) for k in KS] for b in SIZES]})
    cal = Calibration(GRID, warmup=0)
    for _ in range(12):
        for k in (1, 3):
            cal.observe(step(true, 8, k))
    got = cal.grid()
    i = SIZES.index(8)
    for part in ("draft_ms", "verify_ms"):
        assert getattr(got, part)[i][1:] == pytest.approx(getattr(true, part)[i][1:], rel=0.02), part
    assert best_k_table(got, ACCEPTANCE)[8] == best_k_table(true, ACCEPTANCE)[8]


def test_calibrated_lut_prices_its_table_with_the_acceptance_this_replica_sees():
    """lut's table under calibration follows the live acceptance, not only the profiling prompts': a draft that
    agrees far less here shortens k (to 0 where nothing pays); one that agrees as profiled keeps the table."""
    def run(accept_first: bool) -> dict[int, int]:
        pol = calibrated(make_policy("lut", profile(GRID)), profile(GRID))
        for _ in range(200):
            k = 3
            st = step(GRID, 1, k)
            acc = k if accept_first else 0  # every token accepted, or the first one rejected
            st.accepted, st.accepted_per_position = acc, [1 if accept_first else 0] * k
            pol.observe(st)
        pol.refresh()
        return dict(pol.inner.best_k)

    profiled = best_k_table(GRID, ACCEPTANCE)
    low = run(False)
    assert all(low[b] <= profiled[b] for b in SIZES) and low[1] < profiled[1] and low[1] == 0
    high = run(True)
    assert all(high[b] >= profiled[b] for b in SIZES)


def test_calibrated_policies_visit_a_neighbouring_k_now_and_then_so_slopes_are_measured():
    """lut keeps one k per batch size; every 8th speculating step runs k + 1 or k - 1 by turns, so the
    calibration sees two columns and prices a machine whose drafted tokens cost more than profiled (a line,
    not one factor), and the table moves to the k the true latencies call for."""
    pol = calibrated(make_policy("lut", profile(GRID)), profile(GRID))
    k = pol.inner.best_k[2]
    assert k >= 2
    choices = [pol.choose(BatchState(2, 8)) for _ in range(64)]
    assert choices.count(k) == 56 and choices.count(k + 1) == 4 and choices.count(k - 1) == 4
    # verifying a drafted token costs 3x the profile's (longer contexts), the k = 0 step as profiled: one factor
    # on the one column lut runs would scale k = 0 with it and keep the table; two columns measure the slope
    steep = GRID.model_copy(update={"verify_ms": [[row[0] + 3 * (v - row[0]) for v in row] for row in GRID.verify_ms]})
    want = best_k_table(steep, ACCEPTANCE)[2]
    assert want < k
    for explore, got in ((8, want), (0, k)):
        pol = Calibrated(make_policy("lut", profile(GRID)), profile(GRID), explore_every=explore)
        pol.live = None  # prices only here: these steps carry no acceptance
        for _ in range(400):
            pol.observe(step(steep, 2, pol.choose(BatchState(2, 8))))
        assert pol.inner.best_k[2] == got
    # a batch size where the profile says k = 0 (32 here) is explored too: on a machine whose plain step runs 3x the
    # profile's and a speculating one 2x, the k = 0 column alone would price every k at 3x and keep k = 0
    assert make_policy("lut", profile(GRID)).best_k[32] == 0
    plain_slow = GRID.model_copy(update={"verify_ms": [[v * (3.0 if j == 0 else 2.0) for j, v in enumerate(row)]
                                                       for row in GRID.verify_ms]})
    assert best_k_table(plain_slow, ACCEPTANCE)[32] >= 1
    for explore, at_least in ((8, 1), (0, 0)):
        pol = Calibrated(make_policy("lut", profile(GRID)), profile(GRID), explore_every=explore)
        pol.live = None
        for _ in range(400):
            pol.observe(step(plain_slow, 32, pol.choose(BatchState(32, 8))))
        assert pol.inner.best_k[32] >= at_least and (explore or pol.inner.best_k[32] == 0)
    assert Calibrated(make_policy("lut", profile(GRID)), profile(GRID), explore_every=1).choose(
        BatchState(32, 8, has_draft=False)) == 0
    # a one-k plan (rows copying past lut's k) explores by its model rows' depth
    pol = calibrated(make_policy("lut", profile(GRID)), profile(GRID))
    plans = [pol.choose(BatchState(2, 8, max_copy=16, copies=True)) for _ in range(16)]
    assert [p.model_depth for p in plans].count(k) == 14 and {p.model_depth for p in plans} == {k, k + 1, k - 1}
    assert all(p.caps == [16, 16] for p in plans)
    # a plan (budget) or k = 0 passes through untouched
    assert calibrated(make_policy("none"), profile(GRID)).choose(BatchState(2, 8)) == 0


@pytest.mark.parametrize("name", ["budget", "adaptive"])
def test_a_policy_that_probes_on_its_own_is_not_explored_up_from_k_0(name):
    """Where budget or adaptive runs plain steps (speculation does not pay at this batch size), Calibrated's
    exploring would run a uniform k = 1 every 8th step on top of their own probes (every 16th): at a batch of 8
    each such step pays the draft's catch-up and verifies drafts that mostly fail. Their probes alone speculate."""
    slow_draft = GRID.model_copy(update={"draft_ms": [[20 * v for v in row] for row in GRID.draft_ms]})
    pol = calibrated(make_policy(name, profile(slow_draft)), profile(slow_draft))
    picks = [pol.choose(BatchState(8, 4)) for _ in range(64)]
    plain = [p for p in picks if p == 0]
    assert len(plain) >= 60 and len(picks) - len(plain) == 64 // pol.inner.probe_every  # the probes alone
