"""The profile's context axis: a step priced at the KV its rows attend. The grid scales from its own context to
the served one (paged: the rows' mean, padded: the longest); lut, adaptive and budget choose by it; calibration
prices each step at its context, so its factors measure the machine, not the context; the measurement runs on
a real engine and joins a profile file."""

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import IdTokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine.budget import Budget, prices
from serve_app.engine.policy import Adaptive, BatchState, LookupTable
from serve_app.engine.scheduler import Engine
from serve_app.engine.stats import StepStats
from serve_app.engine.worker import ModelWorker
from serve_app.drafting import draft_worker
from serve_app.profiling.calibration import Calibration
from serve_app.pricing import ContextGrid, LatencyGrid
from serve_app.profiling.profiles import load_profile

ROOT = Path(__file__).parent.parent
KS = [0, 1, 2, 4]
CONTEXTS = [64, 512, 2048]


def cube(per_token_ms: float, base: float, k_weight: float):
    """[contexts][batch 1, 8][ks]: a part growing linearly with the context, faster at larger k."""
    return [[[round(base * b ** 0.5 + per_token_ms * c * b * (1 + k_weight * k), 4) for k in KS] for b in (1, 8)]
            for c in CONTEXTS]


def grid(layout="paged") -> LatencyGrid:
    ctx = ContextGrid(contexts=CONTEXTS, batch_sizes=[1, 8], ks=KS, layout=layout,
                      draft_ms=cube(0.0005, 2.0, 1.0), verify_ms=cube(0.002, 10.0, 0.3))
    base = {name: [[c[0][i][j] for j in range(len(KS))] for i in range(2)] for name, c in
            (("draft_ms", ctx.draft_ms), ("verify_ms", ctx.verify_ms))}
    return LatencyGrid(batch_sizes=[1, 8], ks=KS, other_ms=[[1.0] * 4, [1.5] * 4], context_tokens=64,
                       context=ctx, **base)


def test_the_grid_scales_its_cells_to_the_served_context():
    g = grid()
    draft0, verify0, other0 = g.parts_at(8)
    assert g.parts_at(8, 64) == (draft0, verify0, other0)  # at its own context: the cells themselves
    _, v512, o512 = g.parts_at(8, 512)
    assert o512 == other0  # the rest of the step does not read the KV
    assert v512[0] == pytest.approx(g.context.verify_ms[1][1][0], rel=1e-6)
    # between measured contexts: linear; past the longest: extended linearly
    _, v1280, _ = g.parts_at(8, 1280)
    assert v1280[2] == pytest.approx((g.context.verify_ms[1][1][2] + g.context.verify_ms[2][1][2]) / 2, rel=1e-6)
    _, v4096, _ = g.parts_at(8, 4096)
    assert v4096[0] > g.context.verify_ms[2][1][0]
    assert g.step_ms(8, 2048)[3] > g.step_ms(8)[3] * 2  # long contexts cost far more per drafted token here
    # no axis, or no context: unchanged; an older profile loads as one context
    plain = g.model_copy(update={"context": None})
    assert plain.parts_at(8, 2048) == plain.parts_at(8)
    assert load_profile(ROOT / "tests" / "data" / "cpu-2core-before-chunk-prices.json").latency.context is None
    assert load_profile(ROOT / "profiles" / "cpu-2core.json").latency.context.layout == "padded"  # measured here


def test_a_copy_longer_than_the_grid_is_priced_by_the_trend_not_a_last_cells_dip():
    """A copy drafts up to max_copy (16) past the grid's k. The committed CPU profile's verification at batch 1
    dips from k = 7 to 8 and its short context's cells hardly grow with k: extended cell to cell, a 16-token
    copy at 1,024 tokens of context cost 500x a step (the context ratio over a near-zero cell), or, with the
    ratio held, less than a step that drafted nothing."""
    profile = load_profile(ROOT / "profiles" / "cpu-2core.json").latency
    for g in (grid(), profile):
        top = g.ks[-1]
        for b in (1, 8):
            for c in (None, 1024):
                at = [g.part_at("verify", b, k, c) for k in (0, top, 2 * top)]
                assert at[0] <= at[2] < 2 * at[1], (b, c, at)  # never below k = 0, nor a blow-up
        # past the context axis' longest k, its longest k's ratio holds
        kc = g.context.ks[-1]
        assert g.context.scale("verify", 1, 4 * kc, 1024, g.context_tokens) == pytest.approx(
            g.context.scale("verify", 1, kc, 1024, g.context_tokens))


