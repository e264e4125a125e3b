"""Deployment settings: engine groups (one per GPU type) and the application around them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.config import EngineConfig, ModelConfig


class GroupConfig(BaseModel):
    """One engine group: Router replicas whose worker pairs sit on one kind of hardware."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("default", pattern=r"^[A-Za-z0-9_-]+$")
    """Group name; its Router deployment is called Router-<name>."""
    gpu_type: str | None = None
    """Profile key for this group (e.g. NVIDIA_A100). None: detected on the target worker."""
    accelerator_type: str | None = None
    """Ray accelerator type the workers must run on (e.g. A100, L4); None: any node."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each worker needs (another way to pin a group to a node type)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs per worker actor where target_gpus / draft_gpus are not given: 1 on GPU nodes, a fraction to
    share one GPU, 0 on CPU."""
    target_gpus: float | None = Field(None, ge=0)
    """GPUs for the target's worker actor (None: num_gpus). Below 1: a share of one GPU (0.5 + 0.5 with the
    draft on one GPU); above 1 a whole number."""
    draft_gpus: float | None = Field(None, ge=0)
    """GPUs for the draft's worker actor (None: num_gpus), e.g. 0.25 for a 1B draft beside an 8B target's 0.75,
    or 1 + 1 on a two-GPU node. A replica's two actors land on one node (STRICT_PACK): both counts fit one node."""
    worker_cpus: float = Field(1, gt=0)
    """CPUs reserved per worker actor."""
    torch_threads: int = Field(0, ge=0)
    """torch threads per worker actor; 0: all the CPUs the actor's process may use, its cores capped
    by its container's CPU quota (serve_app.hardware.available_cpus; Ray would otherwise give torch
    only the actor's num_cpus). The target's; the draft's is `draft_torch_threads`."""
    draft_torch_threads: int = Field(1, ge=0)
    """torch threads for the draft's worker actor; 0: as `torch_threads`. One by default: a draft's forward is
    small, and after each one libgomp's threads spin-wait on the cores the target's verification needs next, so
    on a CPU a one-threaded draft left the target more of the machine (`specserve serve` on 2 cores, 3 rounds
    against the draft on both: 1.08-1.49x tokens/s at 1 in flight, 0.98-1.16x at 8, 0.97-1.44x at 32;
    docs/benchmarks.md). It also drafts on the host when the models are on a GPU, where one is plenty."""
    num_replicas: int = Field(1, ge=1)
    """Router replicas (each with its own draft + target pair)."""
    placement_strategy: str = Field("STRICT_PACK", pattern="^(STRICT_PACK|PACK|SPREAD|STRICT_SPREAD)$")
    """Placement of a replica's two workers; STRICT_PACK keeps them on one node."""
    call_timeout_s: float = Field(120, gt=0)
    """A worker call slower than this fails the step instead of hanging: its requests are resumed on a
    replacement worker."""
    channel: bool = True
    """True: the Router's calls to its workers over a TCP connection to each worker's model thread, the
    target's features to the draft over one of their own (deployments.channel: ~0.1 ms a call, where a Ray
    task call took 3-7 ms on 2 cores). False: as Ray task calls, the features through Ray's object store."""
    worker_start_timeout_s: float = Field(300, gt=0)
    """How long a replacement worker actor may take to start (load its model) before the repair fails."""

    def threads(self, role: str) -> int:
        """torch threads for the worker actor of `role` (0: all the CPUs its process may use)."""
        return self.torch_threads if role == "target" else self.draft_torch_threads or self.torch_threads

    def gpus(self, role: str) -> float:
        """GPUs the worker actor of `role` (target or draft) asks Ray for."""
        own = self.target_gpus if role == "target" else self.draft_gpus
        return self.num_gpus if own is None else own

    def bundle(self, role: str, resources: dict) -> dict:
        """The placement-group bundle of `role`'s worker actor: its CPUs, its GPUs (a fraction shares one GPU)
        and the group's custom resources."""
        gpus = self.gpus(role)
        return {"CPU": self.worker_cpus, **({"GPU": gpus} if gpus else {}), **resources}

    @model_validator(mode="after")
    def _gpu_counts_ray_can_place(self) -> "GroupConfig":
        for role in ("target", "draft"):
            n = self.gpus(role)
            if n > 1 and n != int(n):
                raise ValueError(f"group {self.name}: {role}_gpus = {n:g}: a count above 1 must be a whole number of "
                                 "GPUs (Ray gives fractions of one GPU only)")
        return self


