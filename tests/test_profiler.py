"""`specserve profile` on tiny saved models, the policies that read its output, and `bench policies`."""

import json
import os
import random

import pytest

from serve_app.cli import main
from serve_app.config import EngineConfig
from serve_app.profiling.profiles import load_profile


@pytest.fixture(scope="module")
def tiny_profile(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "tiny.json"
    code = main(["profile", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
                 "--batch-sizes", "1,2,4", "--max-k", "3", "--reps", "2", "--max-reps", "3", "--prompts", "3",
                 "--max-tokens", "8", "--out", str(out)])
    assert code == 0
    return out


def test_profiling_smoke_writes_a_valid_profile_and_heatmap(tiny_profile):
    p = load_profile(tiny_profile)
    assert p.gpu_type == f"cpu-{os.cpu_count()}core"
    assert (p.target, p.draft) == ("target", "draft")  # directory names: the same on every machine
    g = p.latency
    assert g.batch_sizes == [1, 2, 4] and g.ks == [0, 1, 2, 3]
    assert all(v > 0 for row in g.verify_ms for v in row)
    assert all(row[0] < row[-1] for row in g.draft_ms)  # k = 0 runs no draft forward, k = 3 three
    assert len(g.resume_ms) == 3 and all(v >= 0 for v in g.resume_ms)
    # a copy's verification past k = 3, up to max_copy_tokens (16): halfway and there
    assert g.copy_ks == [10, 16] and all(len(r) == 2 and min(r) > 0 for r in g.copy_verify_ms)
    assert "verification also at k = 10, 16 (copies)" in p.notes
    assert "PROFILE_PROMPTS" in p.notes and "shuffled" in p.notes
    # a CPU's cells are the wall clock (the host is the device); every cell says how far its visits disagree
    assert g.clock == "wall" and g.host_verify_ms is None and "agree within 5%" in p.notes
    assert len(g.spread) == 3 and all(len(r) == 4 and min(r) >= 0 for r in g.spread)
    assert len(p.acceptance) == 3 and sorted(p.acceptance, reverse=True) == p.acceptance
    assert set(p.best_k) == {1, 2, 4} and all(0 <= k <= 3 for k in p.best_k.values())
    assert len(p.confidence_curve) == 10 and all(0 <= v <= 1 for v in p.confidence_curve)
    png = tiny_profile.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_latency_visits_every_k_per_round_in_a_shuffled_order_two_steps_each(tiny_model_dirs, monkeypatch):
    from serve_app.profiling import profiler
    from serve_app.profiling import measuring
    from serve_app.config import ModelConfig
    from serve_app.models import load_models
    from serve_app.engine.policy import FixedK

    chosen = []

    def record(k):
        chosen.append(k)
        return FixedK(k)

    monkeypatch.setattr(profiler, "FixedK", record)
    monkeypatch.setattr(measuring, "FixedK", record)  # the measuring engines start at FixedK(0)
    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    grid = profiler.measure_latency(models, [2], [0, 1, 2, 3], reps=4, bar=profiler.tqdm(disable=True))
    assert chosen[0] == 0 and chosen[-1] == 0  # the engines' own policies (the grid's; the chunk price's, at k = 0)
    per_round = [chosen[1:-1][i:i + 5] for i in range(0, len(chosen) - 2, 5)]
    assert len(per_round) == 5 and all(r[0] == 0 for r in per_round)  # warm-up + 4 recorded; each prefills fresh requests at k = 0
    rounds = [r[1:] for r in per_round]
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds)  # every k once per round
    assert len({tuple(r) for r in rounds}) > 1  # not the same order every round
    assert any(r[0] != 0 for r in rounds)  # k = 1 does not always follow k = 0
    assert grid.resume_ms is not None and len(grid.resume_ms) == 1 and grid.resume_ms[0] >= 0
    assert grid.context_tokens is not None and grid.context_tokens < 60  # fresh requests each round: short contexts
    # the chunked prefill's price at the engine's step budget: a fixed part per step and a part per token
    assert grid.chunk_budget == EngineConfig().max_num_batched_tokens and 0 < grid.chunk_prompt_tokens < 60
    for name in ("chunk_step_ms", "chunk_ms_per_token", "chunk_draft_step_ms", "chunk_draft_ms_per_token"):
        assert len(getattr(grid, name)) == 1 and getattr(grid, name)[0] >= 0
    assert grid.chunk_ms(2, 10) == pytest.approx(grid.chunk_step_ms[0] + 10 * grid.chunk_ms_per_token[0])
    assert grid.prefill_ms is None  # admission no longer prefills: nothing to time there


