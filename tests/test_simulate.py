"""The fleet simulator: hand-computed latencies on a hand-made grid, conservation, real policies."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve_app.pricing import LatencyGrid
from serve_app.profiling.profiles import Profile
from serve_app.sim.simulate import prompt_blocks, simulate

ROOT = Path(__file__).resolve().parents[1]


def grid_profile(gpu="toy", acceptance=(1.0,)):
    """Batch 1 and 2; step = 10 ms at k = 0, 15 ms at k = 1 (batch 1), 20 / 30 ms at batch 2."""
    grid = LatencyGrid(batch_sizes=[1, 2], ks=[0, 1], draft_ms=[[0, 3], [0, 6]], verify_ms=[[9, 11], [18, 22]],
                       other_ms=[[1, 1], [2, 2]])
    return Profile(gpu_type=gpu, target="t", draft="d", best_k={1: 1, 2: 1}, latency=grid,
                   acceptance=list(acceptance), acceptance_rate=acceptance[-1])


def test_one_replica_reproduces_hand_computed_latencies():
    # a step that only prefills runs one forward (10 ms, the batch-1 plain step; no chunk price in this
    # grid): the first token at 10 ms; then k = 1 steps always accepted (15 ms, +2): 3, 5, 7, 9 -> done at 70 ms
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "fixed:1", trace=[(0.0, 4, 9)], max_batch=4)
    [job] = res.jobs
    assert job.first_token == pytest.approx(0.010) and job.done == pytest.approx(0.070)
    assert [(b, k, n) for _, b, k, n in res.replicas[0].steps] == [(0, 0, 4)] + [(1, 1, 0)] * 4
    # plain decoding: the prefill step (10 ms, first token) + 8 steps of 10 ms
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "none", trace=[(0.0, 4, 9)])
    assert res.jobs[0].done == pytest.approx(0.010 + 8 * 0.010)


def test_two_requests_batch_at_the_batch_2_latency():
    res = simulate({"toy": 1}, {"toy": grid_profile(acceptance=(0.0,))}, "fixed:1", trace=[(0.0, 4, 3), (0.0, 4, 3)])
    # one step prefills both (one forward, 10 ms): first tokens at 10 ms; then k = 1 steps at batch 2 (30 ms),
    # nothing accepted: 2 tokens at 40 ms, 3 at 70 ms
    assert [j.first_token for j in res.jobs] == pytest.approx([0.010, 0.010])
    assert [j.done for j in res.jobs] == pytest.approx([0.070, 0.070])


def test_a_long_prompt_prefills_in_chunks_while_the_batch_keeps_decoding():
    """Budget 8 tokens a step: A decodes at k = 1 (2 tokens of it), B's 20-token prompt gets the other 6
    per step; each such step costs the decode step plus the chunk's price: 2 ms + 1 ms per prompt token."""
    prof = grid_profile()
    prof.latency.chunk_step_ms, prof.latency.chunk_ms_per_token = [2.0, 2.0], [1.0, 2.0]  # beside 1 / 2 decoding
    res = simulate({"toy": 1}, {"toy": prof}, "fixed:1", trace=[(0.0, 4, 40), (0.001, 20, 2)], max_batch=4,
                   max_num_batched_tokens=8, block_size=4)  # k = 1 leaves the 4-token block kept for prompts
    a, b = res.jobs
    steps = res.replicas[0].steps
    # A alone: one forward (10 ms, the batch-1 plain step) + 2 ms + 4 tokens x 1 ms
    assert a.first_token == pytest.approx(0.016) and steps[0][1:] == (0, 0, 4)
    # B arrived during that step; then 3 chunks of 6 and one of 2, A decoding (batch 1, k = 1) in every one
    assert [(bs, k, n) for _, bs, k, n in steps[1:6]] == [(1, 1, 6)] * 3 + [(1, 1, 2), (2, 1, 0)]
    assert [t for t, *_ in steps[1:6]] == pytest.approx([0.016, 0.039, 0.062, 0.085, 0.104])  # 15 + 2 + 6; 15 + 2 + 2
    assert b.first_token == pytest.approx(0.104)  # at the end of its last chunk's step
    assert b.done == pytest.approx(0.104 + 0.030)  # then one step at batch 2 (30 ms) gives its second token
    assert a.generated == 40 and a.first_token < b.first_token < a.done
    # without a draft (policy none) the draft's part of the price is not paid
    prof.latency.chunk_draft_step_ms, prof.latency.chunk_draft_ms_per_token = [2.0, 2.0], [1.0, 1.0]
    res = simulate({"toy": 1}, {"toy": prof}, "none", trace=[(0.0, 4, 2)])
    assert res.jobs[0].first_token == pytest.approx(0.010)


