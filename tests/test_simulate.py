"""The fleet simulator: hand-computed latencies on a hand-made grid, conservation, real policies."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve_app.profiling.profiles import LatencyGrid, Profile
from serve_app.sim.simulate import simulate

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


def test_measured_prefill_is_priced_per_prompt_token_and_resuming_speculation_costs_its_switch():
    prof = grid_profile()
    prof.latency.prefill_ms, prof.latency.prefill_tokens = [40.0, 60.0], 4
    prof.latency.resume_ms = [5.0, 5.0]
    # 8 prompt tokens at batch 1: 40 ms per 4 tokens -> 80 ms to the first token, then k = 1 steps of 15 ms
    # (none of them resumes after a k = 0 step: no switch cost)
    res = simulate({"toy": 1}, {"toy": prof}, "fixed:1", trace=[(0.0, 8, 9)], max_batch=4)
    assert res.jobs[0].first_token == pytest.approx(0.080) and res.jobs[0].done == pytest.approx(0.080 + 4 * 0.015)
    # lut at batch 1 -> k = 1, at batch 2 -> k = 0: the second request's arrival switches to k = 0, its end back
    prof.best_k = {1: 1, 2: 0}
    res = simulate({"toy": 1}, {"toy": prof}, "lut", trace=[(0.0, 4, 9), (0.05, 4, 2)], max_batch=4)
    ks = [k for _, b, k in res.replicas[0].steps if b]
    assert 0 in ks and ks[-1] == 1
    first, second = res.jobs
    # the step after k = 0 pays 5 ms more than a plain k = 1 step: total time = sum of the step times
    steps = res.replicas[0].steps
    resumed = next(i for i in range(1, len(steps)) if steps[i][2] == 1 and steps[i - 1][2] == 0)
    assert steps[resumed + 1][0] - steps[resumed][0] == pytest.approx(0.015 + 0.005)


def test_validation_flags_errors_and_orders_and_runs_on_a_tiny_pair(tiny_model_dirs, tmp_path):
    from serve_app.bench.simcheck import discordant_pairs
    from serve_app.cli import main

    assert discordant_pairs({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.0}, 0.05) == [("a", "b")]
    assert discordant_pairs({"a": 1.0, "b": 1.02}, {"a": 2.0, "b": 1.0}, 0.05) == []  # a measured tie
    assert discordant_pairs({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.0, "b": 2.5, "c": 2.4}, 0.05) == [("b", "c")]
    prof = tmp_path / "tiny.json"
    assert main(["profile", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
                 "--batch-sizes", "1,2,4,8", "--max-k", "2", "--reps", "2", "--prompts", "2", "--max-tokens", "8",
                 "--out", str(prof)]) == 0
    out = tmp_path / "v"
    code = main(["simulate", "--validate", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
                 "--profile", str(prof), "--policy", "none,fixed:2", "--scale", "0.15", "--out", str(out)])
    r = json.loads((out / "results.json").read_text())
    assert set(r["error"]) == {"none", "fixed:2"} and r["requests"] >= 3
    for p, e in r["error"].items():
        assert e == pytest.approx(r["sim_mean_latency_s"][p] / r["real_mean_latency_s"][p] - 1)
        assert r["real_mean_latency_s"][p] > 0 and r["sim_mean_latency_s"][p] > 0
    assert code == (0 if r["passed"] else 1)
    assert r["passed"] == (all(abs(e) <= 0.15 for e in r["error"].values()) and not r["discordant_pairs"])
    assert "PASSED" in (out / "summary.md").read_text() or "FAILED" in (out / "summary.md").read_text()


def test_waterfill_matches_sending_each_request_to_the_least_loaded_replica():
    from serve_app.sim.fleetsim import waterfill

    rng = np.random.default_rng(0)
    for _ in range(200):
        loads = rng.integers(0, 6, size=rng.integers(1, 8))
        n = int(rng.integers(0, 15))
        one_by_one = loads.copy()
        for _ in range(n):
            one_by_one[int(np.argmin(one_by_one))] += 1  # argmin: the lowest index on a tie
        assert (loads + waterfill(loads, n) == one_by_one).all(), (loads, n)


@pytest.mark.parametrize("policy", ["none", "fixed:1", "fixed:4", "lut", "adaptive"])
def test_fleet_engine_agrees_with_the_step_engine(policy):
    """The vectorised engine against the exact one on 4 replicas of the committed CPU profile, at a load
    that keeps them batching (mean latency, TTFT, goodput within 10%), and conservation in both."""
    from serve_app.sim.fleetsim import simulate_fleet

    profile = Profile.model_validate(json.loads((ROOT / "profiles" / "cpu-2core.json").read_text()))
    rng = np.random.default_rng(0)
    trace, t = [], 0.0
    while t < 90:
        t += rng.exponential(1 / 6.0)
        trace.append((t, int(rng.integers(30, 60)), int(rng.integers(16, 48))))
    exact = simulate({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8).summary()
    fleet = simulate_fleet({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8, tick_s=0.05).summary()
    assert exact["finished"] == fleet["finished"] == len(trace)
    for key in ("mean_latency_s", "goodput_tokens_per_s", "tpot_p50_s"):
        assert fleet[key] == pytest.approx(exact[key], rel=0.10), key
    # closed loop: every user's requests follow one another, none lost
    res = simulate_fleet({"cpu-2core": 3}, {"cpu-2core": profile}, policy, users_at=lambda t: 5 if t < 20 else 9,
                         duration_s=40, prompt_tokens=40, output_tokens=32)
    assert res.arrivals == len(res.e2e) > 50 and (res.ttft <= res.e2e + 1e-9).all() and (res.ttft > 0).all()


@pytest.mark.parametrize("engine", ["step", "fleet"])
def test_routing_counts_replicas_per_group(engine):
    """The ingress compares groups by requests in flight per replica: a 1-replica group next to a
    5-replica one gets about a sixth of the traffic. Comparing totals (group-total) would hand it half
    of everything in flight, and its requests would queue."""
    from serve_app.sim.fleetsim import simulate_fleet

    profiles = {"a": grid_profile("a", (0.6,)), "b": grid_profile("b", (0.6,))}
    kw = dict(users_at=lambda t: 24, duration_s=30, prompt_tokens=8, output_tokens=20, max_batch=4)
    run = simulate_fleet if engine == "fleet" else simulate
    fair = run({"a": 5, "b": 1}, profiles, "fixed:1", **kw).by_hardware()
    assert 0.12 < fair["b"]["requests"] / (fair["a"]["requests"] + fair["b"]["requests"]) < 0.22, fair
    assert fair["b"]["mean_latency_s"] < 1.3 * fair["a"]["mean_latency_s"]
    totals = run({"a": 5, "b": 1}, profiles, "fixed:1", route="group-total", **kw).by_hardware()
    assert totals["b"]["mean_latency_s"] > 2 * totals["a"]["mean_latency_s"], totals
    with pytest.raises(ValueError, match="route"):
        run({"a": 1}, profiles, "none", route="random", **kw)
