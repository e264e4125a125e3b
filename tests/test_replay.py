"""`bench replay`: the real engine and policies on the cost model's virtual clock. Deterministic (the same run
twice gives the same figures), the clock is the cost model's sum, and the work is counted per step."""

import random
import time

import pytest

from conftest import IdTokenizer, perturbed, tiny_llama
from serve_app.bench.policies import Job
from serve_app.bench.replay import OnClock, _engine, closed_cell, markdown, replay, replay_grid, replay_parts
from serve_app.engine.stats import StepStats
from serve_app.models import LoadedModels
from serve_app.profiling.calibration import Calibrated, step_cost_ms, step_parts_ms
from serve_app.pricing import LatencyGrid
from serve_app.profiling.profiles import Profile

KS = [0, 1, 2, 4]
GRID = LatencyGrid(batch_sizes=[1, 8], ks=KS, draft_ms=[[0.0, 3, 6, 12], [0.0, 6, 12, 24]],
                   verify_ms=[[20 + 2 * k for k in KS], [30 + 8 * k for k in KS]], other_ms=[[1.0] * 4, [1.0] * 4],
                   chunk_step_ms=[5.0, 5.0], chunk_ms_per_token=[0.1, 0.1], chunk_budget=128, chunk_prompt_tokens=16)
PROFILE = Profile(gpu_type="virtual", target="t", draft="d", best_k={1: 4, 8: 2}, latency=GRID,
                  acceptance=[0.7, 0.5, 0.35, 0.25], acceptance_rate=0.7)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(97, layers=2, seed=0)
    return LoadedModels(target, perturbed(target, 0.02), IdTokenizer(), "t", "d")


def test_a_steps_cost_is_the_grid_at_its_forwards_tokens_and_prefill():
    st = StepStats(batch_size=8, k=4, draft_forwards=2, proposed=8 * 3, prefill_tokens=40)
    # draft: 2 forwards at batch 8 = 12; verify at 3 tokens a row = 30 + 24; other 1; prefill 5 + 40 x 0.1
    assert step_cost_ms(GRID, st) == pytest.approx(12 + 54 + 1 + 9)
    # a prefill alone: the chunk and the forward a k = 0 step at batch 1 costs (as calibration prices it)
    assert step_cost_ms(GRID, StepStats(prefill_tokens=16)) == pytest.approx(5 + 1.6 + sum(
        getattr(GRID, f"{part}_ms")[0][0] for part in ("draft", "verify", "other")))


def test_replay_is_deterministic_and_its_clock_is_the_cost_models(models):
    rng = random.Random(0)
    jobs = [Job([rng.randrange(3, 90) for _ in range(rng.randint(3, 12))], rng.randint(4, 16), at=0.05 * i)
            for i in range(12)]
    a, b = replay(models, PROFILE, "adaptive", jobs, 4), replay(models, PROFILE, "adaptive", jobs, 4)
    assert a.latencies == b.latencies and a.counts == b.counts and a.seconds == b.seconds
    assert len(a.latencies) == 12 and min(a.latencies) > 0.02  # at least one decode step each, 21 ms or more
    assert a.tokens == sum(j.max_tokens for j in jobs)
    none = replay(models, PROFILE, "none", jobs, 4)
    assert none.counts["proposed"] == 0 and none.counts["draft_forward_rows"] == 0
    assert a.counts["proposed"] > 0 and 0 < a.counts["accepted"] <= a.counts["proposed"]
    res = replay_parts(models, PROFILE, ["fixed:1", "fixed:2", "adaptive"], {"x": jobs}, 4)["x"]
    assert res["best_fixed"] in ("fixed:1", "fixed:2")
    assert res["policies"][res["best_fixed"]]["vs_best_fixed"] == 1.0
    assert closed_cell(models, PROFILE, "fixed:2", 4, [list(range(3, 40))], 8, 8) > 0