def test_copy_columns_price_a_copys_verification_past_the_grid():
    """A profile measures the verification at copy lengths past its k (`copy_ks`): on this CPU verifying 17 tokens
    at batch 1-4 cost 18-24% more than the line through k <= 8 said, and `simulate --validate` found every k = 16
    step under-priced. Past the grid's k the verification is read between its longest column and the copy
    columns; nothing at k <= ks[-1] moves, nor the draft (a copy runs no draft forward), and calibration scales
    the copy columns with the grid's longest k."""
    g = grid()
    top = g.ks[-1]
    rows = [[r[-1] * 1.5, r[-1] * 3.0] for r in g.verify_ms]  # k = 8, 16: far above the line
    c = g.model_copy(update={"copy_ks": [8, 16], "copy_verify_ms": rows})
    LatencyGrid.model_validate(c.model_dump())
    for b in (1, 8):
        assert [c.part_at("verify", b, k) for k in range(top + 1)] == [g.part_at("verify", b, k) for k in range(top + 1)]
        assert c.part_at("draft", b, 16) == g.part_at("draft", b, 16)
        i = g.batch_sizes.index(b)
        assert c.part_at("verify", b, 16) == pytest.approx(rows[i][1])
        assert c.part_at("verify", b, 12) == pytest.approx((rows[i][0] + rows[i][1]) / 2)
        assert c.part_at("verify", b, 6) == pytest.approx((g.verify_ms[i][-1] + rows[i][0]) / 2)
        assert c.part_at("verify", b, 16) > 1.3 * g.part_at("verify", b, 16)  # the line under-priced it
        # at a context: the copy column scaled like the grid's longest k
        assert c.part_at("verify", b, 16, 1024) == pytest.approx(
            rows[i][1] * g.context.scale("verify", b, top, 1024, g.context_tokens))
    assert c.part_at("verify", 4, 16) == pytest.approx((rows[0][1] * 4 + rows[1][1] * 3) / 7)  # between batch sizes
    # calibration: a machine 2x slow at verifying is 2x slow at the copy columns too
    cal = Calibration(c, warmup=0, min_samples=4)
    for _ in range(12):
        for k in (1, 4):
            cal.observe(StepStats(k=k, batch_size=8, draft_s=c.draft_ms[1][c.ks.index(k)] / 1000,
                                  verify_s=2 * c.verify_ms[1][c.ks.index(k)] / 1000, other_s=c.other_ms[1][0] / 1000))
    assert cal.grid().copy_verify_ms[1] == pytest.approx([2 * v for v in rows[1]], rel=0.02)
    for bad, message in (({"copy_ks": [4, 16]}, "past the longest k"), ({"copy_ks": None}, "come together"),
                         ({"copy_verify_ms": [[1.0], [1.0]]}, "one per copy k")):
        with pytest.raises(ValueError, match=message):
            LatencyGrid.model_validate(c.model_dump() | bad)


def test_paged_prices_the_mean_padded_each_groups_longest_row():
    rows = [100, 100, 100, 1700]
    assert grid("paged").context.context_of(rows) == 500
    assert grid("padded").context.context_of(rows) == 500  # two groups: three chat rows, the document alone
    assert grid("padded").context.context_of([100, 300, 400, 500]) == 500  # one group, padded to its longest
    state = BatchState(4, 8, contexts=tuple(rows))
    assert state.context_for(grid()) == 500 and state.context_for(grid().model_copy(update={"context": None})) is None