def test_spread_compares_the_medians_of_alternate_visits():
    from serve_app.profiling.measuring import spread

    assert spread([]) == spread([5.0]) == 0.0
    assert spread([10.0, 10.0, 10.0, 10.0]) == 0.0
    assert spread([10.0, 11.0, 10.0, 11.0]) == pytest.approx(1 / 10.5)  # even visits 10, odd 11: 9.5% apart
    assert spread([10.0, 10.5, 10.2, 10.1, 9.9, 10.3]) < 0.05


@pytest.mark.parametrize("agree, rounds", [(10.0, 2), (0.0, 4)])
def test_latency_visits_past_reps_until_the_cells_agree(tiny_model_dirs, monkeypatch, agree, rounds):
    """With `agree`, rounds go on past `reps` (here 2) up to `max_reps` (4) while a cell's alternate visits
    disagree by more: 10 (100%) stops at reps, 0 (any disagreement) runs them all."""
    from serve_app.profiling import profiler
    from serve_app.config import ModelConfig
    from serve_app.models import load_models

    visits = []
    real = profiler.visit
    monkeypatch.setattr(profiler, "visit", lambda *a: visits.append(1) or real(*a))
    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    bar = profiler.tqdm(disable=True, total=0)
    grid = profiler.measure_latency(models, [1], [0, 1], reps=2, bar=bar, chunk_prefill=False, agree=agree, max_reps=4)
    assert len(visits) == 2 * (1 + rounds)  # a warm-up round, then the recorded ones, 2 ks each
    assert grid.clock == "wall" and len(grid.spread) == 1 and len(grid.spread[0]) == 2


def test_events_clock_makes_the_cells_device_time_and_keeps_the_hosts_beside(tiny_model_dirs, monkeypatch):
    """With clock = events (a GPU's), the draft and verification cells are the workers' device work (their
    WorkClock: on this CPU its spans around forwards and sampling), the host's wall clock around the same calls
    beside them: never below the device work it contains."""
    from serve_app.profiling import measuring, profiler
    from serve_app.config import ModelConfig
    from serve_app.models import load_models

    seen = []
    real = profiler.visit
    monkeypatch.setattr(profiler, "visit", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(profiler, "clock_of", lambda engine: "events")
    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    grid = profiler.measure_latency(models, [2], [0, 2], reps=3, bar=profiler.tqdm(disable=True), chunk_prefill=False)
    assert grid.clock == "events"
    recorded = seen[2:]  # after the warm-up round's two visits
    for j, k in enumerate(grid.ks):
        mine = [v for v in recorded if v.kept.k == k]
        assert len(mine) == 3
        assert grid.verify_ms[0][j] == measuring.part_ms(mine, "verify", "events") > 0
        assert grid.draft_ms[0][j] == measuring.part_ms(mine, "draft", "events")
        assert grid.host_verify_ms[0][j] == measuring.part_ms(mine, "verify", "wall") >= grid.verify_ms[0][j]
        assert grid.host_draft_ms[0][j] >= grid.draft_ms[0][j]
        assert all(v.verify_device_s <= v.kept.verify_s for v in mine)
    assert grid.draft_ms[0][0] == 0.0 < grid.draft_ms[0][1]  # k = 0 runs no draft forward, k = 2 two
    with pytest.raises(ValueError, match="go with clock = events"):
        type(grid).model_validate(grid.model_dump() | {"clock": "wall"})


def test_chunk_price_times_steps_that_prefill_beside_the_decoding_batch(tiny_model_dirs, monkeypatch):
    """Beside 2 sequences decoding at k = 0, a chat-length prompt and one of a whole chunk (the budget less
    the 2 decoding rows) each prefill in one step, the batch decoding in it too; the price is fitted
    to their extra time over plain steps."""
    from serve_app.profiling import profiler
    from serve_app.config import ModelConfig
    from serve_app.models import load_models
    from serve_app.bench.prompt_sets import PROFILE_PROMPTS, chat_prompts

    engines, seen = [], []
    make = profiler.measuring_engine

    def recorded(*args, **kw):
        engines.append(make(*args, **kw))
        engines[-1].on_step.append(seen.append)
        return engines[-1]

    monkeypatch.setattr(profiler, "measuring_engine", recorded)
    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    prompts = chat_prompts(models.tokenizer, PROFILE_PROMPTS, 2)
    *price, short = profiler.measure_chunk_prefill(models, prompts, 2, reps=1, max_model_len=256, budget=32)
    assert short == round(sum(len(p) for p in prompts) / 2) and all(v >= 0 for v in price)
    assert price[2] <= price[0] and price[3] <= price[1]  # the draft's parts
    [engine] = engines
    assert engine.config.max_num_batched_tokens == 32 and not engine.config.prefix_caching
    chunked = [(st.k, st.prefill_tokens) for st in seen if st.prefill_tokens and st.batch_size == 2]
    assert chunked == [(0, short), (0, 30)] * 3  # 3 repetitions, the whole batch decoding beside each
    assert all(st.scheduled_tokens <= 32 for st in seen)


def speculating_profile(tiny_profile, path, **changes):
    """The tiny profile with every best k = 2 and a grid where verification costs the same at every k,
    so lut and (with a good starting estimate) adaptive speculate whatever the random draft does."""
    body = json.loads(tiny_profile.read_text())
    g = body["latency"]
    g["draft_ms"] = [[0.0] * len(g["ks"]) for _ in g["batch_sizes"]]
    g["verify_ms"] = [[10.0] * len(g["ks"]) for _ in g["batch_sizes"]]
    body |= {"best_k": {str(b): 2 for b in g["batch_sizes"]}, "acceptance_rate": 0.9, **changes}
    path.write_text(json.dumps(body))
    return str(path)


@pytest.mark.parametrize("policy", ["lut", "adaptive"])
def test_profile_driven_policies_speculate_and_keep_greedy_output(tmp_path, tiny_model_dirs, tiny_profile, policy):
    from test_cli import GOOD, run

    _, plain = run(tmp_path, tiny_model_dirs, GOOD, "--max-tokens", "16", "--policy", "none")
    profile = speculating_profile(tiny_profile, tmp_path / "spec.json")
    code, spec = run(tmp_path, tiny_model_dirs, GOOD, "--max-tokens", "16", "--policy", policy,
                     "--profile", profile, "--batch-size", "2")
    assert code == 0
    assert sum(r["stats"]["proposed"] for r in spec) > 0  # it did speculate: the comparison means something
    assert sum(r["stats"]["accepted"] for r in spec) < sum(r["stats"]["proposed"] for r in spec)  # and was rejected
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]