def test_replayed_policies_run_as_served_and_calibrate_on_the_clock(models):
    """lut as a Router serves it: calibrated online, a neighbouring k every 8th step. Its steps read the replay's
    clock (not this machine's wall time), so calibration finds the clock exactly (every factor 1) and the run
    stays deterministic."""
    engine = _engine(models, PROFILE, "lut", 4)
    assert isinstance(engine.policy, OnClock) and isinstance(engine.policy.inner, Calibrated)
    seen, observed = [], []
    engine.on_step.append(seen.append)
    calibrating = engine.policy.inner.observe
    engine.policy.inner.observe = lambda st: (observed.append(st), calibrating(st))
    rng = random.Random(1)
    for _ in range(2):
        engine.submit([rng.randrange(3, 90) for _ in range(9)], Job([1], 48).params())
    while engine.has_work():
        engine.step()
    decode = [st for st in seen if st.batch_size]
    assert len(observed) == len(decode)
    for st, copy in zip(decode, observed):  # the policy saw the clock's parts; the step kept its measured ones
        parts = step_parts_ms(GRID, st)
        assert (copy.draft_s, copy.verify_s, copy.other_s) == pytest.approx(tuple(ms / 1000 for ms in parts))
        assert sum(parts) == pytest.approx(step_cost_ms(GRID, st)) and st.verify_s != copy.verify_s
    assert {st.k for st in decode} > {2}  # batch 2 runs best_k[1] = 4 and, exploring, its neighbours
    factors = engine.policy.inner.calibration.factors()
    assert all(f == pytest.approx(1.0) for part in factors.values() for f in part.values()), factors


def test_a_clock_off_the_profile_is_learnt_by_the_served_policy(models):
    """A machine that runs its profile off: the steps take the clock's time, and the served policy starts from
    the profile and calibrates towards the clock (as a replica does on a machine 20-60% off the profile)."""
    slow = GRID.model_copy(update={f"{part}_ms": [[1.5 * v for v in row] for row in getattr(GRID, f"{part}_ms")]
                                   for part in ("draft", "verify", "other")})
    rng = random.Random(2)
    jobs = [Job([rng.randrange(3, 90) for _ in range(9)], 48, at=0.01 * i) for i in range(3)]
    on_profile, off = replay(models, PROFILE, "lut", jobs, 4), replay(models, PROFILE, "lut", jobs, 4, clock=slow)
    assert off.seconds > 1.3 * on_profile.seconds
    engine = _engine(models, PROFILE, "adaptive", 4, slow)
    for j in jobs:
        engine.submit(j.prompt, j.params())
    while engine.has_work():
        engine.step()
    factors = engine.policy.inner.calibration.factors()
    assert factors["verify"][1] == pytest.approx(1.5) and factors["draft"][1] == pytest.approx(1.5), factors


def test_the_grid_starts_no_cell_past_its_deadline_and_names_those_it_left(models):
    """A lent GPU's call keeps only what it wrote: a grid that ran past its timeout lost every cell. Past the
    deadline no cell starts; the results and their markdown say which were left."""
    docs = {24: [list(range(3, 27))] * 4, 48: [list(range(5, 53))] * 4}
    whole = replay_grid(models, PROFILE, ["fixed:1", "adaptive"], [2], docs, max_tokens=6, rounds=1)
    assert [c["context"] for c in whole["cells"]] == [24, 48] and "skipped" not in whole
    late = replay_grid(models, PROFILE, ["fixed:1", "adaptive"], [2], docs, max_tokens=6, rounds=1,
                       deadline=time.monotonic())
    assert late["cells"] == [] and late["skipped"] == [{"batch": 2, "context": 24}, {"batch": 2, "context": 48}]
    text = markdown({"gpu_type": "virtual", "target": "t", "draft": "d", "grid": late}, ["fixed:1", "adaptive"])
    assert "Not run (past the deadline): batch 2 x 24 tokens, batch 2 x 48 tokens." in text