def test_policies_speculate_less_at_long_context():
    g = grid()
    short, long = BatchState(8, 4, contexts=(64,) * 8), BatchState(8, 4, contexts=(2048,) * 8)
    adaptive = Adaptive(g, acceptance_rate=0.6)
    assert adaptive.choose(long) < adaptive.choose(short)
    lut = LookupTable({1: 4, 8: 4}, g, [0.6, 0.36, 0.22, 0.13])
    assert lut.choose(long) < lut.choose(short)
    assert LookupTable({1: 4, 8: 4}).choose(long) == 4  # a table without a grid: the paper's, by batch only
    at_short, at_long = prices(g, 8, 64), prices(g, 8, 2048)
    assert at_long.token_ms > 3 * at_short.token_ms and at_long.forward_ms > at_short.forward_ms
    budget = Budget(g, acceptance_rate=0.6)
    assert budget.uniform(8, 2048)[0] < budget.uniform(8, 64)[0]


def test_calibration_measures_the_machine_not_the_context():
    """Steps at 2k context on a machine exactly as fast as its profile: with the context axis the factors stay 1;
    priced at the grid's own context (no axis) they read the context as a slow machine."""
    g = grid()
    with_axis, without = Calibration(g, warmup=0), Calibration(g.model_copy(update={"context": None}), warmup=0)
    draft, verify, other = g.parts_at(8, 2048)
    for i in range(40):
        k = KS[1 + i % 3]
        j = KS.index(k)
        st = StepStats(batch_size=8, k=k, draft_s=draft[j] / 1000, verify_s=verify[j] / 1000, other_s=other[j] / 1000,
                       contexts=(2048,) * 8)
        with_axis.observe(st)
        without.observe(st)
    for part in ("draft", "verify"):
        assert with_axis.factor(part, 1) == pytest.approx(1.0, abs=1e-3), part
        assert without.factor(part, 1) > 2.0, part


def test_calibration_learns_how_this_machine_grows_with_context():
    """A machine 1.3x the profile at its own context whose verification grows with context half as fast as the
    profile's (its draft as profiled): the calibrated grid prices steps at 64 and at 2,048 tokens within 3%; with
    the growth taken as profiled one factor would price one end or the other off by far more."""
    g = grid()
    truth = g.model_copy(update={"context": g.context.model_copy(update={"verify_excess": 0.5})})
    cal, rng = Calibration(g, warmup=0), random.Random(1)
    for _ in range(300):
        k, ctx = rng.choice([1, 2, 4]), rng.choice([64, 256, 512, 1024, 2048])
        d, v, o = (part[KS.index(k)] for part in truth.parts_at(8, ctx))
        noise = rng.uniform(0.97, 1.03)
        cal.observe(StepStats(batch_size=8, k=k, draft_s=1.3 * d * noise / 1000, verify_s=1.3 * v * noise / 1000,
                              other_s=1.3 * o / 1000, contexts=(ctx,) * 8))
    assert cal.context_factor("verify") == pytest.approx(0.5, abs=0.08)
    assert cal.context_factor("draft") == pytest.approx(1.0, abs=0.08)
    assert cal.factors()["verify_context"][8] == pytest.approx(cal.context_factor("verify"), abs=1e-4)
    calibrated = cal.grid()
    for ctx in (64, 2048):
        for k in (1, 4):
            want = 1.3 * truth.parts_at(8, ctx)[1][KS.index(k)]
            assert calibrated.parts_at(8, ctx)[1][KS.index(k)] == pytest.approx(want, rel=0.03), (ctx, k)
    # every step at one context: nothing to tell growth from level, the profile's growth stands
    flat = Calibration(g, warmup=0)
    for i in range(40):
        d, v, o = (part[1] for part in truth.parts_at(8, 512))
        flat.observe(StepStats(batch_size=8, k=1, draft_s=d / 1000, verify_s=v / 1000, other_s=o / 1000,
                               contexts=(512,) * 8))
    assert flat.context_factor("verify") == 1.0


def test_measure_context_runs_the_engine_and_joins_a_profile(tmp_path):
    from serve_app.bench.context import bench_context, merge_into_profile
    from serve_app.models import LoadedModels

    target, draft = tiny_llama(97, layers=2, seed=0), tiny_llama(97, layers=1, seed=1)
    models = LoadedModels(target, draft, IdTokenizer(), "tiny", "tiny-draft")
    results, md = bench_context(models, [1, 3], [0, 1, 2], [16, 96], reps=1, deadline_s=None, label="tiny")
    g = ContextGrid.model_validate(results["grid"])
    assert len(g.contexts) == 2 and 16 <= g.contexts[0] < g.contexts[1] and g.layout == "padded"  # gather on a CPU
    assert all(v is not None and v > 0 for c in g.verify_ms for row in c for v in row)
    assert "| context | batch |" in md
    path = tmp_path / "p.json"
    shutil.copy(ROOT / "profiles" / "cpu-2core.json", path)
    merge_into_profile(str(path), results["grid"])
    assert load_profile(path).latency.context == g
    assert json.loads(path.read_text())["latency"]["context"]["contexts"] == g.contexts