def test_acceptance_only_measures_acceptance_and_the_curve_again_and_keeps_the_grid(tiny_profile, tiny_model_dirs,
                                                                                   tmp_path, capsys):
    """`specserve profile --acceptance-only`: an older profile (no curve, another acceptance) gets this pair's
    acceptance, rate and confidence curve, the best-k table from its own grid, a note; the grid stays. A predicted
    profile, or one of another pair, is refused."""
    before = json.loads(tiny_profile.read_text())
    old = dict(before, acceptance=[0.9, 0.8, 0.7], acceptance_rate=0.9)
    del old["confidence_curve"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    pair = ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"]]
    assert main(["profile", "--acceptance-only", *pair, "--prompts", "3", "--max-tokens", "8", "--out", str(path)]) == 0
    p = load_profile(path)
    assert p.latency.model_dump() == load_profile(tiny_profile).latency.model_dump()
    assert p.acceptance == before["acceptance"] and p.acceptance_rate == before["acceptance_rate"]  # same run, same numbers
    assert p.confidence_curve == before["confidence_curve"] and "--acceptance-only" in p.notes
    assert path.with_suffix(".png").exists()
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(before, draft="some-other-draft")))
    assert main(["profile", "--acceptance-only", *pair, "--out", str(other)]) == 2
    assert "measured with target 'target' and draft 'some-other-draft'" in capsys.readouterr().err
    assert main(["profile", "--acceptance-only", "--predict", "NVIDIA_L4"]) == 2


