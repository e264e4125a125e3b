"""The suffix history (`engine.history`): drafts copied from earlier requests' outputs, scoped by tenant.

The history itself (matches, votes, tenants, its bound), then through the engine with tiny models: greedy
identical to the target alone, seeded text unchanged, sampling exact, and one tenant's traffic leaving
another's drafts untouched."""

import random

import numpy as np
import pytest
import torch

from conftest import IdTokenizer, sharp_pair
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting import draft_worker
from serve_app.engine.draftplan import DraftPlan
from serve_app.engine.history import RESYNC_WINDOW, SEPARATOR, LiveOutputs, SuffixHistory, history_estimate
from serve_app.engine.lookup import CopyRecord, NgramIndex
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker
from test_engine import reference
from test_per_row import Fixed


# ---- the history ---------------------------------------------------------------------------------
def test_match_proposes_the_continuation_most_earlier_outputs_took():
    h = SuffixHistory(4096)
    body = list(range(100, 140))
    for tail in ([1, 2, 3], [1, 2, 3], [7, 8, 9]):  # two of three earlier outputs went on 1, 2, 3
        h.add(body[:20] + tail, prompt=[5, 5])
    m = h.match(body[:20], 3)
    assert m.tokens == [1, 2, 3] and m.votes == [2, 2, 2] and m.voters == [3, 2, 2]
    assert m.length >= 8 and m.share == pytest.approx(2 / 3)
    assert h.match(body[:10], 6).tokens == body[10:16]  # the middle of a document: every output agrees
    assert h.match([5, 5] + body[:4], 2).tokens == body[4:6]  # the prompt's tail anchors the answer's start
    assert h.match([9, 9, 9, 9], 4) is None  # never seen
    # a continuation stops at its document's end: nothing crosses into the next one
    assert h.match(body[:20] + [7, 8, 9], 4) is None
    m = h.match(body[14:20] + [1, 2], 4)
    assert m.tokens == [3] and SEPARATOR not in m.tokens


def test_tenants_see_only_their_own_outputs():
    h = SuffixHistory(4096)
    secret = list(range(200, 240))
    h.add(secret, tenant="a")
    assert h.match(secret[:12], 4, tenant="a").tokens == secret[12:16]
    assert h.match(secret[:12], 4, tenant="b") is None and h.match(secret[:12], 4) is None
    h.add(secret[:12] + [1, 1, 1, 1], tenant="b")  # b's own output with the same start
    assert h.match(secret[:12], 4, tenant="b").tokens == [1, 1, 1, 1]
    assert h.match(secret[:12], 4, tenant="a").tokens == secret[12:16]


def test_memory_is_bounded_and_the_oldest_outputs_go_first():
    h = SuffixHistory(1024)
    sizes = (h.tokens.nbytes, h.tenant.nbytes, sum(a.nbytes for a in h.head.values()), sum(a.nbytes for a in h.prev.values()))
    rng = random.Random(0)
    first = [rng.randrange(1000, 2000) for _ in range(100)]
    h.add(first)
    assert h.match(first[:20], 4).tokens == first[20:24]
    for _ in range(40):  # 4,000 tokens through a ring of 1,024
        h.add([rng.randrange(3000, 9000) for _ in range(100)])
    assert h.match(first[:20], 4) is None  # overwritten: gone, not matched against newer tokens
    assert len(h) == 1024 and h.documents == 41
    assert sizes == (h.tokens.nbytes, h.tenant.nbytes, sum(a.nbytes for a in h.head.values()),
                     sum(a.nbytes for a in h.prev.values()))
    last = h.tokens[(h.end - 101 + np.arange(100)) % h.capacity].tolist()
    assert h.match(last[:20], 4).tokens == last[20:24]


def test_rows_at_once_match_each_row_alone():
    rng = random.Random(1)
    h = SuffixHistory(1 << 14)
    docs = [[rng.randrange(50) for _ in range(60)] for _ in range(30)]  # a small vocabulary: many partial matches
    for i, d in enumerate(docs):
        h.add(d, tenant=str(i % 3))
    rows = [docs[rng.randrange(30)][: rng.randrange(2, 50)] for _ in range(40)] + [[1], [], [4, 4, 4]]
    tenants = [str(rng.randrange(4)) for _ in rows]
    assert h.match_rows(rows, 5, tenants) == [h.match(r, 5, t) for r, t in zip(rows, tenants)]


