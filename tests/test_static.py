"""Static steps (engine/static.py): decoding and verification forwards at bucketed shapes in persistent buffers,
the inputs a CUDA graph replays. On a CPU they run eagerly, and must give what the packed path gives: the same
outputs per forward across bucket boundaries, the same tokens for every row kind of a mixed batch, and host work
per step that does not grow with the KV pool."""

import random
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.engine import static
from serve_app.engine.kv import PagedKV, pack
from serve_app.engine.policy import make_policy
from serve_app.engine.scheduler import Engine
from serve_app.engine.static import BATCH_BUCKETS, WIDTH_BUCKETS, StaticSteps
from serve_app.engine.worker import ModelWorker
from serve_app.profiling.profiles import load_profile
from test_mixed_batch import check, drive, jobs, pair  # noqa: F401 (fixtures)

from pathlib import Path


def flex_worker(model, mode: str) -> ModelWorker:
    w = ModelWorker(model, "target")
    w.configure_kv(block_size=16, max_blocks=256, prefix_caching=False, attention_backend="flex", static_steps=mode)
    return w


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 13])
def test_a_static_forward_equals_the_packed_one_across_bucket_boundaries(rows):
    """Row counts and widths on both sides of buckets (1 | 2 | 3-4 | 5-8 | 9-12 | 13-16 rows; widths 1-16, so
    rows of one step pad to 8, 12 or 16), contexts across block edges: the same outputs, and the keys and values the
    static forward wrote read back the same by the next one (a plain step of every row)."""
    rng = random.Random(rows)
    model = tiny_llama(97, layers=2, seed=3)
    packed, fixed = flex_worker(model, "off"), flex_worker(model, "eager")
    assert packed.static is None and fixed.static is not None
    sids = [f"r{i}" for i in range(rows)]
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 40))] for _ in sids]
    for w in (packed, fixed):
        w.add(sids, prompts, [SamplingParams(max_tokens=8)] * rows)
        w.prefill(sids)
    lens = [len(p) for p in prompts]
    fed = [[rng.randrange(1, 97) for _ in range(rng.choice([1, 2, 3, 5, 9, 16]))] for _ in sids]
    index = torch.tensor(sorted(rng.sample(range(sum(map(len, fed))), min(6, sum(map(len, fed))))))
    runs = fixed.static.eager_runs  # a prompt of at most 16 tokens prefilled static too
    a = packed._forward(sids, fed, index, starts=lens)
    b = fixed._forward(sids, fed, index, starts=lens)
    assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()
    assert fixed.static.eager_runs == runs + 1
    assert (static.bucket(rows, BATCH_BUCKETS), static.bucket(max(map(len, fed)), WIDTH_BUCKETS)) in fixed.static.shapes
    after = [n + len(f) for n, f in zip(lens, fed)]
    nxt = [[rng.randrange(1, 97)] for _ in sids]
    a = packed._forward(sids, nxt, 1, starts=after)
    b = fixed._forward(sids, nxt, 1, starts=after)
    assert a.shape == b.shape == (rows, 1, 97)
    assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()


@pytest.mark.parametrize("spec", ["fixed:4", "adaptive"])
def test_static_steps_give_the_packed_paths_tokens_for_every_row_kind(pair, jobs, spec):  # noqa: F811
    """The mixed batch (every row kind, joining and leaving, prefix hits, copies, grammars) with static steps (and
    `one_pass`, where a step's rows are all plain greedy) and without, from the same random streams: every row's
    tokens equal, unseeded sampled rows included; greedy and seeded rows equal the target alone (`check`). The static path ran in buckets of several sizes, the draft's
    too, and prefill chunks stayed packed."""
    target, draft, tokenizer = pair
    profile = load_profile(Path(__file__).parent.parent / "profiles" / "cpu-2core.json")
    outs, engines = {}, {}
    for mode in ("off", "eager"):
        random.seed(11)
        cfg = EngineConfig(max_batch_size=8, max_k=8, max_num_batched_tokens=96, attention_backend="flex",
                           static_steps=mode)
        engine = Engine(ModelWorker(target, "target"), draft_worker(draft, prompt_lookup=True), tokenizer, cfg,
                        policy=make_policy(spec, profile), eos_ids=set())
        engine.target.one_pass = engine.draft.one_pass = mode == "eager"  # a GPU's path where the rows allow it
        reqs, left = drive(engine, jobs, random.Random(3))
        check(jobs, reqs, left, tokenizer, spec)
        outs[mode] = {i: r.output_ids for i, r in reqs.items()}
        engines[mode] = engine
    assert outs["eager"] == outs["off"]
    assert engines["off"].target.static is None
    for w in (engines["eager"].target, engines["eager"].draft):
        st = w.static
        assert st is not None and st.eager_runs >= 10 and st.replays == 0, st.stats()
    seen = engines["eager"].target.static.shapes.keys() | engines["eager"].draft.static.shapes.keys()
    assert len({r for r, _ in seen}) >= 2 and len({w for _, w in seen}) >= 2, seen