def test_a_prompt_feeds_only_what_the_prefix_cache_does_not_hold():
    """Prompts named by their blocks (`prompt_blocks`, 4-token blocks here): b agrees with a up to its last token, so
    a's two full blocks serve it and it feeds 2 of its 10 tokens (one forward + 2 ms + 2 x 1 ms); c differs in its
    first token and feeds all 10, as every prompt does when the trace names no blocks."""
    prof = grid_profile()
    prof.latency.chunk_step_ms, prof.latency.chunk_ms_per_token = [2.0, 2.0], [1.0, 2.0]
    a, b, c = list(range(10)), list(range(9)) + [99], [7] + list(range(1, 10))
    assert prompt_blocks(a, 4) == prompt_blocks(b, 4) and len(prompt_blocks(a, 4)) == 2
    assert prompt_blocks(c, 4)[0] != prompt_blocks(a, 4)[0] and prompt_blocks(c, 4)[1] != prompt_blocks(a, 4)[1]
    trace = [(float(i), 10, 2, prompt_blocks(t, 4)) for i, t in enumerate((a, b, c))]
    res = simulate({"toy": 1}, {"toy": prof}, "none", trace=trace, max_batch=4, block_size=4)
    assert [n for *_, n in res.replicas[0].steps if n] == [10, 2, 10]
    assert res.jobs[1].first_token - 1.0 == pytest.approx(0.014)
    res = simulate({"toy": 1}, {"toy": prof}, "none", trace=[row[:3] for row in trace], max_batch=4, block_size=4)
    assert [n for *_, n in res.replicas[0].steps if n] == [10, 10, 10]


