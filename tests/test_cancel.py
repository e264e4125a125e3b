"""Cancellation bookkeeping: a cancelled waiting request leaves the engine queue at once (so it stops
counting toward the router's 429 bound), and the ingress's per-group in-flight count is given back
exactly once on every path of a streamed request, including a stream that never started.

Runs without a Ray cluster: the Router and the ingress classes are built with `object.__new__`
and given only the attributes the code under test reads.
"""

import asyncio
import gc
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from starlette.requests import ClientDisconnect

from conftest import IdTokenizer
from serve_app.config import EngineConfig, SamplingParams
from serve_app.engine.scheduler import Engine
from serve_app.engine.worker import ModelWorker

LONG = [1, 2, 3]  # prompt of the request that holds the only batch slot
QUEUED = [[5] * 11, list(range(10, 40)), [7, 8], [42]]


def make_engine(target, **cfg):
    # No draft, plain decoding: one token per step, so a 240-token request holds the batch for
    # 240 steps: the queue behind it cannot move while a test looks at it.
    return Engine(ModelWorker(target, "target"), None, IdTokenizer(), EngineConfig(policy="none", **cfg), eos_ids=set())


def greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


async def settle(cond, timeout=5.0):
    """Yield to the loop until cond() holds (the engine loop runs steps in a thread meanwhile)."""
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def collect(stream):
    return [out async for out in stream]


# ---- engine: a cancelled waiting request leaves the queue at once -----------------------------------

def test_cancelled_waiting_requests_leave_the_queue_at_once(tiny_target):
    engine = make_engine(tiny_target, max_batch_size=1)
    prefilled = []
    engine.on_step.append(lambda st: prefilled.append(st.prefilled))

    async def main():
        long = engine.generate(LONG, SamplingParams(max_tokens=240))
        await long.__anext__()  # admitted: the only batch slot is taken
        tasks = [asyncio.create_task(collect(engine.generate(p, SamplingParams(max_tokens=5)))) for p in QUEUED]
        await settle(lambda: len(engine.waiting) == 4)
        for t in tasks[1:]:  # three clients disconnect while queued (Serve cancels their tasks)
            t.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        # at once: not when they would have reached the head, which is after the 240-token request
        assert len(engine.waiting) == 1 and len(engine.running) == 1
        assert engine.running[0].prompt_ids == LONG and not engine.running[0].finished
        rest = await collect(long)
        return rest, await tasks[0]

    rest, live = asyncio.run(asyncio.wait_for(main(), 60))
    assert rest[-1].finish_reason == "length" and rest[-1].stats.generated_tokens == 240
    assert live[-1].finish_reason == "length"
    assert sum((o.token_ids for o in live), []) == greedy(tiny_target, QUEUED[0], 5)
    assert sum(prefilled) == 2  # the cancelled three were never prefilled
    assert not engine.has_work() and engine.reserved == 0 and engine.target.order == []


def test_abort_of_a_waiting_request_ends_its_stream_with_abort(tiny_target):
    """Whoever aborts a queued request, its consumer gets one final output, as for a running one."""
    engine = make_engine(tiny_target, max_batch_size=1)

    async def main():
        long = engine.generate(LONG, SamplingParams(max_tokens=240))
        await long.__anext__()
        queued = asyncio.create_task(collect(engine.generate(QUEUED[0], SamplingParams(max_tokens=5))))
        await settle(lambda: len(engine.waiting) == 1)
        req = engine.waiting[0]
        engine.abort(req)
        assert not engine.waiting and req.finished
        outs = await asyncio.wait_for(queued, 5)
        await long.aclose()
        return req, outs

    req, outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert [o.finished for o in outs] == [True] and outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert outs[0].stats is req.stats and req.stats.generated_tokens == 0 and req.stats.total_s > 0


