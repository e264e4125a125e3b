"""/metrics' latency histograms (`deployments.latency`): cumulative buckets, sum and count as Prometheus reads them."""

from deployments.latency import HISTOGRAMS, new_histograms, observe
from deployments.prometheus import render_metrics
from loadtest.report import parse_metrics


def test_histograms_render_cumulative_buckets_under_vllms_names():
    h = new_histograms()
    for s in (0.004, 0.04, 0.04, 3.0, 1e6):  # the last past every bound: only +Inf holds it
        observe(h, "itl", s)
    observe(h, "ttft", 0.2)
    snap = {"group": "g", "gpu_type": "cpu", "counters": {"requests": {}, "accepted_per_position": []},
            "gauges": {k: 0 for k in ("batch_size", "k", "waiting", "acceptance_estimate", "running", "kv_usage",
                                      "kv_pool_tokens")},
            "histograms": h}
    for key in ("prompt_tokens", "generated_tokens", "draft_tokens", "accepted_tokens", "prefix_queries",
                "prefix_hits", "preemptions", "drafts"):
        snap["counters"][key] = 0
    samples = parse_metrics(render_metrics({"r1": snap}, "m"))
    itl = {lab["le"]: v for n, lab, v in samples if n == "vllm:inter_token_latency_seconds_bucket"}
    bounds = HISTOGRAMS["itl"][2]
    assert list(itl) == [*map(str, bounds), "+Inf"]
    assert itl["0.005"] == 1 and itl["0.05"] == 3 and itl["2.5"] == 3 and itl["5.0"] == 4 and itl["+Inf"] == 5
    assert list(itl.values()) == sorted(itl.values())  # cumulative
    count = [v for n, _, v in samples if n == "vllm:inter_token_latency_seconds_count"]
    total = [v for n, _, v in samples if n == "vllm:inter_token_latency_seconds_sum"]
    assert count == [5.0] and abs(total[0] - (0.084 + 3.0 + 1e6)) < 1e-6
    ttft = {lab["le"]: v for n, lab, v in samples if n == "vllm:time_to_first_token_seconds_bucket"}
    assert ttft["0.15"] == 0 and ttft["0.25"] == 1
    assert [v for n, _, v in samples if n == "vllm:e2e_request_latency_seconds_count"] == [0.0]
