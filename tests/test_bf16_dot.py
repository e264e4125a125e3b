"""bfloat16 products by the CPU's bfloat16 dot product (`engine.bf16_dot`): a float64 matmul's of the same bfloat16
numbers to float32-sum rounding, every row independent of the rest of the batch and of the thread count, chosen
by packing for bfloat16 weights where the CPU has AVX512-BF16."""

import pytest
import torch

from serve_app.engine import bf16_dot, packing

pytestmark = pytest.mark.skipif(not bf16_dot.available(), reason="no AVX512-BF16 or no C compiler here")


def _reference(x, w, bias=None):  # float64 products of the same bfloat16 numbers
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("m, k, n", [(1, 64, 8), (2, 576, 13), (3, 576, 960), (7, 1536, 5), (13, 40, 70), (33, 6, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_a_float64_matmul_of_the_same_numbers(m, k, n, with_bias):
    torch.manual_seed(m * k + n)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    bias = torch.randn(n) if with_bias else None
    got = bf16_dot.linear(x, bf16_dot.to_pairs(w), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-2, atol=1e-2 * k ** 0.5)


def test_a_rows_output_ignores_the_batch_and_the_threads():
    torch.manual_seed(0)
    w, x = torch.randn(200, 96).bfloat16(), torch.randn(40, 96).bfloat16()
    pairs = bf16_dot.to_pairs(w)
    whole = bf16_dot.linear(x, pairs, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bf16_dot.linear(x, pairs, None), whole)
    finally:
        torch.set_num_threads(threads)
    for lo, hi in ((0, 1), (5, 12), (17, 40), (39, 40)):  # tiles of 1-6 rows, every remainder
        assert torch.equal(bf16_dot.linear(x[lo:hi], pairs, None), whole[lo:hi])


def test_inputs_of_any_layout_and_no_rows():
    torch.manual_seed(1)
    w = torch.randn(12, 40).bfloat16()
    pairs = bf16_dot.to_pairs(w)
    wide = torch.randn(3, 81).bfloat16()
    x = wide[:, 1:41]  # an odd element offset and an odd row stride: copied before reading 32-bit pairs
    assert torch.equal(bf16_dot.linear(x, pairs, None), bf16_dot.linear(x.contiguous(), pairs, None))
    assert bf16_dot.linear(torch.zeros(0, 40).bfloat16(), pairs, None).shape == (0, 12)
    assert bf16_dot.linear(torch.randn(2, 3, 40).bfloat16(), pairs, None).shape == (2, 3, 12)
    with pytest.raises(RuntimeError, match="41 features"):
        bf16_dot.linear(torch.randn(1, 41).bfloat16(), pairs, None)


def test_packing_multiplies_bfloat16_weights_with_it(monkeypatch):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 33, bias=False)).bfloat16().eval()
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        want = model(x)
        assert packing.pack_linears(model) == 2
        got = model(x)
    assert all(isinstance(m.packs.packed, bf16_dot.Pairs) for m in model)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(bf16_dot, "fits", lambda w: False)  # where the CPU lacks it: oneDNN's layout
    with torch.no_grad():
        model[0].weight.mul_(1)  # an edit in place: packed again
    with torch.inference_mode():
        model(x)
    assert isinstance(model[0].packs.packed, torch.Tensor)


@pytest.mark.skipif(bf16_dot._amx() is None, reason="no AMX here (Intel Xeons since Sapphire Rapids)")
def test_amx_takes_whole_k_tiles_and_agrees_with_the_dot_product_to_rounding(monkeypatch):
    """On AMX the same packed weights go to `bf16_amx.c` where K is a multiple of 32: the reference's products to
    rounding, every row its own over 16-row tiles and their remainders; another K keeps `bf16_dot.c`."""
    torch.manual_seed(3)
    # SmolLM2's q/k/v shape: enough sums that a k tile summed out of order flips some bfloat16 rounding (a narrow
    # weight's outputs hid the 17-32-row walk run backwards)
    w, x = torch.randn(960, 576).bfloat16(), torch.randn(37, 576).bfloat16()
    pairs = bf16_dot.to_pairs(w)
    assert bf16_dot.uses_amx(576) and not bf16_dot.uses_amx(40)
    tiles = bf16_dot.linear(x, pairs, None)
    for lo, hi in ((0, 1), (3, 19), (16, 32), (36, 37)):
        assert torch.equal(bf16_dot.linear(x[lo:hi], pairs, None), tiles[lo:hi])
    monkeypatch.setattr(bf16_dot, "_amx", lambda: None)
    dots = bf16_dot.linear(x, pairs, None)
    for got in (tiles, dots):
        torch.testing.assert_close(got.double(), _reference(x, w), rtol=1e-2, atol=1e-2 * 576 ** 0.5)
    # the two sum a pair's products alike but not always to the same bit (a few in 10,000 outputs of SmolLM2's
    # projections differ by one): one kernel for every row count of a weight is what keeps rows invariant
    torch.testing.assert_close(tiles.float(), dots.float(), rtol=1e-2, atol=1e-2)
