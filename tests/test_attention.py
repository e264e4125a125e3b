"""Attention backends (engine/attention.py) give the same outputs; the KV pool is sized from device memory."""

import pytest
import torch

from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine import attention
from serve_app.engine.kv import kv_bytes_per_token, kv_pool_tokens
from tests.conftest import make_tokenizer

CASES = {  # rows as (start position, tokens fed)
    "decode": [(30, 1), (7, 1), (64, 1)],
    "verify-ragged": [(30, 5), (3, 2), (47, 4), (16, 1)],
    "prefill-chunks": [(0, 37), (16, 20), (40, 3)],
    "one-row": [(0, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("shared", [0, 1], ids=["own-blocks", "prefix-hit"])
def test_flex_reads_the_pool_as_gather_copies_it(case, heads, kv_heads, shared):
    """Random pools with shuffled blocks: flex_attention over the pool in place equals the gather path
    (GQA and not, ragged rows, chunked prefill, a prefix block shared by every row)."""
    spec = CASES[case]
    if shared and min(s for s, _ in spec) < 16:
        spec = [(s + 16, n) for s, n in spec]  # every row's context covers the shared block
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, heads, kv_heads, seed=len(spec) + shared,
                                                            shared_prefix_blocks=shared)
    want = attention.attend("gather", q, kp, vp, attention.layout("gather", rows, pos, bs, nblk), None)
    got = attention.attend("flex", q, kp, vp, attention.layout("flex", rows, pos, bs, nblk), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rolled_back_positions_are_not_read():
    """After a rollback a row's table still ends in a block holding stale keys past its kv_len: neither
    backend reads them (a query sees only positions up to its own)."""
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch([(20, 2), (5, 1)], seed=3)
    base = [attention.attend(b, q, kp, vp, attention.layout(b, rows, pos, bs, nblk), None) for b in attention.BACKENDS]
    stale = rows[0].table[1] * bs + 6  # position 22 of row 0: past its last query (21)
    kp[stale] += 100.0
    vp[stale] -= 100.0
    for b, before in zip(attention.BACKENDS, base):
        torch.testing.assert_close(attention.attend(b, q, kp, vp, attention.layout(b, rows, pos, bs, nblk), None), before)


def test_auto_is_gather_on_a_cpu_and_unknown_names_are_refused():
    assert attention.choose("auto", "cpu") == "gather"
    assert attention.choose("flex", "cpu") == "flex"
    with pytest.raises(ValueError, match="attention backend"):
        attention.choose("paged", "cpu")
    assert attention.probe("flex", "cpu") < 1e-5


def test_engine_output_is_the_same_with_either_backend(tiny_target, tiny_drafts):
    """Greedy speculative decoding (acceptance, rollback, chunked prefill, a prefix-cache hit) gives the
    same tokens with flex as with gather (float64 models)."""
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.engine.worker import ModelWorker

    prompts = [list(range(3, 40)), list(range(3, 40)) + [5, 6], [7, 8, 9]]  # the 2nd starts on the 1st's blocks
    outs = {}
    for backend in attention.BACKENDS:
        cfg = EngineConfig(policy="fixed:3", max_batch_size=4, max_k=3, block_size=4, max_num_batched_tokens=24,
                           attention_backend=backend)
        engine = Engine(ModelWorker(tiny_target, "target"), ModelWorker(tiny_drafts["near"], "draft"), make_tokenizer(), cfg, FixedK(3))
        reqs = [engine.submit(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))]
        engine.run(reqs)  # then the 2nd starts on its committed blocks
        reqs += [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts[1:]]
        engine.run(reqs[1:])
        assert engine.kv_pool["attention"] == backend
        outs[backend] = [r.output_ids for r in reqs]
        assert sum(r.stats.cached_tokens for r in reqs) > 0 and sum(r.stats.proposed for r in reqs) > 0
    assert outs["flex"] == outs["gather"]


def test_pool_is_sized_from_device_memory(tiny_target):
    """With the memory reading injected: the pool takes gpu_memory_utilization of the device less what the
    weights and a forward used, capped by max_num_tokens; a role on half a GPU sizes from its half."""
    from serve_app.engine.policy import FixedK
    from serve_app.engine.scheduler import Engine
    from serve_app.engine.worker import ModelWorker

    c = tiny_target.config
    per_token = kv_bytes_per_token(c, torch.float64)  # the tiny models are float64
    assert per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 8
    assert kv_pool_tokens(100_000, 20_000, 0.9, 1.0, 10) == 7_000
    assert kv_pool_tokens(100_000, 20_000, 0.9, 0.5, 10) == 2_500
    with pytest.raises(ValueError, match="no room for a KV pool"):
        kv_pool_tokens(100_000, 60_000, 0.9, 0.5, 10)

    seen = []

    def memory(model, probe_tokens):
        seen.append(probe_tokens)
        return 1_000_000, 1_000_000 + 300 * per_token  # 300 tokens' room at utilization 1

    w = ModelWorker(tiny_target, "target")
    assert w.kv_room(1.0, 64) is None  # a CPU: no device memory to size from
    w.kv_room = lambda u, t, share=1.0, memory=memory: ModelWorker.kv_room(w, u, t, share, memory)
    cfg = EngineConfig(max_batch_size=2, max_num_batched_tokens=64, max_num_tokens=4096, gpu_memory_utilization=1.0,
                       block_size=16, max_model_len=256)
    engine = Engine(w, None, make_tokenizer(), cfg, FixedK(0))
    assert seen == [64] and engine.kv_capacity == 288 and engine.kv_pool["from"] == "device memory"
    assert w.cache.num_blocks == 288 // 16 + 1  # allocated at once, not grown
    req = engine.submit(list(range(3, 20)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.run([req])
    assert len(req.output_ids) == 8


needs_kernel = pytest.mark.skipif(attention._kernel() is None, reason="no AVX2/FMA CPU or C compiler here")


@needs_kernel
@pytest.mark.parametrize("case", ["decode", "verify-ragged", "prefill-chunks"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (4, 4, 128)])
def test_the_c_kernel_reads_the_pool_as_sdpa_reads_the_copy(case, heads, kv_heads, dim, monkeypatch):
    """gather's C kernel (short rows, float32, CPU) against SDPA on the gathered copy, queries handed as a
    strided view (the lean forward's: a slice of the fused projection), blocks shuffled, a shared prefix."""
    spec = [(s + 16, n) for s, n in CASES[case]]
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, heads, kv_heads, dim, seed=heads + dim,
                                                            shared_prefix_blocks=1)
    q = torch.cat([q, torch.randn(q.shape[0], 3, dim)], dim=1)[:, :heads]  # not contiguous
    lay = attention.layout("gather", rows, pos, bs, nblk)
    assert any(attention._kernel_fits(q, kp, vp, g) for g in lay)
    got = attention.attend("gather", q, kp, vp, lay, None)
    monkeypatch.setattr(attention, "_kernel", lambda: None)
    want = attention.attend("gather", q, kp, vp, lay, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("case", ["decode", "verify-ragged"])
def test_the_c_kernel_reads_a_bfloat16_pool_as_its_float32_copy(case, monkeypatch):
    """A bfloat16 model's pools read as they are, widened in registers: the AVX2 item gives the same sums as the
    kernel on float32 copies of the same values, rounded once to bfloat16 (so no pool-sized float32 copy is
    needed)."""
    monkeypatch.setattr(attention, "_bf16_scores", lambda: False)
    spec = [(s + 16, n) for s, n in CASES[case]]
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, 9, 3, 64, seed=11, shared_prefix_blocks=1)
    q, kp, vp = q.bfloat16(), kp.bfloat16(), vp.bfloat16()
    lay = attention.layout("gather", rows, pos, bs, nblk)
    assert all(attention._kernel_fits(q, kp, vp, g) for g in lay)
    got = attention.attend("gather", q, kp, vp, lay, None)
    want = attention.attend("gather", q.float(), kp.float(), vp.float(), lay, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


needs_bf16_scores = pytest.mark.skipif(attention._kernel() is None or not attention._bf16_scores(),
                                       reason="no AVX512-BF16 CPU here")


@needs_bf16_scores
@pytest.mark.parametrize("case", ["decode", "verify-ragged", "one-row"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 32), (4, 4, 128), (6, 2, 96)])
def test_the_avx512_bf16_item_reads_the_pool_as_sdpa_reads_its_float32_copy(case, heads, kv_heads, dim):
    """bfloat16 pools on an AVX512-BF16 CPU: scores by vdpbf16ps (exact products, float32 sums in another
    order), values widened once per token's queries; within a bfloat16 rounding of SDPA on float32 copies,
    for every head size the kernel takes (a multiple of 32) and rows long and short of a 16-key tile."""
    spec = [(s + 16, n) for s, n in CASES[case]] + [(5, 1), (33, 3)]
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, heads, kv_heads, dim, seed=dim + heads,
                                                            shared_prefix_blocks=1)
    q, kp, vp = q.bfloat16(), kp.bfloat16(), vp.bfloat16()
    lay = attention.layout("gather", rows, pos, bs, nblk)
    got = attention.attend("gather", q, kp, vp, lay, None)
    attention.KERNEL_ON = False
    try:
        want = attention.attend("gather", q.float(), kp.float(), vp.float(), lay, None)
    finally:
        attention.KERNEL_ON = True
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_bf16_scores
def test_the_avx512_bf16_item_is_batch_invariant_whether_it_takes_rows_or_heads():
    """A row's bits are the same alone (items of one key-value head each) and in a batch large enough that items
    take whole rows: sums in one order per query whatever the item's shape or the thread."""
    spec = [(40 + 9 * i, 1 + i % 4) for i in range(4 * torch.get_num_threads() + 1)]
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, 9, 3, 64, seed=7)
    q, kp, vp = q.bfloat16(), kp.bfloat16(), vp.bfloat16()
    both = attention.attend("gather", q, kp, vp, attention.layout("gather", rows, pos, bs, nblk), None)
    for r in (rows[0], rows[5]):
        alone = attention.Row(0, r.n, r.start, r.table)
        mine = slice(r.offset, r.offset + r.n)
        one = attention.attend("gather", q[mine], kp, vp, attention.layout("gather", [alone], pos[mine], bs, nblk),
                               None)
        assert torch.equal(one, both[mine])


@needs_kernel
def test_the_c_kernel_is_batch_invariant():
    """A row's output is the same bits alone or beside others (the sums never depend on the batch)."""
    spec = [(40, 3), (7, 1), (90, 5)]
    q, kp, vp, rows, pos, bs, nblk = attention.random_batch(spec, 8, 2, 64, seed=5)
    both = attention.attend("gather", q, kp, vp, attention.layout("gather", rows, pos, bs, nblk), None)
    alone = attention.Row(0, rows[2].n, rows[2].start, rows[2].table)
    mine = slice(rows[2].offset, rows[2].offset + rows[2].n)
    one = attention.attend("gather", q[mine], kp, vp, attention.layout("gather", [alone], pos[mine], bs, nblk), None)
    assert torch.equal(one, both[mine])


@needs_kernel
def test_bench_attention_times_the_kernel_against_sdpa_on_the_copy():
    from serve_app.bench.attention import run_case

    r = run_case(2, 48, 3, "smollm2-135m", "cpu", torch.float32, rounds=1, backends=("gather", "gather-sdpa"))
    assert r["backends"]["gather-sdpa"]["max_abs_diff"] < 1e-5
    assert attention.KERNEL_ON  # back on after the baseline's calls