def _pool(tokens: int, rows: int, context: int) -> tuple[PagedKV, list[str]]:
    cache = PagedKV(16, tokens // 16, False, "flex", preallocate=True)
    sids = [f"s{i}" for i in range(rows)]
    for s in sids:
        cache.reserve(s, context)
    return cache, sids


class Written(TorchDispatchMode):
    """The most elements any one op wrote while active: a new tensor's, an in-place op's target (a scatter's:
    its index), not a view's (a view writes nothing)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("index_copy_", "index_put_"):
            n = args[2].numel() if name == "index_copy_" else args[1][0].numel()
        elif name.endswith("_"):
            n = args[0].numel()
        else:
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            outs = out if isinstance(out, (tuple, list)) else [out]
            n = max((o.numel() for o in outs if isinstance(o, torch.Tensor)
                     and o.untyped_storage().data_ptr() not in inputs), default=0)
        self.most = max(self.most, n)
        return out


def test_host_work_per_static_step_does_not_grow_with_the_pool():
    """Writing a step of 32 rows (5 tokens each at 600 of context) into its buffers touches the step's entries
    only: at a 1M-token pool (65,536 blocks) no op writes more than a few thousand elements, the same as at 64k.
    The packed path rebuilds its pool-wide tensors every forward (its block mask: 32 x 65,536 indices).
    Timed (tests/test_static.py's note in docs/architecture.md): 1.17 against 1.18 ms a step, 64k against 1M."""
    for tokens in (1 << 16, 1 << 20):
        cache, sids = _pool(tokens, 32, 600)
        st = StaticSteps(torch.device("cpu"), capture=False)
        fed, starts = [[5, 6, 7, 8, 9]] * 32, [600] * 32
        key = st.key(fed)
        st.fill(cache, sids, fed, starts, key, 0)  # the buffers (pool-wide, once) and the bucket's mask
        with Written() as w:
            st.fill(cache, sids, fed, starts, key, 0)
        assert 32 * 16 <= w.most <= 32 * 64, (tokens, w.most)
        shape = st.shapes[key]
        assert shape.layout.mask is not None and st.kv_idx.shape == (BATCH_BUCKETS[-1], tokens // 16)
    with Written() as w:  # the contrast: what the packed path writes for the same step
        _, _, batch = pack(cache, sids, fed, starts, "cpu")
        batch.layout.block_mask(tokens)
    assert w.most >= 32 * (tokens // 16), w.most


def test_the_mode_is_chosen_per_device_and_backend(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("SPECSERVE_STATIC_STEPS", "eager")  # pins `auto` for a process (the GPU script's dry run)
    assert static.resolve("auto", cpu, "flex").capture is False and static.resolve("off", cpu, "flex") is None
    monkeypatch.delenv("SPECSERVE_STATIC_STEPS")
    assert static.resolve("auto", cpu, "flex") is None  # a CPU gains nothing from fixed shapes
    assert static.resolve("auto", cuda, "gather") is None  # gather's groups are shaped by the rows' contexts
    assert static.resolve("off", cuda, "flex") is None
    assert static.resolve("auto", cuda, "flex").capture is True
    assert static.resolve("eager", cuda, "flex").capture is False
    assert static.resolve("graphs", cpu, "flex").capture is False  # no capture without CUDA: eager
    with pytest.raises(ValueError, match="static_steps"):
        static.resolve("always", cpu, "flex")
    with pytest.raises(ValueError):
        EngineConfig(static_steps="always")
    assert static.bucket(3, BATCH_BUCKETS) == 4 and static.bucket(129, BATCH_BUCKETS) is None
    st = StaticSteps(cpu, capture=False)
    assert st.key([[1] * 17]) is None and st.key([[]]) is None and st.key([[1]] * 129) is None  # packed
    assert st.key([[1, 2], [3]]) == (2, 2) and st.key([[1] * 9] * 5) == (8, 12)


@pytest.mark.slow  # ~20 s: torch.compile of flex_attention for two layouts (the slow tier runs it in CI)
def test_compiled_flex_reads_a_static_steps_mask_as_the_packed_one(monkeypatch):
    """flex_attention compiled (as on CUDA; here inductor's CPU kernel) over a bucket's persistent block mask, built
    once without its query-side lists and rewritten in place step after step: the packed path's outputs, exactly."""
    from serve_app.engine import attention

    monkeypatch.setattr(attention, "COMPILE_FLEX", True)
    rng = random.Random(5)
    model = tiny_llama(97, layers=2, seed=3, dtype=torch.float32)
    packed, fixed = flex_worker(model, "off"), flex_worker(model, "eager")
    sids = [f"r{i}" for i in range(3)]
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(17, 40))] for _ in sids]
    for w in (packed, fixed):
        w.add(sids, prompts, [SamplingParams(max_tokens=8)] * 3)
        w.prefill(sids)
    lens = [len(p) for p in prompts]
    for _ in range(3):  # the same bucket each step: its mask built once, its buffers rewritten
        fed = [[rng.randrange(1, 97) for _ in range(n)] for n in (3, rng.choice([1, 2, 3]), rng.choice([1, 2]))]
        a, b = packed._forward(sids, fed, 1, starts=lens), fixed._forward(sids, fed, 1, starts=lens)
        assert torch.equal(a, b), (a - b).abs().max()
        lens = [n + len(f) for n, f in zip(lens, fed)]
    assert list(fixed.static.shapes) == [(4, 3)]
