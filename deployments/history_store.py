"""HistoryStore: the suffix history every Router replica's draft copies from, shared by the deployment.

Each replica's draft keeps its own `SuffixHistory` (lookups stay local, off any network hop) and remembers the
outputs it finished; with each poll its Router hands those here (`push`) and takes what the other replicas
finished since its last poll (`pull`). A replica that starts, or whose draft was replaced, pulls everything
held and so drafts warm from its first request; the store outlives any one replica. The store itself keeps its
log in memory: restarted, it starts empty under a new epoch, and the first replica to notice hands over its
draft's copy (every draft holds what the store held), so the history outlives the store too. What it holds is bounded
like a draft's history, by tokens, oldest out first. Tenants travel with each output: every draft keeps them
apart (or not, with `history_scope: shared`) as its own outputs.
"""

from __future__ import annotations

import uuid
from collections import deque

from ray import serve

Doc = tuple[str, list[int], list[int]]  # (tenant, prompt tail, output)


class HistoryLog:
    """The outputs every replica pushed, numbered in arrival order, the newest `capacity` tokens of them."""

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self.epoch = uuid.uuid4().hex  # a new store: every replica pulls from the start again
        self.docs: deque[tuple[int, str, Doc]] = deque()  # (number, origin replica, doc)
        self.tokens = 0
        self.last = 0
        self.restored = False  # a replica refilled this store after a restart

    def push(self, origin: str, docs: list[Doc]) -> int:
        """A replica's finished outputs; returns the last number given."""
        for doc in docs:
            self.last += 1
            self.docs.append((self.last, origin, doc))
            self.tokens += len(doc[1]) + len(doc[2])
        while self.tokens > self.capacity and len(self.docs) > 1:
            _, _, (_, prompt, out) = self.docs.popleft()
            self.tokens -= len(prompt) + len(out)
        return self.last

    def pull(self, origin: str | None, since: int, epoch: str | None = None) -> tuple[str, int, list[Doc], bool]:
        """(epoch, last number, the outputs of replicas other than `origin` numbered after `since` (origin None:
        every replica's), whether to `restore`). Where `epoch` is not this log's, the replica never pulled (None:
        it takes everything, a restored copy included) or pulled from a store that since restarted: it holds what
        the old store had, so it takes what was pushed since (numbers from 1), and is asked to restore the rest
        until one replica has (one whose restore failed on the way leaves the job to the next)."""
        restore = False
        if epoch != self.epoch:
            since = -1 if epoch is None else 0
            restore = epoch is not None and not self.restored
        return self.epoch, self.last, [doc for n, o, doc in self.docs if n > since and o != origin], restore

    def restore(self, origin: str, docs: list[Doc]) -> None:
        """A replica's whole history after this store restarted empty: what the old store held, as near as one
        replica knows it (every replica's draft held all of it). Older than anything pushed since, it goes in
        front, numbered 0: replicas that held the old store's skip it, new ones take it. Only the first
        restore is taken: the others' copies are the same history."""
        if self.restored:
            return
        self.restored = True
        room = self.capacity - self.tokens
        for doc in reversed(docs):  # the newest first, while there is room
            size = len(doc[1]) + len(doc[2])
            if size > room:
                break
            self.docs.appendleft((0, origin, doc))
            self.tokens += size
            room -= size

    def stats(self) -> dict:
        return {"documents": len(self.docs), "tokens": self.tokens, "capacity": self.capacity, "last": self.last}


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class HistoryStore:
    """`HistoryLog` as a Serve deployment (one replica): Routers push and pull with each profile poll."""

    def __init__(self, capacity: int = 1 << 20):
        self.log = HistoryLog(capacity)

    def push(self, origin: str, docs: list[Doc]) -> int:
        return self.log.push(origin, docs)

    def pull(self, origin: str | None, since: int, epoch: str | None = None) -> tuple[str, int, list[Doc], bool]:
        return self.log.pull(origin, since, epoch)

    def restore(self, origin: str, docs: list[Doc]) -> None:
        self.log.restore(origin, docs)

    def stats(self) -> dict:
        return self.log.stats()
