"""DraftWorker and TargetWorker: Ray actors that each host one model and its sequences' KV state.

The target wraps `serve_app.engine.worker.ModelWorker`, the draft whatever worker its kind needs
(`serve_app.drafting.draft_worker`); the Router talks to them through `RemoteWorker`, a proxy with
the same methods, so the engine's step runs unchanged across actors. Per step only token ids and a
few numbers per drafted position pass through the Router (for a sampled row, the draft's proposal
over its own top-N tokens). An EAGLE-style draft's features, the target's hidden states of the
positions it made final, go from the target's actor to the draft's directly: the target puts them in
Ray's object store and the Router passes on only the reference.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time

import ray
import torch

from serve_app.config import ModelConfig
from serve_app.drafting import draft_worker
from serve_app.engine.worker import ModelWorker, Verdict
from serve_app.models import load_target


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
        self.direct_bytes = 0
        self.call_s, self.calls = 0.0, 0  # time inside model calls: a caller's wait minus this is the hop

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

    def call(self, method: str, *args):
        self.start()
        t = time.perf_counter()
        try:
            return getattr(self.worker, method)(*args)
        finally:
            self.call_s += time.perf_counter() - t
            self.calls += 1

    def calls(self, batch: list[tuple[str, tuple]]):
        """Several calls in order (`RemoteWorker` holds some back to send with the next); the last one's result.
        A reference among their arguments (an EAGLE-style draft's features) is read here: Ray resolves only the
        references a call gets directly."""
        out = None
        for method, args in batch:
            out = self.call(method, *(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args))
        return out

    def verify(self, seq_ids, proposal, chunks=None) -> Verdict:
        """The target's verification; features (for an EAGLE-style draft) go into this node's object
        store and only their reference returns, so they reach the draft's actor without a Router hop."""
        self.start()
        t = time.perf_counter()
        try:
            return self._verify(seq_ids, proposal, chunks)
        finally:
            self.call_s += time.perf_counter() - t
            self.calls += 1

    def _verify(self, seq_ids, proposal, chunks) -> Verdict:
        verdict = self.worker.verify(seq_ids, proposal, chunks)
        if verdict.features is None:
            return verdict
        self.direct_bytes += sum(f.numel() * f.element_size() for f in verdict.features)
        n = len(seq_ids)  # decoding rows, then prefill chunks: the draft takes them in two calls
        return verdict._replace(features=(ray.put(verdict.features[:n]), ray.put(verdict.features[n:])))

    def kv_room(self, utilization, probe_tokens, share=None):
        """The worker's KV room on its GPU; share None: the GPU count Ray gave this actor (a fraction when
        the draft and target share one GPU), so each role sizes its pool from its own part."""
        if share is None:
            gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
            share = min(1.0, gpus) if gpus else 1.0
        self.start()
        return self.worker.kv_room(utilization, probe_tokens, share)

    def take_timings(self) -> dict:
        self.start()
        out = self.worker.take_timings()
        out["direct_bytes"] += self.direct_bytes
        out["call_s"], out["calls"] = self.call_s, self.calls
        self.direct_bytes, self.call_s, self.calls = 0, 0.0, 0
        return out

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()


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

    A dead or stuck actor raises here (RayActorError / GetTimeoutError), which fails the step and
    ends its requests with an error instead of hanging. With count_bytes, `bytes_sent` and
    `bytes_received` add up the serialized size of what crossed between the engine's process and the
    actor (benchmarks; off by default because measuring is a second serialization).
    """

    MAX_QUEUED = 8
    """Calls held back (`commit`, `prefill`) before they go on their own, in one round trip."""

    def __init__(self, actor, timeout_s: float = 120.0, count_bytes: bool = False):
        self.actor = actor
        self.timeout_s = timeout_s
        self.count_bytes = count_bytes
        self.bytes_sent = self.bytes_received = 0
        self.queued: list[tuple[str, tuple]] = []  # (method, args) held back for the next call

    def _call(self, method: str, *args):
        if not self.queued:
            return self._get(self.actor.call.remote(method, *args), args)
        batch, self.queued = self.queued + [(method, args)], []
        return self._get(self.actor.calls.remote(batch), batch)

    def _queue(self, method: str, *args) -> None:
        """A call whose result the engine does not read (the draft's commit and prefill) rides along with the next
        call (the actor runs them in order, first): one round trip a step instead of two, and no call running
        beside the other worker's forward. Past MAX_QUEUED (steps without speculation) they go on their own."""
        self.queued.append((method, args))
        if len(self.queued) >= self.MAX_QUEUED:
            self.flush()

    def flush(self) -> None:
        """Run the held-back calls now; raises what one of them raised."""
        if self.queued:
            batch, self.queued = self.queued, []
            self._get(self.actor.calls.remote(batch), batch)

    def _get(self, ref, args):
        out = ray.get(ref, timeout=self.timeout_s)
        if self.count_bytes:
            self.bytes_sent += serialized_size(args)
            self.bytes_received += serialized_size(out)
        return out

    def configure_kv(self, block_size, max_blocks, prefix_caching, attention_backend="auto", preallocate=False):
        return self._call("configure_kv", block_size, max_blocks, prefix_caching, attention_backend, preallocate)

    def kv_room(self, utilization, probe_tokens, share=None, memory=None):
        # share None: the actor's own GPU count (below 1 when it shares its GPU with the other role)
        self.flush()
        return self._get(self.actor.kv_room.remote(utilization, probe_tokens, share), ())

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

    def verify(self, seq_ids, proposal, chunks=None):
        """The Verdict's features, if any, stay a reference: `commit` / `prefill` hand it to the draft's
        actor, which Ray gives the tensors from the target's node directly."""
        self.flush()
        return self._get(self.actor.verify.remote(seq_ids, proposal, chunks), (seq_ids, proposal, chunks))

    def commit(self, seq_ids, new_tokens, features=None) -> None:
        self._queue("commit", seq_ids, new_tokens, features)

    def prompt_logprobs(self, ids, top):
        return self._call("prompt_logprobs", ids, top)

    def capture_features(self, layers):
        return self._call("capture_features", layers)

    def take_timings(self) -> dict:
        self.flush()
        return self._get(self.actor.take_timings.remote(), ())

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
