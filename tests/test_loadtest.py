"""Load testing: the shapes' tick() (pure), the locustfile and report against a fake streaming
server (seconds, no Ray), and a ~30 s headless Locust smoke run against the real local service.

The live part is one module fixture (one Ray session): a local service on tiny models whose
profile makes k depend on the batch size. The smoke run must end with zero failures and write
Locust's CSVs plus the PNG report; the same service's scrape then checks that every PromQL
expression of the Grafana dashboard names only metrics the service really exports.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import urllib.parse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("LOCUST_SKIP_MONKEY_PATCH", "1")  # importing the shapes must not gevent-patch pytest (Ray runs here)
from loadtest import report  # noqa: E402
from loadtest.shapes import SHAPES, load_shape  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "k8s" / "dashboards" / "specserve.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadtest(args: list[str]) -> dict:
    """`python -m loadtest.run ARGS` as subprocess keyword arguments."""
    env = {k: v for k, v in os.environ.items() if k != "LOCUST_SKIP_MONKEY_PATCH"}
    return {"args": [sys.executable, "-m", "loadtest.run", *args], "cwd": ROOT, "env": env}


def run_loadtest(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(**loadtest(args), capture_output=True, text=True, timeout=timeout)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- shapes: tick() is a function of the run time only ------------------------------------------

def ticks(shape_cls, times, monkeypatch, **env):
    for k in ("LOADTEST_TIME_SCALE", "LOADTEST_DURATION_S", "LOADTEST_USER_SCALE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    shape = shape_cls()
    out = []
    for t in times:
        monkeypatch.setattr(shape, "get_run_time", lambda t=t: t)
        out.append(shape.tick())
    return out


def users(results):
    return [r[0] if r else None for r in results]


def test_every_shape_loads_by_name_and_lasts_ten_nominal_minutes(monkeypatch):
    for name in SHAPES:
        cls = load_shape(name)
        assert not cls.abstract and cls.__module__ == f"loadtest.shapes.{name}"
        assert cls().nominal_s() == 600
        assert ticks(cls, [599.9], monkeypatch)[0] is not None and ticks(cls, [600], monkeypatch) == [None]
    with pytest.raises(ValueError, match="unknown load shape"):
        load_shape("sawtooth")


def test_step_sine_spike_paper_user_counts(monkeypatch):
    step, sine, spike, paper = (load_shape(n) for n in ("step", "sine", "spike", "paper"))
    assert users(ticks(step, [0, 119, 120, 250, 480, 599], monkeypatch)) == [2, 2, 6, 10, 18, 18]
    s = users(ticks(sine, [0, 60, 150, 240, 300, 450], monkeypatch))
    assert s[0] == 1 and s[2] == 16 and s[4] == 1 and s[5] == 16 and 1 < s[1] < 16 and s[1] == s[3]
    assert users(ticks(spike, [0, 179, 180, 239, 240, 425, 440, 599], monkeypatch)) == [2, 2, 24, 24, 2, 24, 2, 2]
    assert users(ticks(paper, [0, 99, 100, 199, 200, 350, 599], monkeypatch)) == [2, 2, 16, 16, 2, 16, 16]


def test_time_scale_and_duration_compress_a_shape(monkeypatch):
    paper = load_shape("paper")
    # 0.05: the 10-minute shape lasts 30 s, phases of 5 s, spawn rate 20x faster
    fast = ticks(paper, [0, 4.9, 5, 10, 29.9, 30], monkeypatch, LOADTEST_TIME_SCALE=0.05)
    assert users(fast) == [2, 2, 16, 2, 16, None]
    assert fast[0][1] == pytest.approx(paper.spawn_rate / 0.05)
    for name in SHAPES:  # LOADTEST_DURATION_S fits any shape to the given length
        res = ticks(load_shape(name), [0, 29.9, 30], monkeypatch, LOADTEST_DURATION_S=30)
        assert res[0] is not None and res[1] is not None and res[2] is None
    assert users(ticks(paper, [0, 150], monkeypatch, LOADTEST_USER_SCALE=2.5)) == [5, 40]
    assert users(ticks(paper, [0], monkeypatch, LOADTEST_USER_SCALE=0.1)) == [1]  # never below one user


def test_tick_depends_on_run_time_only(monkeypatch):
    """Same run time, same answer: whatever the order of calls, the runner's state or the instance."""
    times = [0, 33, 100, 5, 420, 181, 599, 33, 5]
    for name in SHAPES:
        cls = load_shape(name)
        a = ticks(cls, times, monkeypatch)
        b = ticks(cls, list(reversed(times)), monkeypatch)
        assert a == list(reversed(b))
        shape = cls()
        shape.runner = object()  # no user count to read: tick must not ask for one
        monkeypatch.setattr(shape, "get_run_time", lambda: 33)
        assert shape.tick() == a[1]


