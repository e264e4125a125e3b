"""A failed step loses no request: the engine resumes running requests on repaired workers.

Tiny random models, local workers whose calls are made to fail the way a crashed actor's would.
The Ray side (real actors killed mid-stream) is in test_serve_resume.py.
"""

import asyncio
import threading
import time

import pytest

from test_engine import PROMPTS, make_engine, ref20, reference  # noqa: F401 (ref20: a fixture)

from serve_app.config import SamplingParams


def failing(engine, method: str, fail_on: set[int], message: str = "actor 0xdeadbeef on 10.1.2.3 died"):
    """Make the target's `method` raise on the given call numbers (1-based), as a crashed actor would: each
    crash its own (another actor each time, so the engine retries them); returns the call counter."""
    worker = engine.target if method in ("verify",) else engine.draft
    real = getattr(worker, method)
    calls = {"n": 0}

    def call(*args):
        calls["n"] += 1
        if calls["n"] in fail_on:
            raise RuntimeError(f"{message} (crash {calls['n']})")
        return real(*args)

    setattr(worker, method, call)
    return calls


async def collect(engine, prompt, **params):
    outs = [o async for o in engine.generate(prompt, SamplingParams(**params))]
    return outs


def run_all(engine, prompts, timeout=60, **params):
    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(engine, p, **params) for p in prompts)), timeout)

    return asyncio.run(main())


def test_failed_steps_resume_their_requests_token_for_token(tiny_target, tiny_drafts, ref20):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2")
    calls = failing(engine, "verify", {3, 6})  # the 2nd failure hits the same requests after their resume
    runs = run_all(engine, PROMPTS[:3], max_tokens=20)
    assert calls["n"] > 6
    for i, outs in enumerate(runs):
        final = outs[-1]
        assert final.finish_reason == "length" and final.error is None
        ids = sum((o.token_ids for o in outs), [])
        assert ids == ref20[i]  # nothing repeated, nothing missing, the target's own greedy tokens
        assert "".join(o.text for o in outs) == "".join(f" {t}" for t in ref20[i])
        assert final.stats.resumes == 2 and final.stats.generated_tokens == 20
    for w in (engine.target, engine.draft):
        assert w.order == [] and w.seqs == {}, w.role
    assert engine.running == [] and engine.reserved == 0 and not engine.has_work()


def test_a_failure_while_admitting_resumes_too(tiny_target, tiny_drafts, ref20):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2", max_batch_size=1)
    failing(engine, "add", {1}, "draft actor gone")
    runs = run_all(engine, PROMPTS[:2], max_tokens=20)
    assert [sum((o.token_ids for o in outs), []) for outs in runs] == ref20[:2]
    assert [outs[-1].stats.resumes for outs in runs] == [1, 0]  # the waiting one never failed


def test_more_failures_than_max_resumes_end_with_a_clean_error(tiny_target, tiny_drafts, ref20):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2", max_resumes=2)
    calls = failing(engine, "verify", set(range(2, 100)))
    [outs] = run_all(engine, PROMPTS[:1], max_tokens=20)
    final = outs[-1]
    assert final.finish_reason == "error" and final.stats.resumes == 2 and calls["n"] == 4  # 1 ok + 3 failed
    assert "3 times" in final.error and "crashed" in final.error
    assert "10.1.2.3" not in final.error and "0xdeadbeef" not in final.error  # no internals for the client
    assert sum((o.token_ids for o in outs), []) == ref20[0][:1]  # the one token made before the failures
    assert engine.running == [] and engine.reserved == 0 and not engine.has_work()
    engine.target.verify = type(engine.target).verify.__get__(engine.target)  # healthy again: serves
    [again] = run_all(engine, PROMPTS[:1], max_tokens=20)
    assert sum((o.token_ids for o in again), []) == ref20[0]


