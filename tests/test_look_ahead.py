"""A target that looks ahead (runs the next plain decoding step before it is asked) decides exactly what it would
have decided when asked, and undoes the step without a trace when something else is asked instead."""

import torch

from serve_app.config import SamplingParams
from serve_app.engine.worker import ModelWorker, Proposal

PROMPTS = {"greedy": [5, 9, 2, 7, 11, 3], "sampled": [8, 1, 4, 4, 6], "seeded": [2, 3, 12, 5, 9, 1, 7],
           "logprobs": [6, 6, 1, 10]}
PARAMS = {"greedy": SamplingParams(max_tokens=64), "sampled": SamplingParams(max_tokens=64, temperature=1.0),
          "seeded": SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=3),
          "logprobs": SamplingParams(max_tokens=64, logprobs=2)}


def _script(ids: list[str]) -> list[tuple]:
    """(op, args) in the order an engine could send them: plain steps (which a look-ahead answers), a step with
    drafts, a removal, an admission whose prefill shares the step (each of which the look-ahead must undo)."""
    rows = len(ids)
    # each draft token with q = 0.6 on it and 0.4 on another (what a sampled row's rejection test reads)
    drafts = Proposal(torch.tensor([[7, 3]] * rows), torch.tensor([[[0.6, 0.4]] * 2] * rows),
                      torch.tensor([[[7, 1], [3, 1]]] * rows, dtype=torch.int32))
    rest = [i for i in ids if i != "sampled"]
    return [("verify", (ids, Proposal.empty(rows), None)), ("verify", (ids, Proposal.empty(rows), None)),
            ("verify", (ids, drafts, None)), ("verify", (ids, Proposal.empty(rows), None)),
            ("remove", (["sampled"],)), ("verify", (rest, Proposal.empty(len(rest)), None)),
            ("add", (["late"], [[4, 2, 9]], [SamplingParams(max_tokens=64)])),
            ("verify", (rest, Proposal.empty(len(rest)), {"late": 3})),
            ("verify", (rest + ["late"], Proposal.empty(len(rest) + 1), None)),
            ("verify", (rest + ["late"], Proposal.empty(len(rest) + 1), None))]


def _run(model, look: bool) -> tuple[list, int]:
    """Every verdict of the script (after the prompts' prefill) and how many were answered from a look-ahead."""
    w = ModelWorker(model, "target")
    w.rng.manual_seed(0)
    ids = list(PROMPTS)
    w.add(ids, list(PROMPTS.values()), list(PARAMS.values()))
    w.verify([], Proposal.empty(0), {i: len(p) for i, p in PROMPTS.items()})
    out = []
    for op, args in _script(ids):
        if op != "verify":
            w.drop_ahead()  # what the actor's host does before any other call
            getattr(w, op)(*args)
            continue
        verdict = w.verify(*args)
        out.append((verdict.num_accepted, verdict.next_tokens, verdict.logprobs))
        if look:
            assert w.look_ahead(args[0])
    w.drop_ahead()
    tokens = {sid: list(s.tokens) for sid, s in w.seqs.items()}
    kv = {sid: s.kv_len for sid, s in w.seqs.items()}
    return out + [tokens, kv, w.cache.held_blocks()], w.ahead_used


def test_a_looked_ahead_step_decides_as_if_asked_and_undoes_cleanly(tiny_target):
    plain, _ = _run(tiny_target, look=False)
    ahead, hits = _run(tiny_target, look=True)
    assert ahead == plain  # greedy, unseeded and seeded sampling, logprobs: the same tokens; rows and KV as left
    assert hits == 3  # the plain steps that followed a step of the same rows (the 2nd, 4th, 8th); the rest undone


def test_a_grammar_row_is_never_looked_ahead(tiny_target):
    w = ModelWorker(tiny_target, "target")
    w.add(["g"], [[3, 4, 5]], [SamplingParams(max_tokens=8)])
    w.verify([], Proposal.empty(0), {"g": 3})
    w.seqs["g"].extra["guide"] = object()  # a grammar's state cannot be rewound
    assert not w.look_ahead(["g"]) and w.ahead is None
    assert not w.look_ahead(["unknown"])
