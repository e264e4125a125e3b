"""Policies: parsing, clamping, and the choose/observe hooks (pure Python, no models)."""

import pytest

from serve_app.policy import BatchState, FixedK, NoSpeculation, make_policy
from serve_app.stats import StepStats


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
    p.observe(StepStats(batch_size=4, k=6, proposed=24, accepted=10))  # hooks accept stats


def test_step_stats_acceptance_rate():
    assert StepStats(proposed=8, accepted=6).acceptance_rate == 0.75
    assert StepStats().acceptance_rate == 0.0


def test_lut_uses_nearest_profiled_batch_size_and_clamps_at_the_ends():
    from serve_app.policy import LookupTable

    lut = LookupTable({1: 5, 4: 3, 16: 2, 32: 1})
    pick = {b: lut.choose(BatchState(batch_size=b, max_k=8)) for b in (1, 2, 3, 4, 9, 10, 11, 24, 25, 64)}
    assert pick == {1: 5, 2: 5, 3: 3, 4: 3, 9: 3, 10: 3, 11: 2, 24: 2, 25: 1, 64: 1}  # ties go to the smaller size
    assert lut.choose(BatchState(batch_size=1, max_k=2)) == 2
    assert lut.choose(BatchState(batch_size=1, max_k=8, has_draft=False)) == 0


def test_lut_needs_a_profile():
    from serve_app.profiles import Profile

    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("lut")
    assert make_policy("lut", Profile(gpu_type="x", target="t", draft="d", best_k={"2": 3})).choose(
        BatchState(batch_size=7, max_k=8)) == 3
