"""`bench batching`: the in-process budget curve (C) on tiny models, its report and plot, the gap
arithmetic A uses, and the settings' checks. The services (A, B) need Ray and are not started here."""

import json
import random

import pytest

from conftest import IdTokenizer
from serve_app.bench.batching import (BatchingBench, budget_curve, curve_markdown, gaps_overlapping, gaps_within,
                                      plot_curve, stall_summary)
from serve_app.cli import main
from serve_app.config import EngineConfig
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

rng = random.Random(3)
SHORTS = [[rng.randrange(1, 97) for _ in range(5)] for _ in range(3)]
LONG = [rng.randrange(1, 97) for _ in range(120)]
ROW_FIELDS = {"budget", "ttft_s", "no_first_token", "baseline_gap_ms", "prefill_gap_ms", "ratio",
              "steps_to_first_token", "max_scheduled_tokens", "rounds"}


@pytest.fixture(scope="module")
def curve(tiny_target):
    def make_engine(budget):
        cfg = EngineConfig(policy="none", block_size=4, max_batch_size=4, max_num_batched_tokens=budget)
        return Engine(ModelWorker(tiny_target, "target"), None, IdTokenizer(), cfg, eos_ids=set())

    return budget_curve(make_engine, SHORTS, LONG, [8, 64], rounds=2, baseline_steps=3, after_steps=1, max_wait_s=60)


def test_budget_curve_rows_and_the_budget_holds_in_every_step(curve):
    assert [r["budget"] for r in curve] == [8, 64]
    for row in curve:
        assert ROW_FIELDS <= set(row) and len(row["rounds"]) == 2 and row["no_first_token"] == 0
        assert row["ttft_s"] > 0 and row["baseline_gap_ms"] > 0 and row["ratio"] > 0
        assert row["prefill_gap_ms"]["max"] >= row["prefill_gap_ms"]["median"] > 0
        for run in row["rounds"]:  # the budget holds in every step, the long prompt's and the streams' prefill alike
            assert run["max_scheduled_tokens"] <= row["budget"] and run["steps"] > run["steps_to_first_token"]
            assert all(st[0] <= row["budget"] for st in run["steps_from_arrival"])
            assert run["baseline_gaps"] == 3 * len(SHORTS)  # baseline_steps gaps per stream
            assert run["long_prompt_tokens"] == len(LONG)
    small, large = curve
    # budget 8: 3 decoding rows leave 5 prompt tokens a step; 64: 61. Far more steps to the first token.
    assert small["steps_to_first_token"] == -(-len(LONG) // 5) and large["steps_to_first_token"] == -(-len(LONG) // 61)
    assert small["max_scheduled_tokens"] == 8 and large["max_scheduled_tokens"] == 64


def test_curve_report_and_plot(curve, tmp_path):
    md = curve_markdown(curve, len(SHORTS), len(LONG), 60)
    assert md.count("\n| 8 |") == 1 and md.count("\n| 64 |") == 1
    none = {**curve[0], "budget": 4, "ttft_s": None, "steps_to_first_token": None, "ratio": None,
            "prefill_gap_ms": {"median": None, "max": None}}
    assert "none in 60 s" in curve_markdown([none], 3, 120, 60)
    png = plot_curve([*curve, none], tmp_path / "c.png", "test")
    assert png is not None and png.stat().st_size > 1000
    json.dumps(curve)  # results are plain JSON


def test_gap_windows():
    streams = [[0.0, 1.0, 2.0, 10.0, 11.0], [0.5, 1.5, 9.0]]
    assert gaps_within(streams, 0.0, 2.0) == [1.0, 1.0, 1.0]
    assert sorted(gaps_overlapping(streams, 2.5, 5.0)) == [7.5, 8.0]  # the stalls that straddle the window
    s = stall_summary(streams, 0.0, 2.5, 5.0)
    assert s["baseline_gap_ms"] == 1000.0 and s["prefill_gap_ms"]["max"] == 8000.0 and s["ratio"] == 8.0


def test_settings_checks():
    assert BatchingBench(scenarios=["c", "a"]).scenarios == ["A", "C"]
    quick = BatchingBench.quick(streams=2)
    assert quick.streams == 2 and quick.budgets == [16, 256]
    with pytest.raises(ValueError, match="streams \\+ 1"):
        BatchingBench(streams=16, batch_size=16)
    with pytest.raises(ValueError, match="at least batch_size"):
        BatchingBench(budgets=[16, 64])
    with pytest.raises(ValueError, match="subset"):
        BatchingBench(scenarios=["D"])


def test_cli_refuses_bad_settings_before_starting_anything(capsys):
    assert main(["bench", "batching", "--scenarios", "C", "--budgets", "8"]) == 2
    assert "budgets" in capsys.readouterr().err
    assert main(["bench", "batching", "--policy", "sometimes"]) == 2


def test_serve_flags_reach_the_engine_config():
    from serve_app.cli import _app_config, _parser

    args = _parser().parse_args(["serve", "--max-num-batched-tokens", "64", "--block-size", "8", "--no-prefix-caching",
                                 "--max-num-tokens", "4096"])
    engine = _app_config(args)["engine"]
    assert (engine["max_num_batched_tokens"], engine["block_size"], engine["prefix_caching"],
            engine["max_num_tokens"]) == (64, 8, False, 4096)
    defaults = EngineConfig(**{**_app_config(_parser().parse_args(["serve"]))["engine"], "policy": "none"})
    assert defaults == EngineConfig(policy="none", max_batch_size=32)
