"""Run the service on a local Ray cluster: what `specserve serve` and `make serve` do."""

from __future__ import annotations

import os
import signal
import sys
import time

from .config import AppConfig

APP_NAME = "specserve"


def start(app_args: dict, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None,
          resources: dict | None = None) -> str:
    """Start local Ray + Serve and deploy the app; returns the base URL. Bad config raises ValueError."""
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


def run_forever(app_args: dict, host: str, port: int, metrics_port: int | None = None) -> None:
    from .app import served_name

    url = start(app_args, host, port, metrics_port)
    name = served_name(AppConfig.model_validate(app_args))
    print(f"\nspecserve: serving {name} at {url}/v1 (metrics: http://{host}:{metrics_port}/metrics)")
    print(f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
    print("Ctrl-C stops it.", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nspecserve: stopping")
    finally:
        stop()
