"""The fleet simulator: hand-computed latencies on a hand-made grid, conservation, real policies."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.profiles import LatencyGrid, Profile
from serve_app.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]


def grid_profile(gpu="toy", acceptance=(1.0,)):
    """Batch 1 and 2; step = 10 ms at k = 0, 15 ms at k = 1 (batch 1), 20 / 30 ms at batch 2."""
    grid = LatencyGrid(batch_sizes=[1, 2], ks=[0, 1], draft_ms=[[0, 3], [0, 6]], verify_ms=[[9, 11], [18, 22]],
                       other_ms=[[1, 1], [2, 2]])
    return Profile(gpu_type=gpu, target="t", draft="d", best_k={1: 1, 2: 1}, latency=grid,
                   acceptance=list(acceptance), acceptance_rate=acceptance[-1])


def test_one_replica_reproduces_hand_computed_latencies():
    # prefill (10 ms, first token) + a k = 1 step always accepted (15 ms, +2) in the first step: 3 tokens
    # at 25 ms; then 15 ms steps: 5, 7, 9 tokens -> done at 70 ms
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "fixed:1", trace=[(0.0, 4, 9)], max_batch=4)
    [job] = res.jobs
    assert job.first_token == pytest.approx(0.010) and job.done == pytest.approx(0.070)
    assert [(b, k) for _, b, k in res.replicas[0].steps] == [(1, 1)] * 4
    # plain decoding: prefill 10 ms + 9 steps of 10 ms (the first in the prefill's step)
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "none", trace=[(0.0, 4, 9)])
    assert res.jobs[0].done == pytest.approx(0.010 + 8 * 0.010)


def test_two_requests_batch_at_the_batch_2_latency():
    res = simulate({"toy": 1}, {"toy": grid_profile(acceptance=(0.0,))}, "fixed:1", trace=[(0.0, 4, 3), (0.0, 4, 3)])
    # one step admits both: prefill at batch 2 (20 ms) + a k = 1 step at batch 2 (30 ms), nothing accepted: 2 tokens each
    # then a second step at batch 2 (30 ms): 3 tokens -> both done at 80 ms
    assert [j.done for j in res.jobs] == pytest.approx([0.080, 0.080])


def test_every_request_finishes_once_and_load_spreads_over_groups():
    profiles = {"a": grid_profile("a", (0.6,)), "b": grid_profile("b", (0.3,))}
    res = simulate({"a": 2, "b": 3}, profiles, "fixed:1", users_at=lambda t: 4 if t < 10 else 12, duration_s=30,
                   prompt_tokens=8, output_tokens=20, max_batch=2, seed=3)
    assert all(j.done is not None and j.generated == j.output_tokens for j in res.jobs)
    assert len({j.id for j in res.jobs}) == len(res.jobs) > 100
    served = {r.index: sum(1 for j in res.jobs if j.replica is r) for r in res.replicas}
    assert all(n > 0 for n in served.values()), served  # least-loaded routing reached every replica
    s = res.summary()
    assert s["finished"] == s["requests"] and s["ttft_p50_s"] <= s["e2e_p50_s"] <= s["e2e_p99_s"]


@pytest.mark.parametrize("policy", ["none", "fixed:2", "lut", "adaptive"])
def test_real_policies_run_on_the_committed_cpu_profile(policy):
    profile = Profile.model_validate(json.loads((ROOT / "profiles" / "cpu-2core.json").read_text()))
    res = simulate({"cpu-2core": 2}, {"cpu-2core": profile}, policy, users_at=lambda t: 3, duration_s=20, seed=1)
    ks = {k for r in res.replicas for _, b, k in r.steps if b}
    assert res.summary()["finished"] == len(res.jobs) > 0
    if policy == "none":
        assert ks == {0}
    if policy == "fixed:2":
        assert ks == {2}


def test_missing_profile_or_both_arrival_kinds_refused():
    with pytest.raises(ValueError, match="no profile"):
        simulate({"x": 1}, {}, "none", users_at=lambda t: 1)
    with pytest.raises(ValueError, match="exactly one"):
        simulate({"toy": 1}, {"toy": grid_profile()}, "none", users_at=lambda t: 1, trace=[(0, 1, 1)])


def test_simulate_command_writes_table_and_plot(tmp_path):
    from serve_app.cli import main

    (tmp_path / "trace.csv").write_text("arrival_s,prompt_tokens,output_tokens\n" +
                                        "".join(f"{i * 0.05},16,24\n" for i in range(60)))
    out = tmp_path / "sim"
    assert main(["simulate", "--fleet", "cpu-2core:2", "--profiles", str(ROOT / "profiles"), "--trace",
                 str(tmp_path / "trace.csv"), "--policy", "none,lut", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["policies"]) == {"none", "lut"} and all(p["finished"] == 60 for p in data["policies"].values())
    assert "| lut | 60 |" in (out / "summary.md").read_text()
    assert (out / "k_batch.png").read_bytes()[:4] == b"\x89PNG"
    # a load shape: in its own process (importing locust monkey-patches this one's threads)
    r = subprocess.run([sys.executable, "-m", "serve_app.cli", "simulate", "--fleet", "cpu-2core:2", "--profiles",
                        str(ROOT / "profiles"), "--shape", "step", "--duration", "20", "--policy", "fixed:1",
                        "--out", str(tmp_path / "sim2")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "| fixed:1 |" in r.stdout, r.stderr[-2000:]
    assert main(["simulate", "--fleet", "nope", "--trace", str(tmp_path / "trace.csv")]) == 2