@pytest.mark.parametrize("behind", [0, 1], ids=["alone", "with_one_behind"])
def test_abort_racing_admission_never_pops_the_wrong_request(tiny_target, behind):
    """`_admit` (step thread) peeks the queue head, then pops it; an abort (loop thread) removing that
    head in between would make the pop take the request behind it (unchecked against the KV budget)
    or fail on an empty queue, which fails the step and with it the whole batch. Force the abort into
    exactly that window: with the queue lock it waits until the pop is done."""
    engine = make_engine(tiny_target, max_batch_size=1)
    req = engine.submit(QUEUED[0], SamplingParams(max_tokens=5))
    others = [engine.submit(QUEUED[1], SamplingParams(max_tokens=5)) for _ in range(behind)]
    aborter: list[threading.Thread] = []

    class AbortOnPeek(deque):
        def __getitem__(self, i):
            if not aborter:
                aborter.append(threading.Thread(target=engine.abort, args=(req,)))
                aborter[0].start()
                aborter[0].join(0.3)  # without the lock it completes here, inside the window
            return super().__getitem__(i)

    engine.waiting = AbortOnPeek(engine.waiting)
    outs = engine.step()  # admits req (the abort is still waiting for the lock)
    aborter[0].join(5)
    assert not aborter[0].is_alive()
    assert all(r is req for r, _ in outs)  # its prefill and first token, of the request it peeked
    assert sum((o.token_ids for _, o in outs), []) == greedy(tiny_target, QUEUED[0], 1)
    assert req.cancelled and list(engine.waiting) == others
    outs = engine.step()  # cancelled while running: leaves the batch at the next step
    assert [(r, o.finish_reason) for r, o in outs if r is req] == [(req, "abort")]
    engine.run(others)
    assert [o.output_ids for o in others] == [greedy(tiny_target, QUEUED[1], 5)] * behind
    assert not engine.has_work() and engine.reserved == 0 and engine.target.order == []


# ---- router: 429 bound, 499 status and queue gauge -------------------------------------------------

class FakeMetric:
    def __init__(self):
        self.calls = []

    def inc(self, value=1, tags=None):
        self.calls.append((value, tags))

    def observe(self, value, tags=None):
        self.calls.append((value, tags))

    def set(self, value, tags=None):
        self.calls.append((value, tags))

    def statuses(self):
        return sorted(tags["status"] for _, tags in self.calls)


def make_router(engine, max_queue):
    from deployments.latency import HISTOGRAMS, new_histograms
    from deployments.router import Router

    r = object.__new__(Router.func_or_class)
    r.engine, r.max_queue, r.store, r.totals = engine, max_queue, None, Router.func_or_class.new_totals()
    for name in ("m_requests", "m_prompt", "m_generated", "m_ttft", "m_tpot", "m_queue"):
        setattr(r, name, FakeMetric())
    r.histograms, r.m_latency = new_histograms(), {key: FakeMetric() for key in HISTOGRAMS}
    return r


def test_router_queue_bound_counts_only_live_requests(tiny_target):
    engine = make_engine(tiny_target, max_batch_size=1)
    router = make_router(engine, max_queue=2)

    def ask(prompt, max_tokens=5):
        return router.generate(prompt, {"max_tokens": max_tokens, "temperature": 0})

    async def main():
        long = ask(LONG, 240)
        await long.__anext__()
        queued = [asyncio.create_task(collect(ask(p))) for p in QUEUED[:2]]
        await settle(lambda: len(engine.waiting) == 2)
        assert await collect(ask(QUEUED[2])) == [{"error": "server busy: 2 requests already waiting", "status": 429}]
        queued[1].cancel()  # its client went away (Serve cancels the router call)
        await asyncio.gather(queued[1], return_exceptions=True)
        assert len(engine.waiting) == 1 and router.m_queue.calls[-1][0] == 1  # the gauge reads the true depth
        late = asyncio.create_task(collect(ask(QUEUED[3])))  # a live client is not turned away
        await settle(lambda: len(engine.waiting) == 2)
        await long.aclose()  # a running request's client goes away too
        return await queued[0], await late

    first, late = asyncio.run(asyncio.wait_for(main(), 60))
    assert first[-1]["finish_reason"] == "length" and late[-1]["finish_reason"] == "length"
    assert sum((e["token_ids"] for e in late), []) == greedy(tiny_target, QUEUED[3], 5)
    # each request counted once: two served, one refused, two left (one waiting, one running)
    assert router.m_requests.statuses() == ["200", "200", "429", "499", "499"]
    assert router.m_queue.calls[-1][0] == 0 and not engine.has_work()


