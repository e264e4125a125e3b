"""A decoder layer's small ops in C (`engine.decoder_ops`): torch's results (bits where torch's rounding is the only
rounding, to an ulp elsewhere), each row independent of the batch, and through `lean.forward` greedy text that is
the same at any k and batch, in float32 and bfloat16."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from conftest import IdTokenizer
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine import bf16_dot, decoder_ops
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

pytestmark = pytest.mark.skipif(decoder_ops._library() is None, reason="no AVX2 + FMA or no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Most units in the last place between a and b (same dtype, same signs where they differ)."""
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return int((a.view(bits).int() - b.view(bits).int()).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])  # 40: over MANY_ROWS, threads split the rows
def test_add_rms_norm_is_llamas_norm_of_the_sum(dtype, rows):
    torch.manual_seed(rows)
    d = 200  # not a multiple of 8: the tail loop too
    h, delta = torch.randn(rows, d).to(dtype), torch.randn(rows, d).to(dtype)
    norm = LlamaRMSNorm(d, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(d)
    norm = norm.to(dtype).requires_grad_(False)
    got_h, got = decoder_ops.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(got_h, h + delta)  # the residual add rounds once, as torch's
    ulps = 1 if dtype == torch.bfloat16 else 4  # the sum of squares in another order: its root's last bit
    assert _ulps(got, norm(h + delta)) <= ulps
    same, alone = decoder_ops.add_rms_norm(h, None, norm.weight, norm.variance_epsilon)
    assert same is h and _ulps(alone, norm(h)) <= ulps
    if dtype == torch.bfloat16:  # float32's last-bit differences almost never survive the rounding
        assert (got == norm(h + delta)).float().mean() > 0.999


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_gives_torchs_bits(dtype):
    torch.manual_seed(0)
    t, heads, kv_heads, d = 9, 6, 2, 32
    qkv = torch.randn(t, heads + 2 * kv_heads, d).to(dtype)
    angles = torch.arange(t)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    sin_signed = torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], -1)
    qk = qkv[:, :heads + kv_heads]
    want = qk * cos[:, None] + torch.cat([qk[..., d // 2:], qk[..., :d // 2]], -1) * sin_signed[:, None]
    got = qkv.clone()
    decoder_ops.rotary(got, heads + kv_heads, cos, sin_signed)
    assert torch.equal(got[:, :heads + kv_heads], want)
    assert torch.equal(got[:, heads + kv_heads:], qkv[:, heads + kv_heads:])  # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_stores_keys_and_values_where_the_caches_write_puts_them(dtype):
    """rotary's store: each row's rotated key heads and its value heads at its pool slot, the other slots
    untouched, as `PagedKV.write`'s index_copy_ would; a bad pool is refused, not written past."""
    torch.manual_seed(3)
    t, heads, kv_heads, d = 7, 6, 2, 32
    qkv = torch.randn(t, heads + 2 * kv_heads, d).to(dtype)
    cos, sin = torch.randn(t, d).to(dtype), torch.randn(t, d).to(dtype)
    slots = torch.tensor([40, 3, 17, 18, 5, 60, 0])
    k_pool, v_pool = torch.randn(64, kv_heads, d).to(dtype), torch.randn(64, kv_heads, d).to(dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    rotated = qkv.clone()
    decoder_ops.rotary(rotated, heads + kv_heads, cos, sin)
    want_k.index_copy_(0, slots, rotated[:, heads:heads + kv_heads])
    want_v.index_copy_(0, slots, rotated[:, heads + kv_heads:])
    got = qkv.clone()
    decoder_ops.rotary(got, heads + kv_heads, cos, sin, (k_pool, v_pool, slots, heads))
    assert torch.equal(got, rotated) and torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(ValueError):
        decoder_ops.rotary(qkv.clone(), heads + kv_heads, cos, sin, (k_pool[:, :1], v_pool, slots, heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(dtype):
    torch.manual_seed(1)
    gate_up = (3 * torch.randn(20, 2 * 100)).to(dtype)  # 100: a tail past the 8-lane body
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's overflow and zeros
    want = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    got = decoder_ops.silu_mul(gate_up)
    assert _ulps(got, want) <= (1 if dtype == torch.bfloat16 else 4)  # exp: a polynomial against torch's
    assert torch.equal(got[0, :4], want[0, :4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_results_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(2)
    h, delta, w = torch.randn(40, 64).to(dtype), torch.randn(40, 64).to(dtype), torch.randn(64).to(dtype)
    gate_up = torch.randn(40, 96).to(dtype)
    qkv = torch.randn(40, 5, 16).to(dtype)
    cos, sin = torch.randn(40, 16).to(dtype), torch.randn(40, 16).to(dtype)
    batch = decoder_ops.add_rms_norm(h, delta, w, 1e-6)[1], decoder_ops.silu_mul(gate_up)
    rotated = qkv.clone()
    decoder_ops.rotary(rotated, 3, cos, sin)
    for i in (0, 17, 39):
        alone = qkv[i:i + 1].clone()
        decoder_ops.rotary(alone, 3, cos[i:i + 1], sin[i:i + 1])
        assert torch.equal(decoder_ops.add_rms_norm(h[i:i + 1], delta[i:i + 1], w, 1e-6)[1], batch[0][i:i + 1])
        assert torch.equal(decoder_ops.silu_mul(gate_up[i:i + 1]), batch[1][i:i + 1])
        assert torch.equal(alone, rotated[i:i + 1])


def _llama(dtype) -> LlamaForCausalLM:
    """A random stock Llama whose heads the C rotary takes (head_dim 16)."""
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_forward_with_the_ops_is_torchs_to_rounding(dtype, monkeypatch):
    model = _llama(dtype)
    fast, slow = ModelWorker(model, "target"), ModelWorker(copy.deepcopy(model), "target")
    p = SamplingParams(max_tokens=8, temperature=0)
    outs = []
    for worker, on in ((fast, True), (slow, False)):
        monkeypatch.setattr(decoder_ops, "ON", on)
        worker.add(["a", "b"], [[5, 9, 13, 2, 7, 7, 31], [3, 4]], [p, p])
        outs.append(worker._forward(["a", "b"], [[5, 9, 13, 2, 7, 7, 31], [3, 4]], torch.arange(9)))
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]
    torch.testing.assert_close(outs[0], outs[1], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not bf16_dot.available(), reason="bfloat16 linears batch-invariant only by bf16_dot (AVX512-BF16)"))])
def test_greedy_text_with_the_ops_is_the_same_at_any_k_and_batch(dtype):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [4, 5], [7] * 9]

    def run(k: int, batch: int) -> list[list[int]]:
        draft = copy.deepcopy(target)  # a draft that agrees often, so verified rows carry several tokens
        with torch.no_grad():
            draft.lm_head.weight.add_(0.05 * torch.randn_like(draft.lm_head.weight))
        engine = Engine(ModelWorker(copy.deepcopy(target), "target"), ModelWorker(draft, "draft") if k else None,
                        IdTokenizer(), EngineConfig(policy=f"fixed:{k}", max_batch_size=batch), eos_ids=set())
        reqs = [engine.submit(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        engine.run(reqs)
        return [r.output_ids for r in reqs]

    target = _llama(dtype)
    want = run(0, 1)
    for k, batch in ((0, 4), (2, 4), (4, 2)):
        assert run(k, batch) == want

