"""build_app: wire ProfileStore, HistoryStore (the shared suffix history), one Router deployment per engine
group (or the one group's Router inside the ingress: `AppConfig.router_in_ingress`), and the OpenAI ingress.

Usable by `serve run deployments.app:build_app` with args, by serve_config.yaml (and so by a
KubeRay RayService), and by `specserve serve`.
"""

from __future__ import annotations

from ray.serve import Application

from serve_app.models import EMBEDDED

from .config import AppConfig
from .ingress import OpenAIIngress
from .history_store import HistoryStore
from .profile_store import ProfileStore
from .router import Router


def served_name(cfg: AppConfig) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model.target == EMBEDDED:
        return "SmolLM2-135M-Instruct"
    return cfg.model.target.rstrip("/").split("/")[-1]


def build_app(args: dict | None = None) -> Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    logs = {"enable_access_log": cfg.access_log}
    pinned = {"ray_actor_options": {"num_cpus": 0, "resources": cfg.ingress_resources}} if cfg.ingress_resources else {}
    store = ProfileStore.options(logging_config=logs, **pinned).bind(cfg.profiles_dir)
    history = (HistoryStore.options(logging_config=logs, **pinned).bind(cfg.model.history_tokens)
               if cfg.model.prompt_lookup and cfg.model.history_tokens else None)
    routers = []
    replicas = [g.num_replicas for g in cfg.groups]
    ingress = pinned
    for g in cfg.groups:
        actor_options: dict = {"num_cpus": 0}
        if g.accelerator_type:
            actor_options["accelerator_type"] = g.accelerator_type
        if g.resources:  # the router sits on a node of its group's type too
            actor_options["resources"] = {name: 0.001 for name in g.resources}
        args = (g.model_dump(), cfg.model.model_dump(), cfg.engine.model_dump(), cfg.max_queue, store, cfg.profile_poll_s,
                history)
        if cfg.router_in_ingress:  # the ingress hosts the Router: it takes the group's replicas and placement
            routers.append({"in_process": args})
            ingress = {"num_replicas": g.num_replicas, "ray_actor_options": actor_options,
                       "health_check_period_s": cfg.health_check_period_s, "health_check_timeout_s": 60}
            replicas = [1]  # per ingress replica, its own Router
            continue
        routers.append(
            Router.options(
                name=f"Router-{g.name}", num_replicas=g.num_replicas, ray_actor_options=actor_options,
                health_check_period_s=cfg.health_check_period_s, graceful_shutdown_timeout_s=cfg.drain_timeout_s,
                logging_config=logs,
            ).bind(*args)
        )
    return OpenAIIngress.options(graceful_shutdown_timeout_s=cfg.drain_timeout_s, logging_config=logs, **ingress).bind(
        routers, [g.name for g in cfg.groups], cfg.model.target, served_name(cfg),
        cfg.max_tokens_limit, cfg.engine.max_stop_strings, cfg.engine.max_resumes, cfg.replica_wait_s, store,
        replicas,
    )