def test_estimate_grows_with_the_match_drops_where_outputs_part_and_follows_the_rows_record():
    h = SuffixHistory(4096)
    body = list(range(300, 340))
    h.add(body)
    short, long = h.match(body[:3], 2), h.match(body[:30], 2)
    assert history_estimate(0, 0, long)[0] > history_estimate(0, 0, short)[0]
    assert history_estimate(0, 20, long)[0] < 0.1 and history_estimate(20, 20, short)[0] > 0.9
    for slot in (7, 8, 9):  # a template filled three more times: its slot (the 4th token after the key) differs
        h.add(body[:20] + [1, 2, 3, slot, 4, 5])
    m = h.match(body[:20], 6)
    e = history_estimate(0, 0, m)
    assert m.tokens[:3] == [1, 2, 3] and m.votes[0] == 3 and m.voters[0] == 4  # the body's own output parts at once
    assert e[1] == e[2] > e[0] > e[3] and e[3] < e[2] / 2  # 3 of 4 agree, then all 3, then 1 of 3 at the slot
    good = history_estimate(40, 40, m)  # a row whose copies all landed so far still stops at the slot
    assert good[2] > 0.9 and good[3] < 0.4


def test_the_hash_chains_hold_every_earlier_occurrence_newest_first():
    """`add` indexes a document in one vectorised pass: walking an anchor's chain from its head visits every
    position that follows those tokens in the same tenant's documents, newest first, as a loop over positions
    would have linked them (repeats within one document included)."""
    rng = random.Random(5)
    h = SuffixHistory(4096, anchors=(3,))
    docs = [[rng.randrange(4) for _ in range(rng.randint(2, 40))] for _ in range(30)]
    where: dict[tuple, list[int]] = {}
    for d in docs:
        start = h.end
        h.add(d, tenant="t")
        for i in range(3, len(d)):
            where.setdefault(tuple(d[i - 3 : i]), []).append(start + i)
    tid = np.asarray([h.tenants["t"]])
    for gram, expected in where.items():
        p, seen = int(h.head[3][h._hashes(tid, np.asarray([gram]))[0]]), []
        while p >= 0:
            if tuple(h.tokens[p - 3 : p]) == gram:  # other grams share a hash now and then
                seen.append(p)
            p = int(h.prev[3][p & h.ring_mask])
        assert seen == expected[::-1]


def test_a_slot_counts_every_filling_of_the_template_not_only_the_longest_match():
    """The row's earlier slot agreed with one earlier filling (so that one matches furthest back and leads),
    but at the next slot all four fillings part: the share there is one in four, not one in one."""
    h = SuffixHistory(4096)
    for s, t in zip([50, 51, 52, 53], [60, 61, 62, 63]):
        h.add([10, 11, s, 12, 13, 14, t, 15])
    m = h.match([10, 11, 50, 12, 13, 14], 2)
    assert m.tokens == [60, 15] and m.length == 6
    assert (m.votes[0], m.voters[0]) == (1, 4) and history_estimate(40, 40, m)[0] < 0.3
    exact = SuffixHistory(4096)  # an exact repeat: fillings that match far less far back do not vote it down
    body = list(range(100, 130))
    exact.add(body + [1, 2])
    for t in (3, 4, 5):
        exact.add(body[-3:] + [t])
    assert exact.match(body, 1).share == 1.0


