"""/metrics: the Router replicas' snapshots as Prometheus text, under specserve's series and vLLM's names."""

from .latency import exposition

# (name, type, help, how to read it from a snapshot: counter/gauge key)
_SERIES = [
    ("specserve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", ("counters", "prompt_tokens")),
    ("specserve_generated_tokens_total", "counter", "Tokens generated.", ("counters", "generated_tokens")),
    ("specserve_proposed_tokens_total", "counter", "Draft tokens proposed.", ("counters", "draft_tokens")),
    ("specserve_accepted_tokens_total", "counter", "Draft tokens accepted.", ("counters", "accepted_tokens")),
    ("specserve_batch_size", "gauge", "Sequences in the last engine step.", ("gauges", "batch_size")),
    ("specserve_speculation_k", "gauge", "Speculation length chosen for the last step.", ("gauges", "k")),
    ("specserve_queue_depth", "gauge", "Requests waiting for admission.", ("gauges", "waiting")),
    ("specserve_acceptance_estimate", "gauge", "Live per-token draft acceptance estimate.", ("gauges", "acceptance_estimate")),
    ("vllm:num_requests_running", "gauge", "Requests admitted: decoding or prefilling.", ("gauges", "running")),
    ("vllm:kv_cache_usage_perc", "gauge", "KV pool share counted for admitted requests (0-1; shared prefix blocks counted per holder).", ("gauges", "kv_usage")),
    ("specserve_kv_pool_tokens", "gauge", "KV tokens each worker's pool holds: max_num_tokens, or on a GPU what gpu_memory_utilization leaves.", ("gauges", "kv_pool_tokens")),
    ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache (whole blocks).", ("counters", "prefix_queries")),
    ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", ("counters", "prefix_hits")),
    ("vllm:num_preemptions_total", "counter", "Requests sent back to the queue because the KV pool ran short.", ("counters", "preemptions")),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission.", ("gauges", "waiting")),
    ("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", ("counters", "prompt_tokens")),
    ("vllm:generation_tokens_total", "counter", "Tokens generated.", ("counters", "generated_tokens")),
    ("vllm:spec_decode_num_drafts_total", "counter", "Draft proposals (one per sequence per step with k > 0).", ("counters", "drafts")),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", ("counters", "draft_tokens")),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", ("counters", "accepted_tokens")),
]


def render_metrics(snapshots: dict[str, dict], model_name: str) -> str:
    """Prometheus text exposition of the Router replicas' snapshots (labels: model_name, group,
    gpu_type, replica)."""
    def labels(replica: str, snap: dict, **extra) -> str:
        pairs = {"model_name": model_name, "group": snap["group"], "gpu_type": snap["gpu_type"], "replica": replica, **extra}
        return ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                        for k, v in pairs.items())

    lines = []
    for name, kind, help_text, (part, key) in _SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels(r, s)}}} {float(s[part][key])}" for r, s in snapshots.items()]
    name = "specserve_requests_total"
    lines += [f"# HELP {name} Finished requests by status.", f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels(r, s, status=st)}}} {float(n)}"
              for r, s in snapshots.items() for st, n in sorted(s["counters"]["requests"].items())]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Draft tokens accepted, by position in the draft.", f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels(r, s, position=i)}}} {float(n)}"
              for r, s in snapshots.items() for i, n in enumerate(s["counters"]["accepted_per_position"])]
    name = "specserve_profile_info"
    lines += [f"# HELP {name} 1 for the kind of profile a replica steers by (measured, predicted, none), 0 for the others.",
              f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, s, source=src, version=s['profile']['version'])}}} {float(src == s['profile']['source'])}"
              for r, s in snapshots.items() if "profile" in s for src in ("measured", "predicted", "none")]
    name = "specserve_draft_source_tokens_total"
    lines += [f"# HELP {name} Draft tokens by source (model, context: prompt lookup, history: earlier outputs) and outcome.",
              f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels(r, s, source=src, outcome=outcome)}}} {float(n)}"
              for r, s in snapshots.items() for outcome in ("proposed", "accepted")
              for src, n in sorted(s["counters"].get(f"source_{outcome}", {}).items())]
    held = {r: s["history"] for r, s in snapshots.items() if s.get("history")}
    for name, kind, help_text, key in (
            ("specserve_history_tokens", "gauge", "Tokens the draft's suffix history holds.", "tokens"),
            ("specserve_history_lookups_total", "counter", "Suffix history lookups (one per copyable row per proposal).", "lookups"),
            ("specserve_history_hits_total", "counter", "Suffix history lookups that found a match.", "hits"),
            ("specserve_history_running_lookups_total", "counter",
             "Lookups in the outputs of the rows running now (one per copyable row per proposal).", "running_lookups"),
            ("specserve_history_running_hits_total", "counter",
             "Lookups in the running rows' outputs that found another row's continuation.", "running_hits")):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels(r, snapshots[r])}}} {float(h.get(key, 0))}" for r, h in held.items()]
    calibrated = {r: s["calibration"] for r, s in snapshots.items() if s.get("calibration")}
    name = "specserve_calibration_factor"
    lines += [f"# HELP {name} Measured / profiled step time of one part (draft, verify, other; chunk: a "
              "prompt chunk's price, chunk_context: its price for the KV its row held) at a profiled batch size, as "
              "this replica's calibration has it (1: as profiled).", f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, snapshots[r], part=part, batch_size=b)}}} {float(f)}"
              for r, cal in calibrated.items() for part, by_size in cal["factors"].items() for b, f in by_size.items()]
    name = "specserve_calibration_drift"
    lines += [f"# HELP {name} Largest |calibrated / profiled - 1| of a whole step over the profile's cells.",
              f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, snapshots[r])}}} {float(cal['drift'])}" for r, cal in calibrated.items()]
    lines += exposition({r: s["histograms"] for r, s in snapshots.items() if s.get("histograms")},
                        lambda r, **extra: labels(r, snapshots[r], **extra))
    return "\n".join(lines) + "\n"