def test_copies_only_adds_the_copy_columns_scaled_to_the_grid_and_keeps_the_rest(tiny_profile, tiny_model_dirs,
                                                                                  tmp_path, capsys):
    """`specserve profile --copies-only`: a profile without copy columns gets them, measured beside its grid's
    longest k and scaled per batch size so those columns match the grid's; everything else stays. Copy columns
    not past the grid's k, or a predicted profile, are refused."""
    before = json.loads(tiny_profile.read_text())
    old = json.loads(tiny_profile.read_text())
    old["latency"] |= {"copy_ks": None, "copy_verify_ms": None,
                       "verify_ms": [[v * 3 for v in row] for row in old["latency"]["verify_ms"]]}  # a slower day
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    pair = ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"]]
    assert main(["profile", "--copies-only", *pair, "--max-k", "3", "--copy-ks", "6,9", "--reps", "2",
                 "--out", str(path)]) == 0
    assert "verification at k = [6, 9] added" in capsys.readouterr().out
    p = load_profile(path)
    g = p.latency
    assert g.copy_ks == [6, 9] and "--copies-only" in p.notes
    assert g.model_dump() | {"copy_ks": None, "copy_verify_ms": None} == old["latency"]
    for i, row in enumerate(g.copy_verify_ms):  # scaled to the (3x slower) grid: above its k = 3 cell's half
        assert min(row) > 0.5 * g.verify_ms[i][-1]
    assert p.acceptance == before["acceptance"]
    assert main(["profile", "--copies-only", *pair, "--copy-ks", "2", "--out", str(path)]) == 2
    assert main(["profile", "--copies-only", *pair, "--max-k", "1", "--copy-ks", "3", "--out", str(path)]) == 2
    assert "past the grid's longest k, 3" in capsys.readouterr().err


def test_chunk_context_only_adds_the_chunks_context_price_and_keeps_the_rest(tiny_profile, tiny_model_dirs,
                                                                             tmp_path, capsys):
    """`specserve profile --chunk-context-only`: a measured profile gets `chunk_context_ms` (what a prompt chunk
    pays for the KV its row holds), everything else kept; it is one run of its own."""
    before = json.loads(tiny_profile.read_text())
    path = tmp_path / "p.json"
    path.write_text(tiny_profile.read_text())
    pair = ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"]]
    assert main(["profile", "--chunk-context-only", *pair, "--context", "160", "--out", str(path)]) == 0
    assert "chunk context price added" in capsys.readouterr().out
    p = load_profile(path)
    assert len(p.latency.chunk_context_ms) == 2 and min(p.latency.chunk_context_ms) >= 0
    assert "--chunk-context-only" in p.notes and p.acceptance == before["acceptance"]
    assert p.latency.model_dump() | {"chunk_context_ms": None} == load_profile(tiny_profile).latency.model_dump()
    assert main(["profile", "--chunk-context-only", "--copies-only", *pair, "--out", str(path)]) == 2


