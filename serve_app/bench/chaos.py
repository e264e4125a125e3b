"""`specserve chaos`: steady load on the local service while its target actor, draft actor and Router
replica are killed in turn; `--soak-minutes` for memory over a long run, `--burst` for overload.

A runnable command, not a timed test. Load is Locust-style closed-loop users (streamed greedy chat
requests, each compared with the text the same prompt got from an uninterrupted run) or open-loop
Poisson arrivals at a share of the capacity measured first. Writes results/chaos-<hardware>.json|md
and, for a soak, a PNG of each process's resident memory over time.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from serve_app.config import ModelConfig
from serve_app.bench.prompt_sets import BENCH_PROMPTS

APP = "specserve"


@dataclass
class Outcome:
    start: float
    end: float
    prompt: int
    status: str  # "ok", "429", "503", or "error: ..."
    identical: bool | None = None  # ok answers: the uninterrupted run's text?


@dataclass
class Service:
    url: str
    model: str
    max_tokens: int
    reference: list[str] = field(default_factory=list)

    def ask(self, prompt: int) -> tuple[str, str]:
        """One streamed greedy chat request; (status, text)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": BENCH_PROMPTS[prompt]}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        text = []
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    r.read()
                    return str(r.status_code), ""
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"error: {chunk['error']['message']}", "".join(text)
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content") or "")
        except httpx.HTTPError as e:
            return f"error: {type(e).__name__}", "".join(text)
        return "ok", "".join(text)

    def run(self, prompt: int) -> Outcome:
        t = time.monotonic()
        status, text = self.ask(prompt)
        ok = status == "ok"
        return Outcome(t, time.monotonic(), prompt, status, (text == self.reference[prompt]) if ok and self.reference else None)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


def closed_loop(svc: Service, users: int, stop: threading.Event, out: list[Outcome], bar=None) -> list[threading.Thread]:
    """`users` threads, each sending its next request as soon as the last one ends."""
    def user(u: int) -> None:
        i = u
        while not stop.is_set():
            out.append(svc.run(i % len(BENCH_PROMPTS)))
            i += users
            if bar is not None:
                bar.update(1)

    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    return threads


