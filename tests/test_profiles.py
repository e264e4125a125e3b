"""Profile schema: round trip, clear errors, hardware-type names."""

import json

import pytest

from serve_app.hardware import detect_gpu_type
from serve_app.profiling.profiles import Profile, load_profile, load_profiles


def test_round_trip_and_sorted_table(tmp_path):
    p = Profile(gpu_type="NVIDIA_L4", target="t", draft="d", best_k={"8": 2, "1": 4})
    (tmp_path / "NVIDIA_L4.json").write_text(p.model_dump_json())
    back = load_profile(tmp_path / "NVIDIA_L4.json")
    assert back == p and list(back.best_k) == [1, 8]
    assert load_profiles(tmp_path) == {"NVIDIA_L4": p}


@pytest.mark.parametrize("body, message", [
    ("{", "cannot read profile"),
    (json.dumps({"gpu_type": "x", "target": "t", "draft": "d", "best_k": {}}), "best_k"),
    (json.dumps({"gpu_type": "x", "target": "t", "draft": "d", "best_k": {"0": 2}}), "batch sizes >= 1"),
    (json.dumps({"gpu_type": "x", "target": "t", "best_k": {"1": 2}}), "draft"),
    (json.dumps({"gpu_type": "x", "target": "t", "draft": "d", "best_k": {"1": 2}, "extra": 1}), "extra"),
])
def test_malformed_profiles_are_refused_clearly(tmp_path, body, message):
    (tmp_path / "p.json").write_text(body)
    with pytest.raises(ValueError, match=message):
        load_profile(tmp_path / "p.json")
    with pytest.raises(ValueError):
        load_profiles(tmp_path)  # a bad file is an error, not silently skipped


def test_cpu_hardware_type_names_core_count():
    import os

    assert detect_gpu_type() == f"cpu-{os.cpu_count()}core"


# ---- measured profiles: latency grid, acceptance, derived table ------------------------------------
from serve_app.pricing import LatencyGrid, best_k_table  # noqa: E402
from serve_app.profiling.profiles import fit_acceptance_rate, save_profile  # noqa: E402


def measured(**over) -> dict:
    grid = {"batch_sizes": [1, 8], "ks": [0, 1, 2],
            "draft_ms": [[0, 5, 10], [0, 8, 16]], "verify_ms": [[50, 52, 54], [70, 120, 170]],
            "other_ms": [[1, 1, 1], [1, 1, 1]]}
    grid.update(over.pop("grid", {}))
    body = {"gpu_type": "NVIDIA_L4", "target": "t", "draft": "d", "best_k": {"1": 2, "8": 0},
            "latency": grid, "acceptance": [0.7, 0.5], "acceptance_rate": 0.75}
    body.update(over)
    return body


def test_measured_profile_round_trips(tmp_path):
    p = Profile.model_validate(measured())
    save_profile(p, tmp_path / "NVIDIA_L4.json")
    back = load_profile(tmp_path / "NVIDIA_L4.json")
    assert back.model_dump() == p.model_dump() and back.latency.step_ms(1) == [51, 58, 65]


@pytest.mark.parametrize("over, message", [
    ({"grid": {"verify_ms": [[50, 52, 54]]}}, "a batch size is missing"),
    ({"grid": {"draft_ms": [[0, 5], [0, 8, 16]]}}, "at batch size 1 needs 3 latencies"),
    ({"grid": {"ks": [1, 2, 3]}}, "ks must start at 0"),
    ({"grid": {"batch_sizes": [8, 1]}}, "ascending"),
    ({"grid": {"other_ms": [[1, 1, -1], [1, 1, 1]]}}, ">= 0"),
    ({"best_k": {"1": 2}}, r"best_k lacks batch sizes \[8\]"),
    ({"acceptance": [1.5]}, r"\[0, 1\]"),
])
def test_malformed_measured_profiles_say_what_is_wrong(tmp_path, over, message):
    (tmp_path / "p.json").write_text(json.dumps(measured(**over)))
    with pytest.raises(ValueError, match=message):
        load_profile(tmp_path / "p.json")


