"""HistoryStore: the suffix history every Router replica's draft copies from, shared by the deployment.

Each replica's draft keeps its own `SuffixHistory` (lookups stay local, off any network hop) and remembers the
outputs it finished; with each poll its Router hands those here (`push`) and takes what the other replicas
finished since its last poll (`pull`). A replica that starts, or whose draft was replaced, pulls everything
held and so drafts warm from its first request; the store outlives any one replica. What it holds is bounded
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

    def pull(self, origin: str | None, since: int, epoch: str | None = None) -> tuple[str, int, list[Doc]]:
        """(epoch, last number, the outputs of replicas other than `origin` numbered after `since`; origin None:
        every replica's); from the start where `epoch` is not this log's (the store restarted, or the replica
        never pulled)."""
        if epoch != self.epoch:
            since = 0
        return self.epoch, self.last, [doc for n, o, doc in self.docs if n > since and o != origin]

    def stats(self) -> dict:
        return {"documents": len(self.docs), "tokens": self.tokens, "capacity": self.capacity, "last": self.last}


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class HistoryStore:
    """`HistoryLog` as a Serve deployment (one replica): Routers push and pull with each profile poll."""

    def __init__(self, capacity: int = 1 << 20):
        self.log = HistoryLog(capacity)

    def push(self, origin: str, docs: list[Doc]) -> int:
        return self.log.push(origin, docs)

    def pull(self, origin: str | None, since: int, epoch: str | None = None) -> tuple[str, int, list[Doc]]:
        return self.log.pull(origin, since, epoch)

    def stats(self) -> dict:
        return self.log.stats()