def test_the_engine_hands_the_policy_each_rows_context():
    seen = []

    class Spy:
        name = "spy"

        def choose(self, state):
            seen.append(state.contexts)
            return 1

        def observe(self, stats):
            assert len(stats.contexts) == stats.batch_size or not stats.batch_size

    target, draft = tiny_llama(97, layers=2, seed=0), tiny_llama(97, layers=1, seed=1)
    engine = Engine(ModelWorker(target, "target"), draft_worker(draft), IdTokenizer(), EngineConfig(), policy=Spy(),
                    eos_ids=set())
    reqs = [engine.submit(list(range(1, 1 + n)), SamplingParams(max_tokens=4)) for n in (3, 30)]
    engine.run(reqs)
    assert seen[0] == (4, 31)  # prompt + the first token each
    assert all(len(c) == 2 for c in seen)


def test_a_prompt_chunk_is_priced_at_the_kv_its_row_holds():
    """A chunk's attention reads everything its row already holds: the engine records each chunk's (held, fed),
    the cost model and the calibration price it, and the calibrated chunk factor measures the machine alone."""
    from serve_app.profiling.calibration import step_cost_ms

    g = grid().model_copy(update={"chunk_step_ms": [5.0, 5.0], "chunk_ms_per_token": [0.1, 0.1], "chunk_budget": 128,
                                  "chunk_prompt_tokens": 16})
    late, early = (StepStats(prefill_tokens=100, chunks=((held, 100),)) for held in (2000, 0))
    assert step_cost_ms(g, late) == pytest.approx(step_cost_ms(g, early))  # without the term: as at the start
    priced = g.model_copy(update={"chunk_context_ms": [0.01, 0.0002]})
    assert step_cost_ms(priced, early) == step_cost_ms(g, early)
    assert step_cost_ms(priced, late) == pytest.approx(step_cost_ms(g, early) + 2000 * (0.01 + 0.0002 * 100))
    assert priced.chunk_context_cost([(0, 128), (300, 8)]) == pytest.approx(300 * (0.01 + 0.0002 * 8))
    with pytest.raises(ValueError, match="chunk_context_ms"):
        g.model_copy(update={"chunk_context_ms": [0.01]}).model_validate(
            {**g.model_dump(), "chunk_context_ms": [0.01]})
    # a machine exactly as fast as the profile, prefilling late chunks: the chunk factor stays 1 with the term,
    # reads the context as a slow machine without it
    with_term, without = Calibration(priced, warmup=0), Calibration(g, warmup=0)
    for i in range(20):
        held = 256 * i
        st = StepStats(prefill_tokens=128, chunks=((held, 128),), verify_s=step_cost_ms(
            priced, StepStats(prefill_tokens=128, chunks=((held, 128),))) / 1000)
        with_term.observe(st)
        without.observe(st)
    assert with_term.factors()["chunk"][1] == pytest.approx(1.0, rel=1e-3)
    assert without.factors()["chunk"][1] > 2.0
    assert with_term.grid().chunk_context_ms == pytest.approx(priced.chunk_context_ms)


