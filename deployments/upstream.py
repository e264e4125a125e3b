"""The ingress's side of a request to an engine group: its Router event stream, surviving a Router replica's death
(`RouterStream`), and the lease that counts it in flight and cancels it when the client leaves (`GroupLease`)."""

import asyncio
import inspect
import logging
import time
import uuid
import weakref

from fastapi import Request

log = logging.getLogger("ray.serve")


def request_id(request: Request) -> str:
    """The request's id: Serve's proxy echoes a client's X-Request-Id (or makes one) on the response."""
    return request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:16]}"


def _error_event(message: str) -> dict:
    return {"error": message, "text": "", "token_ids": [], "finished": True, "finish_reason": None, "status": 503}


class RouterStream:
    """One request's events from its engine group, surviving the death of the Router replica serving it.

    The ingress knows what it already received: on a failure it sends the request to the group again
    (Serve routes it to a live replica, or holds it until the replacement is up) with the tokens
    received so far and how much of their text the client has, so the new replica's engine continues
    the request where it stopped (greedy: token for token; text held back there for a partial
    character or stop string is released by the new one). A submission failing before its first
    event is retried until `wait_s` has passed; after `max_resubmits` resumes the request ends with 503.
    """

    def __init__(self, handle, ids: list[int], params: dict, rid: str, stream: bool,
                 max_resubmits: int = 2, wait_s: float = 120.0, reroute=None):
        self.handle, self.ids, self.params, self.rid, self.stream = handle, ids, params, rid, stream
        # reroute(): the (handle, is_down) of the group to use now - another one when this group is down
        # (its nodes gone): resubmissions go there, and a request waiting for its first event moves.
        self.reroute = reroute
        self.group_down = lambda: False
        if reroute is not None:
            self.handle, self.group_down = reroute()
        self.max_resubmits, self.wait_s = max_resubmits, wait_s
        self.received: list[int] = []
        self.sent_chars = 0  # characters of text the client has been given
        self.resubmits = 0
        self.events = None
        self.finished = False  # the last event ended the request (nothing left to cancel)
        self._got_event = False

    def start(self) -> None:
        resume = {"output_ids": self.received, "sent_chars": self.sent_chars} if self.received else None
        self._got_event = False
        self.events = self.handle.options(stream=True).generate.remote(self.ids, self.params, self.rid, self.stream, resume)
        self._pending = None

    async def _event(self) -> dict:
        """The stream's next event. While it waits for its first one, it watches its group: a group
        marked down (no replica reachable) would hold the request in Serve's queue for a replica that
        never comes, so the request moves to the group `reroute` gives now."""
        while not self._got_event and self.reroute is not None:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self.events.__anext__())
            done, _ = await asyncio.wait({self._pending}, timeout=1.0)
            if done:
                task, self._pending = self._pending, None
                return task.result()
            if self.group_down():
                handle, down = self.reroute()
                if handle is not self.handle:
                    log.warning("request %s: its engine group is down; moving it to another group", self.rid)
                    self.cancel()
                    self.handle, self.group_down = handle, down
                    self.start()
        return await self.events.__anext__()

    def cancel(self) -> None:
        if getattr(self, "_pending", None) is not None:
            self._pending.cancel()  # a first event still awaited (see _event)
            self._pending = None
        if self.events is not None:
            self.events.cancel()  # the router aborts the request: frees its queue place or batch slot and KV

    def _end(self, message: str) -> dict:
        """The request is over without an answer: an error event, and nothing left to cancel."""
        self.finished = True
        return _error_event(message)

    async def next(self) -> dict:
        """The next event; a router that is gone for good becomes an error event, not a hang."""
        deadline = None
        while True:
            try:
                ev = await self._event()
            except StopAsyncIteration:
                return self._end("engine stream ended early")
            except Exception as e:  # the Router replica died (or is unreachable)
                if self._got_event:
                    self.resubmits += 1
                    if self.resubmits > self.max_resubmits:
                        return self._end(f"the request failed {self.resubmits} times because an engine "
                                            "replica crashed; giving up (retry later)")
                    deadline = None
                deadline = deadline or time.monotonic() + self.wait_s
                if time.monotonic() > deadline:
                    return self._end("no engine replica of this group is available; retry later")
                log.warning("request %s: engine replica failed (%s); resubmitting with %d tokens received",
                            self.rid, type(e).__name__, len(self.received))
                await asyncio.sleep(0.5)
                if self.reroute is not None:  # the same group while it is up, else a live one
                    self.handle, self.group_down = self.reroute()
                self.start()
                continue
            self._got_event = True
            self.received += ev.get("token_ids", [])
            self.sent_chars += len(ev.get("text", ""))
            self.finished = bool(ev.get("finished")) or "error" in ev
            return ev


