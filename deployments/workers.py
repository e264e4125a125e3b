"""DraftWorker and TargetWorker: Ray actors that each host one model and its sequences' KV state.

The target wraps `serve_app.engine.worker.ModelWorker`, the draft whatever worker its kind needs
(`serve_app.drafting.draft_worker`); the Router talks to them through `RemoteWorker`, a proxy with
the same methods, so the engine's step runs unchanged across actors. Per step only token ids (and,
when sampling, the draft's distributions, sparse when top-k/top-p allow; for an EAGLE-style draft,
the target's features of the positions it made final) cross between them.
"""

from __future__ import annotations

import os

import ray
import torch

from serve_app.config import ModelConfig
from serve_app.drafting import draft_worker
from serve_app.models import draft_spec, load_draft, load_target
from serve_app.engine.worker import ModelWorker


class _ModelHost:
    """Loads one model and forwards engine calls to its ModelWorker."""

    role = ""

    def __init__(self, model: dict, torch_threads: int = 0):
        # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1), which would leave torch one core.
        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        mc = ModelConfig(**model)
        target, tokenizer, _ = load_target(mc.target, mc.dtype, mc.device)
        pad = tokenizer.pad_token_id or 0
        if self.role == "target":
            self.worker = ModelWorker(target, "target", pad)
        else:
            self.worker = draft_worker(load_draft(draft_spec(mc), target, tokenizer, mc.dtype, mc.device), pad)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class TargetWorker(_ModelHost):
    role = "target"


@ray.remote
class DraftWorker(_ModelHost):
    role = "draft"


class RemoteWorker:
    """ModelWorker's interface over a worker actor (blocking calls, made from the engine's thread).

    A dead or stuck actor raises here (RayActorError / GetTimeoutError), which fails the step and
    ends its requests with an error instead of hanging.
    """

    def __init__(self, actor, timeout_s: float = 120.0):
        self.actor = actor
        self.timeout_s = timeout_s

    def _call(self, method: str, *args):
        return ray.get(self.actor.call.remote(method, *args), timeout=self.timeout_s)

    def add(self, seq_ids, prompts, params):
        return self._call("add", seq_ids, prompts, params)

    def remove(self, seq_ids):
        return self._call("remove", seq_ids)

    def reset(self):
        return self._call("reset")

    def prefill(self, seq_ids, features=None):
        return self._call("prefill", seq_ids, features)

    def propose(self, seq_ids, k):
        return self._call("propose", seq_ids, k)

    def verify(self, seq_ids, proposal):
        return self._call("verify", seq_ids, proposal)

    def commit(self, seq_ids, new_tokens, features=None):
        return self._call("commit", seq_ids, new_tokens, features)

    def capture_features(self, layers):
        return self._call("capture_features", layers)

    def info(self) -> dict:
        return self._call("info")