def test_a_chunks_base_and_its_held_kv_term_are_calibrated_apart():
    """A machine that runs a chunk's base 1.5x its profile and its held-KV term 0.6x: one factor for both prices
    chunks after no held KV under and after much over; the two factors fitted apart price both within 2%."""
    from serve_app.profiling.calibration import split_fit, step_cost_ms

    g = grid().model_copy(update={"chunk_step_ms": [5.0, 5.0], "chunk_ms_per_token": [0.1, 0.1], "chunk_budget": 128,
                                  "chunk_context_ms": [0.01, 0.0002]})
    rng = random.Random(0)

    def truth(held):
        st = StepStats(prefill_tokens=128, chunks=((held, 128),))
        return st, 1.5 * g.chunk_ms(1, 128) + 0.6 * g.chunk_context_cost(st.chunks)

    cal = Calibration(g, warmup=0)
    for _ in range(48):
        st, ms = truth(rng.choice([0, 64, 300, 900, 1500, 2500]))
        cal.observe(replace(st, verify_s=ms * rng.uniform(0.97, 1.03) / 1000 + g.part_at("verify", 1, 0) / 1000,
                            draft_s=g.part_at("draft", 1, 0) / 1000, other_s=g.part_at("other", 1, 0) / 1000))
    assert cal.factors()["chunk"][1] == pytest.approx(1.5, rel=0.03)
    assert cal.factors()["chunk_context"][1] == pytest.approx(0.6, rel=0.05)
    for held in (0, 2000):
        st, ms = truth(held)
        decode = sum(g.part_at(part, 1, 0) for part in ("draft", "verify", "other"))
        assert step_cost_ms(cal.grid(), st) == pytest.approx(ms + decode, rel=0.02), held
    # one factor where the held KV's share does not spread (every chunk after about as much): and for an empty set
    assert split_fit([(2.0, 1.0, 0.0)] * 8) == pytest.approx((2.0, 2.0))
    assert split_fit([]) == (1.0, 1.0)


def test_the_context_axis_is_a_line_through_every_context_measured():
    """A slow spell while the shortest context was measured (twice its true time) made joined points price every
    context up to the next as free; the least-squares line keeps the growth the other contexts measured."""
    g = grid()
    true512 = g.context.scale("verify", 8, 2, 512, 64)
    cube = [[list(r) for r in rows] for rows in g.context.verify_ms]
    cube[0] = [[2 * v for v in r] for r in cube[0]]
    noisy = g.context.model_copy(update={"verify_ms": cube})
    assert noisy.scale("verify", 8, 2, 2048, 64) > 1.5  # still grows
    assert noisy.at("verify", 8, 2, 2048) > noisy.at("verify", 8, 2, 512) > noisy.at("verify", 8, 2, 64)
    assert true512 > 1.2 and g.context.at("verify", 8, 2, 512) == pytest.approx(g.context.verify_ms[1][1][2], rel=1e-6)


def test_the_engine_records_each_chunks_held_kv():
    target = tiny_llama(97, layers=1, seed=0)
    engine = Engine(ModelWorker(target, "target"), None, IdTokenizer(),
                    EngineConfig(max_batch_size=2, max_num_batched_tokens=64, max_k=0, prefix_caching=False), eos_ids=set())
    seen = []
    engine.on_step.append(seen.append)
    engine.submit([1 + i % 90 for i in range(150)], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert [st.chunks for st in seen if st.prefill_tokens] == [((0, 64),), ((64, 64),), ((128, 22),)]
    assert all(st.chunks == () for st in seen if not st.prefill_tokens)


def test_measure_chunk_context_fits_both_parts_and_scales_to_a_profile(tmp_path):
    from serve_app.bench.context import merge_into_profile
    from serve_app.models import LoadedModels
    from serve_app.profiling.context import measure_chunk_context

    target, draft = tiny_llama(97, layers=2, seed=0), tiny_llama(97, layers=1, seed=1)
    models = LoadedModels(target, draft, IdTokenizer(), "tiny", "tiny-draft")
    got = measure_chunk_context(models, 192, 16)
    assert got["chunk_sizes"] == [16, 4] and len(got["chunk_context_ms"]) == 2 and got["at_zero_ms"] > 0
    assert min(got["chunk_context_ms"]) >= 0
    path = tmp_path / "p.json"
    shutil.copy(ROOT / "profiles" / "cpu-2core.json", path)
    alone = lambda g: g.chunk_ms(1, 16) + sum(g.part_at(p, 1, 0) for p in ("draft", "verify", "other"))  # noqa: E731
    merge_into_profile(str(path), grid().context.model_dump(), {**got, "chunk_context_ms": [0.02, 0.0004],
                                                                "at_zero_ms": 2 * alone(load_profile(path).latency)})
    assert load_profile(path).latency.chunk_context_ms == pytest.approx([0.01, 0.0002])  # this machine ran 2x slow