def test_a_row_that_left_an_earlier_output_at_a_slot_picks_it_up_after_the_slot():
    """An extraction template: the row followed an earlier filling up to its slot (a name of its own, 77 78
    where the earlier had 50), then the template goes on. The anchors cannot find that place (the row's last
    tokens are its own slot's), the cursor can: after the slot's end (12) it copies the rest."""
    h = SuffixHistory(4096)
    h.add([10, 11, 50, 12, 13, 14, 60, 15], tenant="a")
    h.add([30, 31, 32], tenant="a")
    start = 0  # the first document's first token sits at absolute position 0
    row = [10, 11, 77, 78, 12]
    assert h.match(row, 4, tenant="a") is None
    m = h.resync_rows([start + 2], [row[-1]], 4, ["a"])[0]  # it left the output at 50 (position 2)
    assert m.tokens == [13, 14, 60, 15] and m.at == start + 4 and m.prior is not None
    assert history_estimate(0, 0, m)[0] == pytest.approx(m.prior)
    # nothing crosses the document's end, another tenant's output is never picked up, no cursor: nothing
    assert h.resync_rows([start + 2], [60], 8, ["a"])[0].tokens == [15]
    assert h.resync_rows([start + 2], [12], 4, ["b"]) == [None]
    assert h.resync_rows([-1], [12], 4, ["a"]) == [None]
    assert h.resync_rows([start + 2], [99], 4, ["a"]) == [None]  # the row's token is not in the window
    far = SuffixHistory(4096)  # the window is bounded: a slot's end further on is not looked for
    far.add([10] + list(range(100, 100 + RESYNC_WINDOW)) + [12, 13], tenant="a")
    assert far.resync_rows([1], [12], 2, ["a"]) == [None]


def test_a_rows_cursor_follows_its_accepted_history_copies_and_expires():
    rec = CopyRecord(NgramIndex(2, 4, [1, 2, 3]))
    rec.copied, rec.from_history, rec.history_at = 4, True, 100
    rec.settle([5, 6, 9])  # two copied tokens accepted, then the target's own: it left the output at 102
    assert (rec.cursor, rec.since) == (102, 1)
    rec.copied, rec.from_history, rec.history_at = 3, True, 200
    rec.settle([7])  # a copy the target refused at once: no text the row followed, the cursor stays
    assert (rec.cursor, rec.since) == (102, 2)
    for _ in range(RESYNC_WINDOW):  # the model's tokens: the slot ran too long to be one, the cursor goes
        rec.settle([8])
    assert rec.cursor == -1


def test_votes_at_a_position_never_outnumber_the_voters_there():
    """Candidates agreeing with the followed continuation through position j are among those still agreeing before
    it: votes <= voters everywhere. Small vocabularies make near-identical continuations; a prefix hash that
    collides (an XOR-multiply one did: [x, 1] and [y, 0] where x's hash and y's differ in the last bit) counted
    candidates that had parted as agreeing again."""
    r = random.Random(0)
    checked = 0
    for _ in range(600):
        vocab = r.choice([3, 5, 20])
        h = SuffixHistory(r.choice([64, 256, 4096]))
        for _ in range(r.randrange(1, 40)):
            h.add([r.randrange(vocab) for _ in range(r.randrange(2, 40))], r.choice(["", "a"]),
                  [r.randrange(vocab) for _ in range(r.randrange(0, 5))])
        ctxs = [[r.randrange(vocab) for _ in range(r.randrange(3, 30))] for _ in range(r.randrange(1, 9))]
        tenants = [r.choice(["", "a", "b"]) for _ in ctxs]
        for m in h.match_rows(ctxs, r.randrange(1, 33), tenants):
            if m is not None:
                checked += 1
                assert all(v <= n for v, n in zip(m.votes, m.voters)), m
                assert all(a >= b for a, b in zip(m.votes, m.votes[1:])), m
    assert checked > 500


