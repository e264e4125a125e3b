"""Service metrics during a load test, and the PNG report of a run.

Two halves:
  * Polling (standard library only, so it also runs inside a bare Locust image): `scrape()` reads a
    Prometheus text endpoint (a Ray node's metrics export port), `group_sample()` reduces the
    specserve series to one row per engine group, and `MetricsRecorder` appends those rows to a CSV.
    The locustfile runs the recorder in a greenlet on the master (see `--metrics-url`).
  * Reporting (matplotlib): `make_report()` joins Locust's `<prefix>_stats_history.csv` (written
    with --csv-full-history) with that metrics CSV into one PNG: users, TTFT and TPOT p50/p99,
    tokens/s, and the routers' batch size and chosen k over time.

    python -m loadtest.report --csv out/loadtest/specserve --metrics out/loadtest/specserve_metrics.csv \
        --out out/loadtest/report.png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

# ---- polling ----------------------------------------------------------------------------------

GAUGES = {
    "batch_size": "specserve_batch_size",
    "k": "specserve_speculation_k",
    "queue_depth": "specserve_queue_depth",
}
"""Gauges recorded per group: batch size and k are averaged over the group's router replicas,
queue depth is summed."""
COUNTERS = {
    "generated_tokens": "specserve_generated_tokens_total",
    "proposed_tokens": "specserve_proposed_tokens_total",
    "accepted_tokens": "specserve_accepted_tokens_total",
    "requests": "specserve_requests_total",
}
"""Counters recorded per group (summed over replicas and statuses); rates come from differences.
Names as the service's API port (/metrics) serves them; Ray's metrics export port serves the same
series with a `ray_` prefix, and both are read."""
FIELDS = ["timestamp", "users", "gpu_type", "group", *GAUGES, *COUNTERS]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples (name, labels, value) of a Prometheus text exposition; comments are skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append((m.group(1), labels, value))
    return out


def metric_names(text: str) -> set[str]:
    """Every sample name in a Prometheus text exposition (with _total/_bucket/... suffixes)."""
    return {name for name, _, _ in parse_metrics(text)}


def scrape(urls: list[str], timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """Samples from every URL that answers (a Ray cluster exports metrics per node).

    A URL is either a metrics endpoint (http://NODE:8080/metrics) or, prefixed with `prom+`, a
    Prometheus server (prom+http://prometheus:9090) asked for the specserve series it scraped from
    every node: the way to reach the GPU worker pods' metrics from inside a cluster.
    """
    samples = []
    for url in urls:
        try:
            if url.startswith("prom+"):
                samples += _query_prometheus(url[len("prom+"):].rstrip("/"), timeout)
                continue
            with urllib.request.urlopen(url, timeout=timeout) as r:
                samples += parse_metrics(r.read().decode("utf-8", "replace"))
        except (OSError, ValueError, KeyError):
            continue  # node not up (yet) or a bad answer: the others still count
    return samples


def _query_prometheus(base: str, timeout: float) -> list[tuple[str, dict[str, str], float]]:
    names = "|".join(f"(ray_)?{n}" for n in [*GAUGES.values(), *COUNTERS.values()])
    query = urllib.parse.urlencode({"query": f'{{__name__=~"{names}"}}'})
    with urllib.request.urlopen(f"{base}/api/v1/query?{query}", timeout=timeout) as r:
        data = json.loads(r.read())
    out = []
    for series in data["data"]["result"]:
        labels = dict(series["metric"])
        out.append((labels.pop("__name__"), labels, float(series["value"][1])))
    return out


def group_sample(samples: list[tuple[str, dict[str, str], float]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(gpu_type, group): {batch_size, k, queue_depth, generated_tokens, ...}} from raw samples."""
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_name = {v: k for k, v in {**GAUGES, **COUNTERS}.items()}
    for name, labels, value in samples:
        field = by_name.get(name.removeprefix("ray_"))
        if field is None or math.isnan(value):
            continue
        values[(labels.get("gpu_type", ""), labels.get("group", ""))][field].append(value)
    out = {}
    for key, fields in values.items():
        row = {}
        for field, vs in fields.items():
            row[field] = sum(vs) / len(vs) if field in ("batch_size", "k") else sum(vs)
        out[key] = row
    return out


class MetricsRecorder:
    """Appends one CSV row per engine group and poll to `path` (FIELDS as header)."""

    def __init__(self, urls: list[str], path: str | Path):
        self.urls, self.path = urls, Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerow(FIELDS)

    def poll(self, users: int = 0, now: float | None = None) -> int:
        """Scrape once and append the rows; returns how many groups were seen."""
        now = time.time() if now is None else now
        groups = group_sample(scrape(self.urls))
        with self.path.open("a", newline="") as f:
            w = csv.writer(f)
            for (gpu_type, group), row in sorted(groups.items()):
                w.writerow([f"{now:.3f}", users, gpu_type, group] + [row.get(k, "") for k in FIELDS[4:]])
        return len(groups)


# ---- report -----------------------------------------------------------------------------------

def _num(x: str) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan  # Locust writes N/A before the first sample


def read_history(path: str | Path) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Locust's stats history: {(type, name): [row, ...]} in time order ("Aggregated" included)."""
    entries: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            entries[(row["Type"], row["Name"])].append({k: _num(v) for k, v in row.items() if k not in ("Type", "Name")})
    return entries


def read_metrics(path: str | Path) -> dict[tuple[str, str], list[dict[str, float]]]:
    """The recorder's CSV: {(gpu_type, group): [row, ...]} in time order."""
    series: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            series[(row["gpu_type"], row["group"])].append({k: _num(row[k]) for k in FIELDS if k not in ("gpu_type", "group")})
    return series


def _rate(ts: list[float], totals: list[float], window: float = 3.0) -> tuple[list[float], list[float]]:
    """Per-second rate of a cumulative series over the last `window` seconds (like PromQL rate()).

    A window of a few samples smooths the steps of counters that are exported once a second or so
    and polled at a slightly different cadence.
    """
    xs, ys = [], []
    j = 0
    for i in range(1, len(ts)):
        while j + 1 < i and ts[i] - ts[j + 1] >= window:
            j += 1
        dt = ts[i] - ts[j]
        if dt > 0 and not math.isnan(totals[i]) and not math.isnan(totals[j]):
            xs.append(ts[i])
            ys.append(max(0.0, totals[i] - totals[j]) / dt)
    return xs, ys


def _requests(history: dict) -> dict[tuple[str, str], list[dict[str, float]]]:
    """The whole-request entries (POST /v1/...): not TTFT/TPOT, the model lookup or the aggregate."""
    return {(typ, name): rows for (typ, name), rows in history.items() if typ == "POST" and rows}


def summarize(history: dict) -> dict[str, float]:
    """At the end of the run: whole requests and their output tokens, and failures of any request."""
    req = tokens = 0.0
    for rows in _requests(history).values():
        last = rows[-1]
        req += last["Total Request Count"]
        size = last["Total Average Content Size"]
        tokens += 0 if math.isnan(size) else size * last["Total Request Count"]
    agg = history.get(("", "Aggregated")) or [{"Total Failure Count": 0.0}]
    return {"requests": req, "failures": agg[-1]["Total Failure Count"], "output_tokens": tokens}


def make_report(history_csv: str | Path, metrics_csv: str | Path | None, out: str | Path, title: str = "") -> Path:
    """Write the PNG report; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(history_csv)
    metrics = read_metrics(metrics_csv) if metrics_csv and Path(metrics_csv).exists() else {}
    agg = history.get(("", "Aggregated"), [])
    starts = [r["Timestamp"] for rows in history.values() for r in rows[:1]]
    starts += [r["timestamp"] for rows in metrics.values() for r in rows[:1]]
    t0 = min(starts) if starts else 0.0

    def rel(ts):
        return [t - t0 for t in ts]

    fig, axes = plt.subplots(3, 2, figsize=(14, 11), sharex=True)
    (ax_users, ax_tokens), (ax_ttft, ax_tpot), (ax_batch, ax_k) = axes
    users_t = rel([r["Timestamp"] for r in agg])
    users = [r["User Count"] for r in agg]

    ax_users.step(users_t, users, where="post", color="black", label="users")
    ax_users.set_title("Locust users and request rate")
    ax_users.set_ylabel("users")
    ax_users.set_ylim(bottom=0)
    rps_ax = ax_users.twinx()
    for (typ, name), rows in _requests(history).items():
        ts = [r["Timestamp"] for r in rows]
        xs, ys = _rate(ts, [r["Total Request Count"] for r in rows])
        rps_ax.plot(rel(xs), ys, color="tab:blue", label=f"{typ} {name}: requests/s")
        xs, ys = _rate(ts, [r["Total Failure Count"] for r in rows])
        rps_ax.plot(rel(xs), ys, color="tab:red", label="failures/s")
    rps_ax.set_ylabel("requests/s")
    rps_ax.set_ylim(bottom=0)
    _legend(ax_users, rps_ax)

    for ax, typ, label in ((ax_ttft, "TTFT", "time to first token"), (ax_tpot, "TPOT", "time per output token")):
        found = False
        for (t, name), rows in history.items():
            if t != typ:
                continue
            found = True
            ts = rel([r["Timestamp"] for r in rows])
            ax.plot(ts, [r["50%"] for r in rows], label=f"p50 {name}")
            ax.plot(ts, [r["99%"] for r in rows], label=f"p99 {name}", linestyle="--")
        ax.set_title(f"{label} (client side, sliding window)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        if found:
            ax.legend(loc="upper left", fontsize=8)
        else:
            _empty(ax, f"no {typ} entries (streaming off?)")

    # tokens/s: client side from Locust (output tokens are the whole-request entry's content size),
    # server side from the routers' generated-token counters, per group.
    for (typ, name), rows in _requests(history).items():
        ts = [r["Timestamp"] for r in rows]
        totals = [r["Total Request Count"] * (0 if math.isnan(r["Total Average Content Size"]) else r["Total Average Content Size"])
                  for r in rows]
        xs, ys = _rate(ts, totals)
        ax_tokens.plot(rel(xs), ys, color="black", label="client: output tokens/s")
    for (gpu_type, group), rows in sorted(metrics.items()):
        xs, ys = _rate([r["timestamp"] for r in rows], [r["generated_tokens"] for r in rows])
        ax_tokens.plot(rel(xs), ys, label=f"server {group} ({gpu_type}): generated tokens/s")
    ax_tokens.set_ylim(bottom=0)
    ax_tokens.set_title("output tokens per second")
    ax_tokens.set_ylabel("tokens/s")
    ax_tokens.legend(loc="upper left", fontsize=8)

    for ax, field, label in ((ax_batch, "batch_size", "router batch size (service metrics)"),
                             (ax_k, "k", "chosen speculation length k (service metrics)")):
        ax.set_title(label)
        ax.set_ylabel(field)
        if not metrics:
            _empty(ax, "no service metrics recorded (--metrics-url not set or not reachable)")
        for (gpu_type, group), rows in sorted(metrics.items()):
            ax.step(rel([r["timestamp"] for r in rows]), [r[field] for r in rows], where="post", marker=".",
                    label=f"{group} ({gpu_type})")
        ax.set_ylim(bottom=0)
        load = ax.twinx()
        if metrics:  # the poller's own user counts: the same clock as the service metrics
            rows = next(iter(sorted(metrics.items())))[1]
            load.fill_between(rel([r["timestamp"] for r in rows]), [r["users"] for r in rows], step="post", color="grey",
                              alpha=0.15, label="users")
        else:
            load.fill_between(users_t, users, step="post", color="grey", alpha=0.15, label="users")
        load.set_ylabel("users", color="grey")
        load.set_ylim(bottom=0)
        _legend(ax, load)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since start")

    s = summarize(history)
    fig.suptitle(f"{title}  requests {s['requests']:.0f}, failures {s['failures']:.0f}, "
                 f"output tokens {s['output_tokens']:.0f}".strip())
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _legend(ax, twin) -> None:
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    if h1 or h2:
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n")[0])
    p.add_argument("--csv", required=True, help="Locust's --csv prefix (reads PREFIX_stats_history.csv)")
    p.add_argument("--metrics", default=None, help="the metrics CSV written during the run (default PREFIX_metrics.csv)")
    p.add_argument("--out", default=None, help="PNG to write (default PREFIX_report.png)")
    p.add_argument("--title", default="specserve load test")
    a = p.parse_args(argv)
    history = Path(f"{a.csv}_stats_history.csv")
    if not history.exists():
        print(f"report: {history} not found (run Locust with --csv {a.csv} --csv-full-history)", file=sys.stderr)
        return 2
    out = make_report(history, a.metrics or f"{a.csv}_metrics.csv", a.out or f"{a.csv}_report.png", a.title)
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
