"""Locust load test for specserve's OpenAI-compatible chat endpoint.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000            # web UI on :8089
    LOADTEST_SHAPE=paper locust -f loadtest/locustfile.py --host URL --headless --csv out/run --csv-full-history

Each user sends POST /v1/chat/completions with a prompt drawn from a JSONL file (`--prompts`),
streaming by default, and waits for the whole answer before the next request (closed loop, plus
an optional random think time). Besides the whole request ("POST /v1/chat/completions", its
"size" column being the number of output tokens), two entries of their own are recorded through
environment.events.request:
  TTFT /v1/chat/completions   time to the first content token (streaming only)
  TPOT /v1/chat/completions   time per output token after the first: (end - first) / (tokens - 1);
                              without streaming, the whole time / tokens
Output tokens come from the final usage chunk (`stream_options.include_usage`), or else from the
number of content chunks.

The load shape is picked by name with LOADTEST_SHAPE (step, sine, spike, paper; see
loadtest/shapes/); without it, Locust's -u/-r/-t apply. `--metrics-url` makes the master (or the
single local process) poll the service's Prometheus endpoint(s) during the run and write the
routers' batch size, k, queue depth and token counters to `--metrics-csv` for loadtest/report.py.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import gevent
from locust import FastHttpUser, events, task
from locust.runners import WorkerRunner

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `loadtest` importable however Locust was started
    sys.path.insert(0, str(HERE.parent))

from loadtest.report import MetricsRecorder  # noqa: E402
from loadtest.shapes import load_shape  # noqa: E402

PATH = "/v1/chat/completions"

if os.environ.get("LOADTEST_SHAPE"):
    # The one LoadTestShape subclass in this module's namespace is the one Locust runs.
    Shape = load_shape(os.environ["LOADTEST_SHAPE"])

if os.environ.get("LOADTEST_PERCENTILE_WINDOW_S"):
    # Locust's "current" percentiles (those of the stats history CSV) cover the last 10 s by
    # default; time-scaled short runs use a shorter window so p50/p99 follow the faster phases.
    import locust.stats

    locust.stats.CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW = max(1, int(float(os.environ["LOADTEST_PERCENTILE_WINDOW_S"])))


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--prompts", default=str(HERE / "prompts.jsonl"), env_var="LOADTEST_PROMPTS",
                        help='JSONL of {"messages": [...]} or {"prompt": "..."}, optionally with max_tokens/temperature')
    parser.add_argument("--model", default="", env_var="LOADTEST_MODEL", help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=64, env_var="LOADTEST_MAX_TOKENS", help="max_tokens unless a prompt line sets it")
    parser.add_argument("--temperature", type=float, default=0.0, env_var="LOADTEST_TEMPERATURE")
    parser.add_argument("--no-stream", action="store_true", default=False, env_var="LOADTEST_NO_STREAM",
                        help="send stream=false (no TTFT entry then)")
    parser.add_argument("--think-time", type=float, default=0.0, env_var="LOADTEST_THINK_TIME",
                        help="each user waits uniform(0, this) seconds between requests")
    parser.add_argument("--api-key", default="", env_var="LOADTEST_API_KEY", is_secret=True, help="sent as a Bearer token if set")
    parser.add_argument("--metrics-url", default="", env_var="LOADTEST_METRICS_URL",
                        help="comma-separated Prometheus endpoints of the service (Ray nodes' metrics export ports) to poll")
    parser.add_argument("--metrics-csv", default="", env_var="LOADTEST_METRICS_CSV",
                        help="where the polled metrics go (default: <--csv prefix>_metrics.csv)")
    parser.add_argument("--metrics-interval", type=float, default=1.0, env_var="LOADTEST_METRICS_INTERVAL", help="seconds between polls")


def read_prompts(path: str | Path) -> list[dict]:
    """Prompt lines as chat requests: {"messages": [...], and optional max_tokens/temperature}."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "messages" not in item:
            if "prompt" not in item:
                raise ValueError(f"{path}:{n}: needs messages or prompt")
            item["messages"] = [{"role": "user", "content": item.pop("prompt")}]
        out.append(item)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


