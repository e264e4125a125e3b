"""A `specserve serve` for benchmarks: started as a subprocess on free ports, waited for until ready,
stopped afterwards (its log's tail in the error when it does not come up)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(flags: list[str], port: int = 0, ready_s: float = 600.0, metrics_port: int = 0) -> Iterator[tuple[str, str]]:
    """`specserve serve FLAGS` as a subprocess (its own process group) on a free port (or `port`; its
    Prometheus export on `metrics_port`); yields (base URL, served model name) once /readyz answers, and
    stops it afterwards (SIGTERM, then SIGKILL to its group)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "serve_app.cli", "serve", *flags, "--port", str(port),
           "--metrics-port", str(metrics_port or free_port()), "--drain-timeout", "1"]
    with server(cmd, f"http://127.0.0.1:{port}", "/readyz", ready_s) as served:
        yield served


@contextlib.contextmanager
def server(cmd: list[str], url: str, ready_path: str, ready_s: float = 600.0, env: dict | None = None
           ) -> Iterator[tuple[str, str]]:
    """Any OpenAI-compatible server started by `cmd` (its own process group, its output to a log): yields
    (url, served model name) once GET url + ready_path answers 200, and stops it afterwards (SIGTERM, then
    SIGKILL to its group); when it does not come up in ready_s, the error ends with its log's tail."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="specserve-bench-serve-") as root:
        log_path = Path(root) / "serve.log"
        with open(log_path, "w") as log:
            srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
            try:
                deadline = time.time() + ready_s
                while True:
                    try:
                        if httpx.get(url + ready_path, timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.time() > deadline or srv.poll() is not None:
                        log.flush()
                        raise RuntimeError(f"`{' '.join(cmd)}` did not become ready; its log ends:\n"
                                           + log_path.read_text()[-3000:])
                    time.sleep(1)
                model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                yield url, model
            finally:
                # SIGTERM to the server alone: `specserve serve` drains and stops its Ray cluster in a few seconds
                # (SIGTERM to its whole process group would stop Ray's GCS under it, and its shutdown then waits a minute).
                srv.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    srv.wait(90)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(srv.pid, signal.SIGKILL)  # whatever of it is left
                srv.wait()