def test_an_error_that_repeats_on_the_same_batch_fails_fast_naming_it(tiny_target, tiny_drafts, ref20):
    """A fault in the code (or the request) fails the same way on repaired workers: the second identical error
    ends the request with that error in its message, not a third try into it."""
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2", max_resumes=5)
    real, calls = engine.draft.propose, {"n": 0}

    def propose(*args):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise TypeError("expected Tensor as element 1 in argument 0, but got NoneType")
        return real(*args)

    engine.draft.propose = propose
    [outs] = run_all(engine, PROMPTS[:1], max_tokens=20)
    final = outs[-1]
    assert final.finish_reason == "error" and final.stats.resumes == 1 and calls["n"] == 3
    assert "same error" in final.error and "TypeError: expected Tensor as element 1" in final.error
    assert engine.running == [] and not engine.has_work()


def test_seeded_sampled_request_resumes_to_the_uninterrupted_text(tiny_target, tiny_drafts):
    """Seeded sampling is coupled (each token depends on seed and position only), so a resume after a
    crash, which re-prefills and may change k, gives the very text of an uninterrupted run."""
    [plain] = run_all(make_engine(tiny_target, tiny_drafts["near"], "fixed:3"), PROMPTS[:1],
                      max_tokens=24, temperature=1.0, seed=11)
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:3")
    failing(engine, "verify", {4})
    [outs] = run_all(engine, PROMPTS[:1], max_tokens=24, temperature=1.0, seed=11)
    assert outs[-1].finish_reason == "length" and outs[-1].stats.resumes == 1
    assert sum((o.token_ids for o in outs), []) == sum((o.token_ids for o in plain), [])


def test_draft_lost_decodes_without_speculation_until_it_is_back(tiny_target, tiny_drafts, ref20):
    """A repair that finds the draft gone: k = 0 meanwhile, then the (replacement) draft rejoins and
    the requests are prefilled on both again; greedy output unchanged throughout."""
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2")
    failing(engine, "propose", {3}, "draft actor died")
    ks: list[int] = []
    draft = engine.draft

    def observe(st):
        if st.batch_size:
            ks.append(st.k)
        if ks[-3:] == [0, 0, 0] and engine.draft is None:  # the replacement has "loaded": hand it over
            engine.attach_draft(draft)

    engine.on_step.append(observe)
    engine.repair = lambda e: setattr(e, "draft", None)  # the repair finds the draft gone
    runs = run_all(engine, PROMPTS[:2], max_tokens=60)
    assert [sum((o.token_ids for o in outs), []) for outs in runs] == reference(tiny_target, PROMPTS[:2], 60)
    first_zero = ks.index(0)
    assert ks[:first_zero] == [2] * first_zero and 2 in ks[first_zero:], ks  # k = 0 in between, then 2 again
    assert engine.draft is draft and draft.order == [] and engine.target.order == []


def test_new_requests_wait_during_a_repair_then_get_a_retryable_error(tiny_target, tiny_drafts, ref20):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2", recovery_wait_s=0.5)
    failing(engine, "verify", {2})
    release = threading.Event()
    engine.repair = lambda e: release.wait(10)  # a slow repair (a replacement actor still loading)

    async def main():
        first = asyncio.create_task(collect(engine, PROMPTS[0], max_tokens=20))
        while not engine.repairing:
            await asyncio.sleep(0.01)
        t = time.perf_counter()
        late = await collect(engine, PROMPTS[1], max_tokens=20)  # arrives during the repair
        waited = time.perf_counter() - t
        release.set()
        return await first, late, waited

    first, late, waited = asyncio.run(asyncio.wait_for(main(), 60))
    assert late[-1].finish_reason == "error" and late[-1].retry_after_s >= 1 and "recovering" in late[-1].error
    assert 0.5 <= waited < 5
    # the resumed request was not timed out: it waited for the repair and finished
    assert first[-1].finish_reason == "length" and sum((o.token_ids for o in first), []) == ref20[0]