def test_across_seeds_pairs_each_policy_with_every_fixed_k_seed_by_seed():
    """Seeds are pairs: a schedule where everything is slow moves both sides alike. The best fixed k is the one
    with the lowest geometric mean over seeds, and the markdown prints every ratio with its interval."""
    from serve_app.bench.replay import across_seeds, markdown

    def run(fixed2, fixed3, budget):
        return {"e": {"requests": 10, "policies": {p: {"mean_latency_s": v} for p, v in
                                                   (("fixed:2", fixed2), ("fixed:3", fixed3), ("budget", budget))}}}

    # seed 2's schedule is 3x as slow for everyone; budget is 0.9x fixed:3 on every seed
    runs = [run(1.1, 1.0, 0.9), run(2.1, 2.0, 1.8), run(3.0, 3.3, 2.97)]
    res = across_seeds(runs)["e"]
    assert res["best_fixed"] == "fixed:3" and res["seeds"] == 3 and res["requests"] == [10, 10, 10]
    vs = res["policies"]["budget"]["vs_best_fixed"]
    assert vs["ratio"] == pytest.approx(0.9) and vs["low"] == pytest.approx(0.9) and vs["high"] == pytest.approx(0.9)
    noisy = res["policies"]["fixed:2"]["vs_fixed"]["fixed:3"]
    assert noisy["low"] < 1.0 < noisy["high"]  # 1.1, 1.05, 0.91: no claim
    text = markdown({"gpu_type": "g", "target": "t", "draft": "d", "parts": {}, "seeds": {"e": res}},
                    ["fixed:2", "fixed:3", "budget"])
    assert "| (e) 30 requests, best fixed:3 | budget | 0.900x [0.900, 0.900] |" in text
    # one seed (the command's default): the result holds the count, and there is no across-seeds table
    one = markdown({"gpu_type": "g", "target": "t", "draft": "d", "parts": {}, "seeds": 1}, ["fixed:2"])
    assert "Across" not in one


def test_bench_history_pairs_the_history_on_and_off_and_copies_repeats_on_the_cost_model(models):
    """`bench history`'s two halves on repeating jobs: the wall-clock rounds (both arms, paired figures, sources
    by quarter) and the replay, where answers asked again are copied from the history: more tokens per step."""
    import dataclasses

    from serve_app.bench.repeating import bench_history, replay_history

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 90) for _ in range(8)] for _ in range(3)]
    jobs = [Job(prompts[i % 3], 24, at=0.2 * i, kind="abc"[i % 3]) for i in range(12)]
    models = dataclasses.replace(models, prompt_lookup=True, history_tokens=4096)

    class Bar:
        def update(self, n):
            pass

    res = bench_history(models, PROFILE, "budget", {"x": jobs}, 2, 0.25, 4096, Bar())["x"]
    assert len(res["runs"]["on"]) == len(res["runs"]["off"]) == 2 and set(res["paired"]["by_kind"]) == {"a", "b", "c"}
    assert res["paired"]["tokens_per_step"]["rounds"] == 2
    assert sum(q.get("history", 0) for q in res["runs"]["on"][0]["sources_by_quarter"]) > 0
    assert not any(q.get("history") for q in res["runs"]["off"][0]["sources_by_quarter"])
    rep = replay_history(models, PROFILE, "budget", {"x": jobs}, 4096, 0.25)["x"]
    assert rep["on"]["tokens_per_step"] > 1.5 * rep["off"]["tokens_per_step"]


def test_the_no_repeat_control_asks_each_question_once_on_bs_schedule():
    from conftest import make_tokenizer
    from serve_app.bench.repeating import chat_jobs, distinct_chat_texts, unique_chat_jobs

    texts = distinct_chat_texts()
    assert len(set(texts)) == len(texts) >= 400
    tok = make_tokenizer()
    b, u = chat_jobs(tok, random.Random(0), 1.0), unique_chat_jobs(tok, random.Random(0), 1.0)
    assert [(j.at, j.max_tokens) for j in u] == [(j.at, j.max_tokens) for j in b]