class AppConfig(BaseModel):
    """Everything build_app needs: models, engine limits, groups, HTTP limits."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Target and draft for every group."""
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(policy="adaptive", max_batch_size=32))
    """Batching limits and the speculation policy (lut or adaptive: the profile of each group's hardware); by
    default up to 32 requests decode together (the profiles' largest batch)."""
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig()], min_length=1)
    """Engine groups behind the one ingress (one per GPU type)."""
    served_model_name: str | None = None
    """Model name clients send; None: the target's name (e.g. SmolLM2-135M-Instruct)."""
    max_queue: int = Field(64, ge=1)
    """Requests waiting for admission per Router replica; beyond it, 429."""
    max_tokens_limit: int = Field(2048, ge=1)
    """Largest max_tokens a request may ask for."""
    profiles_dir: str | None = "profiles"
    """Directory of profile JSON files loaded by the ProfileStore at start."""
    profile_poll_s: float = Field(2.0, gt=0)
    """How often routers check the ProfileStore for a newer profile."""
    health_check_period_s: float = Field(10, gt=0)
    """How often Serve checks each Router (and through it, its workers)."""
    replica_wait_s: float = Field(120, gt=0)
    """When a Router replica dies, how long the ingress keeps trying to resubmit its requests to the
    group (a live replica, or the replacement Serve starts) before answering 503."""
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources the ingress and the ProfileStore need, to pin them to a node that stays
    (e.g. {"head": 0.001} with the head started with that resource): by default they may land on any
    node, and one lost with a GPU node takes the HTTP entry with it until Serve replaces it."""
    access_log: bool = False
    """Log a line per request and per internal call (Serve's access log). Off by default: errors and
    state changes (a worker replaced, a profile pushed) are logged either way."""
    drain_timeout_s: float = Field(60, gt=0)
    """On shutdown (SIGTERM to `specserve serve`, a pod deleted, a RayService upgrade) new requests get
    503 and in-flight ones get this long to finish. Keep Kubernetes' terminationGracePeriodSeconds above it."""
    router_in_ingress: bool = False
    """Host the one group's Router inside the ingress's replica (Serve LLM's "direct streaming"): a token goes from
    the engine to its HTTP response without a streamed Ray item between two deployments, which costs about a
    fifth of a core at 32 in flight on 2 cores, beside the forward (docs/benchmarks.md). Needs one group and no
    ingress_resources (the ingress then has the group's replicas and placement). What it gives up: a Router that
    fails takes its ingress replica with it, so its requests end with an error instead of resuming on another
    replica. `specserve serve` turns it on (--separate-router keeps the two deployments)."""

    @model_validator(mode="after")
    def _no_default_draft_without_speculation(self) -> "AppConfig":
        """Policy none never drafts: the target's default draft is not started (an actor, its forwards over each
        step's features and the target's capture of them, all beside the forward for nothing). A draft named
        in `model.draft` still is."""
        if self.engine.policy == "none" and self.model.draft is None:
            self.model = self.model.model_copy(update={"draft": "none"})
        return self

    @model_validator(mode="after")
    def _one_group_for_router_in_ingress(self) -> "AppConfig":
        if self.router_in_ingress and (len(self.groups) != 1 or self.ingress_resources):
            raise ValueError("router_in_ingress needs exactly one group and no ingress_resources (the ingress then "
                             "sits where the group's Router would)")
        return self

    @model_validator(mode="after")
    def _every_model_has_its_gpu(self) -> "AppConfig":
        from serve_app.models import draft_spec

        if not self.model.device.startswith("cuda"):
            return self  # CPU workers (GPU counts there are Ray's logical resources: placement only)
        roles = ["target"] + (["draft"] if draft_spec(self.model) not in ("none",) and
                              not draft_spec(self.model).startswith("ngram") else [])
        for g in self.groups:
            missing = [r for r in roles if not g.gpus(r)]
            if missing:
                raise ValueError(f"group {g.name}: device {self.model.device} but the {' and '.join(missing)} worker "
                                 f"asks Ray for no GPU (set {missing[0]}_gpus or num_gpus; 0.5 each shares one GPU)")
        return self
