"""Request latency histograms a Router replica keeps for /metrics, under vLLM's names.

Cumulative bucket counts, a sum and a count per histogram, as Prometheus histograms are: a scraper (and
the dashboard) reads quantiles with `histogram_quantile` over them. Plain dicts and lists, so they travel in
the replica's snapshot to the ProfileStore and the ingress renders them (`prometheus.render_metrics`).
"""

from __future__ import annotations

import bisect

# (vLLM's series, help, upper bounds in seconds). Bounds reach from a GPU's token (~5 ms) to a CPU's long queue.
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first generated token.",
             [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]),
    "itl": ("vllm:inter_token_latency_seconds",
            "Seconds between two outputs of one request (a step's accepted tokens arrive together).",
            [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]),
    "e2e": ("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its last token.",
            [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0]),
    "queue": ("vllm:request_queue_time_seconds", "Seconds a request waited for admission.",
              [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0]),
}


def new_histograms() -> dict[str, dict]:
    """{key: {"buckets": [count per bound, then +Inf], "sum", "count"}}, all zero (counts per bucket, not cumulative)."""
    return {key: {"buckets": [0] * (len(bounds) + 1), "sum": 0.0, "count": 0} for key, (_, _, bounds) in HISTOGRAMS.items()}


def observe(histograms: dict[str, dict], key: str, seconds: float) -> None:
    h, bounds = histograms[key], HISTOGRAMS[key][2]
    h["buckets"][bisect.bisect_left(bounds, seconds)] += 1
    h["sum"] += seconds
    h["count"] += 1


def exposition(histograms_by_replica: dict[str, dict], labels) -> list[str]:
    """Prometheus text lines of every replica's histograms; labels(replica, **extra) -> the label string."""
    lines = []
    for key, (name, help_text, bounds) in HISTOGRAMS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for replica, hists in histograms_by_replica.items():
            h = hists.get(key)
            if h is None:
                continue
            total = 0
            for bound, n in zip([*map(str, bounds), "+Inf"], h["buckets"]):
                total += n
                lines.append(f"{name}_bucket{{{labels(replica, le=bound)}}} {float(total)}")
            lines += [f"{name}_sum{{{labels(replica)}}} {float(h['sum'])}", f"{name}_count{{{labels(replica)}}} {float(h['count'])}"]
    return lines