def test_profile_errors_exit_2(tmp_path, tiny_model_dirs, tiny_profile, capsys):
    from test_cli import GOOD, run

    code, _ = run(tmp_path, tiny_model_dirs, GOOD, "--policy", "adaptive", "--profile", str(tmp_path / "none.json"))
    assert code == 2 and "no profile at" in capsys.readouterr().err
    other = json.loads(tiny_profile.read_text()) | {"draft": "some-other-draft"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    code, _ = run(tmp_path, tiny_model_dirs, GOOD, "--policy", "lut", "--profile", str(tmp_path / "other.json"))
    assert code == 2 and "measured with target 'target' and draft 'some-other-draft'" in capsys.readouterr().err
    broken = json.loads(tiny_profile.read_text())
    del broken["latency"]["verify_ms"][1]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    code, _ = run(tmp_path, tiny_model_dirs, GOOD, "--policy", "adaptive", "--profile", str(tmp_path / "broken.json"))
    assert code == 2 and "a batch size is missing" in capsys.readouterr().err
    assert main(["profile", "--target", tiny_model_dirs["target"], "--batch-sizes", "1,x"]) == 2
    assert main(["profile", "--target", tiny_model_dirs["target"], "--draft", "none", "--out", str(tmp_path / "p.json")]) == 2
    assert "needs a draft" in capsys.readouterr().err


def test_bench_policies_runs_every_experiment(tmp_path, tiny_model_dirs, tiny_profile, monkeypatch):
    """A small run of (a), (b), (c) and (d) on tiny models: every policy, the regret tables, the markdown and the
    plots."""
    from serve_app.bench import policies as bp
    from serve_app.config import ModelConfig
    from serve_app.models import load_models
    from serve_app.profiling.profiles import load_profile

    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    # the tiny WordPiece tokenizer has no grammar support: (d) without its JSON requests here (the schedule's
    # JSON requests are checked on the embedded tokenizer in test_mixed_schedule_...)
    monkeypatch.setattr(bp, "MIXED_KINDS", (("chat", 0.5), ("rewrite", 0.5)))
    res = bp.bench_policies(models, load_profile(tiny_profile), str(tmp_path / "r"), [1, 2], max_k=2, scale=0.05,
                             parts="abcd")
    policies = ["none", "fixed:1", "fixed:2", "lut", "adaptive", "budget"]
    assert set(res["uniform"][2]) == set(policies) and set(res["varying"]["policies"]) == set(policies)
    assert res["varying"]["requests"] > 0 and set(res["shift"][4]) == {"none", "lut", "adaptive", "budget"}
    mixed = res["mixed"]
    assert set(mixed["policies"]) == set(policies) and sum(mixed["kinds"].values()) == mixed["requests"] > 0
    assert set(mixed["regret"]) == {"lut", "adaptive", "budget"} and all(mixed["regret"].values())
    assert res["uniform"][1]["none"]["mean_k"] == 0 and res["uniform"][1]["fixed:2"]["mean_k"] == 2
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "(a) Uniform load" in summary and "(b) Time-varying" in summary and "(c) Workload shift" in summary
    assert "(d) " in summary and "best fixed k there" in summary  # the regret table
    for name in ("uniform.png", "varying.png", "shift.png", "mixed.png"):
        assert (tmp_path / "r" / name).stat().st_size > 10_000
    again = bp.bench_policies(models, load_profile(tiny_profile), str(tmp_path / "r2"), [1], max_k=2, scale=0.05,
                              parts="ac", repeat=2)  # rounds: medians and spreads
    assert again["repeat"] == 2 and "spread" in again["shift"][1]["adaptive"] and "varying" not in again
    assert "Rounds: 2" in (tmp_path / "r2" / "summary.md").read_text()


def test_bench_policies_runs_the_long_document_schedule_on_the_wall_clock(tmp_path, tiny_model_dirs, tiny_profile,
                                                                          monkeypatch):
    """(e), bench replay's long documents between short chat, runs in `bench policies` too: every policy in
    rounds, paired ratios, regret, its section and plot. (The tiny models' context is short: documents of a few
    tokens here; the real schedule's prompts are checked in test_replay.py.)"""
    from serve_app.bench import policies as bp
    from serve_app.config import ModelConfig
    from serve_app.models import load_models
    from serve_app.profiling.profiles import load_profile

    models = load_models(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]))
    monkeypatch.setattr(bp, "document", lambda tok, n, offset=0: [3 + offset % 15, 4, 5, 6] * 3)
    res = bp.bench_policies(models, load_profile(tiny_profile), str(tmp_path / "e"), [1], max_k=2, scale=0.1,
                            parts="e", repeat=2, policies=["fixed:1", "budget"])
    long = res["long"]
    assert long["requests"] == len(bp.long_jobs(models.tokenizer, random.Random(0), 0.1)) > 0
    assert set(long["kinds"]) == {"chat", "document"} and sum(long["kinds"].values()) == long["requests"]
    assert set(long["policies"]) == {"fixed:1", "budget"} and "budget" in long["paired"]["policies"] and long["regret"]["budget"]
    summary = (tmp_path / "e" / "summary.md").read_text()
    assert "(e) Long documents" in summary and (tmp_path / "e" / "long.png").stat().st_size > 10_000
    assert main(["bench", "policies", "--parts", "ef"]) == 2


def test_time_varying_schedule_swings_and_is_seeded(tiny_model_dirs):
    from serve_app.bench import policies as bp
    from serve_app.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dirs["target"])
    jobs, phases = bp.varying_jobs(tok, random.Random(3), 1.0)
    again, _ = bp.varying_jobs(tok, random.Random(3), 1.0)
    assert [j.at for j in jobs] == [j.at for j in again]
    rate = [sum(a <= j.at < b for j in jobs) / (b - a) for a, b, _ in phases]
    low = [r for r, (_, _, want) in zip(rate, phases) if want < 1]
    high = [r for r, (_, _, want) in zip(rate, phases) if want > 1]
    assert max(low) < min(high)  # the load really swings


def test_mixed_schedule_swings_mixes_kinds_and_is_seeded():
    """(d): bursts that fill the batch between single requests, chat / JSON (with its schema) / rewrites."""
    from serve_app.bench import policies as bp
    from serve_app.models import load_tokenizer

    tok = load_tokenizer("embedded")  # the embedded model's tokenizer (no network)
    jobs, phases = bp.mixed_jobs(tok, random.Random(1), 1.0)
    again, _ = bp.mixed_jobs(tok, random.Random(1), 1.0)
    assert [(j.at, j.kind, j.prompt) for j in jobs] == [(j.at, j.kind, j.prompt) for j in again]
    assert {j.kind for j in jobs} == {"chat", "json", "rewrite"}
    assert all((j.structured is not None) == (j.kind == "json") for j in jobs)
    burst = max(sum(a <= j.at < b for j in jobs) for a, b, _ in phases)
    assert burst >= 20 and min(sum(a <= j.at < b for j in jobs) for a, b, _ in phases) <= 8