def test_k_is_lowered_to_fit_the_token_budget_keeping_a_block_for_prompts():
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "fixed:1", trace=[(0.0, 1, 6), (0.0, 1, 6)], max_batch=2,
                   max_num_batched_tokens=2)
    assert {(b, k) for _, b, k, _ in res.replicas[0].steps if b} == {(2, 0)}  # 2 x (1 + 1) tokens would not fit
    # budget 4, blocks of 4: A alone decodes at k = 1; while B's 12-token prompt prefills, the step keeps
    # a block's worth (all but A's row: 3 tokens) for it, so A decodes at k = 0 beside 3-token chunks
    res = simulate({"toy": 1}, {"toy": grid_profile()}, "fixed:1", trace=[(0.0, 1, 20), (0.015, 12, 2)], max_batch=2,
                   max_num_batched_tokens=4, block_size=4)
    assert [(b, k, n) for _, b, k, n in res.replicas[0].steps[:7]] == \
        [(0, 0, 1), (1, 1, 0)] + [(1, 0, 3)] * 4 + [(2, 1, 0)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        simulate({"toy": 1}, {"toy": grid_profile()}, "none", trace=[(0.0, 4, 6)], max_batch=8, max_num_batched_tokens=4)


def test_admission_by_kv_blocks_and_preemption_of_the_latest_admitted():
    prof = grid_profile()
    # blocks of 4; a request holds context + max_k + 1 = 4 + 1 + 2 -> 8 tokens at admission. A 16-token pool
    # takes the second only beside the first's 8 + a block of headroom: it waits for the first to finish.
    res = simulate({"toy": 1}, {"toy": prof}, "none", trace=[(0.0, 4, 4), (0.0, 4, 4)], max_batch=2, kv_budget=16,
                   block_size=4, max_k=1)
    first, second = res.jobs
    assert second.first_token > first.done
    # a 32-token pool admits both, but they outgrow it (2 x 20 tokens at 11 generated): the second goes back
    # to the queue and prefills its prompt + 11 generated tokens again once the first is done
    res = simulate({"toy": 1}, {"toy": prof}, "none", trace=[(0.0, 4, 12), (0.0, 4, 12)], max_batch=2, kv_budget=32,
                   block_size=4, max_k=1)
    first, second = res.jobs
    assert (first.preemptions, second.preemptions) == (0, 1)
    assert first.first_token == second.first_token and second.done > first.done
    assert all(j.generated == j.output_tokens for j in res.jobs)
    assert [n for *_, n in res.replicas[0].steps if n] == [8, 15]
    with pytest.raises(ValueError, match="does not fit the KV budget"):
        simulate({"toy": 1}, {"toy": prof}, "none", trace=[(0.0, 40, 40)], kv_budget=64)


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
    ks = {k for r in res.replicas for _, b, k, _ in r.steps if b}
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
    # per-row lengths are not in the fleet simulators: refused by name, before anything runs (--validate replays
    # them per row)
    assert main(["simulate", "--fleet", "cpu-2core:2", "--profiles", str(ROOT / "profiles"), "--trace",
                 str(tmp_path / "trace.csv"), "--policy", "fixed:1,budget"]) == 2


def test_old_profiles_prefill_price_is_used_per_prompt_token_and_resuming_speculation_costs_its_switch():
    prof = grid_profile()
    prof.latency.prefill_ms, prof.latency.prefill_tokens = [40.0, 60.0], 4  # a profile from before chunked prefill
    prof.latency.resume_ms = [5.0, 5.0]
    # 8 prompt tokens alone: one forward (10 ms) + 8 x 40 / 4 ms -> 90 ms to the first token, then k = 1
    # steps of 15 ms (none of them resumes after a k = 0 step: no switch cost)
    res = simulate({"toy": 1}, {"toy": prof}, "fixed:1", trace=[(0.0, 8, 9)], max_batch=4)
    assert res.jobs[0].first_token == pytest.approx(0.090) and res.jobs[0].done == pytest.approx(0.090 + 4 * 0.015)
    # lut at batch 1 -> k = 1, at batch 2 -> k = 0: the second request's arrival switches to k = 0, its end back
    prof.best_k = {1: 1, 2: 0}
    res = simulate({"toy": 1}, {"toy": prof}, "lut", trace=[(0.0, 4, 9), (0.05, 4, 2)], max_batch=4)
    ks = [k for _, b, k, _ in res.replicas[0].steps if b]
    assert 0 in ks and ks[-1] == 1
    # the step after k = 0 pays 5 ms more than a plain k = 1 step: total time = sum of the step times
    steps = [s for s in res.replicas[0].steps if s[1]]  # decode steps (the first only prefills, at k = 0)
    resumed = next(i for i in range(1, len(steps)) if steps[i][2] == 1 and steps[i - 1][2] == 0)
    assert steps[resumed + 1][0] - steps[resumed][0] == pytest.approx(0.015 + 0.005)


def test_validation_smoke_report_is_consistent_on_a_tiny_pair(tiny_model_dirs, tmp_path):
    """A smoke test of `simulate --validate` end to end (profile, real rounds, simulated rounds, report): on a
    tiny pair at scale 0.08 the real rounds are too short for an accuracy bound, so it checks the report's
    consistency (its verdict, exit code and errors agree with its own numbers), not the simulator's accuracy;
    that is `bench simcheck`'s and the committed validation results' job."""
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
                 "--profile", str(prof), "--policy", "none,fixed:2,budget", "--scale", "0.08", "--repeat", "2", "--out", str(out)])
    r = json.loads((out / "results.json").read_text())
    # budget: replayed per row, not in the one-k simulator
    assert set(r["error"]) == {"none", "fixed:2"} and set(r["replay_error"]) == {"none", "fixed:2", "budget"}
    assert r["requests"] >= 3
    for p, e in r["error"].items():
        assert e == pytest.approx(r["sim_mean_latency_s"][p] / r["real_mean_latency_s"][p] - 1)
        assert r["real_mean_latency_s"][p] > 0 and r["sim_mean_latency_s"][p] > 0
    for p, e in r["replay_error"].items():
        assert e == pytest.approx(r["replay_mean_latency_s"][p] / r["real_mean_latency_s"][p] - 1)
    buckets = r["cost_model"]
    assert buckets and sum(b["steps"] for b in buckets) > 10 and {b["k"] for b in buckets} >= {0, 2}
    for b in buckets:
        assert b["interval"][0] <= b["median_abs_error"] <= b["interval"][1]
    cost_ok = all(b["median_abs_error"] <= 0.10 for b in buckets if b["steps"] >= 8)
    assert code == (0 if r["passed"] else 1) and r["cost_passed"] == cost_ok
    # the one-k simulator is judged on the policies that drafted one length per row (fixed k and none)
    assert set(r["sim_judged"]) == {p for p in r["error"] if r["per_row_share"][p] <= 0.01} == {"none", "fixed:2"}
    assert 0 <= r["per_row_share"]["budget"] <= 1 and r["per_row_share"]["none"] == 0
    # each round at the clock's speed: its latency times its pace; the raw medians beside
    for p, rounds in r["real_rounds"].items():
        assert len(r["round_pace"][p]) == len(rounds) and all(f > 0 for f in r["round_pace"][p])
        assert r["real_mean_latency_s"][p] == pytest.approx(
            statistics.median(x * f for x, f in zip(rounds, r["round_pace"][p])))
        assert r["raw_mean_latency_s"][p] == pytest.approx(statistics.median(rounds))
        assert r["replay_raw_error"][p] == pytest.approx(r["replay_mean_latency_s"][p] / r["raw_mean_latency_s"][p] - 1)
    assert r["passed"] == (all(abs(e) <= 0.10 for e in [*(r["error"][p] for p in r["sim_judged"]),
                                                         *r["replay_error"].values()])
                           and not r["discordant_pairs"] and not r["replay_discordant_pairs"] and cost_ok)
    assert "| budget |" in (out / "summary.md").read_text() and "## The cost model per step" in (out / "summary.md").read_text()
    assert "PASSED" in (out / "summary.md").read_text() or "FAILED" in (out / "summary.md").read_text()
    # calibrated on this machine first (the default), and the summary says so
    assert r["calibration"]["used"] > 0 and set(r["calibration"]["factors"]) == {"draft", "verify", "other", "chunk",
                                                                                "chunk_context", "draft_context",
                                                                                "verify_context"}
    assert "calibrated by the schedule at fixed:1 and fixed:4" in (out / "summary.md").read_text()