# ---- locustfile + report against a fake streaming server (no Ray) ------------------------------

class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `tokens` chat chunks a few ms apart; /metrics shows batch size = requests in flight."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each SSE chunk leaves at once
    in_flight = 0
    done = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, code, body: bytes, ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode())
        elif self.path == "/healthz":
            self._send(200, b'{"status": "ok"}')
        elif self.path.startswith("/api/v1/query?"):  # a Prometheus server's instant query
            query = urllib.parse.unquote(self.path)  # asks for both names: the API port's and Ray's (ray_ prefix)
            assert "(ray_)?specserve_batch_size" in query and "(ray_)?specserve_requests_total" in query
            result = [{"metric": {"__name__": "ray_specserve_batch_size", "gpu_type": "fake", "group": "g1", "pod": p},
                       "value": [time.time(), v]} for p, v in (("a", "3"), ("b", "5"))]
            self._send(200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode())
        elif self.path == "/metrics":
            n = FakeOpenAI.in_flight
            lines = [
                "# HELP ray_specserve_batch_size Sequences in the last engine step.",
                "# TYPE ray_specserve_batch_size gauge",
                f'ray_specserve_batch_size{{gpu_type="fake",group="g1",replica="r1"}} {n}',
                f'ray_specserve_speculation_k{{gpu_type="fake",group="g1",replica="r1"}} {4 if n <= 2 else 1}',
                'ray_specserve_queue_depth{gpu_type="fake",group="g1"} 0',
                f'ray_specserve_generated_tokens_total{{gpu_type="fake",group="g1"}} {FakeOpenAI.done * 8}',
                f'ray_specserve_requests_total{{gpu_type="fake",group="g1",status="200"}} {FakeOpenAI.done}',
            ]
            self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and body["model"] == "fake-model" and body["messages"]
        with FakeOpenAI.lock:
            FakeOpenAI.in_flight += 1
        try:
            tokens = 8
            if not body.get("stream"):
                time.sleep(0.002 * tokens)
                self._send(200, json.dumps({"choices": [{"message": {"content": "x " * tokens}}],
                                            "usage": {"completion_tokens": tokens}}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(data: dict | str):
                payload = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                self.wfile.flush()

            chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            time.sleep(0.03)  # time to first token
            for _ in range(tokens):
                chunk({"choices": [{"index": 0, "delta": {"content": "x "}}]})
                time.sleep(0.005)
            chunk({"choices": [], "usage": {"completion_tokens": tokens}})
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # Locust stopped that user mid-stream (a phase change)
        finally:
            with FakeOpenAI.lock:
                FakeOpenAI.in_flight -= 1
                FakeOpenAI.done += 1


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # a phase change opens many connections at once
    daemon_threads = True


@pytest.fixture()
def fake_server():
    server = Server(("127.0.0.1", free_port()), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_prometheus_parsing_and_grouping():
    text = ('# TYPE x gauge\nray_specserve_batch_size{gpu_type="A",group="a",replica="1"} 4\n'
            'ray_specserve_batch_size{gpu_type="A",group="a",replica="2"} 2\n'
            'ray_specserve_speculation_k{gpu_type="A",group="a",replica="1"} 3\n'
            'ray_specserve_queue_depth{gpu_type="A",group="a",replica="1"} 1\n'
            'ray_specserve_queue_depth{gpu_type="A",group="a",replica="2"} 5\n'
            'ray_specserve_requests_total{gpu_type="A",group="a",status="200"} 7\n'
            'ray_specserve_requests_total{gpu_type="A",group="a",status="429"} 1\n'
            'ray_other{label="with \\"quote\\", comma"} 1.5e3\n')
    samples = report.parse_metrics(text)
    assert ("ray_other", {"label": 'with "quote", comma'}, 1500.0) in samples
    assert report.metric_names(text) >= {"ray_specserve_batch_size", "ray_specserve_requests_total", "ray_other"}
    g = report.group_sample(samples)
    assert g == {("A", "a"): {"batch_size": 3.0, "k": 3.0, "queue_depth": 6.0, "requests": 8.0}}


def test_poller_reads_metrics_endpoints_and_prometheus(fake_server, tmp_path):
    assert report.group_sample(report.scrape([f"prom+{fake_server}"])) == {("fake", "g1"): {"batch_size": 4.0}}
    both = report.scrape([f"{fake_server}/metrics", f"http://127.0.0.1:{free_port()}/metrics"])  # one node down
    assert report.group_sample(both)[("fake", "g1")]["k"] == 4.0
    rec = report.MetricsRecorder([f"{fake_server}/metrics"], tmp_path / "m.csv")
    assert rec.poll(users=3, now=100.0) == 1
    [row] = read_csv(tmp_path / "m.csv")
    assert row["users"] == "3" and row["gpu_type"] == "fake" and float(row["batch_size"]) == 0


@pytest.mark.timeout(180)
def test_locust_records_ttft_tpot_tokens_and_the_report_against_a_fake_server(fake_server, tmp_path):
    out = tmp_path / "lt"
    r = run_loadtest(["--url", fake_server, "--metrics-url", f"{fake_server}/metrics", "--shape", "paper",
                      "--duration", "8", "--max-tokens", "8", "--out", str(out)], timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    stats = {(row["Type"], row["Name"]): row for row in read_csv(out / "paper_stats.csv")}
    whole = stats[("POST", "/v1/chat/completions")]
    ttft, tpot = stats[("TTFT", "/v1/chat/completions")], stats[("TPOT", "/v1/chat/completions")]
    n = int(whole["Request Count"])
    assert n > 20 and int(whole["Failure Count"]) == 0
    assert int(ttft["Request Count"]) == n and int(tpot["Request Count"]) == n
    assert float(whole["Average Content Size"]) == 8  # output tokens from the usage chunk
    assert 25 <= float(ttft["Median Response Time"]) < float(whole["Median Response Time"]) - 15
    assert float(tpot["Average Response Time"]) < float(ttft["Average Response Time"])
    history = read_csv(out / "paper_stats_history.csv")
    assert {row["Type"] for row in history} >= {"POST", "TTFT", "TPOT"}
    assert {int(row["User Count"]) for row in history} >= {2, 16}  # both phases of the paper shape
    metrics = read_csv(out / "paper_metrics.csv")
    assert len(metrics) >= 4 and {m["group"] for m in metrics} == {"g1"}
    assert {float(m["k"]) for m in metrics} >= {1.0}
    png = out / "paper_report.png"
    assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for suffix in ("_stats.csv", "_stats_history.csv", "_failures.csv", "_exceptions.csv", ".html"):
        assert (out / f"paper{suffix}").exists(), suffix


def test_distributed_run_master_and_workers(fake_server, tmp_path):
    """--workers 2: a Locust master runs the shape and writes the CSVs, two worker processes run the
    users; their TTFT/TPOT events reach the master's statistics."""
    out = tmp_path / "dist"
    r = run_loadtest(["--url", fake_server, "--metrics-url", "", "--shape", "step", "--duration", "8",
                      "--max-tokens", "8", "--out", str(out), "--workers", "2", "--master-port", str(free_port())],
                     timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "master + 2 workers" in r.stdout
    stats = {(row["Type"], row["Name"]): row for row in read_csv(out / "step_stats.csv")}
    n = int(stats[("POST", "/v1/chat/completions")]["Request Count"])
    assert n > 10 and int(stats[("POST", "/v1/chat/completions")]["Failure Count"]) == 0
    assert int(stats[("TTFT", "/v1/chat/completions")]["Request Count"]) == n
    assert (out / "step_report.png").exists()


def test_sigterm_ends_the_run_early_with_its_results_and_no_process_left(fake_server, tmp_path):
    """`kill` (a CI timeout, a Job's end) of a distributed run a minute long: Locust's master stops the run and writes
    its CSVs, the report is made, and neither Locust nor its workers outlive it (they used to run on, orphaned)."""
    import psutil

    out = tmp_path / "stopped"
    before = FakeOpenAI.done
    run = subprocess.Popen(**loadtest(["--url", fake_server, "--metrics-url", "", "--shape", "step", "--duration", "60",
                                       "--max-tokens", "8", "--out", str(out), "--workers", "2",
                                       "--master-port", str(free_port())]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        history, deadline = out / "step_stats_history.csv", time.monotonic() + 60
        while time.monotonic() < deadline and not (  # the run under way: requests answered and in the master's stats
                FakeOpenAI.done >= before + 20 and history.exists()
                and any(int(r["Total Request Count"]) > 0 for r in read_csv(history) if r["Name"] == "Aggregated")):
            time.sleep(0.5)
        children = psutil.Process(run.pid).children(recursive=True)
        assert len(children) >= 3, children  # the master and its two workers
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert time.monotonic() - started < 30
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    assert "requests" in stdout and (out / "step_report.png").exists(), stdout + stderr
    assert int(next(r for r in read_csv(out / "step_stats.csv") if r["Name"] == "Aggregated")["Request Count"]) > 0


def test_non_streaming_requests_record_tpot_but_no_ttft(fake_server, tmp_path):
    out = tmp_path / "lt"
    r = run_loadtest(["--url", fake_server, "--metrics-url", "", "--shape", "step", "--duration", "4",
                      "--no-stream", "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    types = {row["Type"] for row in read_csv(out / "step_stats.csv")}
    assert "TPOT" in types and "TTFT" not in types and "POST" in types
    assert (out / "step_report.png").exists()  # the report says "no service metrics" instead of failing


def test_unreachable_service_is_exit_status_2(tmp_path):
    r = run_loadtest(["--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "nothing answers" in r.stderr


# ---- live: the local Ray Serve service, one session for the smoke run and the metrics checks -----

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """specserve on a local Ray cluster: tiny target + draft, a profile whose k falls with the batch."""
    import ray
    from ray import serve

    from conftest import save_serving_pair
    from deployments.app import build_app

    root = tmp_path_factory.mktemp("live")
    save_serving_pair(root)
    (root / "profiles").mkdir()
    (root / "profiles" / "smoke-cpu.json").write_text(json.dumps(
        {"gpu_type": "smoke-cpu", "target": "target", "draft": "draft", "best_k": {"1": 4, "4": 2, "8": 1}}))
    http_port = free_port()
    cfg = {
        "model": {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32"},
        "engine": {"policy": "lut", "max_batch_size": 8, "max_model_len": 200},
        "groups": [{"name": "smoke", "gpu_type": "smoke-cpu", "torch_threads": 1}],
        "served_model_name": "tiny", "profiles_dir": str(root / "profiles"), "max_tokens_limit": 64, "max_queue": 64,
    }
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # gauges every second: k over a 30 s run
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    metrics_port = ray.nodes()[0]["MetricsExportPort"]  # the metrics agent's own choice: nothing can take it first
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(cfg), name="specserve", route_prefix="/")
        yield {"url": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "root": root}
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = saved


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_locust_smoke_run_against_the_local_service(live):
    out = live["root"] / "loadtest"
    started = time.time()
    # no --metrics-url: the poller reads the service's own /metrics on the API port
    r = run_loadtest(["--url", live["url"], "--shape", "paper", "--duration", "30",
                      "--max-tokens", "32", "--out", str(out)], timeout=300)
    took = time.time() - started
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 30 <= took < 120, took
    stats = {(row["Type"], row["Name"]): row for row in read_csv(out / "paper_stats.csv")}
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0
    whole = stats[("POST", "/v1/chat/completions")]
    n = int(whole["Request Count"])
    assert n >= 10 and int(stats[("TTFT", "/v1/chat/completions")]["Request Count"]) == n
    assert float(whole["Average Content Size"]) == 32  # every answer is max_tokens long (EOS suppressed)
    assert not read_csv(out / "paper_failures.csv") and not read_csv(out / "paper_exceptions.csv")
    for suffix in ("_stats.csv", "_stats_history.csv", "_failures.csv", "_exceptions.csv", "_metrics.csv", ".html"):
        assert (out / f"paper{suffix}").exists(), suffix
    png = out / "paper_report.png"
    assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = read_csv(out / "paper_metrics.csv")
    assert {(m["gpu_type"], m["group"]) for m in metrics} == {("smoke-cpu", "smoke")}
    batch = [float(m["batch_size"]) for m in metrics if m["batch_size"]]
    ks = {float(m["k"]) for m in metrics if m["k"]}
    assert max(batch) > 2 and ks <= {0.0, 1.0, 2.0, 4.0} and len(ks) >= 2, (batch, ks)  # k follows the batch


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_dashboard_promql_names_only_metrics_the_service_exports(live):
    spec = importlib.util.spec_from_file_location("provision_dashboards", ROOT / "k8s" / "provision_dashboards.py")
    dashboards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dashboards)
    wanted = set().union(*(dashboards.promql_metric_names(e) for e in dashboards.dashboard_exprs(json.loads(DASHBOARD.read_text()))))
    polled = set(report.GAUGES.values()) | set(report.COUNTERS.values())  # what the poller reads on the API port
    deadline, exported, api = time.time() + 60, set(), set()
    while time.time() < deadline:
        exported = report.metric_names(httpx.get(live["metrics"], timeout=10).text)
        api = report.metric_names(httpx.get(f"{live['url']}/metrics", timeout=10).text)
        if wanted <= exported and polled <= api:
            break
        httpx.post(f"{live['url']}/v1/chat/completions", timeout=60,  # this test may run alone: make traffic
                   json={"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 8})
        time.sleep(2)
    assert wanted <= exported, sorted(wanted - exported)
    assert polled <= api, sorted(polled - api)
    assert {f"ray_{n}" for n in polled} <= exported  # the same series on Ray's export port
    assert len(wanted) >= 11


# ---- a real Prometheus: it scrapes the live service under a Locust run and evaluates the dashboard ---------
RULES = ROOT / "k8s" / "prometheus-rules.yaml"


def panel_queries(dashboard: dict, rate_interval: str = "20s") -> list[tuple[str, str, list[str]]]:
    """(panel title, PromQL with Grafana's variables filled in, the labels it groups by) for every target."""
    import re

    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", rate_interval).replace('"$gpu_type"', '".*"')
            by = re.findall(r"by \(([^)]*)\)", expr)
            labels = sorted({x.strip() for group in by for x in group.split(",")} - {"le"})
            out.append((panel["title"], expr, labels))
    return out


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_prometheus_evaluates_every_dashboard_query_and_the_alert_rules(live, tmp_path):
    """Prometheus (Debian's package: `make test` installs it where apt-get can) scrapes the live service, Ray's
    export port and the API port, while Locust drives it and a few requests are refused; every dashboard panel's
    query then returns series carrying the labels it groups by, the recording rules evaluate, and promtool
    accepts the rules and passes their unit tests (each alert fires where it should, tests/data)."""
    import shutil

    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        pytest.skip("prometheus is not installed here (make test installs Debian's package where it can)")
    import shutil as sh

    import yaml

    rules = tmp_path / "specserve-rules.yaml"  # the PrometheusRule's spec is a plain rules file
    rules.write_text(yaml.safe_dump(next(d for d in yaml.safe_load_all(RULES.read_text()) if d)["spec"]))
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    sh.copy(ROOT / "tests" / "data" / "prometheus_rules_test.yaml", tmp_path)
    unit = subprocess.run([promtool, "test", "rules", "prometheus_rules_test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr

    port = free_port()
    ray_target, api_target = (urllib.parse.urlsplit(u).netloc for u in (live["metrics"], live["url"]))
    (tmp_path / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [ray_target]}]},
                           {"job_name": "specserve-api", "static_configs": [{"targets": [api_target]}]}]}))
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                               "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = f"http://127.0.0.1:{port}/api/v1"
    run = None  # the Locust run, once Prometheus is up

    def query(expr: str) -> list[dict]:
        r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # traffic until every query answered (then stopped: its own results are the smoke run's to check)
        run = subprocess.Popen(**loadtest(["--url", live["url"], "--shape", "step", "--duration", "40", "--max-tokens", "16",
                                           "--out", str(tmp_path / "locust")]),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(3):  # refused by the engine (past the context limit): a status other than 200
            httpx.post(f"{live['url']}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "the cat sat " * 120, "max_tokens": 4})
        queries = panel_queries(json.loads(DASHBOARD.read_text()))
        missing = queries
        deadline = time.time() + 60
        while missing and time.time() < deadline:
            time.sleep(3)
            missing = [(title, expr, labels) for title, expr, labels in missing if not query(expr)]
        assert not missing, [title for title, _, _ in missing]
        for title, expr, labels in queries:
            for series in query(expr) or []:  # a panel that rated to nothing since is not a missing label
                assert set(labels) <= set(series["metric"]), (title, labels, series["metric"])
        assert query("specserve:acceptance_rate:rate10m") and query("specserve:ttft_seconds:p95_5m")
        assert query('vllm:kv_cache_usage_perc{job="specserve-api"}')  # what the KV-pool alert reads
        rules = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"] if r["type"] == "alerting"} == {
            "SpecserveErrorRatioHigh", "SpecserveQueueTimeHigh", "SpecserveKVPoolFull", "SpecserveAcceptanceCollapse"}
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    finally:
        for process in filter(None, (run, server)):  # loadtest.run stops the Locust it started
            process.terminate()
            process.wait(timeout=60)
