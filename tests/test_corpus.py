"""The draft's training corpus (`specserve corpus grow`) and EAGLE-3 training from it, on tiny models:
the stored text is the target's own (greedy continuations equal `generate`), runs resume to the same
corpus, nothing repeats; the teacher-forced batches carry the served features and the exact teacher
distribution over the token set; training lifts agreement, resumes mid-epoch, and the draft stays lossless."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import make_tokenizer, tiny_llama
from test_eagle3 import target_features
from test_eagle3_train import assert_serves_losslessly
from serve_app.drafting.corpus import CorpusSettings, grow, load_corpus, read_manifest
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.eagle3_corpus import corpus_token_set, epoch_batches, teacher, train_from_corpus
from serve_app.models import LoadedModels

SMALL = CorpusSettings(self_prompts=8, seed_prompts=3, samples=1, max_tokens=12)
LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    target = tiny_llama(len(tok), 2, seed=0, dtype=torch.float32, eos=tok.eos_token_id)
    with torch.no_grad():  # a peaked model: its text has structure a draft can learn
        target.lm_head.weight.mul_(8)
    return LoadedModels(target, None, tok, "tiny", "none")


@pytest.fixture(scope="module")
def corpus(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    grow(models, out, tokens=10**9, settings=SMALL, max_batch=8, max_rounds=3)
    return out


def test_the_corpus_is_the_targets_own_text_with_provenance(models, corpus):
    seqs = load_corpus(corpus)
    manifest = read_manifest(corpus)
    assert manifest["rounds"] == 3 and manifest["totals"]["sequences"] == len(seqs) > 10
    assert manifest["totals"]["generated_tokens"] == sum(len(s.ids) - s.prompt_len for s in seqs)
    assert manifest["runs"][0]["tokens_per_s"] > 0
    assert {s.meta["mode"] for s in seqs} == {"greedy", "sampled"}
    assert {s.meta["source"].split(":")[0] for s in seqs} == {"self", "seed"}
    assert all(s.ids.dtype == np.uint16 for s in seqs)
    greedy = [s for s in seqs if s.meta["mode"] == "greedy"][:6]
    for s in greedy:  # a greedy continuation is exactly what the target alone generates
        prompt = torch.from_numpy(s.ids[: s.prompt_len].astype(np.int64))[None]
        ref = models.target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=SMALL.max_tokens,
                                     do_sample=False)[0, s.prompt_len :].tolist()
        assert s.ids[s.prompt_len :].tolist() == ref[: len(s.ids) - s.prompt_len]
    keys = [bytes(s.ids) for s in seqs]
    assert len(set(keys)) == len(keys)  # no sequence twice
    greedy_prompts = [s.meta["key"] for s in seqs if s.meta["mode"] == "greedy"]
    assert len(set(greedy_prompts)) == len(greedy_prompts)  # no prompt twice


def test_a_resumed_run_grows_the_same_corpus(models, corpus, tmp_path):
    grow(models, tmp_path, tokens=10**9, settings=SMALL, max_batch=8, max_rounds=2)
    grow(models, tmp_path, tokens=10**9, settings=SMALL, max_batch=5, max_rounds=1)  # another batch: same text
    assert [s.ids.tolist() for s in load_corpus(tmp_path)] == [s.ids.tolist() for s in load_corpus(corpus)]
    assert len(read_manifest(tmp_path)["runs"]) == 2
    with pytest.raises(ValueError, match="grown with"):
        grow(models, tmp_path, tokens=1, settings=dataclasses.replace(SMALL, max_tokens=13))


def test_teacher_batches_carry_the_served_features_and_the_exact_teacher(models, corpus):
    target = models.target
    seqs = load_corpus(corpus)
    tokens = corpus_token_set(seqs, 20, {models.tokenizer.eos_token_id})
    head = target.lm_head.weight[tokens]
    chunk = seqs[:4]
    ids, feats, p, valid = teacher(target, chunk, LAYERS, head, 1024, generated_only=False)
    for b, s in enumerate(chunk):
        n = len(s.ids)
        torch.testing.assert_close(feats[b, : n - 1].float(), target_features(target, s.ids[:-1].tolist()).float(),
                                   rtol=2e-2, atol=2e-2)
        with torch.no_grad():
            full = target(torch.from_numpy(s.ids.astype(np.int64))[None]).logits[0, :-1].softmax(-1)[:, tokens]
        torch.testing.assert_close(p[b, : n - 1], full / full.sum(-1, keepdim=True), rtol=1e-4, atol=1e-5)
        assert valid[b].sum() == n - 1
    _, _, _, gen_only = teacher(target, chunk, LAYERS, head, 1024, generated_only=True)
    assert [int(v.sum()) for v in gen_only] == [len(s.ids) - s.prompt_len for s in chunk]


def test_epoch_batches_cover_every_sequence_once_within_the_token_budget(corpus):
    seqs = load_corpus(corpus)
    batches = epoch_batches(seqs, 64, 1024, seed=0, epoch=1)
    assert sorted(j for b in batches for j in b) == list(range(len(seqs)))
    assert all(len(b) == 1 or len(b) * max(len(seqs[j].ids) for j in b) <= 64 for b in batches)
    assert batches == epoch_batches(seqs, 64, 1024, seed=0, epoch=1) != epoch_batches(seqs, 64, 1024, seed=0, epoch=2)


def test_training_from_the_corpus_lifts_agreement_resumes_and_serves_losslessly(models, corpus, tmp_path):
    target = models.target.double()
    seqs = load_corpus(corpus)
    tokens = corpus_token_set(seqs, 24, {models.tokenizer.eos_token_id})

    def fresh():
        return Eagle3Draft.from_target(target, tokens, LAYERS).cast_own(torch.float32)

    draft = fresh()
    history = train_from_corpus(draft, target, seqs, epochs=12, batch_tokens=96, lr=5e-3, seed=0, ckpt=tmp_path / "a.pt")
    # the loss is a cross-entropy against a wide teacher (its entropy is most of it): agreement is the signal
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["agree"][0] > max(0.5, history[0]["agree"][0] + 0.2)
    # stopped by its deadline after the first checkpoint, then resumed: the same weights as one run
    half = fresh()
    train_from_corpus(half, target, seqs, epochs=12, batch_tokens=96, lr=5e-3, seed=0, ckpt=tmp_path / "b.pt",
                      ckpt_every=5, deadline=0.0)
    assert torch.load(tmp_path / "b.pt", weights_only=False)["done"] == 5
    resumed = fresh()
    train_from_corpus(resumed, target, seqs, epochs=12, batch_tokens=96, lr=5e-3, seed=0, ckpt=tmp_path / "b.pt",
                      ckpt_every=5)
    for a, b in zip(draft.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert_serves_losslessly(target, draft, [s.ids[: s.prompt_len].tolist() for s in seqs[:4]], 12, max_batch=4)


def test_cli_corpus_grow_and_show(tmp_path, capsys):
    from serve_app.cli import main

    tok = make_tokenizer()
    target_dir = tmp_path / "target"
    tiny_llama(len(tok), 2, seed=0, dtype=torch.float32, eos=tok.eos_token_id).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    out = tmp_path / "c"
    assert main(["corpus", "grow", "--target", str(target_dir), "--dtype", "float32", "--out", str(out),
                 "--tokens", "50", "--max-batch", "16"]) == 0
    assert "generated tokens" in capsys.readouterr().out
    assert main(["corpus", "show", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["totals"]["generated_tokens"] >= 50 and shown["rounds"] >= 1
    assert main(["corpus", "show", str(tmp_path / "nothing")]) == 2


def test_epochs_of_different_batch_counts_are_each_read_whole(models):
    """An epoch's shuffle groups sequences differently, so epochs can differ in batch count: each is read whole."""
    from serve_app.drafting.corpus import Sequence

    rng = np.random.default_rng(0)
    vocab = models.target.config.vocab_size
    seqs = [Sequence(rng.integers(3, vocab, size=int(n)).astype(np.uint16), 2, {}) for n in rng.integers(4, 40, 300)]
    budget = next(bt for bt in range(40, 2000, 7)
                  if len({len(epoch_batches(seqs, bt, 1024, 0, e)) for e in range(3)}) > 1)
    sizes = [len(epoch_batches(seqs, budget, 1024, 0, e)) for e in range(3)]
    target = models.target.double()
    draft = Eagle3Draft.from_target(target, torch.arange(3, vocab), LAYERS).cast_own(torch.float32)
    history = train_from_corpus(draft, target, seqs, epochs=3, batch_tokens=budget, lr=1e-3, seed=0)
    assert [h["steps"] for h in history] == sizes