def test_running_rows_draft_from_each_others_output_so_far():
    """Row b asks what row a is answering, a few tokens behind it: b's last tokens anchor in a's output so far
    and it copies on as far as a got (further as a commits); never from itself, never across tenants, nothing
    once a is gone, and nothing left behind in the index."""
    live = LiveOutputs(anchor=3)
    a, b = [1, 2, 3, 10, 11, 12, 13, 14], [1, 2, 3, 10, 11]
    live.start("a", "t", a, 3)
    live.start("b", "t", b, 3)
    live.start("c", "u", list(b), 3)  # the same text under another tenant
    m = live.match_rows(["b"], 4)[0]
    assert m.tokens == [12, 13, 14] and m.length == 5 and m.at == -1  # 1 2 3 10 11 agree; a has 3 more
    a.append(15)
    live.extend("a")
    assert live.match_rows(["b"], 8)[0].tokens == [12, 13, 14, 15]
    assert live.match_rows(["a", "c"], 4) == [None, None]  # a's own suffix is prompt lookup's; c sees only u's rows
    b += [12, 99]
    live.extend("b")  # b parted from a: nothing of a follows 12 99
    assert live.match_rows(["b"], 4) == [None]
    for row in ("a", "b", "c"):
        live.stop(row)
    assert not live.index and not live.rows and live.indexed == 0
    small = LiveOutputs(anchor=3, capacity=4)  # memory is bounded: positions past the capacity wait for room
    x, y = [1, 2, 3, 10, 11, 12, 13, 14, 15], [1, 2, 3, 10, 11]
    small.start("x", "t", x, 3)
    small.start("y", "t", y, 3)
    assert small.indexed == 4 and len(small.index) <= 4
    assert small.match_rows(["y"], 8)[0].tokens == [12, 13, 14, 15]  # found at x's indexed position 5
    y += [12, 13]
    small.extend("y")
    assert small.match_rows(["y"], 8) == [None]  # x's position 8 is past the capacity: not indexed


# ---- through the engine ----------------------------------------------------------------------------
PROMPTS = [[1, 2, 3], list(range(10, 40)), [7, 8], [42, 43, 44, 45]]


class Plans:
    """Per-row plans with random caps and prices (rows stop on the draft's confidence)."""

    name = "plans"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def choose(self, state):
        r = self.rng
        return DraftPlan(caps=[r.choice([0, 2, 5, 8]) for _ in range(state.batch_size)],
                         token_value=r.choice([0.0, 0.05, 0.3]))

    def observe(self, stats):
        pass


def history_engine(target, draft, policy, history=4096, shared=False, **cfg):
    return Engine(ModelWorker(target, "target"), draft_worker(draft, 0, True, history, shared), IdTokenizer(),
                  EngineConfig(**cfg), policy=policy, eos_ids=set())


def copies_from_history(engine) -> list[int]:
    """Rows per proposal that drafted from the history (appended as the engine steps)."""
    seen: list[int] = []
    propose = engine.draft.propose

    def watched(ids, k):
        out = propose(ids, k)
        if out.history:
            seen.append(sum(out.history))
        return out

    engine.draft.propose = watched
    return seen


@pytest.mark.parametrize("policy", ["fixed", "plans"])
def test_greedy_identical_with_the_history(tiny_target, tiny_drafts, policy):
    """Every prompt twice, the second round after the first finished: its rows draft from the first round's
    outputs, and the text stays the target's own."""
    ref = reference(tiny_target, PROMPTS, 24)
    engine = history_engine(tiny_target, tiny_drafts["random"], Fixed(6) if policy == "fixed" else Plans(),
                            max_batch_size=3)
    seen = copies_from_history(engine)
    sources: dict[str, list[int]] = {}
    totals = [0, 0]

    def tally(st):
        totals[0], totals[1] = totals[0] + st.proposed, totals[1] + st.accepted
        for src, (proposed, accepted) in st.by_source.items():
            sources.setdefault(src, [0, 0])
            sources[src][0] += proposed
            sources[src][1] += accepted

    engine.on_step.append(tally)
    for _ in range(2):
        reqs = [engine.submit(p, SamplingParams(max_tokens=24)) for p in PROMPTS]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref
    assert seen, "no row drafted from the history"
    assert sources["history"][1] > 0 and [sum(x) for x in zip(*sources.values())] == totals  # every token has a source
    assert sum(r.stats.accepted for r in reqs) > 0.6 * 24 * len(PROMPTS)  # the repeats copy their earlier answers
    assert engine.draft.history.stats()["hits"] > 0