class ChatUser(FastHttpUser):
    """One client: a chat completion at a time, streamed unless --no-stream."""

    prompts: list[dict] = []
    model: str = ""

    def wait_time(self):
        think = self.environment.parsed_options.think_time if self.environment.parsed_options else 0
        return random.uniform(0, think) if think > 0 else 0

    def on_start(self):
        opts = self.environment.parsed_options
        if not ChatUser.prompts:
            ChatUser.prompts = read_prompts(opts.prompts)
        self.order = itertools.cycle(random.Random(id(self)).sample(ChatUser.prompts, len(ChatUser.prompts)))
        self.headers = {"Accept-Encoding": "identity"}
        if opts.api_key:
            self.headers["Authorization"] = f"Bearer {opts.api_key}"
        if not ChatUser.model:
            ChatUser.model = opts.model or self._discover_model()

    def _discover_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as r:
            try:
                return r.json()["data"][0]["id"]
            except Exception as e:  # noqa: BLE001 - any bad answer fails the request
                r.failure(f"cannot read the model list: {e}")
                return "unknown"

    @task
    def chat(self):
        opts = self.environment.parsed_options
        item = next(self.order)
        stream = not opts.no_stream
        body = {"model": ChatUser.model, "messages": item["messages"],
                "max_tokens": item.get("max_tokens", opts.max_tokens),
                "temperature": item.get("temperature", opts.temperature), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        with self.client.post(PATH, json=body, headers=self.headers, stream=stream, catch_response=True) as r:
            if r.status_code != 200:
                text = r.text if not stream else r._response.read().decode("utf-8", "replace")
                r.failure(f"HTTP {r.status_code}: {(text or '')[:200]}")
                return
            try:
                first, tokens = self._read_stream(r) if stream else (None, r.json()["usage"]["completion_tokens"])
            except Exception as e:  # noqa: BLE001 - a broken stream is a failed request
                _discard(r)
                r.failure(f"bad response: {e}")
                return
            end = time.perf_counter()
            r.request_meta["response_time"] = (end - start) * 1000  # the whole request, stream included
            r.request_meta["response_length"] = tokens  # output tokens, not bytes
        if first is not None:
            self._fire("TTFT", (first - start) * 1000)
            if tokens > 1:
                self._fire("TPOT", (end - first) * 1000 / (tokens - 1))
        elif tokens > 0:
            self._fire("TPOT", (end - start) * 1000 / tokens)

    def _read_stream(self, r) -> tuple[float | None, int]:
        """Read the SSE stream line by line as it arrives: (time of the first content, tokens)."""
        raw = r._response  # geventhttpclient response: readline returns as soon as a line is in
        first, chunks, usage, done = None, 0, None, False
        while True:
            line = raw.readline(b"\n")
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return first, usage if usage is not None else chunks

    def _fire(self, kind: str, ms: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=PATH, response_time=ms, response_length=0,
                                             exception=None, context={})


def _discard(r) -> None:
    """Close the connection of a response whose body was not read to the end (never reuse it)."""
    raw = getattr(r, "_response", None)
    try:
        if raw is not None and raw._sock is not None and not raw.message_complete:
            raw._pool.release_socket(raw._sock)
            raw._sock = raw._pool = None
    except AttributeError:
        pass


_poller = {"greenlet": None, "recorder": None}


@events.test_start.add_listener
def _start_poller(environment, **_kw):
    opts = environment.parsed_options
    if opts is None or not opts.metrics_url or isinstance(environment.runner, WorkerRunner) or _poller["greenlet"]:
        return
    path = opts.metrics_csv or (f"{opts.csv_prefix}_metrics.csv" if opts.csv_prefix else "loadtest_metrics.csv")
    recorder = MetricsRecorder([u.strip() for u in opts.metrics_url.split(",") if u.strip()], path)

    def loop():
        while True:
            recorder.poll(environment.runner.user_count if environment.runner else 0)
            gevent.sleep(opts.metrics_interval)

    _poller.update(recorder=recorder, greenlet=gevent.spawn(loop))


@events.quitting.add_listener
def _stop_poller(environment, **_kw):
    if _poller["greenlet"] is not None:
        _poller["greenlet"].kill()
        _poller["recorder"].poll(0)  # one last row at the end
        _poller["greenlet"] = None

