"""Router: one engine group's continuous-batching loop over a DraftWorker + TargetWorker pair.

Each replica places its two worker actors in a placement group (STRICT_PACK: same node), runs the
engine's step loop across them, bounds its admission queue, streams tokens to callers, and picks k
each step with the profile of its hardware type from the shared ProfileStore (polled, so a pushed
profile takes effect without a restart).

A worker actor that dies is replaced in place (same placement-group bundle) by the engine's repair
hook, and the engine resumes the requests it was running: a dead target stalls the batch while its
replacement loads, a dead draft only turns speculation off (k = 0) until its replacement is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import contextvars
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter as Tally
from collections import deque

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.models import draft_spec, load_tokenizer, model_names
from serve_app.engine.allocator import allocator_env
from serve_app.engine.policy import AcceptanceEstimate, make_policy, needs_profile
from serve_app.profiling.calibration import Calibrated, calibrated, calibrated_profile, steering_profile
from serve_app.profiling.profiles import Profile
from serve_app.profiling.startup import short_profile
from serve_app.engine.scheduler import Engine, RequestOutput
from serve_app.engine.stats import StepStats
from serve_app.bench import regret

from .config import GroupConfig
from .latency import new_histograms, observe
from .workers import DraftWorker, RemoteWorker, TargetWorker

log = logging.getLogger("ray.serve")

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]


class HeldGauge(metrics.Gauge):
    """A Ray gauge that remembers its last value per tag set, so the Router can set them again (`again`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last: dict[tuple, float] = {}

    def set(self, value, tags: dict | None = None) -> None:
        self.last[tuple(sorted((tags or {}).items()))] = value
        super().set(value, tags=tags)

    def again(self) -> None:
        for key, value in list(self.last.items()):  # list(): the step thread may add a tag set meanwhile
            super().set(value, tags=dict(key) or None)


@serve.deployment(max_ongoing_requests=4096, health_check_period_s=10, health_check_timeout_s=60,
                  ray_actor_options={"num_cpus": 0})
class Router:
    async def __init__(self, group: dict, model: dict, engine: dict, max_queue: int, store=None, profile_poll_s: float = 2.0,
                       history=None):
        self.group = GroupConfig(**group)
        mc, self.engine_config = ModelConfig(**model), EngineConfig(**engine)
        self.max_queue, self.store, self.profile_poll_s = max_queue, store, profile_poll_s
        has_draft = draft_spec(mc) != "none"
        self.model_config = mc
        self.roles = ["target"] + (["draft"] if has_draft else [])
        self._generation = itertools.count()
        self.pg = self._placement_group()
        self.actors = [self._start_worker(i) for i in range(len(self.roles))]
        self.actor_names = [self._names[i] for i in range(len(self.roles))]
        target = RemoteWorker(self.actors[0], self.group.call_timeout_s, channel=self.group.channel)
        draft = RemoteWorker(self.actors[1], self.group.call_timeout_s, channel=self.group.channel) if has_draft else None
        target.features_to = lambda: self.engine.draft
        await asyncio.gather(*(a.start.remote() for a in self.actors))  # ready only once both models loaded
        info = await self.actors[0].call.remote("info")
        self.gpu_type = self.group.gpu_type or info["gpu_type"]
        self.model_pair = model_names(mc)
        self.dtype = info["dtype"]  # what `auto` resolved to on the target's node
        self.profile_problem: str | None = None
        self.profile_version, self.profile = await self._fetch_profile()
        self.machine = socket.gethostname()
        self.shared = await self._fetch_shared()  # a calibrated profile another replica of this type shared
        self._polls = 0
        self.local: Profile | None = None  # a startup profile of this machine (EngineConfig.startup_profile)
        self.startup: dict | None = None  # what it cost and found, for stats()
        self.engine = Engine(target, draft, load_tokenizer(mc.target), self.engine_config, self._policy())
        if has_draft and self._wants_startup_profile():
            await asyncio.to_thread(self._startup_profile)
        self.engine.on_step.append(self._on_step)
        self.engine.repair = self._repair
        self.recoveries: list[dict] = []  # {role, seconds}: each replaced worker and how long it took
        self.repair_failures = 0  # consecutive; past a few, the health check gives up on this replica
        self.starting: set[int] = set()  # actors being replaced in the background (a draft)
        self.resumed = 0  # finished requests that were resumed after a worker or replica failure
        # What /metrics on the API port shows (reported to the store with each profile poll).
        self.totals = self.new_totals()
        self.histograms = new_histograms()  # request latencies for /metrics (vLLM's histograms)
        self.last_step = {"batch_size": 0, "k": 0}
        self.k_tally: Tally = Tally()
        self.observed = AcceptanceEstimate(0.0)  # live acceptance under any policy (adaptive keeps its own)
        self.recent: deque[StepStats] = deque(maxlen=self.REGRET_STEPS)  # decode steps, for stats()["regret"]
        self.drifted = False  # calibrated latencies past DRIFT_WARN (logged once each way)
        self.max_batch_seen = 0
        self.split = self.new_split()  # where the steps' time went since the last breakdown()
        self._poll_task: asyncio.Task | None = None
        self._metrics()
        self._gauge_task = asyncio.get_running_loop().create_task(self._hold_gauges(), context=contextvars.Context())
        # the deployment's shared suffix history (`history_store`): what this replica's draft finished goes there,
        # what the others finished comes back; pulled once now so a new replica drafts warm from its first request
        self.history_store, self.history_seen, self.history_draft = history, (None, 0), None
        self.history: dict | None = None  # the draft's history stats, as of the last exchange
        try:
            await self._exchange_history()
        except Exception:
            log.warning("could not pull the shared suffix history", exc_info=True)

    @staticmethod
    def new_split() -> dict:
        return {"steps": 0, "tokens": 0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0, "gap_s": 0.0}

    async def breakdown(self) -> dict:
        """Where a step's time went since the last call (which it resets), in ms per step: the Router's wait on
        each worker split into the worker's own time in its calls (forwards, vocabulary work, the rest) and
        the hops (Ray's calls there and back), the Router's own work in the step, and the gap between steps
        (streaming the outputs, the hop to the step's thread). A target that looks ahead (`_ModelHost._look_ahead`)
        runs some forwards while the Router is not waiting: its hops are then net of that overlap (below zero
        where the overlap hid more than the hops cost)."""
        split, self.split = self.split, self.new_split()
        workers = await asyncio.gather(*(asyncio.to_thread(self._worker(i).take_timings) if self.group.channel
                                         else a.take_timings.remote() for i, a in enumerate(self.actors)),
                                       return_exceptions=True)
        n = max(1, split["steps"])
        ms = lambda s: round(1e3 * s / n, 2)
        out = {"steps": split["steps"], "tokens": split["tokens"],
               "step_ms": ms(split["draft_s"] + split["verify_s"] + split["other_s"] + split["gap_s"]),
               "router_ms": ms(split["other_s"]), "gap_ms": ms(split["gap_s"])}
        for role, timings in zip(self.roles, workers):
            wait = split["verify_s" if role == "target" else "draft_s"]
            if isinstance(timings, BaseException):  # a worker being replaced: its wait only
                out[role] = {"wait_ms": ms(wait)}
                continue
            worked = timings["call_s"] + timings["ahead_s"]  # a looked-ahead step's forward ran outside any call
            out[role] = {"wait_ms": ms(wait), "calls_per_step": round(timings["calls"] / n, 2),
                         "forward_ms": ms(timings["forward_s"]), "sample_ms": ms(timings["sample_s"]),
                         "call_other_ms": ms(worked - timings["forward_s"] - timings["sample_s"]),
                         "hops_ms": ms(wait - worked), "ahead_ms": ms(timings["ahead_s"]),
                         "ahead_hits": round(timings["ahead_hits"] / n, 2)}
        return out

    @staticmethod
    def new_totals() -> dict:
        return {"requests": Tally(), "prompt_tokens": 0, "generated_tokens": 0, "drafts": 0,
                "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": Tally(),
                "prefix_queries": 0, "prefix_hits": 0, "preemptions": 0,
                "source_proposed": Tally(), "source_accepted": Tally()}

    # ---- setup -------------------------------------------------------------------------------
    def _resources(self) -> dict:
        resources = dict(self.group.resources)
        if self.group.accelerator_type:
            resources[f"accelerator_type:{self.group.accelerator_type}"] = 0.001
        return resources

    def _placement_group(self):
        """One bundle per role, each with that role's GPUs (target_gpus / draft_gpus), placed together by the
        group's strategy; refused with the bundles and the cluster's resources named when Ray cannot place it
        in worker_start_timeout_s (a GPU count no node has), rather than pending forever."""
        g = self.group
        bundles = [g.bundle(role, self._resources()) for role in self.roles]
        self._names: dict[int, str] = {}
        pg = placement_group(bundles, strategy=g.placement_strategy)
        if not pg.wait(g.worker_start_timeout_s):
            remove_placement_group(pg)
            raise RuntimeError(f"group {g.name}: Ray could not place its workers {dict(zip(self.roles, bundles))} "
                               f"({g.placement_strategy}) in {g.worker_start_timeout_s:g} s; the cluster has "
                               f"{ray.cluster_resources()}: give the roles fewer GPUs or add a node that has them")
        return pg

    def _start_worker(self, i: int):
        """Start worker actor i (0 target, 1 draft) in its bundle of this replica's placement group;
        a replacement gets the same bundle, so it lands where the dead one was reserved."""
        g, role = self.group, self.roles[i]
        replica = serve.get_replica_context().replica_id.unique_id
        gen = next(self._generation)
        self._names[i] = f"specserve-{g.name}-{replica}-{role}" + (f"-{gen}" if gen >= len(self.roles) else "")
        cls = TargetWorker if role == "target" else DraftWorker
        # one thread for the model calls (the engine makes one at a time); `ping` has its own (workers.CONTROL)
        return cls.options(
            name=self._names[i], max_concurrency=1, num_cpus=g.worker_cpus, num_gpus=g.gpus(role), resources=self._resources() or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            runtime_env={"env_vars": allocator_env()} if self.model_config.device == "cpu" else None,
        ).remote(self.model_config.model_dump(), g.threads(role))

    # ---- repair (Engine.repair: runs in the engine's step thread) ---------------------------
    def _alive(self, actor) -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=10)
            return True
        except ray.exceptions.GetTimeoutError:  # stuck: as good as dead, and it holds the bundle
            ray.kill(actor)
            return False
        except ray.exceptions.RayError:
            return False

    def _replace(self, i: int):
        t0 = time.perf_counter()
        self.actors[i] = self._start_worker(i)
        self.actor_names[i] = self._names[i]
        return t0

    def _ready(self, i: int, t0: float) -> None:
        ray.get(self.actors[i].start.remote(), timeout=self.group.worker_start_timeout_s)  # its model loaded
        if self.roles[i] == "draft" and self.history_store is not None and self.history is not None:
            # a replacement draft remembers its outputs for the shared history from its first request, not from
            # the next poll's exchange (what finished in between never reached the store)
            ray.get(self.actors[i].call.remote("take_history"), timeout=self.group.call_timeout_s)
        self.recoveries.append({"role": self.roles[i], "seconds": round(time.perf_counter() - t0, 2)})
        self.m_recoveries.inc(tags={"role": self.roles[i]})
        log.warning("%s worker of group %s replaced in %.1f s", self.roles[i], self.group.name, time.perf_counter() - t0)

    def _repair(self, engine: Engine) -> None:
        dead = [i for i, a in enumerate(self.actors) if i not in self.starting and not self._alive(a)]
        try:
            if 0 in dead:  # no target, no decoding: wait for the replacement (and a dead draft's alongside)
                starts = {i: self._replace(i) for i in dead}
                for i, t0 in starts.items():
                    self._ready(i, t0)
                engine.target.actor = self.actors[0]
                if 1 in dead:
                    engine.draft.actor = self.actors[1]
            elif 1 in dead:  # decode at k = 0 while the draft's replacement loads, then bring it in
                t0 = self._replace(1)
                engine.draft = None
                self.starting.add(1)
                threading.Thread(target=self._bring_draft_back, args=(engine, t0), daemon=True).start()
        except Exception:
            self.repair_failures += 1
            raise
        self.repair_failures = 0

    def _bring_draft_back(self, engine: Engine, t0: float) -> None:
        try:
            self._ready(1, t0)
            engine.attach_draft(RemoteWorker(self.actors[1], self.group.call_timeout_s, channel=self.group.channel))
        except Exception:
            log.exception("replacement draft worker failed to start; decoding without speculation")
            self.repair_failures += 1
        finally:
            self.starting.discard(1)

    def _worker(self, i: int) -> RemoteWorker:
        """The engine's proxy of worker i (0 target, 1 draft): calls to a worker go through it (its channel holds
        the worker's model thread); a draft being replaced has none (raises)."""
        worker = self.engine.target if i == 0 else self.engine.draft
        if worker is None:
            raise RuntimeError(f"the {self.roles[i]} worker is being replaced")
        return worker

    async def _fetch_profile(self) -> tuple[int, Profile | None]:
        if self.store is None:
            return 0, None
        version, data = await self.store.get.remote(self.gpu_type)
        return version, Profile.model_validate(data) if data else None

    async def _fetch_shared(self) -> Profile | None:
        if self.store is None or not self.engine_config.calibrate:
            return None
        _, data = await self.store.get_calibrated.remote(self.gpu_type)
        return Profile.model_validate(data) if data else None

    SHARE_EVERY = 15
    """Polls between two shares of this replica's calibrated profile (30 s at the default 2 s poll)."""

    async def _share(self) -> None:
        """Leave this replica's calibrated profile in the store for the others of its type (new replicas
        start from it while no measured profile of their own machine exists), once it has learned enough
        and differs from what it steers by."""
        policy = self.engine.policy
        if not isinstance(policy, Calibrated) or policy.calibration.used < 64 or policy.calibration.drift() < 0.05:
            return
        shared = calibrated_profile(policy.profile, policy.calibration, self.machine)
        await self.store.share.remote(shared.model_dump(), self.profile_version)

    def _wants_startup_profile(self) -> bool:
        """EngineConfig.startup_profile: True when no profile measured here is held; None (default) when the
        policy needs a profile and none usable is held (missing, another pair or dtype, no latency grid)."""
        want = self.engine_config.startup_profile
        if want is not None:
            return want and not self._measured_here()
        return needs_profile(self.engine_config.policy) and not self._usable(self.profile)

    def _usable(self, profile) -> bool:
        """The profile is for this pair and dtype and holds what the policy reads."""
        if profile is None:
            return False
        try:
            profile.check_pair(*self.model_pair, self.dtype)
            make_policy(self.engine_config.policy, profile)
            return True
        except ValueError:
            return False

    def _measured_here(self) -> bool:
        return self.profile is not None and self.profile.source == "measured" and self.profile.machine == self.machine

    def _startup_profile(self) -> None:
        """Measure a short profile of this machine on the engine before it serves (`profiling.startup`) and
        steer by it: no profile measured here is held, and one from elsewhere can be far off."""
        t = time.perf_counter()
        try:
            self.local = short_profile(self.engine, self.gpu_type, *self.model_pair, self.dtype)
        except Exception as e:  # a replica that cannot profile still serves, on what it holds
            log.warning("startup profile failed (%s); steering by the held profile", e)
            self.startup = {"error": str(e)}
            return
        self.startup = {"seconds": round(time.perf_counter() - t, 2), "batch_sizes": self.local.latency.batch_sizes,
                        "ks": self.local.latency.ks, "best_k": self.local.best_k,
                        "acceptance_rate": self.local.acceptance_rate}
        log.info("group %s: startup profile of %s in %.1f s: best k %s", self.group.name, self.machine,
                 self.startup["seconds"], self.local.best_k)
        self.engine.policy = self._policy()

    def _policy(self):
        """The configured policy; a profile-driven one without a usable profile decodes plainly meanwhile."""
        spec, self.profile_problem = self.engine_config.policy, None
        if needs_profile(spec):
            try:
                if self.profile is None and self.local is None:
                    raise ValueError(f"no profile for hardware type {self.gpu_type} yet")
                # a usable profile measured on this machine; else its startup profile; else one another replica of the
                # type calibrated and shared; else the held one
                if self.local is not None and not (self._measured_here() and self._usable(self.profile)):
                    base = self.local
                elif self.engine_config.calibrate:
                    base = steering_profile(self.profile, self.shared, self.machine)
                else:
                    base = self.profile
                base.check_pair(*self.model_pair, self.dtype)
                policy = make_policy(spec, base)
                # a new profile means a new calibration: what was learned was relative to the old one
                return calibrated(policy, base) if self.engine_config.calibrate else policy
            except ValueError as e:
                self.profile_problem = str(e)
                log.warning("policy %s: %s; decoding without speculation until a usable profile is pushed", spec, e)
                spec = "none"
        return make_policy(spec)

    def _metrics(self) -> None:
        tags = ("gpu_type", "group")
        self.m_requests = metrics.Counter("specserve_requests", "Finished requests by status.", tag_keys=tags + ("status",))
        self.m_prompt = metrics.Counter("specserve_prompt_tokens", "Prompt tokens of finished requests.", tag_keys=tags)
        self.m_generated = metrics.Counter("specserve_generated_tokens", "Tokens generated.", tag_keys=tags)
        self.m_proposed = metrics.Counter("specserve_proposed_tokens", "Draft tokens proposed.", tag_keys=tags)
        self.m_accepted = metrics.Counter("specserve_accepted_tokens", "Draft tokens accepted.", tag_keys=tags)
        self.m_ttft = metrics.Histogram("specserve_ttft_seconds", "Time to first token.", boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_itl = metrics.Histogram("specserve_itl_seconds", "Inter-token latency: seconds between two outputs of a request.",
                                       boundaries=ITL_BUCKETS, tag_keys=tags)
        self.m_e2e = metrics.Histogram("specserve_e2e_seconds", "Seconds from arrival to a finished request's last token.",
                                       boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_queue_time = metrics.Histogram("specserve_queue_time_seconds", "Seconds a request waited for admission.",
                                              boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_latency = {"ttft": self.m_ttft, "itl": self.m_itl, "e2e": self.m_e2e, "queue": self.m_queue_time}
        self.m_tpot = metrics.Histogram("specserve_tpot_seconds", "Time per output token after the first.", boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_step = metrics.Histogram("specserve_step_seconds", "Engine step latency.", boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_batch = HeldGauge("specserve_batch_size", "Sequences in the last engine step.", tag_keys=tags)
        self.m_k = HeldGauge("specserve_speculation_k", "Speculation length chosen for the last step.", tag_keys=tags)
        self.m_queue = HeldGauge("specserve_queue_depth", "Requests waiting for admission.", tag_keys=tags)
        self.m_estimate = HeldGauge("specserve_acceptance_estimate",
                                        "Live per-token draft acceptance estimate (what the adaptive policy steers by).",
                                        tag_keys=tags)
        self.m_recoveries = metrics.Counter("specserve_worker_recoveries", "Worker actors replaced after dying.",
                                            tag_keys=tags + ("role",))
        self.m_resumed = metrics.Counter("specserve_resumed_requests", "Requests resumed after a worker failure.",
                                         tag_keys=tags)
        self.m_profile = HeldGauge("specserve_profile_info",
                                       "1 on the series of the kind of profile this group holds (measured, predicted, "
                                       "or none); 0 on the others.", tag_keys=tags + ("source",))
        self.m_source = metrics.Counter("specserve_draft_source_tokens",
                                        "Draft tokens by source (model, context: prompt lookup, history: earlier outputs) "
                                        "and outcome (proposed, accepted).", tag_keys=tags + ("source", "outcome"))
        self.m_history_tokens = HeldGauge("specserve_history_tokens", "Tokens the draft's suffix history holds.",
                                              tag_keys=tags)
        self.m_history_hits = HeldGauge("specserve_history_hit_ratio",
                                            "Share of the suffix history's lookups that found a match (since its draft started).",
                                            tag_keys=tags)
        for m in (self.m_recoveries, self.m_resumed, self.m_requests, self.m_prompt, self.m_generated, self.m_proposed, self.m_accepted,
                  self.m_ttft, self.m_itl, self.m_e2e, self.m_queue_time, self.m_tpot, self.m_step, self.m_batch, self.m_k,
                  self.m_queue, self.m_estimate, self.m_profile,
                  self.m_source, self.m_history_tokens, self.m_history_hits):
            m.set_default_tags({"gpu_type": self.gpu_type, "group": self.group.name})
        self._profile_gauge()

    GAUGE_HOLD_S = 1.0
    """How often the gauges are set again with their last values: Ray's metrics agent drops a gauge series not
    set for two export intervals (20 s by default, 2 s at the shortest), so without it an idle router's batch
    size, k and queue depth would vanish from Prometheus between bursts."""

    async def _hold_gauges(self) -> None:
        gauges = [m for m in vars(self).values() if isinstance(m, HeldGauge)]
        while True:
            await asyncio.sleep(self.GAUGE_HOLD_S)
            for g in gauges:
                g.again()

    def profile_source(self) -> str:
        """`measured` or `predicted` (the profile held for this hardware type), `none` without one."""
        return self.profile.source if self.profile is not None else "none"

    def _profile_gauge(self) -> None:
        # Every source gets a value, so a predicted profile replaced by a measured one drops to 0 rather
        # than lingering at 1 beside it.
        for source in ("measured", "predicted", "none"):
            self.m_profile.set(1 if source == self.profile_source() else 0, tags={"source": source})

    # ---- serving -----------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: dict, request_id: str = "req", stream: bool = True,
                       resume: dict | None = None):
        """Events {text, token_ids, finished, finish_reason, ...}, or one {error, status}.

        stream=False sends a single final event with the whole text: every event costs a hop through
        Serve (router -> ingress -> proxy) on the CPUs the models use, so unstreamed requests skip them.
        resume: {"output_ids", "sent_chars"}: the ingress continuing a request whose replica died.
        """
        self._ensure_poll()
        if len(self.engine.waiting) >= self.max_queue:
            self.m_requests.inc(tags={"status": "429"})
            yield {"error": f"server busy: {len(self.engine.waiting)} requests already waiting", "status": 429}
            return
        try:
            sampling = SamplingParams(**params)
        except ValidationError as e:
            err = e.errors()[0]
            self.m_requests.inc(tags={"status": "400"})
            yield {"error": f"{'.'.join(map(str, err['loc']))}: {err['msg']}", "status": 400}
            return
        text, token_ids, logprobs, prompt_lps = [], [], [], None
        recorded = False  # a final output was counted: a caller leaving after it is not a 499 too
        last = None  # when this request's previous tokens came out (inter-token latency)
        try:
            # aclosing: when the caller leaves, the engine stream's `finally` aborts the request now
            # (a waiting one leaves the queue at once), not whenever the generator is collected.
            async with contextlib.aclosing(self.engine.generate(prompt_ids, sampling, request_id, resume)) as outs:
                async for out in outs:
                    if out.token_ids:
                        now = time.perf_counter()
                        if last is not None:
                            self._observe("itl", now - last)
                        last = now
                    if out.finished:
                        self._record_request(out)
                        recorded = True
                    if stream:
                        yield self._event(out)
                        continue
                    text.append(out.text)
                    token_ids += out.token_ids
                    logprobs += out.logprobs or []
                    prompt_lps = prompt_lps or out.prompt_logprobs
                    if out.finished:
                        out.text, out.token_ids = "".join(text), token_ids
                        out.logprobs = logprobs if sampling.logprobs is not None else None
                        out.prompt_logprobs = prompt_lps
                        yield self._event(out)
        except ValueError as e:  # refused by Engine.submit before anything was generated
            self.m_requests.inc(tags={"status": "400"})
            yield {"error": str(e), "status": 400}
        except (asyncio.CancelledError, GeneratorExit):
            if not recorded:
                # The caller left (client disconnect -> cancel) before the final output: the engine's
                # abort output is never consumed here, so count it as 499 whether the request was still
                # waiting or already running, as `_record_request` does for an abort output that arrives.
                self.m_requests.inc(tags={"status": "499"})
            raise
        finally:
            self.m_queue.set(len(self.engine.waiting))  # an abort shortens the queue now, not at a step

    def _event(self, out: RequestOutput) -> dict:
        ev = {"text": out.text, "token_ids": out.token_ids, "finished": out.finished, "finish_reason": out.finish_reason}
        if out.logprobs is not None:
            ev["logprobs"] = out.logprobs
        if out.prompt_logprobs is not None:
            ev["prompt_logprobs"] = out.prompt_logprobs
        if out.error:
            ev.update(error=out.error, status=503)
            if out.retry_after_s:
                ev["retry_after"] = out.retry_after_s
        if out.stats:
            ev["stats"] = out.stats.to_dict()
        return ev

    def _record_request(self, out: RequestOutput) -> None:
        status = {"error": "503", "abort": "499"}.get(out.finish_reason, "200")
        self.m_requests.inc(tags={"status": status})
        self.totals["requests"][status] += 1
        self.totals["prompt_tokens"] += out.stats.prompt_tokens
        self.totals["generated_tokens"] += max(out.stats.generated_tokens - out.stats.carried_tokens, 0)
        s = out.stats
        if s.resumes:
            self.m_resumed.inc()
            self.resumed += 1
        self.m_prompt.inc(s.prompt_tokens)
        if s.generated_tokens > s.carried_tokens:  # what the replica that died generated was counted there
            self.m_generated.inc(s.generated_tokens - s.carried_tokens)
            if not s.carried_tokens:  # a continued request's first token came from the other replica
                self._observe("ttft", s.ttft_s)
        if s.generated_tokens > 1:
            self.m_tpot.observe(s.tpot_s)
        if status == "200":
            self._observe("e2e", s.total_s)
            self._observe("queue", s.queue_s)

    def _observe(self, key: str, seconds: float) -> None:
        """One latency into /metrics' histogram (vLLM's name) and Ray's exporter (the dashboard's)."""
        observe(self.histograms, key, seconds)
        self.m_latency[key].observe(seconds)

    def _on_step(self, st: StepStats) -> None:  # runs in the engine's step thread
        self.m_step.observe(st.draft_s + st.verify_s + st.other_s)
        split = self.split
        split["steps"] += 1
        split["tokens"] += st.generated + st.prefilled
        for part in ("draft_s", "verify_s", "other_s", "gap_s"):
            split[part] += getattr(st, part)
        self.m_queue.set(len(self.engine.waiting))
        self.totals["prefix_queries"] += st.prefix_queried
        self.totals["prefix_hits"] += st.prefix_hits
        self.totals["preemptions"] += st.preempted
        if st.batch_size:
            self.m_batch.set(st.batch_size)
            self.m_k.set(st.k)
            self.last_step = {"batch_size": st.batch_size, "k": st.k}
            t = self.totals
            t["drafts"] += st.batch_size if st.k else 0
            t["draft_tokens"] += st.proposed
            t["accepted_tokens"] += st.accepted
            for i, n in enumerate(st.accepted_per_position):
                t["accepted_per_position"][i] += n
            for src, (proposed, accepted) in st.by_source.items():
                t["source_proposed"][src] += proposed
                t["source_accepted"][src] += accepted
                self.m_source.inc(proposed, tags={"source": src, "outcome": "proposed"})
                if accepted:
                    self.m_source.inc(accepted, tags={"source": src, "outcome": "accepted"})
            self.k_tally[st.k] += 1
            self.max_batch_seen = max(self.max_batch_seen, st.batch_size)
            if st.proposed:
                self.m_proposed.inc(st.proposed)
            if st.accepted:
                self.m_accepted.inc(st.accepted)
            self.observed.observe(st)
            if not st.prefill_tokens:
                self.recent.append(dataclasses.replace(st, rows=None))  # not its per-row lists: 2,048 steps at batch 64
            if st.k:
                self.m_estimate.set(self.acceptance_estimate())
            if self.k_tally.total() % 64 == 0:
                self._watch_drift()

    DRIFT_WARN = 0.2
    """Calibrated step times this far from the profile's (either way) get a line in the router log."""

    def _watch_drift(self) -> None:
        cal = self.calibration()
        drifted = cal is not None and cal["drift"] > self.DRIFT_WARN
        if drifted != self.drifted:
            self.drifted = drifted
            if drifted:
                log.warning("group %s (%s): steps are %.0f%% off the profile's latencies; steering by the "
                            "calibrated grid (factors %s); re-profile this machine type", self.group.name,
                            self.gpu_type, 100 * cal["drift"], cal["factors"])
            else:
                log.info("group %s: steps are back within %.0f%% of the profile", self.group.name, 100 * self.DRIFT_WARN)

    REGRET_STEPS = 2048
    """Recent decode steps stats()["regret"] reads."""

    def regret(self) -> list[dict] | None:
        """The policy's recent steps per batch-size group against the best fixed k there, priced by the
        calibrated grid with the live acceptance (`bench.regret`; a serving replica has no fixed-k runs beside
        it): drafted per row, tokens per ms, the best fixed k and its rate, time lost (+) or won (-)."""
        policy = self.engine.policy
        if not isinstance(policy, Calibrated) or not self.recent:
            return None
        a = self.acceptance_estimate()
        acceptance = [a ** (j + 1) for j in range(max(policy.profile.latency.ks))]
        best = regret.grid_rates(policy.calibration.grid(), acceptance)
        return [{**r, "lost_ms": round(r["lost_ms"], 1), "rate": round(r["rate"], 4), "best_rate": round(r["best_rate"], 4),
                 "drafted_per_row": round(r["drafted_per_row"], 3)} for r in regret.regret(list(self.recent), best)]

    def calibration(self) -> dict | None:
        """The calibration the policy steers by: steps seen and used, factors per part and batch size, drift."""
        policy = self.engine.policy
        if not isinstance(policy, Calibrated):
            return None
        c = policy.calibration
        return {"steps": c.steps, "used": c.used, "factors": c.factors(), "drift": round(c.drift(), 4),
                "profile_version": self.profile_version, "from": policy.profile.source}

    # ---- profiles, health, introspection ----------------------------------------------------
    def _ensure_poll(self) -> None:
        if self.store is not None and (self._poll_task is None or self._poll_task.done()):
            # Fresh context: the poller outlives the request that happened to start it.
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_profiles(), context=contextvars.Context())

    async def _poll_profiles(self) -> None:
        while True:
            await asyncio.sleep(self.profile_poll_s)
            try:
                version, profile = await self._fetch_profile()
            except Exception:  # the store restarting is not the router's failure
                log.warning("profile store unreachable", exc_info=True)
                continue
            try:
                await self.store.report.remote(serve.get_replica_context().replica_id.unique_id, self.snapshot())
            except Exception:
                log.warning("could not report metrics to the store", exc_info=True)
            try:
                await self._exchange_history()
            except Exception:
                log.warning("could not exchange the suffix history with the store", exc_info=True)
            self._polls += 1
            if self._polls % self.SHARE_EVERY == 0:
                try:
                    await self._share()
                except Exception:
                    log.warning("could not share the calibrated profile", exc_info=True)
            if version != self.profile_version:
                shared = await self._fetch_shared()  # a measured or predicted push dropped the old one
                # no await from here on: stats() never shows the new version with the old policy
                self.profile_version, self.profile, self.shared = version, profile, shared
                self.engine.policy = self._policy()  # the next step uses it
                self._profile_gauge()
                log.info("profile for %s now version %d (%s)", self.gpu_type, version, self.profile_source())

    async def _exchange_history(self) -> None:
        """This replica's finished outputs to the shared history store, the other replicas' into its draft
        (`deployments.history_store`). A new draft (started, or replaced after dying) holds none: it pulls all."""
        if len(self.actors) < 2 or 1 in self.starting:
            return
        if self.group.channel:  # its calls go where the engine's go (the draft's channel), between the steps' calls
            worker = self._worker(1)
            call = lambda *args: asyncio.to_thread(worker.call, *args)  # noqa: E731
        else:
            call = self.actors[1].call.remote
        if self.actors[1] is not self.history_draft:
            self.history = await call("history_stats")
            self.history_draft, self.history_seen = self.actors[1], (None, 0)
        if self.history is None:  # a draft without a history (off, or an n-gram draft)
            return
        if self.history_store is not None:
            me = serve.get_replica_context().replica_id.unique_id
            mine = await call("take_history")
            if mine:
                await self.history_store.push.remote(me, mine)
            # a draft that never pulled (new, or replaced after dying) holds none of this replica's earlier outputs
            # either: it takes them all, its own included
            asker = me if self.history_seen[0] is not None else None
            epoch, last, docs, restore = await self.history_store.pull.remote(asker, self.history_seen[1], self.history_seen[0])
            if restore:  # the store restarted empty: this draft's copy of what it held refills it
                held = await call("export_history")
                await self.history_store.restore.remote(me, held)
                log.info("the shared suffix history restarted: restored %d outputs from this replica", len(held))
            if docs:
                await call("add_history", docs)
            self.history_seen = (epoch, last)
        self.history = h = await call("history_stats")
        self.m_history_tokens.set(h["tokens"])
        self.m_history_hits.set(h["hits"] / h["lookups"] if h["lookups"] else 0.0)

    async def check_health(self) -> None:
        """A dead worker found here is repaired in place (the engine replaces it, see `_repair`); only a
        replica whose repairs keep failing is reported unhealthy, so Serve replaces it whole."""
        self._ensure_poll()
        if self.repair_failures >= 3:
            raise RuntimeError(f"worker repair failed {self.repair_failures} times in a row")
        if not self.engine.repairing and not await self._workers_alive():
            self.engine.request_repair()

    async def _workers_alive(self) -> bool:
        for i, actor in enumerate(self.actors):
            if i in self.starting:
                continue
            try:
                await asyncio.wait_for(actor.ping.remote(), timeout=10)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                return False
        return True

    async def ready(self) -> dict:
        """Can this replica serve now? Not while a repair is under way or a worker is found dead (a
        repair then starts). A draft still loading does not count: decoding goes on at k = 0."""
        if self.engine.repairing:
            return {"ready": False, "reason": "replacing a worker that died"}
        if not await self._workers_alive():
            self.engine.request_repair()
            return {"ready": False, "reason": "a worker died; replacing it"}
        return {"ready": True, "reason": None}

    def reconfigure(self, user_config: dict) -> None:
        """Live-tunable settings (Serve user_config): `max_queue`, `policy`."""
        if "max_queue" in user_config:
            self.max_queue = int(user_config["max_queue"])
        if "policy" in user_config:
            if not needs_profile(user_config["policy"]):  # refuse a bad spec before changing anything
                make_policy(user_config["policy"])
            self.engine_config = self.engine_config.model_copy(update={"policy": user_config["policy"]})
            self.engine.policy = self._policy()

    def acceptance_estimate(self) -> float:
        """The adaptive policy's own estimate (what it steers by), else the router's of the same kind."""
        return getattr(self.engine.policy, "acceptance_estimate", self.observed.value)

    def snapshot(self) -> dict:
        """Counters and gauges of this replica, for /metrics on the API port."""
        t = self.totals
        return {"group": self.group.name, "gpu_type": self.gpu_type, "time": time.time(),
                "profile": {"source": self.profile_source(), "version": self.profile_version},
                "counters": {**{k: v for k, v in t.items() if not isinstance(v, Tally)},
                             "requests": dict(t["requests"]), "source_proposed": dict(t["source_proposed"]),
                             "source_accepted": dict(t["source_accepted"]),
                             "accepted_per_position": [t["accepted_per_position"][i] for i in range(len(t["accepted_per_position"]))]},
                "gauges": {**self.last_step, "running": len(self.engine.running) + len(self.engine.prefilling),
                           "waiting": len(self.engine.waiting), "acceptance_estimate": self.acceptance_estimate(),
                           "kv_usage": self.engine.reserved / self.engine.kv_capacity,
                           "kv_pool_tokens": self.engine.kv_capacity},
                "calibration": self.calibration(), "history": self.history, "histograms": self.histograms}

    async def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def pids(self) -> dict[str, int]:
        """Process ids of this replica and its workers (the soak samples their memory)."""
        workers = await asyncio.gather(*(a.pid.remote() for a in self.actors))
        return {"router": os.getpid(), **dict(zip(self.roles, workers))}

    async def stats(self) -> dict:
        return {
            "group": self.group.name, "gpu_type": self.gpu_type, "profile_version": self.profile_version,
            "profile_source": self.profile_source(), "policy": self.engine.policy.name, "profile_problem": self.profile_problem,
            "acceptance_estimate": self.acceptance_estimate(),
            "k_steps": dict(self.k_tally), "max_batch_seen": self.max_batch_seen,
            "running": len(self.engine.running), "prefilling": len(self.engine.prefilling),
            "waiting": len(self.engine.waiting), "reserved": self.engine.reserved,
            "actors": self.actor_names, "recoveries": self.recoveries, "resumed": self.resumed, "repairing": self.engine.repairing,
            "speculating": self.engine.speculating, "calibration": self.calibration(), "regret": self.regret(),
            "startup_profile": self.startup, "kv_pool": self.engine.kv_pool, "history": self.history,
            "draft_sources": {src: {"proposed": n, "accepted": self.totals["source_accepted"][src]}
                              for src, n in self.totals["source_proposed"].items()},
        }

    def __del__(self):
        try:
            for a in getattr(self, "actors", []):
                ray.kill(a)
            if getattr(self, "pg", None) is not None:
                remove_placement_group(self.pg)
        except Exception:
            pass