def open_loop(svc: Service, rate: float, seconds: float, out: list[Outcome], bar=None, seed: int = 0) -> None:
    """Poisson arrivals at `rate` requests/s for `seconds`, whatever the service answers."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    with ThreadPoolExecutor(256) as pool:
        i = 0
        while time.monotonic() < end:
            pool.submit(lambda p: out.append(svc.run(p)) or (bar.update(1) if bar is not None else None), i % len(BENCH_PROMPTS))
            i += 1
            time.sleep(rng.expovariate(rate))


def capacity(svc: Service, users: int, seconds: float) -> float:
    """Completed requests per second with `users` closed-loop users (the service kept full)."""
    out: list[Outcome] = []
    stop = threading.Event()
    threads = closed_loop(svc, users, stop, out)
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    done = [o for o in out if o.status == "ok"]
    span = max(o.end for o in done) - min(o.start for o in done)
    return len(done) / span


# ---- what is killed, and when it is back ------------------------------------------------------------

def router_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Router-default", APP).stats.remote().result(timeout_s=60)


def kill(role: str) -> dict:
    """Kill the target or draft actor of the (first) Router replica, or the Router replica itself."""
    import ray

    if role == "router":
        [replica] = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Router-default" in a["name"]][:1]
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
        return {"victim": replica["name"]}
    victim = router_stats()["actors"][0 if role == "target" else 1]
    ray.kill(ray.get_actor(victim))
    return {"victim": victim}


def recovered(role: str, victim: str, svc: Service) -> bool:
    if not svc.ready():
        return False
    st = router_stats()
    if role == "router":
        return True  # a replica answers again (the victim's stats went with it)
    i = 0 if role == "target" else 1
    return st["actors"][i] != victim and st["speculating"] and not st["repairing"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def process_ids() -> dict[str, int]:
    from ray import serve

    return {**serve.get_deployment_handle("Router-default", APP).pids.remote().result(timeout_s=60),
            "ingress": serve.get_deployment_handle("OpenAIIngress", APP).pid.remote().result(timeout_s=60)}


# ---- the command ------------------------------------------------------------------------------------

def tally(outs: list[Outcome]) -> dict:
    c = Counter(o.status if o.status in ("ok", "429", "503") else "error" for o in outs)
    return {"sent": len(outs), "succeeded": c["ok"], "429": c["429"], "503": c["503"], "failed": c["error"] + c["503"],
            "identical": sum(bool(o.identical) for o in outs), "different": sum(o.identical is False for o in outs)}


def chaos(mc: ModelConfig, policy: str, users: int, max_tokens: int, interval_s: float, port: int,
          soak_minutes: float, load: float, burst: float, capacity_s: float, out_stem) -> tuple[dict, str]:
    from deployments.app import served_name
    from deployments.config import AppConfig
    from deployments.local import start, stop

    app_args = {"model": mc.model_dump(), "engine": {"policy": policy, "max_batch_size": max(users, 8)},
                "profiles_dir": "profiles", "max_queue": 32, "health_check_period_s": 2}
    svc = Service(start(app_args, port=port), served_name(AppConfig.model_validate(app_args)), max_tokens)
    res: dict = {"policy": policy, "users": users, "max_tokens": max_tokens, "target": mc.target, "dtype": mc.dtype}
    try:
        with tqdm(total=len(BENCH_PROMPTS), desc="reference (uninterrupted)", unit="req") as bar:
            for i in range(len(BENCH_PROMPTS)):
                svc.reference.append(svc.ask(i)[1])
                bar.update(1)
        res["kills"] = _kill_in_turn(svc, users, interval_s)
        if soak_minutes or burst:
            res["capacity_req_s"] = cap = capacity(svc, max(users, 8), capacity_s)
        if soak_minutes:
            res["soak"] = _soak(svc, cap * load, soak_minutes, load, out_stem)
        if burst:
            res["burst"] = _burst(svc, cap * burst, burst)
    finally:
        stop()
    return res, report(res)


def _kill_in_turn(svc: Service, users: int, interval_s: float) -> dict:
    outs: list[Outcome] = []
    stop = threading.Event()
    kills = []
    with tqdm(desc="chaos: load, kills in turn", unit="req") as bar:
        threads = closed_loop(svc, users, stop, outs, bar)
        for role in ("target", "draft", "router"):
            time.sleep(interval_s)
            bar.set_postfix_str(f"killing the {role}")
            t = time.monotonic()
            k = kill(role)
            while not recovered(role, k["victim"], svc) and time.monotonic() - t < 300:
                time.sleep(0.25)
            k.update(role=role, at=t, recovery_s=round(time.monotonic() - t, 1))
            kills.append(k)
        time.sleep(interval_s)
        stop.set()
        for th in threads:
            th.join()
    for k in kills:  # the requests in flight when it was killed: every one should have been resumed
        cut = [o for o in outs if o.start < k["at"] < o.end]
        k.update(cut=len(cut), cut_succeeded=sum(o.status == "ok" for o in cut),
                 cut_identical=sum(bool(o.identical) for o in cut))
        del k["at"]
    return {"steady": tally(outs), "events": kills}


def _soak(svc: Service, rate: float, minutes: float, load: float, out_stem) -> dict:
    outs: list[Outcome] = []
    samples: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    done = threading.Event()

    def sample() -> None:
        pids = process_ids()
        while not done.is_set():
            samples.append((time.monotonic() - t0, {name: rss_mb(pid) for name, pid in pids.items()}))
            done.wait(5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tqdm(desc=f"soak: {load:.0%} of capacity for {minutes:g} min", unit="req") as bar:
        open_loop(svc, rate, minutes * 60, outs, bar)
    done.set()
    sampler.join()
    png = f"{out_stem}-soak-memory.png"
    _plot_memory(samples, png, f"soak: {minutes:g} min at {load:.0%} of capacity ({rate:.2f} req/s arriving)")
    return {"minutes": minutes, "load": load, "rate_req_s": round(rate, 3), **tally(outs),
            "rss_mb_start": samples[0][1], "rss_mb_end": samples[-1][1],
            "rss_slope_mb_per_min": _memory_slopes(samples, 60),
            "rss_slope_last_half_mb_per_min": _memory_slopes(samples, samples[-1][0] / 2), "plot": png,
            "rss_samples": [{"t_s": round(t, 1), **{k: round(v, 1) for k, v in rss.items()}} for t, rss in samples]}


def _memory_slopes(samples, after_s: float) -> dict[str, float]:
    """Least-squares slope of each process's resident memory, MB per minute, over samples after `after_s`
    (caches grow to the largest batch and context seen at first; a leak keeps growing)."""
    import numpy as np

    late = [s for s in samples if s[0] >= after_s] or samples
    t = np.array([s[0] / 60 for s in late])
    return {name: round(float(np.polyfit(t, [s[1][name] for s in late], 1)[0]), 3) if len(late) > 1 else 0.0
            for name in late[0][1]}


def _plot_memory(samples, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in samples[0][1]:
        ax.plot([s[0] / 60 for s in samples], [s[1][name] for s in samples], label=name)
    ax.set(xlabel="minutes", ylabel="resident memory (MB)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _burst(svc: Service, rate: float, factor: float, seconds: float = 30) -> dict:
    outs: list[Outcome] = []
    with tqdm(desc=f"burst: {factor:g}x capacity for {seconds:g} s", unit="req") as bar:
        open_loop(svc, rate, seconds, outs, bar, seed=1)
    after = svc.run(0)
    return {"factor": factor, "seconds": seconds, "rate_req_s": round(rate, 3), **tally(outs),
            "healthy_after": svc.ready() and after.status == "ok" and bool(after.identical)}


def report(res: dict) -> str:
    k = res["kills"]
    s = k["steady"]
    lines = [f"# specserve chaos: {res['target']} ({res['dtype']}), policy {res['policy']}", "",
             f"{res['users']} closed-loop users, streamed greedy chat requests, max_tokens {res['max_tokens']}; "
             "every answer compared with the same prompt's uninterrupted answer.", "",
             f"Steady load with kills: {s['sent']} sent, {s['succeeded']} succeeded, {s['failed']} failed, "
             f"{s['429']} refused (429); {s['identical']} identical to the uninterrupted text, {s['different']} different.", "",
             "| killed | requests in flight (cut) | of those succeeded | identical text | recovery (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {e['role']} | {e['cut']} | {e['cut_succeeded']} | {e['cut_identical']} | {e['recovery_s']} |"
              for e in k["events"]]
    if "soak" in res:
        so = res["soak"]
        lines += ["", f"Soak: {so['minutes']:g} min, Poisson arrivals at {so['load']:.0%} of the measured capacity "
                      f"({so['rate_req_s']:.2f} of {res['capacity_req_s']:.2f} req/s): {so['sent']} sent, "
                      f"{so['succeeded']} succeeded, {so['failed']} failed, {so['429']} refused.", "",
                  "| process | RSS start (MB) | RSS end (MB) | slope after 1 min (MB/min) | slope, last half (MB/min) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {n} | {so['rss_mb_start'][n]:.0f} | {so['rss_mb_end'][n]:.0f} | {so['rss_slope_mb_per_min'][n]:+.2f} | "
                  f"{so['rss_slope_last_half_mb_per_min'][n]:+.2f} |" for n in so["rss_slope_mb_per_min"]]
        lines += ["", f"![memory]({os.path.basename(so['plot'])})"]
    if "burst" in res:
        b = res["burst"]
        lines += ["", f"Burst: {b['factor']:g}x capacity ({b['rate_req_s']:.2f} req/s) for {b['seconds']:g} s: "
                      f"{b['sent']} sent, {b['succeeded']} succeeded, {b['429']} refused with 429, "
                      f"{b['failed']} failed otherwise; healthy afterwards: {b['healthy_after']}."]
    return "\n".join(lines) + "\n"
