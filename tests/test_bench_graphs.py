"""`specserve bench graphs` (what captured graphs would buy a step) in its CPU dry run: the engine-step pass and
the per-shape forward run on real engine rows, and the forward the probe times is the worker's own."""

import torch

from serve_app.bench.context import random_models
from serve_app.bench.graphs import _forward_fn, graphs_markdown, probe_graphs
from serve_app.config import SamplingParams
from serve_app.profiling.measuring import measuring_engine


def test_probe_runs_both_passes_on_a_cpu():
    models, _ = random_models("tiny-128k:3", 1, "cpu", "float32")
    res = probe_graphs(models, [1, 3], [0, 2], context=20, steps=2, reps=2)
    assert [e["batch"] for e in res["batches"]] == [1, 3]
    for e in res["batches"]:
        assert [s["k"] for s in e["steps"]] == [0, 2]
        for s in e["steps"]:
            assert s["wall_ms"] > 0 and s["busy_ms"] is None  # no device profiler on a CPU
            assert s["tokens_per_step"] >= e["batch"]  # every row gains at least its verified token
        widths = [(f["role"], f["width"]) for f in e["forwards"]]
        assert widths == [("target", 1), ("target", 3), ("draft", 1)]
        assert all(f["tokens"] == e["batch"] * f["width"] and "graph_ms" not in f for f in e["forwards"])
    md = graphs_markdown({**res, "device": "cpu"}, "tiny")
    assert md.count("| 3 | target |") == 2 and "| 1 | 2 |" in md


def test_the_probed_forward_is_the_workers_forward():
    models, _ = random_models("tiny-128k:2", 1, "cpu", "float32")
    engine = measuring_engine(models, 2, 2, 64)
    for n in (5, 9):
        engine.submit(list(range(10, 10 + n)), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.waiting or engine.prefilling:
        engine.step()
    worker = engine.target
    fed = [[7, 8, 9], [11, 12, 13]]
    probed = _forward_fn(worker, fed)()  # [6, V]
    sids = list(worker.seqs)
    own = worker._forward(sids, fed, torch.arange(6))
    assert probed.shape == own.shape == (6, models.target.config.vocab_size)
    torch.testing.assert_close(probed, own)


def test_the_dry_run_pairs_static_steps_on_against_off_where_attention_is_flex(monkeypatch):
    """With flex attention the step pass also times static steps on against off (eager on a CPU: no capture),
    alternating, and reports the paired ratio; with gather (a CPU's default) there is nothing to pair."""
    models, _ = random_models("tiny-128k:2", 1, "cpu", "float32")
    res = probe_graphs(models, [2], [0], context=20, steps=2, reps=1)
    assert res["batches"][0]["steps"][0]["static"] is None
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "flex")
    res = probe_graphs(models, [2], [0, 2], context=20, steps=3, reps=1)
    for s in res["batches"][0]["steps"]:
        a = s["static"]
        assert a["on_ms"] > 0 and a["off_ms"] > 0 and a["off_over_on"]["rounds"] == 3, a
        assert a["captured"] is False and a["graphs"] == 0 and a["replays"] == 0
    md = graphs_markdown({**res, "device": "cpu"}, "tiny")
    assert "## Static steps on against off" in md and "| 2 | 2 |" in md
