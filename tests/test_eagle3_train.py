"""EAGLE-3 training on tiny models: the unrolled training forward is exactly what the cached draft
computes at serving time; data carries the target's features; the loss falls and agreement rises."""

import random

import pytest
import torch

from conftest import IdTokenizer, make_tokenizer, tiny_llama
from test_eagle3 import LAYERS, target_features
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.distill import continue_prompts, token_set
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.eagle3_train import eagle_batches, train_eagle3, unroll
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker


def test_unrolled_training_steps_equal_what_the_draft_computes_when_serving():
    target = tiny_llama(97, layers=2, seed=0)
    draft = Eagle3Draft.from_target(target, torch.arange(97), LAYERS)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):  # let the embedding half matter too
            w = getattr(draft.self_attn, name).weight
            w[:, : w.shape[1] // 2] = torch.randn_like(w[:, : w.shape[1] // 2]) * 0.2
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    feats = target_features(target, tokens[:-1])[None]  # [1, T-1, F]
    with torch.no_grad():
        states = unroll(draft, torch.tensor([tokens]), feats, steps=3)
    n = len(tokens) - 1

    def serve(real: int, own: list[torch.Tensor]) -> torch.Tensor:
        """The cached draft's view: real positions 0..real-1, then own states fed one per step."""
        ids = tokens[1 : real + 1 + len(own)]
        hidden = torch.cat([draft.fuse(feats[:, :real])] + [o[None, None] for o in own], dim=1)
        m = hidden.shape[1]
        mask = torch.ones(m, m, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            return draft.step(torch.tensor([ids]), hidden, torch.arange(m)[None], attention_mask=mask)[0, -1]

    assert [s.shape[1] for s in states] == [n - 1, n - 2, n - 3]
    for p in range(n - 3):
        s0 = serve(p + 1, [])
        torch.testing.assert_close(states[0][0, p], s0)
        s1 = serve(p + 1, [states[0][0, p]])
        torch.testing.assert_close(states[1][0, p], s1)
        torch.testing.assert_close(states[2][0, p], serve(p + 1, [states[0][0, p], states[1][0, p]]))


def assert_serves_losslessly(target, draft, prompts: list[list[int]], max_tokens: int, max_batch: int):
    """The trained draft (cast to float64) at fixed:3 gives the target's own greedy text; returns the requests."""
    engine = Engine(ModelWorker(target, "target"), draft_worker(draft.cast_own(torch.float64)), IdTokenizer(),
                    EngineConfig(policy="fixed:3", max_batch_size=max_batch), eos_ids=set())
    reqs = [engine.submit(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    engine.run(reqs)
    ref = [target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=max_tokens, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
           for p in prompts]
    assert [r.output_ids for r in reqs] == ref
    return reqs


@pytest.fixture(scope="module")
def tiny_data():
    tok = make_tokenizer()
    target = tiny_llama(len(tok), 2, seed=0, dtype=torch.float32)
    with torch.no_grad():  # a peaked teacher (random tiny models are nearly uniform): there is something to learn
        target.lm_head.weight.mul_(30)
    rng = random.Random(0)
    prompts = [[rng.randrange(7, len(tok)) for _ in range(rng.randint(3, 8))] for _ in range(48)]
    data = continue_prompts(target, prompts, 20, 8, 0.0, 0, None, feature_layers=LAYERS)
    return target, tok, data


def test_generation_data_carries_the_targets_features_at_every_position_but_the_last(tiny_data):
    target, _, data = tiny_data
    for d in data[:6]:
        assert d["feat"].shape == (len(d["ids"]) - 1, 3 * 32) and d["feat"].dtype == torch.bfloat16
        torch.testing.assert_close(d["feat"].float(), target_features(target, d["ids"][:-1]).float(), rtol=2e-2, atol=2e-2)


def test_training_lifts_agreement_and_the_trained_draft_stays_lossless(tiny_data, tmp_path):
    target, _, data = tiny_data
    target = target.double()
    draft = Eagle3Draft.from_target(target, token_set(data, 20, set()), LAYERS).cast_own(torch.float32)
    history = train_eagle3(draft, data, epochs=20, batch_size=8, lr=5e-3, seed=0, steps=3, ckpt=tmp_path / "ck.pt")
    assert history[-1]["loss"] < history[0]["loss"] * 0.8
    assert history[-1]["agree"][0] > history[0]["agree"][0] and history[-1]["agree"][0] > 0.3
    again = train_eagle3(Eagle3Draft.from_target(target, token_set(data, 20, set()), LAYERS).cast_own(torch.float32), data, epochs=20,
                         batch_size=8, lr=5e-3, seed=0, steps=3, ckpt=tmp_path / "ck.pt")
    assert again == history  # resumed from the checkpoint, nothing retrained
    reqs = assert_serves_losslessly(target, draft, [d["ids"][: d["start"]] for d in data[:5]], 16, max_batch=3)
    accepted = sum(r.stats.accepted for r in reqs) / sum(r.stats.steps for r in reqs)
    assert accepted > 0.5  # tokens accepted per step: the trained head drafts from the target's features


def test_batches_pad_with_zero_mass(tiny_data):
    _, _, data = tiny_data
    ids, feats, t_idx, t_p = next(eagle_batches(data, 4, random.Random(0)))
    lens = (t_p.sum(-1) > 0).sum(1)
    assert feats.shape[:2] == t_p.shape[:2] == (4, ids.shape[1] - 1)
    assert all(feats[b, n:].abs().sum() == 0 for b, n in enumerate(lens.tolist()))


def test_distill_method_eagle3_writes_a_head_that_serves_losslessly(tmp_path, capsys):
    """`specserve distill --method eagle3` end to end on a tiny target: data with features, training,
    the draft directory; `generate --draft DIR` then gives the target's own greedy text."""
    import json

    from serve_app.cli import main
    from tests.test_self_prompts import WORDS

    tok = make_tokenizer(WORDS)
    target_dir = tmp_path / "target"
    tiny_llama(len(tok), 2, seed=0, dtype=torch.float32, eos=tok.eos_token_id).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    out = tmp_path / "eagle"
    args = ["distill", "--method", "eagle3", "--target", str(target_dir), "--out", str(out), "--tokens", "16",
            "--max-tokens", "6", "--prompts", "8", "--samples", "0", "--epochs", "1", "--batch-size", "4"]
    assert main(args) == 2  # two decoder layers: no default feature layers
    assert "no default EAGLE-3 feature layers" in capsys.readouterr().err
    assert main(args + ["--feature-layers", "0,1"]) == 2
    assert "three layers" in capsys.readouterr().err
    assert main(args + ["--feature-layers", "0,1,2", "--steps", "2"]) == 0
    meta = json.loads((out / "specserve_draft.json").read_text())
    assert meta["format"] == "specserve-eagle3-draft/1" and meta["feature_layers"] == [0, 1, 2]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the cat sat"}\n{"prompt": "a dog ran to the"}\n')
    texts = {}
    for draft in ("none", str(out)):
        dest = tmp_path / f"{len(texts)}.jsonl"
        assert main(["generate", "--target", str(target_dir), "--draft", draft, "--policy", "fixed:3", "--dtype", "float32",
                     "--max-tokens", "12", "--prompts", str(prompts), "--out", str(dest)]) == 0
        texts[draft] = [json.loads(line)["text"] for line in dest.read_text().splitlines()]
    assert len(texts["none"]) == 2 and texts[str(out)] == texts["none"]