def test_bench_acceptance_tells_a_perfect_draft_from_a_random_one(tiny_model_dirs, capsys, tmp_path):
    from serve_app.bench.acceptance import bench_acceptance
    from serve_app.config import ModelConfig

    target = tiny_model_dirs["target"]
    # the drafts alone (prompt lookup copies, which the target may reject, are measured with the policies)
    same, _ = bench_acceptance(ModelConfig(target=target, draft=target, prompt_lookup=False), k=3, max_tokens=12, batch=4)
    other, md = bench_acceptance(ModelConfig(target=target, draft=tiny_model_dirs["draft"], prompt_lookup=False), k=3,
                                 max_tokens=12, batch=4)
    assert list(same["sets"]) == ["benchmark", "creative", "structured", "rewrite"]
    for name, s in same["sets"].items():
        o = other["sets"][name]
        assert s["acceptance"] > 0.95 and 3.0 < s["tokens_per_step"] <= 4.0  # the target as its own draft
        assert o["acceptance"] < s["acceptance"] and o["tokens_per_step"] < s["tokens_per_step"]
    assert "| structured |" in md
    out = tmp_path / "acc"
    assert main(["bench", "acceptance", "--target", target, "--draft", target, "--k", "2", "--max-tokens", "4",
                 "--out", str(out)]) == 0
    assert json.loads((tmp_path / "acc.json").read_text())["sets"]["creative"]["tokens_per_step"] > 2.9
    assert "tokens/step" in (tmp_path / "acc.md").read_text() and "tokens/step" in capsys.readouterr().out
    assert main(["bench", "acceptance", "--target", target, "--draft", target, "--k", "0"]) == 2


def test_startup_profile_measures_a_small_grid_on_the_serving_engine_and_leaves_it_as_it_was(tiny_model_dirs):
    """profiling.startup.short_profile: batch sizes clipped to the engine's, k 0 / 1 / 2 / 4, every cell
    timed, acceptance per position at the largest k (the target as its own draft: all accepted), this host;
    the engine keeps its policy and holds no request afterwards, and still serves."""
    from serve_app.config import EngineConfig, ModelConfig, SamplingParams
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.models import load_models
    from serve_app.profiling.startup import short_profile

    target = tiny_model_dirs["target"]
    models = load_models(ModelConfig(target=target, draft=target, dtype="float32", prompt_lookup=False))
    engine = Engine.from_models(models, EngineConfig(max_batch_size=4, max_k=4), FixedK(1))
    prof = short_profile(engine, "cpu-test", "t", "d", "float32")
    grid = prof.latency
    assert grid.batch_sizes == [1, 4] and grid.ks == [0, 1, 2, 4] and prof.source == "measured" and prof.machine
    assert all(v > 0 for row in grid.verify_ms for v in row) and all(row[0] < 0.05 <= min(row[1:]) for row in grid.draft_ms)
    assert prof.acceptance == [1.0] * 4 and set(prof.best_k) == {1, 4} and "startup profile" in prof.notes
    # every judged draft accepted: each bin at or above its own confidence, those with outcomes above it
    mids = [(i + 0.5) / 10 for i in range(10)]
    assert all(v >= m - 1e-4 for v, m in zip(prof.confidence_curve, mids))
    assert any(v > m + 0.05 for v, m in zip(prof.confidence_curve, mids))
    assert engine.policy.name == "fixed:1" and not engine.has_work()
    req = engine.submit([3, 4, 5], SamplingParams(max_tokens=4))
    engine.run([req])
    assert req.stats.generated_tokens == 4
    # the long-context pass: a second point on the context axis (rows of LONG_CONTEXT tokens; this tiny model's
    # context limit is short, so a shorter "long" context here), every cell timed
    import serve_app.profiling.startup as startup

    startup.LONG_CONTEXT = 120
    try:
        ctx = short_profile(engine, "cpu-test", "t", "d", "float32").latency.context
    finally:
        startup.LONG_CONTEXT = 512
    assert ctx is not None and len(ctx.contexts) == 2 and ctx.contexts[1] >= 120 and ctx.layout == "padded"
    assert all(v > 0 for row in ctx.verify_ms[1] for v in row) and not engine.has_work()