def test_request_repair_when_idle_resets_workers(tiny_target, tiny_drafts):
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2")
    seen = []
    engine.repair = seen.append

    async def main():
        engine.request_repair()
        await asyncio.wait_for(engine._loop_task, 10)

    asyncio.run(main())
    assert seen == [engine] and not engine.repairing


# ---- the ingress: a Router replica dying mid-request ------------------------------------------------

class Upstream:
    """A router stream as the ingress sees it: events, then (optionally) a crash."""

    def __init__(self, events: list[dict], crash: bool):
        self.events, self.crash = list(events), crash
        self.cancels = 0

    async def __anext__(self):
        if not self.events:
            if self.crash:
                raise ConnectionError("replica 0xabc on 10.0.0.7 died")
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        self.cancels += 1


class Handle:
    """Serve's handle to a group: each submission gets the next scripted upstream."""

    def __init__(self, scripts):
        self.scripts, self.calls = list(scripts), []

    def options(self, stream):
        from types import SimpleNamespace

        return SimpleNamespace(generate=SimpleNamespace(remote=self.remote))

    def remote(self, ids, params, rid, stream, resume=None):
        self.calls.append((list(ids), dict(params), resume and dict(resume, output_ids=list(resume["output_ids"]))))
        events, crash = self.scripts.pop(0) if self.scripts else ([], True)
        return Upstream(events, crash)


def ev(tokens, finished=False):
    return {"text": "".join(f" {t}" for t in tokens), "token_ids": tokens, "finished": finished,
            "finish_reason": "length" if finished else None}


def drain_stream(rs):
    async def main():
        rs.start()
        out = []
        while True:
            e = await rs.next()
            out.append(e)
            if e["finished"]:
                return out

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_router_death_mid_stream_resubmits_with_the_tokens_received():
    from deployments.ingress import RouterStream

    handle = Handle([([ev([7]), ev([8, 9])], True),  # dies after two events
                     ([], True),                      # the dead replica is still routed to once
                     ([ev([10]), ev([11], finished=True)], False)])
    rs = RouterStream(handle, [1, 2, 3], {"max_tokens": 5, "seed": 4}, "r", True, max_resubmits=2, wait_s=10)
    out = drain_stream(rs)
    assert sum((e["token_ids"] for e in out), []) == [7, 8, 9, 10, 11] and out[-1]["finish_reason"] == "length"
    assert handle.calls[0] == ([1, 2, 3], {"max_tokens": 5, "seed": 4}, None)
    # again with the same prompt and settings, plus what the client already has: the engine continues it
    assert handle.calls[2] == ([1, 2, 3], {"max_tokens": 5, "seed": 4}, {"output_ids": [7, 8, 9], "sent_chars": 6})
    assert rs.resubmits == 1


def test_router_deaths_past_the_bound_end_with_a_clean_503():
    from deployments.ingress import RouterStream

    handle = Handle([([ev([i])], True) for i in range(5)])
    out = drain_stream(RouterStream(handle, [1], {"max_tokens": 9}, "r", True, max_resubmits=2, wait_s=10))
    assert [e["token_ids"] for e in out[:3]] == [[0], [1], [2]]
    assert out[-1]["status"] == 503 and "3 times" in out[-1]["error"]
    assert "10.0.0.7" not in out[-1]["error"] and "0xabc" not in out[-1]["error"]


def test_a_group_that_never_comes_back_gives_503_after_the_wait():
    from deployments.ingress import RouterStream

    t = time.monotonic()
    out = drain_stream(RouterStream(Handle([]), [1], {"max_tokens": 9}, "r", True, wait_s=1.2))
    assert out[-1]["status"] == 503 and "no engine replica" in out[-1]["error"]
    assert 1.2 <= time.monotonic() - t < 10
    ended = drain_stream(RouterStream(Handle([([], False)]), [1], {"max_tokens": 9}, "r", True))
    assert ended[-1]["status"] == 503 and "ended early" in ended[-1]["error"]


