"""DraftWorker and TargetWorker: Ray actors that each host one model and its sequences' KV state.

The target wraps `serve_app.engine.worker.ModelWorker`, the draft whatever worker its kind needs
(`serve_app.drafting.draft_worker`); the Router talks to them through `RemoteWorker`, a proxy with
the same methods, so the engine's step runs unchanged across actors, its calls over each worker's
channel (deployments.channel) or as Ray task calls. Per step only token ids and a few numbers per
drafted position pass through the Router (for a sampled row, the draft's proposal over its own top-N
tokens). An EAGLE-style draft's features, the target's hidden states of the positions it made final,
go from the target's actor to the draft's directly (over the channel's own connection, or through
Ray's object store) and the Router passes on only a tag or a reference.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import selectors
import socket
import threading
import time

import ray
import torch

from serve_app.config import ModelConfig
from serve_app.drafting import draft_worker
from serve_app.engine.worker import ModelWorker, Verdict
from serve_app.models import load_target

from . import channel
from .channel import FeatureTag


class _ModelHost:
    """Loads one model and forwards engine calls to its ModelWorker.

    The model loads on the thread that runs its calls (the first of them, or `start`), never in `__init__`:
    torch keeps an OpenMP pool per calling thread, and a second pool (Ray runs `__init__` on the actor's main
    thread, its calls on another) makes libgomp count more threads than cores and stop spinning at its
    barriers, so every parallel region of a forward waits for a sleeping thread to wake."""

    role = ""

    def __init__(self, model: dict, torch_threads: int = 0):
        self.model, self.torch_threads = model, torch_threads
        self.worker = None
        self.load_thread: int | None = None  # the thread the model loaded on (its OpenMP pool's)
        self.threads: int | None = None  # torch threads of that pool, once loaded
        self.direct_bytes = 0
        self.call_s, self.n_calls = 0.0, 0  # time inside model calls: a caller's wait minus this is the hop
        self.listener: socket.socket | None = None  # the channel's (open_channel), for the actor's life
        self.serving = False  # inside serve_channel: answering the Router's connection
        self.peer: socket.socket | None = None  # target: the connection its features go to the draft on
        self.feature_step = 0  # target: verifications whose features went to the peer
        self.no_draft = False  # target: told there is no draft (peer None): its features go nowhere
        self.inbox: dict[int, tuple] = {}  # draft: packed features by FeatureTag.step, the last INBOX kept
        self.feature_conns: list[socket.socket] = []  # draft: the targets' connections features come on
        self.sel: selectors.BaseSelector | None = None  # serve_channel's, while it runs
        self.next_ahead: list[str] | None = None  # target: rows whose next step to look ahead after this answer
        self.ahead_s = 0.0  # time in looked-ahead steps (outside any call)

    def start(self) -> bool:
        """Load the model if not yet loaded (on this, the model calls' thread); True once it is."""
        if self.worker is None:
            self._load()
            self.load_thread = threading.get_ident()
        return True

    def _load(self) -> None:
        from serve_app.hardware import available_cpus
        from serve_app.models import load_draft_for_host

        # Denormals as zeros on this thread before torch starts its OpenMP pool from it (the pool's threads
        # inherit the setting): see serve_app.engine.worker.denormals_flushed, which the worker then leaves alone.
        torch.set_flush_denormal(True)

        # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1), which would leave torch one core; the
        # machine's count (os.cpu_count()) would be the node's cores in a pod limited to a few.
        torch.set_num_threads(self.torch_threads or available_cpus())
        self.threads = torch.get_num_threads()
        mc = ModelConfig(**self.model)
        if self.role == "target":
            target, tokenizer, _ = load_target(mc.target, mc.dtype, mc.device)
            worker = ModelWorker(target, "target", tokenizer.pad_token_id or 0)
        else:  # the target's weights only if the draft is built from them (not for ngram, a separate model)
            draft, tokenizer = load_draft_for_host(mc)
            worker = draft_worker(draft, tokenizer.pad_token_id or 0, mc.prompt_lookup, mc.history_tokens,
                                  mc.history_scope == "shared")
        worker.tokenizer = tokenizer  # structured outputs: grammar masks over the vocabulary's strings
        worker.flush_denormals = False  # on for this thread and its pool already (above)
        self.worker = worker

    KEEPS_AHEAD = frozenset({"take_timings", "info", "vocab_size", "history_stats", "shares_prefixes"})
    """Worker methods that read only: a step looked ahead stays for the verification that may follow them."""

    def call(self, method: str, *args):
        self.start()
        if method not in self.KEEPS_AHEAD:
            self._drop_ahead()
        t = time.perf_counter()
        try:
            return getattr(self.worker, method)(*args)
        finally:
            self.call_s += time.perf_counter() - t
            self.n_calls += 1

    def calls(self, batch: list[tuple[str, tuple]]):
        """Several calls in order (`RemoteWorker` holds some back to send with the next: the draft's commit and
        prefill, which carry the features); the last one's result."""
        out = None
        for method, args in batch:
            out = self.call(method, *map(self._arg, args))
        return out

    def _arg(self, a):
        """An EAGLE-style draft's features as they came: a reference is read here (Ray resolves only the ones a
        call gets directly, not those inside a `calls` batch); a tag from the target's connection."""
        if isinstance(a, ray.ObjectRef):
            return ray.get(a)
        if isinstance(a, FeatureTag):
            return self._features(a)
        return a

    def verify(self, seq_ids, proposal, chunks=None, ahead=False) -> Verdict:
        """The target's verification; features (for an EAGLE-style draft) go to the draft's actor without a Router
        hop: down the connection to its channel, a tag returning (serve_channel), or into this node's object store,
        a reference returning (Ray calls). ahead: the Router expects these rows' plain decoding step next, which
        serve_channel then runs while the Router streams this one's tokens (`ModelWorker.look_ahead`)."""
        self.start()
        t = time.perf_counter()
        self.next_ahead = None
        try:
            verdict = self._verify(seq_ids, proposal, chunks)
            self.next_ahead = list(seq_ids) if ahead and self.serving else None  # not after a failed one
            return verdict
        finally:
            self.call_s += time.perf_counter() - t
            self.n_calls += 1

    def _verify(self, seq_ids, proposal, chunks) -> Verdict:
        verdict = self.worker.verify(seq_ids, proposal, chunks)
        if verdict.features is None:
            return verdict
        self.direct_bytes += sum(f.numel() * f.element_size() for f in verdict.features)
        n = len(seq_ids)  # decoding rows, then prefill chunks: the draft takes them in two calls
        if not self.serving:
            return verdict._replace(features=(ray.put(verdict.features[:n]), ray.put(verdict.features[n:])))
        if self.peer is None:
            if self.no_draft:  # the draft is being replaced: it reads the features again at its prefill
                return verdict._replace(features=None)
            raise RuntimeError("the target captures features for a draft but was never told where it is: "
                               "give its RemoteWorker features_to")
        self.feature_step += 1
        channel.send(self.peer, (self.feature_step, channel.pack_rows(verdict.features[:n]),
                                 channel.pack_rows(verdict.features[n:])))
        return verdict._replace(features=(FeatureTag(self.feature_step, 0), FeatureTag(self.feature_step, 1)))

    # ---- the channel (deployments.channel) --------------------------------------------------
    INBOX = 16
    """Verifications whose features a draft keeps: RemoteWorker holds a commit back at most MAX_QUEUED calls."""
    FEATURE_WAIT_S = 60.0

    def open_channel(self) -> tuple[str, int]:
        """The address the Router (and, for a draft, the target's features) connect to; one for the actor's life."""
        if self.listener is None:
            self.listener = channel.listen(ray.util.get_node_ip_address())
        return self.listener.getsockname()[:2]

    def serve_channel(self) -> None:
        """Answer requests from the Router's connection on this, the model thread, until it closes: a Ray call
        that lasts. A new Router connection replaces the last (a Router that gave up on a call reconnects); a
        connection that says "features" brings a target's features (a draft)."""
        self.start()
        self.sel = sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        for conn in self.feature_conns:  # a draft's loop again (its Router reconnected): the target's still come
            sel.register(conn, selectors.EVENT_READ, "features")
        router = None
        self.serving = True
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "accept":
                        conn, _ = self.listener.accept()
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        if channel.recv(conn) == "features":  # a (new) target: what an old one sent is stale
                            self.inbox.clear()
                            self.feature_conns.append(conn)
                            sel.register(conn, selectors.EVENT_READ, "features")
                            continue
                        if router is not None:
                            sel.unregister(router)
                            router.close()
                        router = conn
                        sel.register(conn, selectors.EVENT_READ, "calls")
                    elif key.data == "features":
                        self._take_features(key.fileobj)
                    else:
                        try:
                            op, args = channel.recv(router)
                        except (ConnectionError, OSError):
                            return  # the Router left: Ray calls reach the model thread again
                        router.sendall(self._answer(op, args))
                        self._look_ahead(router)
        finally:
            self._drop_ahead()
            self.serving = False
            if router is not None:
                router.close()
            sel.close()
            self.sel = None

    def _look_ahead(self, router: socket.socket) -> None:
        """After a verification the Router marked: its rows' next plain decoding step, now, unless a request
        already waits (its answer would wait for the whole forward). A failure undoes it; the step that asks
        for it runs it again and meets the error there."""
        ids, self.next_ahead = self.next_ahead, None
        if ids is None or select.select([router], [], [], 0)[0]:
            return
        t = time.perf_counter()
        try:
            self.worker.look_ahead(ids)
        except Exception:
            self._drop_ahead()
        self.ahead_s += time.perf_counter() - t

    def _drop_ahead(self) -> None:
        """Undo a looked-ahead step (a target's `ModelWorker` only looks ahead) before a call that is not its own."""
        if getattr(self.worker, "ahead", None) is not None:
            self.worker.drop_ahead()

    def _answer(self, op: str, args: tuple) -> bytes:
        """The encoded answer to one request: ("ok", result) or ("err", what it raised); what cannot be pickled
        fails while encoding, as an error, never half a message."""
        ops = {"call": self.call, "calls": self.calls, "verify": self.verify, "kv_room": self.kv_room,
               "take_timings": self.take_timings, "peer": self._peer}
        try:
            return channel.encode(("ok", ops[op](*args)))
        except Exception as e:
            try:
                return channel.encode(("err", e))
            except Exception:
                return channel.encode(("err", RuntimeError(f"{type(e).__name__}: {e}")))

    def _peer(self, address: tuple[str, int] | None) -> None:
        """Target: send the features of each verification to the draft's channel at address (None: no draft)."""
        if self.peer is not None:
            self.peer.close()
        self.peer, self.no_draft = None, address is None
        if address is not None:
            self.peer = channel.connect(tuple(address), self.FEATURE_WAIT_S)
            channel.send(self.peer, "features")

    def _take_features(self, conn: socket.socket) -> None:
        try:
            step, decoding, chunks = channel.recv(conn)
        except (ConnectionError, OSError):  # that target is gone (replaced): its connection goes
            self.feature_conns.remove(conn)
            if self.sel is not None:
                self.sel.unregister(conn)
            conn.close()
            return
        self.inbox[step] = (decoding, chunks)
        while len(self.inbox) > self.INBOX:
            del self.inbox[next(iter(self.inbox))]

    def _features(self, tag: FeatureTag) -> list:
        deadline = time.monotonic() + self.FEATURE_WAIT_S
        while tag.step not in self.inbox:
            left = deadline - time.monotonic()
            ready = select.select(self.feature_conns, [], [], max(left, 0))[0] if self.feature_conns and left > 0 else []
            if not ready:
                raise TimeoutError(f"the target's features of verification {tag.step} never came")
            for conn in ready:
                self._take_features(conn)
        return channel.unpack_rows(self.inbox[tag.step][tag.part])

    def kv_room(self, utilization, probe_tokens, share=None):
        """The worker's KV room on its GPU; share None: the GPU count Ray gave this actor (a fraction when
        the draft and target share one GPU), so each role sizes its pool from its own part."""
        if share is None:
            gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
            share = min(1.0, gpus) if gpus else 1.0
        self.start()
        self._drop_ahead()
        return self.worker.kv_room(utilization, probe_tokens, share)

    def take_timings(self) -> dict:
        self.start()
        out = self.worker.take_timings()
        out["direct_bytes"] += self.direct_bytes
        out["call_s"], out["calls"] = self.call_s, self.n_calls
        out["ahead_s"] = self.ahead_s
        out["ahead_hits"], self.worker.ahead_used = getattr(self.worker, "ahead_used", 0), 0
        self.direct_bytes, self.call_s, self.n_calls = 0, 0.0, 0
        self.ahead_s = 0.0
        return out

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def threads_in_use(self) -> int | None:
        """The model's torch threads (None until it loaded)."""
        return self.threads


CONTROL = {"control": 2}
"""A model host's concurrency groups: `ping` and `pid` answer on threads of their own while a long model
call runs (so a busy worker is never taken for a dead one), and every model call runs on the default
group's one thread. One thread matters on CPUs: torch keeps a pool of OpenMP workers per calling thread,
and calls spread over Ray's four threads took turns (one target answered on three thread ids in rotation,
its four pool threads at 12-19% CPU each), waking a different pool each step."""


@ray.remote(concurrency_groups=CONTROL)
class TargetWorker(_ModelHost):
    role = "target"


@ray.remote(concurrency_groups=CONTROL)
class DraftWorker(_ModelHost):
    role = "draft"


class RemoteWorker:
    """ModelWorker's interface over a worker actor (blocking calls, made from the engine's thread).

    With `channel` the calls go over a TCP connection to the actor's model thread
    (`deployments.channel`), opened at the first call and again after the actor is replaced; without it,
    as Ray task calls. A dead or stuck actor raises here (RayActorError / GetTimeoutError), which fails
    the step and ends its requests with an error instead of hanging. Calls from other threads (the
    Router's statistics) wait their turn. With count_bytes, `bytes_sent` and `bytes_received` add up the
    serialized size of what crossed between the engine's process and the actor (benchmarks; off by default
    because measuring is a second serialization). `features_to` (a target's): a function giving the draft's
    RemoteWorker, or None, to which the target sends its features directly.
    """

    MAX_QUEUED = 8
    """Calls held back (`commit`, `prefill`) before they go on their own, in one round trip."""

    def __init__(self, actor, timeout_s: float = 120.0, count_bytes: bool = False, channel: bool = True):
        self._actor = actor
        self.timeout_s = timeout_s
        self.count_bytes = count_bytes
        self.channel = channel
        self.bytes_sent = self.bytes_received = 0
        self.queued: list[tuple[str, tuple]] = []  # (method, args) held back for the next call
        self.lock = threading.RLock()  # one request at a time on the connection
        self.sock: socket.socket | None = None
        self.address: tuple[str, int] | None = None  # the actor's channel
        self.loop = None  # the actor's serve_channel call (done: the actor left its loop, or died)
        self.features_to = None
        self.peered: tuple | None = ()  # the draft channel the target sends features to (None: none; (): not told)

    @property
    def actor(self):
        return self._actor

    @actor.setter
    def actor(self, actor) -> None:
        """A replacement actor (Router repair): the next call connects to it."""
        with self.lock:
            self._close()
            self._actor, self.address, self.loop, self.peered = actor, None, None, ()

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def close(self) -> None:
        """End the actor's channel loop and wait for it: its model thread takes Ray calls again (the next call
        here opens the channel again)."""
        with self.lock:
            if self.sock is not None:
                self._close()
                try:
                    ray.get(self.loop, timeout=self.timeout_s)
                except ray.exceptions.RayError:  # the actor died, or is stuck in a call: nothing to wait for
                    pass
            self.loop = None

    def channel_address(self) -> tuple[str, int]:
        with self.lock:
            self._connect()
            return self.address

    def _connect(self) -> socket.socket:
        if self.sock is None:
            if self.address is None:
                self.address = tuple(self._get(self._actor.open_channel.remote(), ()))
            if self.loop is None or ray.wait([self.loop], timeout=0)[0]:
                self.loop = self._actor.serve_channel.remote()
            try:
                self.sock = channel.connect(self.address, self.timeout_s)
                channel.send(self.sock, "calls")
            except OSError as e:
                self._close()
                raise ray.exceptions.RayActorError(error_msg=f"worker's channel {self.address}: {e}") from e
        return self.sock

    def _request(self, op: str, *args):
        """One request over the channel and its answer; what the actor raised is raised here."""
        sock = self._connect()
        try:
            channel.send(sock, (op, args))
            status, out = channel.recv(sock)
        except socket.timeout:
            self._close()  # its answer may still come: a fresh connection for the next call
            raise ray.exceptions.GetTimeoutError(f"worker call {op} took over {self.timeout_s:g} s") from None
        except (OSError, EOFError) as e:
            self._close()
            raise ray.exceptions.RayActorError(error_msg=f"worker's channel {self.address} closed: {e}") from e
        if status == "err":
            raise out
        return out

    def _send(self, op: str, args: tuple):
        """Request op of the actor (a `_ModelHost` method) over the channel, or as a Ray call."""
        with self.lock:
            if not self.channel:
                return self._get(getattr(self._actor, op).remote(*args), args)
            out = self._request(op, *args)
            if self.count_bytes:
                self.bytes_sent += serialized_size(args)
                self.bytes_received += serialized_size(out)
            return out

    def _call(self, method: str, *args):
        with self.lock:
            if not self.queued:
                return self._send("call", (method, *args))
            batch, self.queued = self.queued + [(method, args)], []
            return self._send("calls", (batch,))

    def _queue(self, method: str, *args) -> None:
        """A call whose result the engine does not read (the draft's commit and prefill) rides along with the next
        call (the actor runs them in order, first): one round trip a step instead of two, and no call running
        beside the other worker's forward. Past MAX_QUEUED (steps without speculation) they go on their own."""
        with self.lock:
            self.queued.append((method, args))
            if len(self.queued) >= self.MAX_QUEUED:
                self.flush()

    def flush(self) -> None:
        """Run the held-back calls now; raises what one of them raised."""
        with self.lock:
            if self.queued:
                batch, self.queued = self.queued, []
                self._send("calls", (batch,))

    def _get(self, ref, args):
        out = ray.get(ref, timeout=self.timeout_s)
        if self.count_bytes:
            self.bytes_sent += serialized_size(args)
            self.bytes_received += serialized_size(out)
        return out

    def _peer(self) -> None:
        """Before a target's verification: it sends its features to the current draft's channel."""
        if self.features_to is None:  # not a target with a draft: it is never told (and raises if it has features)
            return
        draft = self.features_to()
        address = draft.channel_address() if isinstance(draft, RemoteWorker) and draft.channel else None
        if address != self.peered:
            self._request("peer", address)
            self.peered = address

    def call(self, method: str, *args):
        """Any ModelWorker method by name (the Router's history exchange)."""
        return self._call(method, *args)

    def configure_kv(self, block_size, max_blocks, prefix_caching, attention_backend="auto", preallocate=False,
                     static_steps="auto"):
        return self._call("configure_kv", block_size, max_blocks, prefix_caching, attention_backend, preallocate,
                          static_steps)

    def kv_room(self, utilization, probe_tokens, share=None, memory=None):
        # share None: the actor's own GPU count (below 1 when it shares its GPU with the other role)
        with self.lock:
            self.flush()
            return self._send("kv_room", (utilization, probe_tokens, share))

    def add(self, seq_ids, prompts, params):
        return self._call("add", seq_ids, prompts, params)

    def remove(self, seq_ids, remember=False):
        return self._call("remove", seq_ids, remember)

    def reset(self):
        self.queued = []  # a reset follows a failure: what they would have done is forgotten with the rest
        return self._call("reset")

    def prefill(self, seq_ids, features=None, upto=None) -> None:
        self._queue("prefill", seq_ids, features, upto)

    def propose(self, seq_ids, k):
        return self._call("propose", seq_ids, k)

    def verify(self, seq_ids, proposal, chunks=None, ahead=False):
        """The Verdict's features, if any, stay off this process: a tag of what the target sent the draft's channel
        (or, over Ray calls, a reference Ray resolves from the target's node); `commit` / `prefill` pass it on.
        ahead: the same rows' plain decoding step is expected next (the actor may run it while this one streams)."""
        with self.lock:
            self.flush()
            if self.channel:
                self._peer()
            return self._send("verify", (seq_ids, proposal, chunks, ahead))

    def commit(self, seq_ids, new_tokens, features=None) -> None:
        self._queue("commit", seq_ids, new_tokens, features)

    def prompt_logprobs(self, ids, top):
        return self._call("prompt_logprobs", ids, top)

    def capture_features(self, layers):
        return self._call("capture_features", layers)

    def take_timings(self) -> dict:
        with self.lock:
            self.flush()
            return self._send("take_timings", ())

    def info(self) -> dict:
        return self._call("info")


class _RefsAsTags(pickle.Pickler):
    """Pickles as Ray would ship it through this process: an ObjectRef is a reference, not its data."""

    def persistent_id(self, obj):
        return "ref" if isinstance(obj, ray.ObjectRef) else None


def serialized_size(obj) -> int:
    """Bytes of obj pickled (tensors with their data; ObjectRefs as references)."""
    buf = io.BytesIO()
    _RefsAsTags(buf, protocol=5).dump(obj)
    return buf.tell()