def test_rows_picking_up_an_earlier_output_past_its_slots_stay_exact(tiny_target, tiny_drafts):
    """The history holds each answer with two slots filled otherwise (an extraction template's other filling):
    rows copy it, part at each slot, pick it up again after it (`resync_rows`), and the text is the target's,
    in fewer target steps than with the anchors alone."""
    ref = reference(tiny_target, PROMPTS, 24)
    for policy in (Fixed(6), Plans(3)):
        steps = {}
        for resync in (True, False):
            engine = history_engine(tiny_target, tiny_drafts["random"], policy, max_batch_size=3)
            history = engine.draft.history
            for p, out in zip(PROMPTS, ref):
                other = list(out)
                for i in (6, 14):
                    other[i] = next(t for t in range(97) if t not in out[i - 3:i + 4])  # a filling the target never emits
                history.add(other, "", p)
            picked, resync_rows = [], history.resync_rows

            def watched(cursors, *a, on=resync, **k):
                out = resync_rows(cursors, *a, **k) if on else [None] * len(cursors)
                picked.extend(m for m in out if m is not None)
                return out

            history.resync_rows = watched
            reqs = [engine.submit(p, SamplingParams(max_tokens=24)) for p in PROMPTS]
            engine.run(reqs)
            assert [r.output_ids for r in reqs] == ref
            assert bool(picked) == resync, "no row picked up its earlier output past a slot"
            steps[resync] = sum(r.stats.steps for r in reqs)
        assert steps[True] < steps[False], steps


def test_a_request_behind_another_with_the_same_prompt_copies_its_output_so_far(tiny_target, tiny_drafts):
    """A burst: the same prompt again while its first answer is still running. The second copies the first's
    output so far (`LiveOutputs`; finished outputs are kept out), in fewer target steps than without it; both
    texts are the target's own, greedy and seeded, under a fixed k and per-row plans."""
    prompt, n = PROMPTS[0], 12  # an answer that does not repeat itself: prompt lookup finds nothing in it
    ref = reference(tiny_target, [prompt], n)[0]
    for policy, params in ((Fixed(4), SamplingParams(max_tokens=n)), (Plans(1), SamplingParams(max_tokens=n)),
                           (Plans(2), SamplingParams(max_tokens=n, temperature=0.9, seed=5))):
        steps, outs = {}, {}
        for live in (True, False):
            engine = history_engine(tiny_target, tiny_drafts["random"], policy, max_batch_size=3)
            engine.draft.history.add = lambda *a, **k: None  # finished outputs stay out: the running one alone
            if not live:
                engine.draft.live = None
            first = engine.submit(prompt, params)
            for _ in range(8):
                engine.step()
            assert not first.finished and len(engine.draft.history) == 0
            second = engine.submit(prompt, params)
            engine.run([first, second])
            outs[live] = (first.output_ids, second.output_ids)
            steps[live] = second.stats.steps
            assert (engine.draft.history_stats().get("running_hits", 0) > 0) == live
        assert outs[True] == outs[False] and outs[True][0] == outs[True][1]
        if params.greedy:
            assert outs[True][0] == ref
        assert steps[True] < steps[False], steps


def test_seeded_text_is_the_same_with_the_history(tiny_target, tiny_drafts):
    def run(history):
        engine = history_engine(tiny_target, tiny_drafts["near"], Plans(2), history=history, max_batch_size=3)
        seen = copies_from_history(engine)
        outs = []
        for _ in range(2):
            reqs = [engine.submit(p, SamplingParams(max_tokens=16, temperature=0.9, seed=s)) for s, p in enumerate(PROMPTS)]
            engine.run(reqs)
            outs.append([r.output_ids for r in reqs])
        return outs, seen

    (off, _), (on, seen) = run(0), run(4096)
    assert on == off and seen


