"""Policies: parsing, clamping, and the choose/observe hooks (pure Python, no models)."""

import pytest

from serve_app.engine.policy import BatchState, FixedK, NoSpeculation, make_policy
from serve_app.engine.stats import StepStats


def test_make_policy_forms():
    assert isinstance(make_policy("none"), NoSpeculation)
    p = make_policy("fixed:4")
    assert isinstance(p, FixedK) and p.k == 4 and p.name == "fixed:4"


@pytest.mark.parametrize("spec, message", [("fixed:", "whole number"),
                                           ("fixed:-1", "whole number"), ("fixed:two", "whole number"), ("", "unknown policy")])
def test_make_policy_rejects_unknown_forms_up_front(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec)


def test_fixed_clamps_to_max_k_and_needs_a_draft():
    p = make_policy("fixed:6")
    assert p.choose(BatchState(batch_size=4, max_k=8)) == 6
    assert p.choose(BatchState(batch_size=4, max_k=3)) == 3
    assert p.choose(BatchState(batch_size=4, max_k=8, has_draft=False)) == 0
    assert make_policy("none").choose(BatchState(batch_size=1, max_k=8)) == 0
    steps = [StepStats(batch_size=4, k=6, proposed=24, accepted=0, accepted_per_position=[0] * 6),
             StepStats(batch_size=4, k=6, proposed=24, accepted=24, accepted_per_position=[4] * 6)]
    for policy, k in ((p, 6), (make_policy("none"), 0)):  # what a step did never moves a fixed choice
        for st in steps:
            policy.observe(st)
            assert [policy.choose(BatchState(batch_size=b, max_k=8)) for b in (1, 4, 32)] == [k] * 3


def test_step_stats_acceptance_rate():
    assert StepStats(proposed=8, accepted=6).acceptance_rate == 0.75
    assert StepStats().acceptance_rate == 0.0


def test_lut_uses_nearest_profiled_batch_size_and_clamps_at_the_ends():
    from serve_app.engine.policy import LookupTable

    lut = LookupTable({1: 5, 4: 3, 16: 2, 32: 1})
    pick = {b: lut.choose(BatchState(batch_size=b, max_k=8)) for b in (1, 2, 3, 4, 9, 10, 11, 24, 25, 64)}
    assert pick == {1: 5, 2: 5, 3: 3, 4: 3, 9: 3, 10: 3, 11: 2, 24: 2, 25: 1, 64: 1}  # ties go to the smaller size
    assert lut.choose(BatchState(batch_size=1, max_k=2)) == 2
    assert lut.choose(BatchState(batch_size=1, max_k=8, has_draft=False)) == 0


def test_lut_needs_a_profile():
    from serve_app.profiling.profiles import Profile

    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("lut")
    assert make_policy("lut", Profile(gpu_type="x", target="t", draft="d", best_k={"2": 3})).choose(
        BatchState(batch_size=7, max_k=8)) == 3


# ---- adaptive: goodput from a latency grid and a live acceptance estimate ------------------------
from serve_app.engine.policy import Adaptive  # noqa: E402
from serve_app.pricing import LatencyGrid, expected_tokens  # noqa: E402


def hand_grid() -> LatencyGrid:
    """Batch 1: verification nearly free, so speculation pays; batch 32: each extra token costs."""
    ks = [0, 1, 2, 3, 4]
    return LatencyGrid(
        batch_sizes=[1, 32], ks=ks,
        draft_ms=[[0, 2, 4, 6, 8], [0, 5, 10, 15, 20]],
        verify_ms=[[50, 52, 54, 56, 58], [100, 180, 260, 340, 420]],
        other_ms=[[0] * 5, [0] * 5],
    )


def argmax_by_hand(grid: LatencyGrid, b: int, a: float) -> int:
    i = grid.batch_sizes.index(b)
    g = {k: b * expected_tokens(a, k) / (grid.draft_ms[i][j] + grid.verify_ms[i][j]) for j, k in enumerate(grid.ks)}
    return max(g, key=g.get)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.8, 0.95])
def test_adaptive_picks_the_goodput_argmax(a):
    grid = hand_grid()
    p = Adaptive(grid, a, probe_every=0)
    for b in (1, 32):
        assert p.choose(BatchState(batch_size=b, max_k=8)) == argmax_by_hand(grid, b, a)


def test_adaptive_known_choices_on_the_hand_grid():
    p = Adaptive(hand_grid(), 0.8, probe_every=0)
    # batch 1, a=0.8: E = 1, 1.8, 2.44, 2.95, 3.36 over 50, 54, 58, 62, 66 ms -> k = 4 is best
    assert p.choose(BatchState(batch_size=1, max_k=8)) == 4
    assert p.choose(BatchState(batch_size=1, max_k=2)) == 2  # clamped to the engine's max_k
    # batch 32: 1/100 vs 1.8/185 (0.00973) -> plain decoding wins
    assert p.choose(BatchState(batch_size=32, max_k=8)) == 0
    assert p.choose(BatchState(batch_size=1, max_k=8, has_draft=False)) == 0


