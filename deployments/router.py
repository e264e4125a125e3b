"""Router: one engine group's continuous-batching loop over a DraftWorker + TargetWorker pair.

Each replica places its two worker actors in a placement group (STRICT_PACK: same node), runs the
engine's step loop across them, bounds its admission queue, streams tokens to callers, and picks k
each step with the profile of its hardware type from the shared ProfileStore (polled, so a pushed
profile takes effect without a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import Counter as Tally

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config import EngineConfig, ModelConfig, SamplingParams
from serve_app.models import draft_spec, load_tokenizer, model_names
from serve_app.policy import AcceptanceEstimate, make_policy, needs_profile
from serve_app.profiles import Profile
from serve_app.scheduler import Engine, RequestOutput
from serve_app.stats import StepStats

from .config import GroupConfig
from .workers import DraftWorker, RemoteWorker, TargetWorker

log = logging.getLogger("ray.serve")

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


@serve.deployment(max_ongoing_requests=4096, health_check_period_s=10, health_check_timeout_s=60,
                  ray_actor_options={"num_cpus": 0})
class Router:
    async def __init__(self, group: dict, model: dict, engine: dict, max_queue: int, store=None, profile_poll_s: float = 2.0):
        self.group = GroupConfig(**group)
        mc, self.engine_config = ModelConfig(**model), EngineConfig(**engine)
        self.max_queue, self.store, self.profile_poll_s = max_queue, store, profile_poll_s
        has_draft = draft_spec(mc) != "none"
        self.pg, self.actors = self._start_workers(mc, has_draft)
        target = RemoteWorker(self.actors[0], self.group.call_timeout_s)
        draft = RemoteWorker(self.actors[1], self.group.call_timeout_s) if has_draft else None
        await asyncio.gather(*(a.ping.remote() for a in self.actors))  # ready only once both models loaded
        info = await self.actors[0].call.remote("info")
        self.gpu_type = self.group.gpu_type or info["gpu_type"]
        self.model_pair = model_names(mc)
        self.dtype = info["dtype"]  # what `auto` resolved to on the target's node
        self.profile_problem: str | None = None
        self.profile_version, self.profile = await self._fetch_profile()
        self.engine = Engine(target, draft, load_tokenizer(mc.target), self.engine_config, self._policy())
        self.engine.on_step.append(self._on_step)
        self.k_tally: Tally = Tally()
        self.observed = AcceptanceEstimate(0.0)  # live acceptance under any policy (adaptive keeps its own)
        self.max_batch_seen = 0
        self._poll_task: asyncio.Task | None = None
        self._metrics()

    # ---- setup -------------------------------------------------------------------------------
    def _start_workers(self, mc: ModelConfig, has_draft: bool):
        g = self.group
        resources = dict(g.resources)
        if g.accelerator_type:
            resources[f"accelerator_type:{g.accelerator_type}"] = 0.001
        bundle = {"CPU": g.worker_cpus, **({"GPU": g.num_gpus} if g.num_gpus else {}), **resources}
        classes = [(TargetWorker, "target")] + ([(DraftWorker, "draft")] if has_draft else [])
        pg = placement_group([bundle] * len(classes), strategy=g.placement_strategy)
        replica = serve.get_replica_context().replica_id.unique_id
        self.actor_names = [f"specserve-{g.name}-{replica}-{role}" for _, role in classes]
        actors = [
            cls.options(
                name=name, num_cpus=g.worker_cpus, num_gpus=g.num_gpus, resources=resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(mc.model_dump(), g.torch_threads)
            for i, ((cls, _), name) in enumerate(zip(classes, self.actor_names))
        ]
        return pg, actors

    async def _fetch_profile(self) -> tuple[int, Profile | None]:
        if self.store is None:
            return 0, None
        version, data = await self.store.get.remote(self.gpu_type)
        return version, Profile.model_validate(data) if data else None

    def _policy(self):
        """The configured policy; a profile-driven one without a usable profile decodes plainly meanwhile."""
        spec, self.profile_problem = self.engine_config.policy, None
        if needs_profile(spec):
            try:
                if self.profile is None:
                    raise ValueError(f"no profile for hardware type {self.gpu_type} yet")
                self.profile.check_pair(*self.model_pair, self.dtype)
                return make_policy(spec, self.profile)
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
        self.m_tpot = metrics.Histogram("specserve_tpot_seconds", "Time per output token after the first.", boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_step = metrics.Histogram("specserve_step_seconds", "Engine step latency.", boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.m_batch = metrics.Gauge("specserve_batch_size", "Sequences in the last engine step.", tag_keys=tags)
        self.m_k = metrics.Gauge("specserve_speculation_k", "Speculation length chosen for the last step.", tag_keys=tags)
        self.m_queue = metrics.Gauge("specserve_queue_depth", "Requests waiting for admission.", tag_keys=tags)
        self.m_estimate = metrics.Gauge("specserve_acceptance_estimate",
                                        "Live per-token draft acceptance estimate (what the adaptive policy steers by).",
                                        tag_keys=tags)
        for m in (self.m_requests, self.m_prompt, self.m_generated, self.m_proposed, self.m_accepted,
                  self.m_ttft, self.m_tpot, self.m_step, self.m_batch, self.m_k, self.m_queue, self.m_estimate):
            m.set_default_tags({"gpu_type": self.gpu_type, "group": self.group.name})

    # ---- serving -----------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: dict, request_id: str = "req", stream: bool = True):
        """Events {text, token_ids, finished, finish_reason, ...}, or one {error, status}.

        stream=False sends a single final event with the whole text: every event costs a hop through
        Serve (router -> ingress -> proxy) on the CPUs the models use, so unstreamed requests skip them.
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
        text, token_ids = [], []
        recorded = False  # a final output was counted: a caller leaving after it is not a 499 too
        try:
            # aclosing: when the caller leaves, the engine stream's `finally` aborts the request now
            # (a waiting one leaves the queue at once), not whenever the generator is collected.
            async with contextlib.aclosing(self.engine.generate(prompt_ids, sampling, request_id)) as outs:
                async for out in outs:
                    if out.finished:
                        self._record_request(out)
                        recorded = True
                    if stream:
                        yield self._event(out)
                        continue
                    text.append(out.text)
                    token_ids += out.token_ids
                    if out.finished:
                        out.text, out.token_ids = "".join(text), token_ids
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
        if out.error:
            ev.update(error=out.error, status=503)
        if out.stats:
            ev["stats"] = out.stats.to_dict()
        return ev

    def _record_request(self, out: RequestOutput) -> None:
        status = {"error": "503", "abort": "499"}.get(out.finish_reason, "200")
        self.m_requests.inc(tags={"status": status})
        s = out.stats
        self.m_prompt.inc(s.prompt_tokens)
        if s.generated_tokens:
            self.m_generated.inc(s.generated_tokens)
            self.m_ttft.observe(s.ttft_s)
        if s.generated_tokens > 1:
            self.m_tpot.observe(s.tpot_s)

    def _on_step(self, st: StepStats) -> None:  # runs in the engine's step thread
        self.m_step.observe(st.draft_s + st.verify_s + st.other_s)
        self.m_queue.set(len(self.engine.waiting))
        if st.batch_size:
            self.m_batch.set(st.batch_size)
            self.m_k.set(st.k)
            self.k_tally[st.k] += 1
            self.max_batch_seen = max(self.max_batch_seen, st.batch_size)
            if st.proposed:
                self.m_proposed.inc(st.proposed)
            if st.accepted:
                self.m_accepted.inc(st.accepted)
            self.observed.observe(st)
            if st.k:
                self.m_estimate.set(self.acceptance_estimate())

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
            if version != self.profile_version:
                self.profile_version, self.profile = version, profile
                self.engine.policy = self._policy()  # the next step uses it
                log.info("profile for %s now version %d", self.gpu_type, version)

    async def check_health(self) -> None:
        """Unhealthy if a worker actor is gone: Serve then replaces this replica (and its workers)."""
        self._ensure_poll()
        for actor in self.actors:
            await asyncio.wait_for(actor.ping.remote(), timeout=30)

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

    async def stats(self) -> dict:
        return {
            "group": self.group.name, "gpu_type": self.gpu_type, "profile_version": self.profile_version,
            "policy": self.engine.policy.name, "profile_problem": self.profile_problem,
            "acceptance_estimate": self.acceptance_estimate(),
            "k_steps": dict(self.k_tally), "max_batch_seen": self.max_batch_seen,
            "running": len(self.engine.running), "waiting": len(self.engine.waiting), "reserved": self.engine.reserved,
            "actors": self.actor_names,
        }

    def __del__(self):
        try:
            for a in getattr(self, "actors", []):
                ray.kill(a)
            if getattr(self, "pg", None) is not None:
                remove_placement_group(self.pg)
        except Exception:
            pass
