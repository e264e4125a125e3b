"""`engine/direct.py`: the lean forward's layers as direct kernel calls give `lean.forward`'s bits (its path through
the modules and `decoder_ops`), for every row kind a step packs, features included; weights edited or replaced
after a forward are seen."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from serve_app.config import SamplingParams
from serve_app.engine import bf16_dot, decoder_ops, direct, packing
from serve_app.engine.worker import ModelWorker

pytestmark = pytest.mark.skipif(not (bf16_dot.available() and decoder_ops._library() is not None),
                                reason="needs the bfloat16 dot-product kernels (AVX512-BF16) and a C compiler")


def _model(intermediate: int, seed: int = 0) -> LlamaForCausalLM:
    """bfloat16, head size 32; intermediate 96 puts every product on AMX where the CPU has it, 80 the down
    projection (K = 80) on bf16_dot.c."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=intermediate, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # each norm its own weights (they start as ones): a norm used in another's place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(torch.bfloat16)


PROMPTS = [list(range(3, 43)), [5, 6, 7], list(range(50, 70)), [9]]


def _steps(worker: ModelWorker) -> list[torch.Tensor]:
    """Logits and features of: a first chunk of long prompts beside short ones, their second chunks beside
    verify-shaped rows, then decode rows; and each layer's pools at the end."""
    worker.capture_features([0, 1, 3])
    p = SamplingParams(max_tokens=8, temperature=0)
    sids = ["a", "b", "c", "d"]
    worker.add(sids, PROMPTS, [p] * 4)
    outs = []
    for fed in ([PROMPTS[0][:24], PROMPTS[1], PROMPTS[2][:2], PROMPTS[3]],
                [PROMPTS[0][24:], [11, 12, 13], PROMPTS[2][2:], [14, 15]],
                [[16], [17], [18], [19]]):
        index = torch.arange(sum(len(f) for f in fed))
        outs.append(worker._forward(sids, fed, index))
        outs += [worker._captured.pop(i) for i in worker.feature_layers]
        for sid, f in zip(sids, fed):
            worker.seqs[sid].kv_len += len(f)
    return outs + list(worker.cache.keys) + list(worker.cache.values)


@pytest.mark.parametrize("intermediate, dtype", [(96, torch.bfloat16), (80, torch.bfloat16), (96, torch.float32)],
                         ids=["amx-or-dot", "dot-down", "float32-bf16-linear"])
def test_direct_calls_are_bit_for_bit_the_lean_forward(intermediate, dtype, monkeypatch):
    """bfloat16 models, and a bfloat16 model widened to float32 on a CPU taken for one without bfloat16 products
    (its weights kept as bfloat16 bits for `bf16_linear`, float32 activations: the AVX2 machines' path)."""
    if dtype == torch.float32:
        monkeypatch.setattr(packing, "supports", lambda d: d == torch.float32)
    model = _model(intermediate).to(dtype)
    worker = ModelWorker(model, "target")
    assert worker.lean and direct.layers(model, dtype) is not None
    fast = _steps(worker)
    monkeypatch.setattr(direct, "ON", False)
    slow = _steps(ModelWorker(_model(intermediate).to(dtype), "target"))
    assert len(fast) == len(slow) == 3 * 4 + 2 * 3
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_direct_calls_follow_edited_and_replaced_weights(monkeypatch):
    """After a forward, a weight edited in place and then one replaced by a new tensor: each forward after
    computes with the weights as they are (as the module path does)."""
    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(direct, "ON", on)
        model = _model(96, seed=3)
        worker = ModelWorker(model, "target")
        p = SamplingParams(max_tokens=8, temperature=0)
        worker.add(["a"], [[4, 5, 6, 7]], [p])
        outs = [worker._forward(["a"], [[4, 5, 6, 7]], torch.arange(4))]
        layer = model.model.layers[1]
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(-2)  # in place: its version moves
            outs.append(worker._forward(["a"], [[4, 5, 6, 7]], torch.arange(4)))
            layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight * 3)
            outs.append(worker._forward(["a"], [[4, 5, 6, 7]], torch.arange(4)))
            layer.post_attention_layernorm.weight.add_(1)
            outs.append(worker._forward(["a"], [[4, 5, 6, 7]], torch.arange(4)))
        return outs

    fast, slow = run(True), run(False)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), i
    assert not any(torch.equal(fast[i], fast[i + 1]) for i in range(3))  # each edit changed the output
