"""The target's features (residual stream at chosen layers) for EAGLE-style drafts: right positions, right values."""

import pytest
import torch

from serve_app.config import SamplingParams
from serve_app.engine.worker import ModelWorker, Proposal


def hf_states(model, tokens, layers):
    """[len(tokens), F]: the residual stream entering each layer id (len(layers) == N: after the last)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    # hidden_states[i] enters layer i; the last entry is after the final norm, so rebuild "after the
    # last layer, before the norm" from a hook-free second route: the final entry's pre-norm input
    n = len(model.model.layers)
    states = list(out.hidden_states[:n])
    if n in layers:
        grabbed = {}
        h = model.model.norm.register_forward_pre_hook(lambda m, a: grabbed.setdefault("x", a[0]))
        with torch.no_grad():
            model(torch.tensor([tokens]))
        h.remove()
        states.append(grabbed["x"])
    return torch.cat([states[i][0] for i in layers], dim=-1)


def test_verify_returns_features_of_exactly_the_positions_it_made_final(tiny_target):
    layers = [0, 1, 2]  # the tiny target has 2 layers: 2 = output of the last one, before the final norm
    w = ModelWorker(tiny_target, "target")
    w.capture_features(layers)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12]}
    w.add(list(prompts), list(prompts.values()), [SamplingParams(), SamplingParams()])
    n, first, feats = w.verify(list(prompts), Proposal(torch.zeros((2, 0), dtype=torch.long)))[:3]
    assert n == [0, 0] and [f.shape for f in feats] == [(5, 3 * 32), (2, 3 * 32)]  # prefill: every prompt position
    for f, p in zip(feats, prompts.values()):
        assert f.dtype == torch.bfloat16
        torch.testing.assert_close(f.float(), hf_states(tiny_target, p, layers).float(), rtol=2e-2, atol=2e-2)
    # A step where row a gets its first draft accepted and row b none: features of pending + accepted.
    greedy_a = w.seqs["a"].tokens  # prompt + pending first token
    with torch.no_grad():
        nxt = tiny_target(torch.tensor([greedy_a])).logits[0, -1].argmax().item()
    drafts = torch.tensor([[nxt, (nxt + 1) % 97, 3], [(first[1] + 1) % 97, 4, 4]])
    n, _, feats = w.verify(list(prompts), Proposal(drafts))[:3]
    assert n[1] == 0 and n[0] >= 1
    assert [f.shape[0] for f in feats] == [1 + n[0], 1]  # the pending token, then the accepted drafts
    for sid, f in zip(prompts, feats):
        seq = w.seqs[sid].tokens  # now prompt + first + accepted + next (pending)
        full = hf_states(tiny_target, seq[:-1], layers)  # the target has processed all but the pending one
        torch.testing.assert_close(f.float(), full[-f.shape[0]:].float(), rtol=2e-2, atol=2e-2)


def test_features_only_when_asked_and_layer_ids_are_checked(tiny_target):
    w = ModelWorker(tiny_target, "target")
    w.add(["s"], [[1, 2, 3]], [SamplingParams()])
    assert w.verify(["s"], Proposal(torch.zeros((1, 0), dtype=torch.long))).features is None
    with pytest.raises(ValueError, match="do not fit a target of 2 layers"):
        w.capture_features([0, 3])
    w.capture_features([1])
    with pytest.raises(ValueError, match="already captures"):
        w.capture_features([0])
