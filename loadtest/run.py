"""Headless Locust run against specserve, then the PNG report: what `make loadtest` runs.

    python -m loadtest.run                                   # local service (started if none answers)
    python -m loadtest.run --url http://HOST:8000 --shape step    # metrics from HOST:8000/metrics
    python -m loadtest.run --shape paper --duration 30       # ~30 s smoke run of any shape
    python -m loadtest.run --workers 4                       # distributed: a Locust master + 4 worker processes

Writes into --out (default out/loadtest), all named after the shape: Locust's CSVs
(<shape>_stats.csv, _stats_history.csv with every entry, _failures.csv, _exceptions.csv), its HTML
page, the polled service metrics (<shape>_metrics.csv) and <shape>_report.png. Exit status: Locust's
(1 when any request failed), 2 when the service could not be reached or started. SIGTERM ends a run early: Locust
stops and writes its CSVs, the report is still made, and a service the run started is stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = ("step", "sine", "spike", "paper")  # loadtest/shapes/<name>.py (not imported here: no gevent in this process)


def healthy(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def start_local(port: int, metrics_port: int, wait_s: float, serve_args: list[str]) -> subprocess.Popen:
    """`specserve serve` in the background (its own process group); returns once /healthz answers."""
    env = dict(os.environ)
    env.setdefault("RAY_metrics_report_interval_ms", "2000")  # gauges every 2 s instead of 10: k over time
    cmd = [sys.executable, "-m", "serve_app.cli", "serve", "--port", str(port), "--metrics-port", str(metrics_port), *serve_args]
    print(f"loadtest: starting a local service: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + wait_s
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the local service exited with status {proc.returncode}")
            if healthy(url):
                return proc
            time.sleep(2)
        raise RuntimeError(f"the local service did not answer {url}/healthz within {wait_s:.0f} s")
    except BaseException:  # those, and SIGTERM while it starts (`_leave`)
        stop_local(proc)
        raise


def stop_local(proc: subprocess.Popen, wait_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # specserve serve shuts Serve and Ray down on SIGTERM
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _leave(signum, frame) -> None:
    raise SystemExit(128 + signum)  # through the `finally`s: a service this run started is stopped, not orphaned


def _on_sigterm(handler) -> None:
    """SIGTERM (`kill`, a CI timeout, a Kubernetes Job's end) handled, where Python lets a handler be set."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def locust_command(a, prefix: Path) -> list[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "--host", a.url,
           "--csv", str(prefix), "--csv-full-history", "--html", f"{prefix}.html", "--only-summary",
           "--loglevel", "WARNING", "--max-tokens", str(a.max_tokens)]
    if a.metrics_url:
        cmd += ["--metrics-url", a.metrics_url, "--metrics-csv", f"{prefix}_metrics.csv"]
    if a.model:
        cmd += ["--model", a.model]
    if a.no_stream:
        cmd += ["--no-stream"]
    return cmd + a.locust_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="service base URL (default: the local one, http://127.0.0.1:PORT)")
    p.add_argument("--metrics-url", default=None,
                   help="comma-separated Prometheus endpoints to poll (default: the service's own URL/metrics; "
                        "'' disables)")
    p.add_argument("--shape", default="paper", choices=SHAPES)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--duration", type=float, default=None, help="real length of the run in seconds (any shape)")
    g.add_argument("--time-scale", type=float, default=None, help="real seconds per nominal second (1: ten minutes)")
    p.add_argument("--users-scale", type=float, default=1.0, help="multiplies the shape's user counts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="model name (default: asked from /v1/models)")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--out", default="out/loadtest", help="directory for the CSVs and the report")
    p.add_argument("--serve", choices=("auto", "never"), default="auto",
                   help="auto: start `specserve serve` when nothing answers at the local URL")
    p.add_argument("--port", type=int, default=8000, help="local service port")
    p.add_argument("--metrics-port", type=int, default=8080, help="local service metrics port")
    p.add_argument("--serve-wait", type=float, default=600, help="seconds to wait for a started service")
    p.add_argument("--serve-args", default="", help="extra `specserve serve` arguments for a started service")
    p.add_argument("--workers", type=int, default=0,
                   help="distributed: a Locust master and this many worker processes on this machine (0: one process); "
                        "workers elsewhere join with `locust -f loadtest/locustfile.py --worker --master-host HOST`")
    p.add_argument("--master-port", type=int, default=5557, help="distributed: the master's port for workers")
    p.add_argument("locust_args", nargs="*", help="after --: passed to Locust as they are")
    a = p.parse_args(argv)

    local = a.url is None
    a.url = (a.url or f"http://127.0.0.1:{a.port}").rstrip("/")
    if a.metrics_url is None:  # the service's own /metrics on its API port: every replica's series
        a.metrics_url = f"{a.url}/metrics"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / a.shape
    for old in out.glob(f"{a.shape}_*"):
        old.unlink()  # Locust appends to nothing, but the report must not mix runs

    proc = None
    _on_sigterm(_leave)
    if not healthy(a.url):
        if not (local and a.serve == "auto"):
            print(f"loadtest: nothing answers at {a.url}/healthz", file=sys.stderr)
            return 2
        try:
            proc = start_local(a.port, a.metrics_port, a.serve_wait, a.serve_args.split())
        except RuntimeError as e:
            print(f"loadtest: {e}", file=sys.stderr)
            return 2
    try:
        env = dict(os.environ)
        env.pop("LOCUST_SKIP_MONKEY_PATCH", None)  # Locust needs gevent's patching
        env["LOADTEST_SHAPE"] = a.shape
        env["LOADTEST_USER_SCALE"] = str(a.users_scale)
        if a.duration is not None:
            env["LOADTEST_DURATION_S"] = str(a.duration)
            env["LOADTEST_PERCENTILE_WINDOW_S"] = str(max(2, min(10, round(a.duration / 10))))
        elif a.time_scale is not None:
            env["LOADTEST_TIME_SCALE"] = str(a.time_scale)
            env["LOADTEST_PERCENTILE_WINDOW_S"] = str(max(2, min(10, round(10 * a.time_scale * 6))))
        cmd = locust_command(a, prefix)
        workers = []
        if a.workers > 0:  # the master runs the shape and writes the CSVs; the workers run the users
            cmd += ["--master", "--expect-workers", str(a.workers), "--master-bind-port", str(a.master_port)]
            worker_cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--worker",
                          "--master-host", "127.0.0.1", "--master-port", str(a.master_port), "--loglevel", "WARNING"]
            workers = [subprocess.Popen(worker_cmd, env=env, start_new_session=True) for _ in range(a.workers)]
        print(f"loadtest: {a.shape} shape against {a.url} -> {out}/"
              + (f" (master + {a.workers} workers)" if workers else ""), flush=True)
        try:
            locust = subprocess.Popen(cmd, env=env)
            # a stop asked of the run ends Locust's run early: it writes its CSVs and the report still comes
            _on_sigterm(lambda signum, frame: locust.terminate())
            try:
                rc = locust.wait()
            except BaseException:  # Ctrl-C and the like: not left running (as subprocess.run has it)
                locust.kill()
                raise
            finally:
                _on_sigterm(_leave)
        finally:
            for w in workers:  # they quit with the master; make sure
                stop_local(w, wait_s=15)
    finally:
        if proc is not None:
            stop_local(proc)

    history = Path(f"{prefix}_stats_history.csv")
    if not history.exists():
        print(f"loadtest: Locust wrote no {history} (exit status {rc})", file=sys.stderr)
        return rc or 1
    from .report import make_report, read_history, summarize

    png = make_report(history, f"{prefix}_metrics.csv", f"{prefix}_report.png", title=f"specserve, {a.shape} shape:")
    s = summarize(read_history(history))
    print(f"loadtest: {s['requests']:.0f} requests, {s['failures']:.0f} failures, {s['output_tokens']:.0f} output tokens; "
          f"report {png}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
