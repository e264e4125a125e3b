"""bfloat16 weights with float32 arithmetic (`engine.bf16_linear`): the products of a float32 matmul over the
same weights, every row independent of the rest of the batch (so greedy text is the same at any k and batch),
chosen by packing exactly where the weights are bfloat16-exact, and what `--dtype bfloat16` loads on a CPU
without bfloat16 arithmetic."""

import copy

import pytest
import torch

from conftest import IdTokenizer, tiny_llama
from serve_app import models
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine import bf16_linear, packing
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="no AVX2 + FMA or no C compiler here")


def _reference(x, bits, bias=None):  # float64 products of the same bfloat16 weights
    blocks = bits.blocks.view(torch.bfloat16).double()  # [N / 16, K, 16]
    w = blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[:bits.out_features]
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("m, k, n", [(1, 64, 8), (2, 577, 13), (3, 576, 960), (5, 9, 7), (7, 1536, 5), (13, 40, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_a_float64_matmul_of_the_same_weights(m, k, n, with_bias):
    torch.manual_seed(m * k + n)
    bits = bf16_linear.to_bits(torch.randn(n, k))
    x, bias = torch.randn(m, k), torch.randn(n) if with_bias else None
    got = bf16_linear.linear(x, bits, bias)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), _reference(x, bits, bias), rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_inputs_of_any_layout_and_no_rows():
    bits = bf16_linear.to_bits(torch.randn(12, 40))
    wide = torch.randn(2, 3, 50)
    x = wide[..., 5:45]  # strided rows, three dimensions
    torch.testing.assert_close(bf16_linear.linear(x, bits, None).double(), _reference(x, bits), rtol=1e-5, atol=1e-4)
    assert bf16_linear.linear(torch.randn(0, 40), bits, None).shape == (0, 12)
    assert bf16_linear.linear(torch.randn(1, 2, 40).double(), bits, None).dtype == torch.float32
    with pytest.raises(RuntimeError, match="input of 41 features"):
        bf16_linear.linear(torch.randn(2, 41), bits, None)


def test_a_rows_output_is_bit_identical_alone_in_any_batch_and_thread_count():
    torch.manual_seed(0)
    bits = bf16_linear.to_bits(torch.randn(37, 1001))
    x = torch.randn(14, 1001)
    alone = torch.cat([bf16_linear.linear(x[i:i + 1], bits, None) for i in range(14)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (2, 3, 5, 6, 11, 14):  # tiles of 1 to 6 rows
                assert torch.equal(bf16_linear.linear(x[:m], bits, None), alone[:m])
    finally:
        torch.set_num_threads(before)


def _widened(seed: int = 3):
    """A tiny float32 model holding bfloat16 weights (what models.py loads for `--dtype bfloat16` here)."""
    model = tiny_llama(96, layers=2, dtype=torch.bfloat16, seed=seed)
    torch.nn.Module.float(model)
    return model


@pytest.fixture
def no_bf16_packing(monkeypatch):
    """As on a CPU without bfloat16 arithmetic (AVX2 only), where models.py widens a bfloat16 model and packing keeps
    its weights as bits: on one with avx512_bf16, oneDNN packs bfloat16 itself and the bits are not used."""
    monkeypatch.setattr(packing, "supports", lambda dtype: dtype == torch.float32)


def test_packing_keeps_bfloat16_exact_weights_as_bits_and_repacks_an_edited_one(no_bf16_packing):
    model, plain = _widened(), _widened()
    packing.pack_linears(model)
    ids = torch.randint(3, 96, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    head = model.lm_head.packs
    assert isinstance(head.packed, bf16_linear.Bits)  # half the bytes
    assert isinstance(model.model.layers[0].mlp.up_proj.fused.packs.packed, bf16_linear.Bits)
    with torch.no_grad():  # no longer bfloat16-exact: oneDNN's float32 layout, same products
        noise = 1e-3 * torch.randn_like(model.lm_head.weight)
        for m in (model, plain):
            m.lm_head.weight.add_(noise)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    assert head.packed.dtype == torch.float32
    float32 = tiny_llama(96, layers=2, dtype=torch.float32, seed=3)  # random float32 weights: never bits
    packing.pack_linears(float32)
    with torch.inference_mode():
        float32(ids)
    assert float32.lm_head.packs.packed.dtype == torch.float32


def test_greedy_text_is_the_unpacked_models_at_any_k(no_bf16_packing):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [4, 5], [7] * 9]

    def run(model, k: int, batch: int) -> list[list[int]]:
        draft = _widened(seed=4)
        engine = Engine(ModelWorker(model, "target"), ModelWorker(draft, "draft") if k else None, IdTokenizer(),
                        EngineConfig(policy=f"fixed:{k}", max_batch_size=batch), eos_ids=set())
        reqs = [engine.submit(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        engine.run(reqs)
        return [r.output_ids for r in reqs]

    model = _widened()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_PACK_WEIGHTS", "0")
        want = run(copy.deepcopy(model), 0, 1)
    assert run(model, 0, 1) == want
    assert isinstance(model.lm_head.packs.packed, bf16_linear.Bits)
    for k, batch in ((0, 4), (2, 4), (4, 2)):
        assert run(model, k, batch) == want


def test_dtype_bfloat16_loads_float32_arithmetic_over_bfloat16_weights(monkeypatch, tiny_model_dirs):
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: False)
    target, _, _ = models.load_target(tiny_model_dirs["target"], "bfloat16")
    assert target.dtype == torch.float32 and target.specserve_dtype == "bfloat16"
    w = target.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, w.bfloat16().float())
    worker = ModelWorker(target, "target")
    assert worker.info()["dtype"] == "bfloat16"  # what profiles and metrics are keyed by
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)  # native bfloat16: left as loaded
    native, _, _ = models.load_target(tiny_model_dirs["target"], "bfloat16")
    assert native.dtype == torch.bfloat16


def test_bench_linears_reports_both_formats_paired_by_rows():
    from serve_app.bench.linears import bench_linears

    results, text = bench_linears([1, 3], rounds=2, layers=1, head=64, reps=1)
    assert {(r["format"], r["rows"]) for r in results["runs"]} == {(f, n) for f in ("float32", "bf16") for n in (1, 3)}
    assert len(results["runs"]) == 8 and all(r["ms"] > 0 for r in results["runs"])
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 and all("x [" in line and "GB/s" in line for line in rows)