def test_adaptive_falls_to_zero_when_speculation_cannot_pay_and_probes_sometimes():
    p = Adaptive(hand_grid(), 0.0, probe_every=4)
    picks = [p.choose(BatchState(batch_size=1, max_k=8)) for _ in range(8)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 1]  # a = 0: every k > 0 only adds draft time
    assert Adaptive(hand_grid(), 0.0, probe_every=0).choose(BatchState(batch_size=1, max_k=8)) == 0


def test_adaptive_acceptance_estimate_follows_the_steps():
    p = Adaptive(hand_grid(), 0.02, half_life=64, probe_every=0)
    assert p.acceptance_estimate == pytest.approx(0.02)
    assert p.choose(BatchState(batch_size=1, max_k=8)) == 0
    # 8 sequences at k = 4, each accepting all 4: 32 successes, no stops
    full = StepStats(batch_size=8, k=4, proposed=32, accepted=32, accepted_per_position=[8, 8, 8, 8])
    for _ in range(10):
        p.observe(full)
    assert p.acceptance_estimate > 0.9
    assert p.choose(BatchState(batch_size=1, max_k=8)) == 4  # the draft agrees now: speculate fully
    # now every sequence rejects the first token: 8 stops, no successes
    none_ok = StepStats(batch_size=8, k=4, proposed=32, accepted=0, accepted_per_position=[0, 0, 0, 0])
    before = p.acceptance_estimate
    p.observe(none_ok)
    assert p.acceptance_estimate < before
    for _ in range(40):
        p.observe(none_ok)
    assert p.acceptance_estimate < 0.05 and p.choose(BatchState(batch_size=1, max_k=8)) == 0
    p.observe(StepStats(batch_size=8, k=0))  # k = 0 steps carry no acceptance news
    assert p.acceptance_estimate < 0.05


def test_adaptive_estimate_is_the_geometric_mle():
    """Two sequences at k = 3: one accepts 1 then stops, one accepts all 3 -> 4 successes, 1 stop."""
    p = Adaptive(hand_grid(), 0.5, half_life=1e9, probe_every=0)
    p.estimate.accepted, p.estimate.trials = 0.0, 0.0
    p.observe(StepStats(batch_size=2, k=3, proposed=6, accepted=4, accepted_per_position=[2, 1, 1]))
    assert p.acceptance_estimate == pytest.approx(4 / 5)


def test_backlog_evidence_moves_the_estimate_and_brings_speculation_back():
    """A probe step after k = 0 steps reports the draft's backlog check: a draft that now agrees is
    noticed within a few probes, not only through the one token a probe proposes."""
    p, blind = Adaptive(hand_grid(), 0.0, probe_every=4), Adaptive(hand_grid(), 0.0, probe_every=4)
    state = BatchState(batch_size=1, max_k=8)
    probe = dict(batch_size=1, k=1, proposed=1, accepted=1, accepted_per_position=[1])
    for _ in range(3):
        assert [p.choose(state) for _ in range(4)] == [0, 0, 0, 1]
        p.observe(StepStats(**probe, backlog_checked=3, backlog_matched=3))  # the 3 skipped tokens all matched
        blind.observe(StepStats(**probe))
    assert p.acceptance_estimate > 3.5 * blind.acceptance_estimate > 0
    for _ in range(10):
        p.observe(StepStats(batch_size=1, k=1, proposed=1, accepted=1, accepted_per_position=[1],
                            backlog_checked=30, backlog_matched=27))
    assert p.acceptance_estimate > 0.75 and p.choose(state) == 4


def test_adaptive_interpolates_between_profiled_batch_sizes():
    grid = hand_grid()
    mid = grid.step_ms(16)  # halfway between batch 1 and batch 32 in batch size
    lo, hi = grid.step_ms(1), grid.step_ms(32)
    w = (16 - 1) / 31
    assert mid == pytest.approx([x + w * (y - x) for x, y in zip(lo, hi)])
    assert grid.step_ms(0) == lo  # flat below the smallest size
    assert grid.step_ms(64)[1] > hi[1]  # extended beyond the largest


def test_make_policy_adaptive_needs_a_measured_profile():
    from serve_app.profiling.profiles import Profile

    table_only = Profile(gpu_type="x", target="t", draft="d", best_k={1: 3})
    with pytest.raises(ValueError, match="latency grid"):
        make_policy("adaptive", table_only)
    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("adaptive")
    full = Profile(gpu_type="x", target="t", draft="d", best_k={1: 4, 32: 0}, latency=hand_grid(),
                   acceptance=[0.8, 0.64], acceptance_rate=0.8)
    p = make_policy("adaptive", full)
    assert p.name == "adaptive" and p.choose(BatchState(batch_size=1, max_k=8)) == 4