class FakeRouter:
    """A Router object as the ingress hosts it (`InProcessRouter`): an async __init__, a method and a stream."""

    async def __init__(self, name):
        self.name, self.closed = name, []

    async def ready(self):
        return {"ready": True, "name": self.name}

    def max_model_len(self):
        return 96

    async def generate(self, ids, params, rid, stream, resume=None):
        try:
            for t in ids:
                yield ev([t])
            await asyncio.Event().wait()  # an engine request that goes on until the caller leaves
        finally:
            self.closed.append(rid)


def test_a_router_in_the_ingress_is_called_as_its_handle_and_aborts_when_its_caller_leaves():
    from deployments.upstream import InProcessRouter, RouterStream

    async def main():
        router = await InProcessRouter.start(FakeRouter, "D")
        assert await router.ready.remote() == {"ready": True, "name": "D"} and await router.max_model_len.remote() == 96
        rs = RouterStream(router, [5, 6], {}, "r1", True)
        rs.start()
        assert [(await rs.next())["token_ids"] for _ in range(2)] == [[5], [6]]
        rs.cancel()  # the lease ends: nothing awaits the stream, so it closes at once
        # a caller that leaves while a task of its own awaits the next event (an SSE pump): the task is cancelled
        # first, and the stream closes once that task has unwound
        second = RouterStream(router, [7], {}, "r2", True)
        second.start()
        await second.next()
        pump = asyncio.ensure_future(second.next())
        await asyncio.sleep(0.05)
        pump.cancel()
        second.cancel()
        for _ in range(100):
            if len(router.router.closed) == 2:
                break
            await asyncio.sleep(0.01)
        return router.router.closed

    assert asyncio.run(asyncio.wait_for(main(), 10)) == ["r1", "r2"]


def test_engine_continues_a_request_another_engine_started(tiny_target, tiny_drafts, ref20):
    """What a Router does with the ingress's resume: the tokens count as generated, the stream goes on."""
    engine = make_engine(tiny_target, tiny_drafts["near"], "fixed:2")
    done = ref20[0][:7]
    req = engine.submit(PROMPTS[0], SamplingParams(max_tokens=20), resume={"output_ids": done, "sent_chars": 9})
    outs = []
    while not req.finished:
        outs += [o for r, o in engine.step() if r is req]
    assert req.output_ids == ref20[0] and sum((o.token_ids for o in outs), []) == ref20[0][7:]
    # the client had 9 characters of " a b c ..." for the 7 tokens: the rest of their text comes first
    sent = "".join(f" {t}" for t in done)
    assert "".join(o.text for o in outs) == sent[9:] + "".join(f" {t}" for t in ref20[0][7:])
    assert outs[-1].stats.generated_tokens == 20 and outs[-1].finish_reason == "length"
    for bad in ({"output_ids": [10**6]}, {"output_ids": list(range(20))}):
        with pytest.raises(ValueError, match="resume"):
            engine.submit(PROMPTS[0], SamplingParams(max_tokens=20), resume=bad)


def test_sigterm_to_serve_drains_then_stops(monkeypatch, capsys):
    """`specserve serve` on SIGTERM: drain (with the configured timeout), then stop Serve and Ray."""
    import os
    import signal

    import deployments.local as local

    calls = []
    monkeypatch.setattr(local, "start", lambda *a, **k: "http://127.0.0.1:1")
    monkeypatch.setattr(local, "drain", lambda timeout, app=local.APP_NAME: calls.append(("drain", timeout)) or 0)
    monkeypatch.setattr(local, "stop", lambda: calls.append(("stop",)))
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, [os.getpid(), signal.SIGTERM])
    timer.start()
    try:
        local.run_forever({"drain_timeout_s": 7, "profiles_dir": None}, "127.0.0.1", 1)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert calls == [("drain", 7.0), ("stop",)]
    assert "draining" in capsys.readouterr().out