def test_history_copies_keep_sampling_exact(monkeypatch):
    """Rows that always copy from the history (one-hot q) still emit the target's marginals."""
    import serve_app.engine.worker as worker_mod

    monkeypatch.setattr(worker_mod, "history_estimate", lambda hits, tries, match: [1.0] * len(match.tokens))
    vocab, trials = 6, 2000
    target, draft = sharp_pair(vocab, 10)
    prompt = [1, 2, 3, 4]

    def dist(prefix):
        with torch.no_grad():
            return target(torch.tensor([prefix])).logits[0, -1].softmax(-1)

    p1 = dist(prompt)
    t2 = sum(p1[a] * dist(prompt + [a]) for a in range(vocab))
    engine = history_engine(target, draft, Fixed(3), max_batch_size=64, max_num_tokens=100_000)
    engine.draft.history.add([5, 0, 1, 2, 3, 4, 5], prompt=[9])  # every request's context [.., 3, 4] matches
    reqs = [engine.submit(prompt, SamplingParams(max_tokens=2, temperature=1.0)) for _ in range(trials)]
    engine.run(reqs)
    assert sum(r.stats.accepted for r in reqs) > 0.05 * trials  # copies were proposed and some accepted
    f1 = torch.bincount(torch.tensor([r.output_ids[0] for r in reqs]), minlength=vocab).double() / trials
    f2 = torch.bincount(torch.tensor([r.output_ids[1] for r in reqs]), minlength=vocab).double() / trials
    assert (f1 - p1).abs().sum() / 2 < 0.04, (f1, p1)
    assert (f2 - t2).abs().sum() / 2 < 0.04, (f2, t2)


def test_one_tenants_traffic_leaves_anothers_drafts_unchanged(tiny_target, tiny_drafts):
    """Tenant a's requests fill the history; tenant b's (same prompts) then draft exactly as on a fresh engine,
    while a's own repeats copy from it. With a shared history (`history_scope: shared`) b copies too."""
    def run(engine, salt):
        reqs = [engine.submit(p, SamplingParams(max_tokens=20, cache_salt=salt)) for p in PROMPTS]
        engine.run(reqs)
        return [(r.output_ids, r.stats.proposed, r.stats.accepted) for r in reqs]

    fresh = run(history_engine(tiny_target, tiny_drafts["random"], Fixed(4), max_batch_size=2), "b")
    engine = history_engine(tiny_target, tiny_drafts["random"], Fixed(4), max_batch_size=2)
    first_a = run(engine, "a")
    assert run(engine, "b") == fresh  # b's acceptance untouched by a's traffic
    again_a = run(engine, "a")
    assert sum(a for _, _, a in again_a) > sum(a for _, _, a in first_a) + 20
    shared = history_engine(tiny_target, tiny_drafts["random"], Fixed(4), shared=True, max_batch_size=2)
    run(shared, "a")
    assert sum(a for _, _, a in run(shared, "b")) > sum(a for _, _, a in fresh) + 20


