"""Distillation on tiny models: the loss falls, the draft stays lossless, bad draft dirs fail clearly."""

import json

import pytest
import torch

from conftest import IdTokenizer, make_tokenizer, tiny_llama
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting.distill import continue_prompts, distill, make_data, seed_prompts
from serve_app.drafting.layers import CONFIG_FILE, WEIGHTS_FILE, load_draft_dir
from serve_app.models import load_draft
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker


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
    assert meta["samples"] == 1 and meta["generated_tokens"] > 48 * 2  # greedy and sampled continuations
    assert meta["data_seconds"] >= 0 and meta["train_seconds"] >= 0 and meta["torch_threads"] >= 1  # the cost, on record
    with pytest.raises(ValueError, match="use those settings"):  # data made otherwise is never mixed in
        make_data(target, tok, seed_prompts(0)[:48], 1, 0.8, 12, 8, 16, 0, out / "work" / "data")


def test_generation_labels_every_position_with_the_targets_own_distribution():
    tok = make_tokenizer()
    target = tiny_llama(len(tok), 2, seed=1)  # float64: padded batch and single forwards agree
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    greedy = continue_prompts(target, prompts, 10, 4, 0.0, 0, None)
    for p, d in zip(prompts, greedy):
        ids = torch.tensor([p])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        assert d["ids"] == ref[0].tolist() and d["start"] == len(p)
        # The labels gathered while generating are what one teacher forward over the text gives.
        full = target(torch.tensor([d["ids"]])).logits[0, :-1].softmax(-1).topk(4)
        assert d["idx"].shape == (len(d["ids"]) - 1, 4)
        assert torch.equal(d["idx"].long(), full.indices)
        assert torch.allclose(d["p"].double(), full.values, atol=2e-3)
    # Stops each prompt at the end-of-sequence token (kept as its last token); finished rows leave
    # the batch while the others go on unchanged.
    eos = greedy[0]["ids"][len(prompts[0]) + 2]
    stopped = continue_prompts(target, prompts, 10, 4, 0.0, 0, eos)
    for p, d, g in zip(prompts, stopped, greedy):
        out = g["ids"][len(p):]
        out = out[: out.index(eos) + 1] if eos in out else out
        assert d["ids"] == p + out and torch.equal(d["idx"], g["idx"][: len(d["ids"]) - 1])
    assert len(stopped[0]["ids"]) <= len(prompts[0]) + 3 < len(greedy[0]["ids"])
    assert max(len(d["ids"]) - len(p) for p, d in zip(prompts, stopped)) > 3  # others went on without it
    a, b, c = (continue_prompts(target, prompts, 10, 4, 1.0, 0, None, seed=s) for s in (7, 7, 8))
    assert [d["ids"] for d in a] == [d["ids"] for d in b]  # seeded
    assert [d["ids"] for d in a] != [d["ids"] for d in c] != [d["ids"] for d in greedy]


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


def test_seed_prompts_are_varied_and_reproducible():
    prompts = seed_prompts(0)
    assert len(prompts) >= 600 and len(set(prompts)) == len(prompts)
    assert any("Python" in p for p in prompts) and any("story" in p for p in prompts)
    assert seed_prompts(0) == prompts and seed_prompts(1) != prompts


def test_fingerprint_survives_a_dtype_change(distilled):
    from serve_app.drafting.layers import target_fingerprint

    target = distilled[0]
    import copy

    assert target_fingerprint(copy.deepcopy(target).to(torch.bfloat16)) == target_fingerprint(target)


def test_a_redistilled_draft_gets_another_name_so_old_profiles_do_not_match(distilled, tmp_path):
    from serve_app.drafting.layers import save_draft
    from serve_app.models import display_name

    target, tok, out, meta = distilled
    name = display_name(str(out))
    assert name.startswith(out.name + "@") and len(name) == len(out.name) + 9  # name@8 hex digits
    draft = load_draft(str(out), target, tok)
    with torch.no_grad():
        draft.head.weight.mul_(1.01)  # what another training run in the same directory would leave
    again = tmp_path / out.name
    save_draft(draft, target, again, meta)
    assert display_name(str(again)) != name and display_name(str(again)).startswith(out.name + "@")


def test_bench_forward_latency_reads_a_reduced_vocabulary_draft(distilled):
    """`bench engine` times the draft's single-token forward: it must work on the distilled kind too."""
    from serve_app.bench.engine import forward_ms

    target, _, out, _ = distilled
    assert forward_ms(load_draft_dir(out, target), context=8, reps=2) > 0