# ---- ingress: the per-group in-flight count -------------------------------------------------------

class FakeEvents:
    """The router's event stream as the ingress sees it: async events and best-effort cancel()."""

    def __init__(self, n_events: int, block_first: bool = False):
        self.events = [{"text": f" t{i}", "token_ids": [i], "finished": i == n_events - 1,
                        "finish_reason": "length" if i == n_events - 1 else None} for i in range(n_events)]
        self.block_first = block_first
        self.cancels = 0

    async def __anext__(self):
        if self.block_first:
            await asyncio.Event().wait()  # an engine that has not answered yet
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        self.cancels += 1


class FakeRouterHandle:
    def __init__(self, **events_kw):
        self.events_kw, self.streams = events_kw, []

    def options(self, stream):
        assert stream
        return SimpleNamespace(generate=SimpleNamespace(remote=self.remote))

    def remote(self, ids, params, rid, stream, resume=None):
        self.streams.append(FakeEvents(**self.events_kw))
        return self.streams[-1]


def make_ingress(handle):
    from deployments.ingress import OpenAIIngress

    class Ingress(OpenAIIngress.func_or_class):
        def __del__(self):  # Serve's ASGI wrapper has an async __del__ (app shutdown); no app here
            pass

    ing = object.__new__(Ingress)
    ing.routers, ing.in_flight, ing.replicas, ing.down, ing._watcher = {"A": handle}, {"A": 0}, {"A": 1}, set(), None
    ing.model_name, ing.max_tokens_limit, ing.max_stop_strings = "m", 100, 4
    ing.draining, ing.max_resubmits, ing.resubmit_wait_s = False, 2, 5.0
    return ing


def respond(ing, stream=True):
    from deployments.ingress import CompletionRequest

    body = CompletionRequest(model="m", prompt="the cat", stream=stream)
    return ing._respond(SimpleNamespace(headers={}), body, [[4, 5]], 5, chat=False)


async def collected():
    """Drop what is unreferenced now and let the loop run the callbacks that scheduled."""
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("how", ["discarded", "send_failed"])
def test_stream_dropped_before_its_first_iteration_releases_and_cancels(how):
    handle = FakeRouterHandle(n_events=5)
    ing = make_ingress(handle)

    async def main():
        resp = await respond(ing)
        assert ing.in_flight["A"] == 1
        if how == "send_failed":  # the client left before the body began: the response start fails

            async def send(message):
                raise OSError("connection reset")

            with pytest.raises(ClientDisconnect):
                await resp({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
        del resp
        await collected()
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 1

    asyncio.run(main())


def test_stream_to_its_end_releases_once_and_does_not_cancel():
    handle = FakeRouterHandle(n_events=3)
    ing = make_ingress(handle)

    async def main():
        resp = await respond(ing)
        chunks = [c async for c in resp.body_iterator]
        assert chunks[-1] == "data: [DONE]\n\n" and ing.in_flight["A"] == 0
        del resp, chunks
        await collected()  # the finalizer must not give the count back a second time
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 0

    asyncio.run(main())


def test_disconnect_mid_stream_releases_once_and_cancels():
    handle = FakeRouterHandle(n_events=10)
    ing = make_ingress(handle)

    async def main():
        resp = await respond(ing)
        body = resp.body_iterator
        assert (await body.__anext__()).startswith("data: ")
        await body.aclose()  # what Starlette's task group does when the client disconnects
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 1
        del resp, body
        await collected()
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 1

    asyncio.run(main())


def test_client_gone_before_the_first_event_releases_and_cancels():
    handle = FakeRouterHandle(n_events=3, block_first=True)
    ing = make_ingress(handle)

    async def main():
        task = asyncio.create_task(respond(ing))
        await settle(lambda: handle.streams)
        assert ing.in_flight["A"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 1

    asyncio.run(main())


def test_unstreamed_answer_releases_once_and_does_not_cancel():
    handle = FakeRouterHandle(n_events=3)
    ing = make_ingress(handle)

    async def main():
        answer = await respond(ing, stream=False)
        assert answer["usage"]["completion_tokens"] == 3
        await collected()
        assert ing.in_flight["A"] == 0 and handle.streams[0].cancels == 0

    asyncio.run(main())