def test_cost_model_check_groups_steps_and_measures_the_error_it_was_given():
    """Steps that took 25% longer than predicted show -20% in their bucket, wherever they fall; a bucket is
    (batch, k, context) with batch and context rounded to a power of two; the shape spread is how far steps of one
    exact shape stray from their median (1% here)."""
    from serve_app.bench.simcheck import cost_model_check, step_bucket
    from serve_app.engine.stats import StepStats
    from serve_app.profiling.calibration import step_cost_ms

    grid = grid_profile().latency
    predicted = []
    for i in range(40):
        b, k = (1, 1) if i % 2 else (2, 0)
        st = StepStats(batch_size=b, k=k, proposed=b * k, contexts=[100] * b)
        ms = step_cost_ms(grid, st)
        st.verify_s = ms * 1.25 * (1 + 0.01 * (i % 3)) / 1000
        predicted.append((st, ms))
    assert step_bucket(predicted[0][0]) == (2, 0, 128) and step_bucket(predicted[1][0]) == (1, 1, 128)
    out = cost_model_check(predicted)
    assert [(b["batch"], b["k"], b["steps"]) for b in out] == [(1, 1, 20), (2, 0, 20)]
    for b in out:
        assert b["median_error"] == pytest.approx(1 / 1.2625 - 1, abs=0.01) and b["median_abs_error"] > 0.19
        assert b["interval"][0] <= b["median_abs_error"] <= b["interval"][1] < 0.22
        assert b["shape_spread"] == pytest.approx(0.0, abs=0.011)


