"""What both simulators share: the profile's acceptance per draft position and the summary figures."""

from __future__ import annotations

import numpy as np

from serve_app.profiling.profiles import Profile


def marginal_acceptance(profile: Profile, max_k: int) -> list[float]:
    """P(draft token i accepted), i < max_k: the profile's measured acceptance per position, extended
    past the measured positions by its per-token rate."""
    m = list(profile.acceptance or [])
    rate = profile.acceptance_rate if profile.acceptance_rate is not None else 0.0
    while len(m) < max_k:
        m.append((m[-1] if m else 1.0) * rate)
    return m[:max_k]


def summarize(policy: str, requests: int, e2e, ttft, tpot, output_tokens: int, span_s: float) -> dict:
    """The figures both engines report: mean and p50/p90/p99 end-to-end latency, TTFT and TPOT of the
    finished requests (seconds; NaN-free arrays), and goodput over the span."""
    def pct(x: np.ndarray, q: float) -> float:
        return float(np.quantile(x, q, method="lower")) if len(x) else float("nan")

    e2e, ttft, tpot = (np.asarray(x, dtype=float) for x in (e2e, ttft, tpot))
    return {"policy": policy, "requests": requests, "finished": len(e2e),
            "mean_latency_s": float(e2e.mean()) if len(e2e) else float("nan"),
            **{f"{name}_p{int(q * 100)}_s": pct(vals, q) for name, vals in (("e2e", e2e), ("ttft", ttft), ("tpot", tpot))
               for q in (0.5, 0.9, 0.99)},
            "goodput_tokens_per_s": output_tokens / span_s if span_s > 0 else float("nan")}