def test_a_profile_for_another_model_pair_is_refused():
    p = Profile.model_validate(measured())
    p.check_pair("t", "d", "float32")
    with pytest.raises(ValueError, match="measured with target 't' and draft 'd'.*runs target 't' with draft 'other'"):
        p.check_pair("t", "other", "float32")
    with pytest.raises(ValueError, match="measured in float32, but this engine runs bfloat16.*--dtype bfloat16"):
        p.check_pair("t", "d", "bfloat16")


def test_fitted_acceptance_rate_and_best_k_table():
    assert fit_acceptance_rate([0.5, 0.25, 0.125]) == pytest.approx(0.875 / (0.875 + 0.875))  # geometric a = 0.5
    assert fit_acceptance_rate([1.0, 1.0]) == 1.0
    assert fit_acceptance_rate([0.0, 0.0]) == 0.0
    grid = LatencyGrid.model_validate(measured()["latency"])
    # batch 1: 51, 58/1.7, 66/2.2 -> k=2 (30 ms/token); batch 8: 71/8, 129/13.6, 187/17.6 -> k=0
    assert best_k_table(grid, [0.7, 0.5]) == {1: 2, 8: 0}
    assert best_k_table(grid, [0.7]) == {1: 1, 8: 0}  # ks beyond the measured acceptance are left out


def test_committed_profiles_are_usable_for_the_embedded_pair():
    """profiles/*.json load and drive both profile-driven policies; the measured ones are for the default
    model pair (the predicted ones are for the Kubernetes manifest's pair: tests/test_predict.py)."""
    from pathlib import Path

    from serve_app.config import ModelConfig
    from serve_app.models import model_names
    from serve_app.engine.policy import BatchState, make_policy

    profiles = load_profiles(Path(__file__).resolve().parent.parent / "profiles")
    assert "cpu-2core" in profiles
    for p in profiles.values():
        if p.source == "measured":
            p.check_pair(*model_names(ModelConfig()), p.dtype)
        assert p.latency is not None and p.acceptance and p.best_k.keys() == set(p.latency.batch_sizes)
        for spec in ("lut", "adaptive"):
            k = make_policy(spec, p).choose(BatchState(batch_size=3, max_k=8))
            assert 0 <= k <= 8


def test_chunked_prefill_price_and_old_profiles_fallback(tmp_path):
    """New profiles price a step's prefill chunks as a fixed part + a part per prompt token beside a
    decoding batch; profiles from before chunked prefill (prefill_ms per admission) still load, and
    their per-token price stands in."""
    chunk = {"chunk_step_ms": [2.0, 4.0], "chunk_ms_per_token": [0.5, 0.25], "chunk_draft_step_ms": [1.0, 1.0],
             "chunk_draft_ms_per_token": [0.1, 0.05], "chunk_budget": 256, "chunk_prompt_tokens": 40}
    p = Profile.model_validate(measured(grid=chunk))
    save_profile(p, tmp_path / "new.json")
    g = load_profile(tmp_path / "new.json").latency
    assert g.chunk_ms(1, 100) == pytest.approx(52.0) and g.chunk_ms(8, 100) == pytest.approx(29.0)
    assert g.chunk_ms(1, 100, draft=False) == pytest.approx(41.0)  # without a draft: less the draft's part
    assert g.chunk_ms(1, 0) == 0.0
    old = LatencyGrid.model_validate(measured(grid={"prefill_ms": [40.0, 160.0], "prefill_tokens": 4})["latency"])
    assert old.chunk_ms(1, 8) == pytest.approx(80.0) and old.chunk_ms(8, 8) == old.prefill_at(8, 8)
    assert LatencyGrid.model_validate(measured()["latency"]).chunk_ms(1, 8) is None  # neither measured
    for bad, message in (({**chunk, "chunk_ms_per_token": [0.5]}, "chunk_ms_per_token needs one value >= 0 per batch"),
                         ({"chunk_step_ms": [1.0, 1.0]}, "chunk_ms_per_token is missing"),
                         ({**chunk, "chunk_draft_step_ms": None}, "come together")):
        (tmp_path / "bad.json").write_text(json.dumps(measured(grid=bad)))
        with pytest.raises(ValueError, match=message):
            load_profile(tmp_path / "bad.json")
