"""Distillation on tiny models: the loss falls, the draft stays lossless, bad draft dirs fail clearly."""

import json

import pytest
import torch

from conftest import IdTokenizer, make_tokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.distill import distill, seed_prompts
from serve_app.draft import CONFIG_FILE, WEIGHTS_FILE, load_draft_dir
from serve_app.models import load_draft
from serve_app.scheduler import Engine
from serve_app.worker import ModelWorker


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    tok = make_tokenizer()
    target = tiny_llama(len(tok), 2, seed=0, dtype=torch.float32)  # no EOS id: HF's reference then never masks it
    meta = distill(target, tok, "tiny", str(out), num_layers=1, num_tokens=12, num_prompts=48, max_tokens=24,
                   epochs=4, batch_size=8, lr=3e-3, seed=0, gen_batch_size=16, teacher_top=8)
    return target, tok, out, meta


def test_loss_falls_and_files_hold_only_the_drafts_own_weights(distilled):
    target, _, out, meta = distilled
    assert meta["losses"][-1] < meta["losses"][0] * 0.9
    assert (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file()
    from safetensors.torch import load_file

    keys = load_file(str(out / WEIGHTS_FILE)).keys()
    assert "token_ids" in keys and "head.weight" in keys
    assert not any("embed_tokens" in k for k in keys)  # shared with the target, not stored


def test_rerun_resumes_instead_of_starting_over(distilled):
    target, tok, out, meta = distilled
    again = distill(target, tok, "tiny", str(out), num_layers=1, num_tokens=12, num_prompts=48, max_tokens=24,
                    epochs=4, batch_size=8, lr=3e-3, seed=0, gen_batch_size=16, teacher_top=8)
    assert again["losses"] == meta["losses"]  # data and checkpoint were reused


def test_reduced_vocab_draft_is_lossless(distilled):
    target, tok, out, _ = distilled
    draft = load_draft(str(out), target, tok)
    assert 1 <= draft.token_ids.numel() <= 12  # at most N: the tiny target uses few distinct tokens
    logits = draft(torch.tensor([[5, 6, 7]])).logits
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[draft.token_ids] = False
    assert torch.isinf(logits[..., outside]).all()  # the draft proposes only inside its token set
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    ref = []
    for p in prompts:
        ids = torch.tensor([p])
        ref.append(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False)[0, len(p):].tolist())
    for params in (SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3)):
        engine = Engine(ModelWorker(target, "target"), ModelWorker(draft, "draft"), IdTokenizer(),
                        EngineConfig(policy="fixed:3", max_batch_size=2), eos_ids=set())
        reqs = [engine.submit(p, params) for p in prompts]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref
        assert sum(r.stats.accepted for r in reqs) > 0


def test_missing_corrupt_and_foreign_drafts_fail_clearly(distilled, tmp_path):
    target, tok, out, _ = distilled
    with pytest.raises(FileNotFoundError, match="not a specserve draft"):
        load_draft_dir(tmp_path, target)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / CONFIG_FILE).write_text("{oops")
    with pytest.raises(ValueError, match="corrupt"):
        load_draft_dir(bad, target)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    (bad / CONFIG_FILE).write_text(json.dumps(cfg))
    (bad / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="corrupt model.safetensors"):
        load_draft_dir(bad, target)
    other = tiny_llama(len(tok), 2, seed=9, dtype=torch.float32)
    with pytest.raises(ValueError, match="made for another target"):
        load_draft_dir(out, other)


def test_seed_prompts_are_varied_and_unseen_by_the_benchmark():
    from serve_app.bench import BENCH_PROMPTS

    prompts = seed_prompts(0)
    assert len(prompts) >= 600 and len(set(prompts)) == len(prompts)
    assert not set(prompts) & set(BENCH_PROMPTS)
    assert any("Python" in p for p in prompts) and any("story" in p for p in prompts)
    assert seed_prompts(0) == prompts and seed_prompts(1) != prompts


def test_fingerprint_survives_a_dtype_change(distilled):
    from serve_app.draft import target_fingerprint

    target = distilled[0]
    import copy

    assert target_fingerprint(copy.deepcopy(target).to(torch.bfloat16)) == target_fingerprint(target)