def test_a_replica_drafts_from_anothers_outputs(tiny_target, tiny_drafts):
    """What the shared store carries between replicas: one draft's remembered outputs (`take_history`) into
    another's (`add_history`); the second then copies the first one's answers."""
    one = history_engine(tiny_target, tiny_drafts["random"], Fixed(4), max_batch_size=2)
    two = history_engine(tiny_target, tiny_drafts["random"], Fixed(4), max_batch_size=2)
    assert one.draft.take_history() == []  # a store starts collecting (without one, nothing is kept for it)
    reqs = [one.submit(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
    one.run(reqs)
    docs = one.draft.take_history()
    assert len(docs) == len(PROMPTS) and one.draft.take_history() == []
    fresh = history_engine(tiny_target, tiny_drafts["random"], Fixed(4), max_batch_size=2)
    cold = [fresh.submit(p, SamplingParams(max_tokens=20)) for p in PROMPTS[2:]]
    fresh.run(cold)
    two.draft.add_history(docs)
    warm = [two.submit(p, SamplingParams(max_tokens=20)) for p in PROMPTS[2:]]
    two.run(warm)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    assert sum(r.stats.accepted for r in warm) > 0.6 * 20 * len(warm) > sum(r.stats.accepted for r in cold) + 5


def test_the_shared_log_hands_each_replica_the_others_outputs_and_stays_bounded():
    from deployments.history_store import HistoryLog

    log = HistoryLog(capacity=100)
    log.push("r1", [("", [1], [2, 3, 4])])
    log.push("r2", [("t", [5], [6, 7])])
    epoch, last, docs, restore = log.pull("r1", 0)  # a first pull (no epoch yet): all but its own
    assert last == 2 and docs == [("t", [5], [6, 7])] and not restore
    assert log.pull("r1", last, epoch) == (epoch, 2, [], False)
    assert len(log.pull(None, 0)[2]) == 2  # r1's draft replaced: it takes its own earlier outputs too
    log.push("r2", [("", [], list(range(30)))] * 4)  # 120 tokens through a log of 100: the oldest go
    assert log.tokens <= 100 and log.pull("r3", 0, epoch)[2] == [("", [], list(range(30)))] * 3
    fresh = HistoryLog(capacity=100)  # the store restarted: a replica's numbers are from the old one
    fresh.push("r2", [("", [], [9, 9])])
    assert fresh.pull("r1", 5, epoch)[2:] == ([("", [], [9, 9])], True)  # and the first to see it restores


def test_a_restarted_store_is_refilled_from_one_replica_and_new_drafts_start_warm():
    """The store lives in memory: when it restarts, the first replica that held the old one hands over its
    draft's whole history (`SuffixHistory.export`); the other warm replicas do not take it again, a new draft
    takes it all, and a history rebuilt from the export drafts the same continuations."""
    from deployments.history_store import HistoryLog

    old = SuffixHistory(capacity=64)
    for i in range(12):  # 12 documents of 8 tokens through a ring of 64: the oldest went, one cut at the wrap
        old.add([100 + i, 7, 8, 9, 10, 11], tenant="ab"[i % 2], prompt=[1, 2])
    docs = old.export()
    assert 0 < len(docs) < 12 and all(len(d[2]) == 8 for d in docs)
    assert docs[-1] == ("b", [], [1, 2, 111, 7, 8, 9, 10, 11])
    copy = SuffixHistory(capacity=64)
    for tenant, prompt, out in docs:
        copy.add(out, tenant, prompt)
    ctx = [5, 1, 2, 111, 7]
    assert copy.match(ctx, 4, "b").tokens == old.match(ctx, 4, "b").tokens == [8, 9, 10, 11]
    assert copy.match(ctx, 4, "a") is None and copy.export() == docs

    log, before = HistoryLog(capacity=1000), "old-epoch"
    log.push("r2", [("a", [], [3, 3, 3])])  # pushed to the new store before anyone noticed
    epoch, last, got, restore = log.pull("r1", 7, before)
    assert restore and got == [("a", [], [3, 3, 3])]
    assert log.pull("r3", 0, before)[3]  # asked too, until a restore lands
    log.restore("r1", docs)
    log.restore("r3", docs[:1])  # a second copy is not taken
    assert log.pull("r2", 0, before)[2:] == ([], False)  # another warm replica: nothing again, and no restore
    assert log.pull(None, 0)[2] == docs + [("a", [], [3, 3, 3])]  # a new draft: all of it, oldest first
    assert log.pull("r1", last, epoch)[2] == []


def test_copies_may_go_past_max_k_and_model_rows_may_not(tiny_target, tiny_drafts):
    """Under a plan a copying row drafts up to `max_copy_tokens` in a step (no draft forward needed), the draft
    model's rows stay within max_k; the text is the target's either way."""
    class Long:
        name = "long"

        def choose(self, state):
            return DraftPlan(caps=[state.max_copy] * state.batch_size, model_depth=8)

        def observe(self, stats):
            pass

    ref = reference(tiny_target, PROMPTS, 40)
    engine = history_engine(tiny_target, tiny_drafts["random"], Long(), max_batch_size=4, max_k=4, max_copy_tokens=12)
    drafted: list[tuple[int, bool]] = []
    engine.on_step.append(lambda st: st.rows and drafted.extend(
        (n, bool(st.rows.lookup and st.rows.lookup[i])) for i, n in enumerate(st.rows.drafted)))
    for _ in range(2):
        reqs = [engine.submit(p, SamplingParams(max_tokens=40)) for p in PROMPTS]
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == ref
    assert max(n for n, copied in drafted if not copied) <= 4
    assert max(n for n, copied in drafted if copied) == 12
