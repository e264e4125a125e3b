"""Predicted Outputs: the client's prediction drafted from directly, re-aligned after an edit; the output is
the same as without it (greedy identical, seeded text the same, sampling exact) in fewer target steps."""

import pytest
import torch

from conftest import IdTokenizer, assert_marginals, exact_marginals, sharp_pair
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.ngram import NgramDraft
from serve_app.engine.predicted_output import PredictedOutput
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

PROMPTS = [[1, 2, 3], list(range(10, 40)), [7, 8], [42, 43]]


def make_engine(target, draft=None, policy="none", **cfg):
    return Engine(ModelWorker(target, "target"), draft_worker(draft) if draft is not None else None, IdTokenizer(),
                  EngineConfig(policy=policy, **cfg), eos_ids=set())


def run(engine, prompts, predictions, **params):
    reqs = [engine.submit(p, SamplingParams(predicted_output=pred, **params)) for p, pred in zip(prompts, predictions)]
    engine.run(reqs)
    return reqs


def edited(out: list[int], at: int, vocab: int = 97) -> list[int]:
    """A prediction that is the output with one token replaced and one inserted (an edit the answer undoes)."""
    pred = list(out)
    pred[at] = (pred[at] + 1) % vocab
    return pred[: at + 5] + [(pred[at + 5] + 2) % vocab] + pred[at + 5 :]


def test_prediction_follows_the_output_and_realigns_after_an_edit():
    p = PredictedOutput([5, 6, 7, 8, 9, 10, 11, 12])
    assert p.propose(3) == [5, 6, 7]
    p.advance([5, 6], 2)
    assert p.propose(10) == [7, 8, 9, 10, 11, 12]
    p.advance([5, 6, 99], 1)  # the edit: lost
    assert p.propose(4) == []
    p.advance([5, 6, 99, 8], 1)  # one token, right after where it was: found again
    assert p.propose(2) == [9, 10]
    p.advance([5, 6, 99, 8, 9, 10, 11, 12], 4)
    assert p.propose(4) == []  # the prediction is used up
    assert p.usage() == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2}  # 7 replaced; 8 re-aligned
    far = PredictedOutput(list(range(100)))
    far.advance([0, 1, 500], 3)
    far.advance([0, 1, 500, 60], 1)  # a single token far from the alignment does not re-align
    assert far.propose(2) == []
    far.advance([0, 1, 500, 60, 61], 1)  # two do, anywhere
    assert far.propose(2) == [62, 63]


@pytest.mark.parametrize("kind", [None, "near", "eagle3", "ngram"])
def test_greedy_output_is_identical_with_a_prediction_in_fewer_target_steps(tiny_target, tiny_drafts, kind):
    """Rows drafting from their prediction skip the draft model's forwards; it catches up on them later (EAGLE-3
    from the target's features of those positions)."""
    draft = {"eagle3": lambda: Eagle3Draft.from_target(tiny_target, torch.arange(0, 97, 3), [0, 1, 2]),
             "ngram": NgramDraft, None: lambda: None}.get(kind, lambda: tiny_drafts[kind])()
    policy = "fixed:2" if kind else "none"
    plain = run(make_engine(tiny_target, draft, policy, max_batch_size=4), PROMPTS, [[]] * 4, max_tokens=40)
    outs = [r.output_ids for r in plain]
    preds = [edited(outs[0], 10), outs[1], [], edited(outs[3], 3)[:25]]  # one row without a prediction
    engine = make_engine(tiny_target, draft, policy, max_batch_size=4, max_predicted_tokens=16)
    steps = []
    engine.on_step.append(lambda st: st.batch_size and steps.append(st))
    reqs = run(engine, PROMPTS, preds, max_tokens=40)
    assert [r.output_ids for r in reqs] == outs
    assert reqs[1].stats.steps <= 4 < plain[1].stats.steps  # an exact prediction: 16 tokens a step
    assert reqs[0].stats.steps * 2.5 <= plain[0].stats.steps if not kind else reqs[0].stats.steps < plain[0].stats.steps
    assert reqs[1].stats.accepted_prediction_tokens == 40 and reqs[1].stats.rejected_prediction_tokens == 0
    assert reqs[2].stats.accepted_prediction_tokens == 0
    assert any(st.predicted for st in steps) and all(st.k <= 2 for st in steps)  # the policy's k stays its own


def test_seeded_text_is_the_same_with_a_prediction(tiny_target, tiny_drafts):
    params = dict(max_tokens=24, temperature=0.9, seed=7)
    [alone] = run(make_engine(tiny_target), PROMPTS[:1], [[]], **params)
    pred = edited(alone.output_ids, 8)
    [with_pred] = run(make_engine(tiny_target, tiny_drafts["near"], "fixed:3"), PROMPTS[:1], [pred], **params)
    assert with_pred.output_ids == alone.output_ids and with_pred.stats.accepted_prediction_tokens > 10


def test_sampling_stays_exact_with_a_prediction():
    """Tokens 2 and 3 drafted from a prediction (a one-hot q) keep the target's marginals."""
    vocab, trials = 6, 3000
    target, draft = sharp_pair(vocab, 40)
    prompt = [1, 2, 3]
    t2, t3 = exact_marginals(target, prompt, vocab)
    engine = make_engine(target, draft, "fixed:1", max_batch_size=64, max_num_tokens=100_000)
    reqs = [engine.submit(prompt, SamplingParams(max_tokens=3, temperature=1.0, predicted_output=[i % vocab, 2, 3]))
            for i in range(trials)]
    engine.run(reqs)
    assert sum(r.stats.accepted_prediction_tokens for r in reqs) > 0.05 * trials
    assert_marginals(reqs, t2, t3, vocab)


def test_a_prediction_longer_than_max_tokens_drafts_only_what_is_left(tiny_target):
    engine = make_engine(tiny_target, max_batch_size=2)
    [plain] = run(engine, [[1, 2, 3]], [[]], max_tokens=6)
    drafted = []
    engine.on_step.append(lambda st: drafted.append(st.predicted))
    [r] = run(engine, [[1, 2, 3]], [plain.output_ids + list(range(5, 90))], max_tokens=6)
    assert r.output_ids == plain.output_ids and max(drafted) == 6 - 1 - 1  # the first token came from prefill


def test_a_prediction_past_the_context_limit_is_refused(tiny_target):
    engine = make_engine(tiny_target, max_model_len=64)
    with pytest.raises(ValueError, match="prediction has 65 tokens"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=4, predicted_output=[5] * 65))
