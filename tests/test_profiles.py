"""Profile schema: round trip, clear errors, hardware-type names."""

import json

import pytest

from serve_app.profiles import Profile, detect_gpu_type, load_profile, load_profiles


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