def test_calibration_pace_follows_a_machine_that_slows_and_prices_the_next_step():
    """A machine that turns 1.5x slower: within a few steps `predict_ms` prices the next step (of another shape) at
    1.5x its grid price, and the per-cell factors, which move over dozens of steps, do not need to."""
    from serve_app.engine.stats import StepStats
    from serve_app.profiling.calibration import Calibration, step_cost_ms

    grid = grid_profile().latency
    cal = Calibration(grid, warmup=0)

    def step(b, k, slow):  # each part as the grid prices it, times slow
        st = StepStats(batch_size=b, k=k, proposed=b * k, contexts=[50] * b)
        st.draft_s, st.verify_s, st.other_s = (grid.part_at(part, b, k) * slow / 1000 for part in ("draft", "verify", "other"))
        return st

    for i in range(40):
        cal.observe(step(1 + i % 2, 1, 1.0))
    probe = step(2, 1, 1.0)
    assert cal.predict_ms(probe) == pytest.approx(step_cost_ms(grid, probe), rel=0.02)
    for i in range(12):
        cal.observe(step(1, 1, 1.5))
    assert cal.predict_ms(probe) == pytest.approx(1.5 * step_cost_ms(grid, probe), rel=0.05)


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
@pytest.mark.parametrize("chunked", [False, True])
def test_fleet_engine_agrees_with_the_step_engine(policy, chunked):
    """The vectorised engine against the exact one on 4 replicas of the committed CPU profile, at a load
    that keeps them batching (mean latency, goodput, TPOT within 10%, TTFT within 15%), and conservation in
    both. chunked: a chunk price with a fixed part per step and a 64-token step budget, so prompts of up
    to 300 tokens prefill over several steps beside the decoding batch."""
    from serve_app.sim.fleetsim import simulate_fleet

    # The CPU profile as committed before it had measured chunk prices (its prefill priced per token); the
    # committed one is checked below.
    profile = Profile.model_validate(json.loads((ROOT / "tests" / "data" / "cpu-2core-before-chunk-prices.json").read_text()))
    kw, prompts = {}, (30, 60)
    if chunked:
        profile.latency.chunk_step_ms = [30.0] * 6
        profile.latency.chunk_ms_per_token = [1.5, 1.4, 1.3, 1.2, 1.1, 1.0]
        kw, prompts = {"max_num_batched_tokens": 64}, (100, 300)
    rng = np.random.default_rng(0)
    trace, t = [], 0.0
    while t < 90:
        t += rng.exponential(1 / 6.0)
        trace.append((t, int(rng.integers(*prompts)), int(rng.integers(16, 48))))
    exact = simulate({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8, **kw).summary()
    fleet = simulate_fleet({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8, tick_s=0.05,
                           **kw).summary()
    assert exact["finished"] == fleet["finished"] == len(trace)
    for key in ("mean_latency_s", "goodput_tokens_per_s", "tpot_p50_s"):
        assert fleet[key] == pytest.approx(exact[key], rel=0.10), key
    assert fleet["ttft_p50_s"] == pytest.approx(exact["ttft_p50_s"], rel=0.15)
    if chunked:
        return
    # closed loop: every user's requests follow one another, none lost
    res = simulate_fleet({"cpu-2core": 3}, {"cpu-2core": profile}, policy, users_at=lambda t: 5 if t < 20 else 9,
                         duration_s=40, prompt_tokens=40, output_tokens=32)
    assert res.arrivals == len(res.e2e) > 50 and (res.ttft <= res.e2e + 1e-9).all() and (res.ttft > 0).all()


@pytest.mark.parametrize("policy", ["none", "fixed:1", "fixed:4"])
@pytest.mark.parametrize("chunked", [False, True])
def test_fleet_engine_agrees_with_the_step_engine_on_the_committed_profile(policy, chunked):
    """Unchunked: a prompt reaching a decoding replica waits for the step under way, a uniform part of it (TTFT
    median and p90 within 5%; a fixed half step of the feeding step's price put the median 8-18% high and the p90
    up to 8% low). Chunked (the test above's prices, 100-300-token prompts at a 64-token budget): each chunk pays for
    what its row already holds (`chunk_context_ms`), as the step engine prices it (mean latency within 10%, TTFT p90
    within 10%; unpriced, the fleet engine ran up to 12% fast and its TTFT p90 17% low). Its TTFT median, near
    saturation, stays within 20%."""
    from serve_app.sim.fleetsim import simulate_fleet

    profile = Profile.model_validate(json.loads((ROOT / "profiles" / "cpu-2core.json").read_text()))
    kw, prompts = {}, (30, 60)
    if chunked:
        profile.latency.chunk_step_ms = [30.0] * 6
        profile.latency.chunk_ms_per_token = [1.5, 1.4, 1.3, 1.2, 1.1, 1.0]
        kw, prompts = {"max_num_batched_tokens": 64}, (100, 300)
    rng = np.random.default_rng(0)
    trace, t = [], 0.0
    while t < 90:
        t += rng.exponential(1 / 6.0)
        trace.append((t, int(rng.integers(*prompts)), int(rng.integers(16, 48))))
    exact = simulate({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8, **kw).summary()
    fleet = simulate_fleet({"cpu-2core": 4}, {"cpu-2core": profile}, policy, trace=trace, max_batch=8,
                           tick_s=0.05, **kw).summary()
    close = {"mean_latency_s": 0.10, "ttft_p90_s": 0.10, "ttft_p50_s": 0.20} if chunked else \
        {"mean_latency_s": 0.10, "ttft_p50_s": 0.05, "ttft_p90_s": 0.05}
    for key, rel in close.items():
        assert fleet[key] == pytest.approx(exact[key], rel=rel), key


def test_both_engines_price_a_decode_step_at_its_rows_context():
    """Eight 2,000-token prompts prefilled in one step, then decoded together: on the committed profile's context axis
    a batch-8 step at ~2,017 tokens is 3.0x its price at the grid's own 72, and both engines charge that (TPOT); a
    policy is asked at the rows' context, as the engine asks it (lut: k = 1 there, 0 at short context)."""
    from serve_app.engine.policy import BatchState, make_policy
    from serve_app.sim.fleetsim import simulate_fleet

    profile = Profile.model_validate(json.loads((ROOT / "profiles" / "cpu-2core.json").read_text()))
    grid = profile.latency
    assert grid.step_ms(8, 2017.0)[0] > 2.5 * grid.step_ms(8)[0]
    kw = dict(trace=[(1.0 + 0.001 * i, 2000, 33) for i in range(8)], max_batch=8, max_num_batched_tokens=16384)
    for engine in (simulate, lambda *a, **k: simulate_fleet(*a, tick_s=0.05, **k)):
        tpot = engine({"c": 1}, {"c": profile}, "none", **kw).summary()["tpot_p50_s"]
        assert tpot * 1000 == pytest.approx(grid.step_ms(8, 2017.0)[0], rel=0.02)
    lut = make_policy("lut", profile)
    assert lut.choose(BatchState(8, 8, True, contexts=(56,) * 8)) == 0
    assert lut.choose(BatchState(8, 8, True, contexts=(2048,) * 8)) == 1
    run = simulate({"c": 1}, {"c": profile}, "lut", **kw)
    assert {k for _, b, k, _ in run.replicas[0].steps if b == 8} == {1}
    fleet = simulate_fleet({"c": 1}, {"c": profile}, "lut", tick_s=0.05, **kw)
    assert 1 in fleet.k[:, 0] and (fleet.k[:, 0][~np.isnan(fleet.k[:, 0])] <= 3).all()


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


def test_per_row_share_and_a_runs_pace():
    """The one-k simulator is judged only on policies whose decoding steps ran (almost) no per-row plan; a run's pace
    is its steps' price on the clock over their measured time (0.8: the machine ran them 25% slower)."""
    from serve_app.bench.simcheck import per_row_share, run_pace
    from serve_app.engine.stats import RowOutcomes, StepStats
    from serve_app.profiling.calibration import step_cost_ms

    plan = RowOutcomes(ids=["a", "b"], drafted=[2, 5], accepted=[1, 5])
    steps = [StepStats(batch_size=2, k=5, proposed=7, rows=plan), StepStats(batch_size=1, k=1, proposed=1),
             StepStats(batch_size=1, k=1, proposed=1), StepStats(prefill_tokens=8)]
    assert per_row_share(steps) == pytest.approx(1 / 3) and per_row_share(steps[1:]) == 0.0 == per_row_share([])
    grid = grid_profile().latency
    for st in steps:
        st.verify_s = step_cost_ms(grid, st) * 1.25 / 1000
    assert run_pace(grid, steps) == pytest.approx(0.8) and run_pace(grid, []) == 1.0


def test_validation_schedules_are_the_replays_parts():
    """`simulate --validate --part` and `bench replay` share `replay.schedule`: (b), (d) and (e) are bench policies'
    time-varying and mixed schedules and the long-document one, seeded as the replay seeds them, with their phases;
    anything else is refused."""
    import random

    import serve_app.bench.replay as rp
    from serve_app.bench.policies import mixed_jobs, varying_jobs
    from serve_app.bench.simcheck import schedule
    from serve_app.models import load_tokenizer

    tok = load_tokenizer("embedded")
    expect = {"b": varying_jobs(tok, random.Random(3), 0.2)[0], "d": mixed_jobs(tok, random.Random(4), 0.2)[0],
              "e": rp.long_jobs(tok, random.Random(3), 0.2)}
    for part in ("b", "d", "e"):
        jobs, phases = schedule(tok, part, 3, 0.2)
        assert [(j.prompt, j.max_tokens, j.at, j.kind) for j in jobs] == \
            [(j.prompt, j.max_tokens, j.at, j.kind) for j in expect[part]] and jobs
        assert rp.schedules(tok, [part], 3, 0.2)[part] == jobs
        assert phases and all(a < b for a, b, _ in phases) and all(j.at < phases[-1][1] for j in jobs)
    assert len(schedule(tok, "e", 3, 0.2)[1]) == len(rp.LONG_PHASES)
    with pytest.raises(ValueError, match="unknown part"):
        schedule(tok, "x", 0, 0.2)


def test_validation_calibrates_as_deep_as_the_deepest_fixed_k_it_judges():
    """The acceptance the simulated replica draws comes from the second calibration run's steps at its k; past
    that it is extended geometrically, which made fixed:8 16% slow in simulation when that run was fixed:4."""
    from serve_app.bench.simcheck import calibration_policies, measured_acceptance
    from serve_app.engine.stats import StepStats

    assert calibration_policies(["none", "fixed:1", "fixed:2", "budget"]) == ("fixed:1", "fixed:4")
    assert calibration_policies(["none", "fixed:8", "fixed:4", "lut"]) == ("fixed:1", "fixed:8")
    assert calibration_policies(["lut", "adaptive"]) == ("fixed:1", "fixed:4")
    # a draft that keeps agreeing once going: positions 5-8 as measured, not a geometric tail
    deep = [StepStats(batch_size=2, k=8, accepted_per_position=[2, 1, 1, 1, 1, 1, 1, 0]) for _ in range(4)]
    got = measured_acceptance(deep)
    assert len(got) == 8 and got[4:] == [0.5, 0.5, 0.5, 0.0]
    # pooled: a position counts the rows of every step that drafted it (fixed:1's steps too, for position 0)
    shallow = [StepStats(batch_size=4, k=1, accepted_per_position=[0]) for _ in range(2)]
    assert measured_acceptance(deep + shallow)[:2] == [0.5, 0.5]  # (4 x 2 accepted) / (4 x 2 + 2 x 4 rows); 4 / 8
