"""Packed CPU linears (`engine.packing`): the same outputs to float32 rounding, fused siblings correct in any
call order, packs that follow their weights (edited, converted, copied), and the engine's greedy text unchanged."""

import copy

import pytest
import torch
from torch import nn

from conftest import IdTokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine import packing
from serve_app.engine.packing import FusedPart, PackedLinear, pack_linears
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

pytestmark = pytest.mark.skipif(not packing.supports(torch.float32), reason="this torch has no oneDNN")


def _pair(tied: bool):
    model = tiny_llama(96, layers=2, dtype=torch.float32, seed=3)  # untied
    if tied:  # as SmolLM2's: the head is the embedding
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_gives_the_same_logits(tied):
    model, plain = _pair(tied)
    n = pack_linears(model)
    assert n == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert pack_linears(model) == 0  # packing twice packs nothing more
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, FusedPart) and isinstance(layer.mlp.up_proj, FusedPart)
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.lm_head, nn.Linear)
    # the parameters are the plain ones; a tied head still shares the embedding
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.lm_head.weight.shape == plain.lm_head.weight.shape
    ids = torch.randint(3, 96, (3, 11))
    with torch.inference_mode():
        got, want = model(ids).logits, plain(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fused_sibling_called_alone_or_out_of_order_gives_its_own_projection():
    model, plain = _pair(True)
    pack_linears(model)
    att, ref = model.model.layers[1].self_attn, plain.model.layers[1].self_attn
    x, y = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(att.v_proj(x), ref.v_proj(x), rtol=1e-5, atol=1e-5)  # alone
        att.q_proj(x)
        torch.testing.assert_close(att.k_proj(y), ref.k_proj(y), rtol=1e-5, atol=1e-5)  # another input
        torch.testing.assert_close(att.v_proj(x), ref.v_proj(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="input of 7 features"):
            att.q_proj(torch.randn(2, 7))


def test_packs_follow_their_weights_edited_converted_or_copied():
    model, plain = _pair(True)
    pack_linears(model)
    ids = torch.randint(3, 96, (2, 7))
    with torch.inference_mode():
        model(ids)  # packs made
    with torch.no_grad():  # edited in place after packing (as a test or a tool zeroes a head row)
        for m in (model, plain):
            m.lm_head.weight[5] = 0
            m.model.layers[0].mlp.up_proj.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(model)  # a packed model copies
        torch.testing.assert_close(twin(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
        half = copy.deepcopy(model).to(torch.bfloat16)  # and converts (bfloat16 runs plainly where oneDNN cannot)
        torch.testing.assert_close(half(ids).logits.float(), plain.to(torch.bfloat16)(ids).logits.float(),
                                   rtol=0.05, atol=0.05)
    x = torch.randn(3, 32, requires_grad=True)  # autograd takes the plain path
    model.model.layers[0].mlp.gate_proj(x).sum().backward()
    assert x.grad is not None


def test_biases_and_float64_models():
    lin = nn.Linear(16, 24)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = lin, nn.Linear(16, 8, bias=False), nn.Linear(16, 8)
    want = [copy.deepcopy(m) for m in (parent.q_proj, parent.k_proj, parent.v_proj)]
    assert pack_linears(parent) == 3
    x = torch.randn(3, 16)
    with torch.inference_mode():
        for name, ref in zip(("q_proj", "k_proj", "v_proj"), want):
            torch.testing.assert_close(getattr(parent, name)(x), ref(x), rtol=1e-5, atol=1e-5)
    assert pack_linears(tiny_llama(32)) == 0  # float64 (the suite's tiny models): left as they are


def test_model_worker_packs_a_cpu_model_unless_switched_off(monkeypatch):
    model, _ = _pair(True)
    ModelWorker(model, "target")
    assert isinstance(model.lm_head, PackedLinear)
    monkeypatch.setenv("SPECSERVE_PACK_WEIGHTS", "0")
    other, _ = _pair(True)
    ModelWorker(other, "target")
    assert type(other.lm_head) is nn.Linear


def test_engine_greedy_text_is_the_same_packed_or_not():
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [4, 5]]

    def run(model, k: int) -> list[list[int]]:
        draft = tiny_llama(96, layers=1, dtype=torch.float32, seed=4)
        engine = Engine(ModelWorker(model, "target"), ModelWorker(draft, "draft") if k else None, IdTokenizer(),
                        EngineConfig(policy=f"fixed:{k}", max_batch_size=2), eos_ids=set())
        reqs = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        engine.run(reqs)
        return [r.output_ids for r in reqs]

    packed, plain = _pair(True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_PACK_WEIGHTS", "0")
        want = run(plain, 0)
    assert run(packed, 0) == want
    assert run(packed, 3) == want