class GroupLease:
    """One request's place in its engine group's in-flight count (what `_pick_group` balances on),
    and the router request behind it.

    `end` gives both back exactly once, whichever path gets there first: the handler (unstreamed
    answers, refusals, a client gone while it waited), the SSE generator's `finally` (normal end,
    error event, client gone mid-stream), or the finalizer of an SSE generator collected without
    ever having started: its `finally` then never runs (the client left before the body began, or
    the response was discarded), and without the finalizer the count would stay high for good and
    the router would go on generating for nobody.

    Every `end` runs on the ingress's event-loop thread (the finalizer hops there), so the flag and
    the count need no lock.
    """

    def __init__(self, in_flight: dict[str, int], group: str, ingress=None):
        self.in_flight, self.group, self.ingress = in_flight, group, ingress
        self.upstream: RouterStream | None = None  # the router's event stream, once asked for
        self.ended = False
        in_flight[group] += 1

    def reroute(self):
        """(handle, is_down) of the group this request should use now: its own while that group is
        up, else the least loaded live one (the request's place in the counts moves with it)."""
        ing = self.ingress
        if self.group in ing.down and not self.ended:
            group = ing._pick_group()
            if group != self.group:
                self.in_flight[self.group] -= 1
                self.in_flight[group] += 1
                self.group = group
        return ing.routers[self.group], (lambda g=self.group: g in ing.down)

    def end(self, finished: bool) -> None:
        """finished: the router's stream is over (or never began), so there is nothing to cancel."""
        if self.ended:
            return
        self.ended = True
        self.in_flight[self.group] -= 1
        if not finished and self.upstream is not None:
            self.upstream.cancel()

    def end_with(self, stream) -> None:
        """Hand the lease to an SSE generator: its `finally` ends it once started; if it is collected
        without ever starting, this finalizer does."""
        loop = asyncio.get_running_loop()

        def collected():  # the collector may run in any thread; `end` belongs on the loop
            try:
                loop.call_soon_threadsafe(self.end, False)
            except RuntimeError:  # loop closed: the replica is going away, and its counts with it
                pass

        weakref.finalize(stream, collected).atexit = False  # at interpreter exit there is nothing to free


class InProcessRouter:
    """A Router object living in the ingress's own process, called the way its deployment handle is
    (`router.method.remote(...)`, `router.options(stream=True).generate.remote(...)`), so the ingress's code is
    the same for both layouts (`AppConfig.router_in_ingress`). Its events reach the SSE response without
    crossing a Ray hop: each token otherwise costs a streamed item out of the Router's replica and into the
    ingress's, on the cores the forward needs."""

    def __init__(self, router):
        self.router = router

    @classmethod
    async def start(cls, router_cls, *args) -> "InProcessRouter":
        """Construct `router_cls` (the Router deployment's class; its __init__ is async) here."""
        router = router_cls.__new__(router_cls)
        await router_cls.__init__(router, *args)
        return cls(router)

    def options(self, **_) -> "InProcessRouter":
        return self

    def __getattr__(self, name: str) -> "_InProcessMethod":
        return _InProcessMethod(getattr(self.router, name))


class _InProcessMethod:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        """An awaitable for a method, an `InProcessStream` for an async generator (as a handle's response)."""
        out = self.fn(*args, **kwargs)
        if inspect.isasyncgen(out):
            return InProcessStream(out)
        if inspect.iscoroutine(out):
            return asyncio.ensure_future(out)
        done = asyncio.get_running_loop().create_future()
        done.set_result(out)
        return done


class InProcessStream:
    """An in-process Router stream with a handle stream's `cancel()`: closing the generator runs the
    Router's own cleanup (the engine aborts the request, freeing its batch slot and KV)."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        return await self.agen.__anext__()

    def cancel(self) -> None:
        async def close():
            # A task awaiting the next event is being cancelled too (the caller cancels it first): the
            # generator is then still running until that task has unwound, so try again briefly.
            for _ in range(100):
                try:
                    return await self.agen.aclose()
                except RuntimeError:
                    await asyncio.sleep(0.01)
            log.warning("an in-process router stream did not close")

        asyncio.ensure_future(close())
