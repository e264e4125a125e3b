"""The benchmarks' method: every side warmed up and run each round, ratios within a round, every output compared."""

import json
import math

import pytest

from serve_app.bench.rounds import rotated, summary, write_results
from serve_app.cli import main


def test_rounds_rotate_so_no_side_always_goes_first():
    sides = ["hf", "none", "fixed:1"]
    firsts = [rotated(sides, r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(sides)
    assert all(sorted(rotated(sides, r)) == sorted(sides) for r in range(5))


def test_summary_reports_median_range_and_spread():
    s = summary([1.0, 3.0, 2.0])
    assert (s["median"], s["min"], s["max"]) == (2.0, 1.0, 3.0) and s["spread"] == pytest.approx(1.0)
    assert s["rounds"] == [1.0, 3.0, 2.0]


def test_results_files_carry_what_made_them(tmp_path):
    j, m = write_results(tmp_path / "sub" / "bench-x-cpu.v2", {"a": 1}, "# x\n")
    assert j.name == "bench-x-cpu.v2.json" and m.name == "bench-x-cpu.v2.md"  # dots in the stem survive
    data = json.loads(j.read_text())
    assert data["a"] == 1 and {"command", "hardware", "torch", "torch_threads", "created"} <= set(data["provenance"])
    assert m.read_text().startswith("<!-- written by") and "# x" in m.read_text()


def test_bench_engine_in_bfloat16_also_measures_hf_generate_in_float32(tiny_model_dirs):
    """The speed a user starts from is HF generate in float32: a bfloat16 run reports both baselines."""
    from serve_app.bench.engine import bench_engine
    from serve_app.config import ModelConfig

    mc = ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"], dtype="bfloat16")
    res, md = bench_engine(mc, max_tokens=4, num_prompts=1, ks=[1], concurrency=2, rounds=1)
    assert res["dtype"] == "bfloat16"
    runs = [r["run"] for r in res["rows"]]
    assert runs[:4] == ["HF generate, batch 1, 1 prompts (baseline)", "HF generate float32, batch 1, 1 prompts",
                        "HF generate, batch 1, 2 prompts (baseline)", "HF generate float32, batch 1, 2 prompts"]
    engine_rows = [r for r in res["rows"] if "policy" in r]
    assert len(engine_rows) == 4 and all(len(r["vs_hf_float32"]["rounds"]) == 1 for r in engine_rows)
    assert "vs_hf_float32" in res["best_fixed_batch1"] and "| vs HF float32 b1 |" in md


def test_bench_engine_compares_like_with_like(tiny_model_dirs, tmp_path, capsys):
    """Tiny models: every side runs every round, ratios are per round, every output matches HF's."""
    from serve_app.bench.engine import bench_engine
    from serve_app.config import ModelConfig

    # float64: batched and unbatched forwards agree, so equality tests the engine, not rounding
    mc = ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"], dtype="float64")
    res, md = bench_engine(mc, max_tokens=6, num_prompts=2, ks=[1, 2], concurrency=3, rounds=2)
    runs = [r["run"] for r in res["rows"]]
    assert runs[:2] == ["HF generate, batch 1, 2 prompts (baseline)", "HF generate, batch 1, 3 prompts (baseline)"]
    assert len(runs) == 2 + 2 * 3  # none, fixed:1, fixed:2 at batch 1 and at concurrency 3
    for row in res["rows"][2:]:
        assert row["same_as_hf"] is True, row["run"]  # every output of every round, not a sample
        assert len(row["vs_hf"]["rounds"]) == 2 and len(row["tokens_per_s"]["rounds"]) == 2
        assert row["vs_hf"]["min"] <= row["vs_hf"]["median"] <= row["vs_hf"]["max"]
    none_b1 = next(r for r in res["rows"] if r.get("policy") == "none" and r["batch"] == 1)
    assert none_b1["vs_engine_none"]["rounds"] == [1.0, 1.0]
    assert res["best_fixed_batch1"]["policy"] in ("fixed:1", "fixed:2")
    assert res["hf_outputs_stable_over_rounds"] and 0 < res["forward_ms"]["draft_share"]["median"]
    assert "| engine fixed:2, 3 concurrent |" in md
    out = tmp_path / "eng"
    assert main(["bench", "engine", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
                 "--dtype", "float64", "--max-tokens", "3", "--num-prompts", "1", "--ks", "1", "--concurrency", "2", "--rounds", "1",
                 "--out", str(out)]) == 0
    assert json.loads((tmp_path / "eng.json").read_text())["rounds"] == 1
    assert "identical to HF" in (tmp_path / "eng.md").read_text() and "results:" in capsys.readouterr().out
    assert main(["bench", "engine", "--target", tiny_model_dirs["target"], "--rounds", "0"]) == 2
    assert main(["bench", "engine", "--target", tiny_model_dirs["target"], "--concurrency", "1"]) == 2
    assert main(["bench", "http", "--target", tiny_model_dirs["target"], "--policy", "adaptive"]) == 2


def test_paired_ratios_rotate_and_hold_out_their_reference():
    """Paired by round: a common slow spell cancels; the interval shrinks as rounds agree; the reference fixed k
    is picked on the even rounds and judged on the odd ones."""
    from serve_app.bench.policies import paired_report
    from serve_app.bench.rounds import paired_ratio, rotated

    assert [rotated(list("abc"), i) for i in range(3)] == [list("abc"), list("bca"), list("cab")]
    slow = [1.0, 3.0, 1.0, 3.0, 1.0, 3.0]  # the machine's speed swings 3x between rounds
    r = paired_ratio([0.9 * x for x in slow], slow)
    assert r["ratio"] == pytest.approx(0.9) and r["low"] == pytest.approx(0.9) and r["high"] == pytest.approx(0.9)
    noisy = paired_ratio([0.9 * x * (1.05 if i % 2 else 0.95) for i, x in enumerate(slow)], slow)
    assert noisy["low"] < 0.9 < noisy["high"] and noisy["high"] < 1.0
    assert paired_ratio([1.0], [2.0]) == {"ratio": 0.5, "low": None, "high": None, "rounds": 1}

    class R:
        def __init__(self, x):
            self.mean_latency = x

    # fixed:1 is best on the even rounds (its luck), fixed:2 on the odd ones: the held-out reference is fixed:1,
    # judged where it was not picked
    runs = {"fixed:1": [R(1.0), R(1.3), R(1.0), R(1.3)], "fixed:2": [R(1.2), R(1.1), R(1.2), R(1.1)],
            "adaptive": [R(1.05), R(1.05), R(1.05), R(1.05)]}
    rep = paired_report(runs)
    held = rep["policies"]["adaptive"]["held_out"]
    assert rep["rounds"] == 4 and held["reference"] == "fixed:1"
    assert held["ratio"] == pytest.approx(1.05 / 1.3)
    assert rep["policies"]["adaptive"]["fixed:2"]["ratio"] == pytest.approx(math.exp(
        (math.log(1.05 / 1.2) + math.log(1.05 / 1.1)) / 2))
