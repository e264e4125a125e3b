"""The lean Llama forward (engine/lean.py) gives the bits transformers' wrapped forward gives, features included,
with torch's small ops (the C ones, `decoder_ops`, are torch's to rounding: tests/test_decoder_ops.py), and only
stock Llama decoders take it."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from conftest import tiny_llama
from serve_app.config import SamplingParams
from serve_app.engine import decoder_ops, lean
from serve_app.engine.worker import ModelWorker


def _steps(worker: ModelWorker, features: bool) -> list[torch.Tensor]:
    """Logits (and captured features) of a prefill, a ragged verify-shaped forward and a decode, two rows."""
    if features:
        worker.capture_features([0, 1, 2])
    p = SamplingParams(max_tokens=8, temperature=0)
    worker.add(["a", "b"], [[5, 9, 13, 2, 7, 7, 31, 4, 8, 19, 3, 22, 40, 41, 6, 1, 17, 18], [3, 4]], [p, p])
    outs = []
    for fed in ([[5, 9, 13, 2, 7, 7, 31, 4, 8, 19, 3, 22, 40, 41, 6, 1, 17, 18], [3, 4]], [[11, 12, 13], [14]],
                [[15], [16]]):
        index = torch.arange(sum(len(f) for f in fed))
        outs.append(worker._forward(["a", "b"], fed, index))
        if features:
            outs += [worker._captured.pop(i) for i in worker.feature_layers]
        for sid, f in zip(["a", "b"], fed):
            worker.seqs[sid].kv_len += len(f)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("features", [False, True], ids=["logits", "features"])
def test_lean_forward_is_bit_for_bit_the_wrapped_one(dtype, features, monkeypatch):
    monkeypatch.setattr(decoder_ops, "ON", False)
    model = tiny_llama(64, layers=2, dtype=dtype, seed=4)
    fast, slow = ModelWorker(model, "target"), ModelWorker(copy.deepcopy(model), "target")
    assert fast.lean and slow.lean
    slow.lean = False
    for a, b in zip(_steps(fast, features), _steps(slow, features)):
        assert torch.equal(a, b)


def test_only_stock_llama_decoders_go_lean():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    assert not lean.supports(Qwen3ForCausalLM(cfg))  # query/key norms in its attention
    llama = tiny_llama(64, layers=2)
    assert lean.supports(llama)
    llama.model.layers[1].self_attn = torch.nn.Identity()
    assert not lean.supports(llama)


def _draft_steps(worker) -> list[torch.Tensor]:
    """A draft's outputs (logits, state, reduced logits) over a catch-up, a ragged step and a one-token step."""
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(max_tokens=8, temperature=0)
    worker.add(["a", "b"], [list(range(5, 25)), [3, 4, 9]], [p, p])
    h = worker.model.config.hidden_size
    outs, starts = [], [0, 0]
    for fed in ([list(range(6, 25)), [4, 9]], [[30, 31, 32], [33]], [[34], [35]]):
        hidden = torch.randn(sum(map(len, fed)), h, generator=g).to(worker.model.dtype)
        outs += worker._step(["a", "b"], fed, starts, hidden, 1)
        starts = [s + len(f) for s, f in zip(starts, fed)]
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ops", [False, True], ids=["torch-ops", "c-ops"])
def test_lean_draft_step_is_the_wrapped_one(dtype, ops, monkeypatch):
    """An EAGLE-3 draft's layer through `lean.draft_step` against transformers' modules (`Eagle3Draft.step`):
    bit for bit with torch's ops, to rounding with the C norms (each norm its own weights, so a swapped one
    shows)."""
    from serve_app.drafting.eagle3 import Eagle3Draft
    from serve_app.drafting.eagle3_worker import EagleWorker

    monkeypatch.setattr(decoder_ops, "ON", ops)
    target = tiny_llama(97, layers=4, dtype=dtype, seed=6)
    draft = Eagle3Draft.from_target(target, torch.arange(0, 97, 2), [0, 1, 2])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p is not draft.embed_tokens.weight:
                p.add_(0.2 * torch.randn(p.shape, generator=g).to(dtype))
    fast, slow = EagleWorker(draft), EagleWorker(copy.deepcopy(draft))
    assert fast.lean_draft
    slow.lean_draft = False
    for a, b in zip(_draft_steps(fast), _draft_steps(slow)):
        if ops:
            torch.testing.assert_close(a, b, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        else:
            assert torch.equal(a, b)
