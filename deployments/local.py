"""Run the service on a local Ray cluster: what `specserve serve` and `make serve` do."""

from __future__ import annotations

import os
import signal
import time

from .config import AppConfig

APP_NAME = "specserve"

SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}
"""Ray Serve's two busiest timers, slowed (its defaults: the controller's loop every 0.1 s, every replica exporting
its cached metrics every 0.1 s). Each wake-up lands on a core a forward's OpenMP threads are using, and a parallel
region waits for its slowest thread: beside an idle service with the defaults a batch-1 forward took 1.33x its time
with the service frozen; with these, about the same (docs/benchmarks.md). The controller still notices a dead
replica within a loop; Prometheus scrapes every few seconds anyway. And the streamed tokens' way from Router to
ingress to proxy by value over gRPC, not through Ray's object store (what Ray's throughput-optimized mode,
RAY_SERVE_THROUGHPUT_OPTIMIZED, turns on among others): ~10% more tokens/s at 8 in flight here."""


def quiet_serve_env() -> None:
    """SERVE_ENV into this process's environment (what a local cluster started from here inherits); a variable the
    user set stays as set. A cluster started elsewhere (KubeRay) sets them in its pods (k8s/rayservice*.yaml)."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def start(app_args: dict, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None,
          resources: dict | None = None) -> str:
    """Start local Ray + Serve and deploy the app; returns the base URL. Bad config raises ValueError."""
    # Before Serve is imported: it reads its settings once, at import, and a handle bound here keeps the transport
    # this process read (imported first, the ingress's calls to its Routers went through Ray's object store).
    quiet_serve_env()
    import ray
    from ray import serve

    from .app import build_app

    cfg = AppConfig.model_validate(app_args)  # validate before starting anything
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 4), resources=resources, include_dashboard=False,
        _metrics_export_port=metrics_port, logging_level="WARNING",
    )
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def drain(timeout_s: float, app: str = APP_NAME) -> int:
    """Stop admitting new requests (they get 503 + Retry-After, /readyz turns 503) and wait up to
    timeout_s for the in-flight ones to finish. Returns how many were still in flight. Needs a
    connected Ray driver (ray.init)."""
    from ray import serve

    ingress = serve.get_deployment_handle("OpenAIIngress", app)
    left = ingress.drain.remote().result()
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = ingress.in_flight_total.remote().result()
    return left


def breakdown(window_s: float, app: str = APP_NAME) -> dict:
    """Where each engine group's steps spent their time over the next window_s seconds ({group: Router.breakdown}).
    Needs a connected Ray driver (ray.init)."""
    from ray import serve

    ingress = serve.get_deployment_handle("OpenAIIngress", app)
    ingress.breakdown.remote().result()  # resets the counts: the window starts now
    time.sleep(window_s)
    return ingress.breakdown.remote().result()


class _Stop(Exception):
    """SIGTERM: leave the serving loop the way Ctrl-C does."""


def _raise_stop(*_):
    raise _Stop


def run_forever(app_args: dict, host: str, port: int, metrics_port: int | None = None) -> None:
    from .app import served_name

    url = start(app_args, host, port, metrics_port)
    cfg = AppConfig.model_validate(app_args)
    name = served_name(cfg)
    print(f"\nspecserve: serving {name} at {url}/v1 (metrics: http://{host}:{metrics_port}/metrics)")
    print(f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
    print(f"Ctrl-C (or SIGTERM) drains it: no new requests, in-flight ones get {cfg.drain_timeout_s:g} s to finish.",
          flush=True)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, _Stop):
        print("\nspecserve: draining (a second Ctrl-C stops at once)", flush=True)
        try:
            left = drain(cfg.drain_timeout_s)
            print(f"specserve: drained ({left} requests still in flight), stopping", flush=True)
        except KeyboardInterrupt:
            print("specserve: stopping now", flush=True)
    finally:
        stop()
