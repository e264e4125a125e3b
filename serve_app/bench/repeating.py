"""(f) repeating traffic, and `specserve bench history`: the suffix history on against off.

Real traffic repeats itself across requests: agent loops re-send the same tool schemas and emit near-identical
calls, extraction jobs fill one template over many documents, coding tools rewrite the same files, chat products
answer the same questions. (f) is that mix at batch 1-8 (open-loop Poisson arrivals), greedy, generated here
from small templates (no data to ship), beside a share of plain chat:

- `agent`: a tool-calling loop: a system prompt with the same tool schemas every time, a task, and the turns so
  far (earlier calls and their results); the answer is the next call, as JSON.
- `extract`: one extraction template over many short documents (people, orders), the answer a JSON record.
- `rewrite`: a coding tool rewriting one of a few files (type hints, docstrings) for different users.
- `chat`: everyday questions (`LATENCY_PROMPTS`), some asked again.

The bench runs the same schedule through a fresh engine with the history off and on (model draft and prompt
lookup in both), in rounds whose order rotates, from an empty history each time (it warms as the run goes):
tokens per target step per request, mean latency after the warm-up (overall and per kind), the sources of the
accepted tokens over the run; each paired by round (`rounds.paired_ratio`). Plain chat (b) runs the same way,
to show the history costs chat nothing, and (u), the same schedule with no prompt asked twice, the control
where only the lookups' cost can show. Beside the wall clock, the deterministic replay (`bench.replay`) gives
the same comparison on the profile's cost model.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

from serve_app.bench.policies import LATENCY_PROMPTS, Job, _run, varying_jobs
from serve_app.bench.prompt_sets import BENCH_PROMPTS, CREATIVE_PROMPTS, PROFILE_PROMPTS, chat_prompts, encode_chat
from serve_app.bench.rounds import fmt_paired, paired_ratio, rotated

KINDS = (("agent", 0.3), ("extract", 0.25), ("rewrite", 0.2), ("chat", 0.25))
"""(f)'s request kinds and their shares."""

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}},
    {"name": "search_flights", "description": "Flights between two cities on a date.",
     "parameters": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                                                     "date": {"type": "string"}}, "required": ["origin", "destination", "date"]}},
    {"name": "book_hotel", "description": "Book a hotel room in a city for some nights.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                    "required": ["city", "nights"]}},
]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens"]
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Eva Novak", "Farid Haddad", "Grace Kim", "Hugo Berg"]
FILES = [
    "def total(items):\n    s = 0\n    for it in items:\n        s += it.price * it.quantity\n    return s\n\n\n"
    "def average(values):\n    if not values:\n        return 0\n    return sum(values) / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n    def empty(self):\n        return not self.items\n",
    "def parse_line(line):\n    key, value = line.split('=', 1)\n    return key.strip(), value.strip()\n\n\n"
    "def parse(text):\n    out = {}\n    for line in text.splitlines():\n        if line and not line.startswith('#'):\n"
    "            k, v = parse_line(line)\n            out[k] = v\n    return out\n",
]
REWRITES = ["Add type hints to every function in this Python file and return the whole file:\n\n",
            "Add a one-line docstring to every function in this Python file and return the whole file:\n\n"]
MAX_BATCH = 8
"""(f) is served at batch 1-8."""
FAQ = 6
"""Chat questions drawn from the first this many of `LATENCY_PROMPTS` half of the time (asked again)."""


def _agent(rng: random.Random) -> tuple[list[dict], int]:
    system = ("You are a travel assistant. You can call these tools:\n" + json.dumps(TOOLS, indent=1) +
              '\nAnswer with exactly one tool call as JSON: {"name": ..., "arguments": {...}}.')
    a, b = rng.sample(CITIES, 2)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"I am flying from {a} to {b} next week. Check the weather in {b}, find a "
                                        f"flight on 2025-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} and book a hotel for "
                                        f"{rng.randint(2, 5)} nights."}]
    for turn in range(rng.randint(0, 2)):  # the loop so far: earlier calls and their results
        call = [{"name": "get_weather", "arguments": {"city": b}},
                {"name": "search_flights", "arguments": {"origin": a, "destination": b, "date": "2025-06-12"}}][turn]
        msgs += [{"role": "assistant", "content": json.dumps(call)},
                 {"role": "user", "content": f"Tool result: {json.dumps({'ok': True, 'turn': turn + 1})}. Next call?"}]
    return msgs, 48


def _extract(rng: random.Random) -> tuple[list[dict], int]:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    doc = (f"Order {rng.randint(1000, 9999)} was placed by {name} from {city} on 2025-0{rng.randint(1, 9)}-2{rng.randint(0, 8)}. "
           f"They bought {rng.randint(1, 9)} units of item {rng.choice('ABCDEFG')}{rng.randint(10, 99)} and paid "
           f"{rng.randint(10, 500)} euros.")
    return [{"role": "user", "content": "Extract the order as JSON with the keys order_id, customer, city, date, "
                                        f"quantity, item and amount. Text:\n{doc}"}], 64


def _rewrite(rng: random.Random) -> tuple[list[dict], int]:
    return [{"role": "user", "content": rng.choice(REWRITES) + rng.choice(FILES)}], 128


def _chat(rng: random.Random) -> tuple[list[dict], int]:
    pool = LATENCY_PROMPTS[:FAQ] if rng.random() < 0.5 else LATENCY_PROMPTS
    return [{"role": "user", "content": rng.choice(pool)}], rng.randint(24, 64)


MAKERS = {"agent": _agent, "extract": _extract, "rewrite": _rewrite, "chat": _chat}


def repeating_jobs(tokenizer, rng: random.Random, scale: float, rate: float = 1.2, seconds: float = 60.0) -> list[Job]:
    """(f): open-loop Poisson arrivals at `rate` per second for `seconds` x scale (batch 1-8 on this CPU), each
    request a kind drawn from `KINDS`."""
    kinds, weights = zip(*KINDS)
    jobs, at = [], rng.expovariate(rate)
    while at < seconds * scale:
        kind = rng.choices(kinds, weights)[0]
        msgs, max_tokens = MAKERS[kind](rng)
        jobs.append(Job(encode_chat(tokenizer, msgs), max_tokens, at, kind))
        at += rng.expovariate(rate)
    if not jobs:
        raise ValueError("the arrival schedule drew no requests at this --scale: raise it")
    return jobs


def tokens_per_step(steps: list[tuple[float, int, int]], since: float) -> float:
    """Tokens per target step per request over the decode steps from `since` seconds on: (rows + accepted) / rows
    of those steps, from (seconds, rows, accepted) per step."""
    rows = sum(n for t, n, _ in steps if t >= since)
    return (rows + sum(a for t, _, a in steps if t >= since)) / rows if rows else 0.0


def _figures(res, jobs: list[Job], warmup: float) -> dict:
    """One run's figures after the warm-up (the first `warmup` share of the requests, and the steps before the
    first request after it arrived): tokens per target step per request (1 + accepted per row and step), mean
    latency (and per kind); and the accepted tokens by source per quarter of the whole run."""
    start = int(len(jobs) * warmup)
    lat = res.latencies[start:]
    by_kind: dict[str, list[float]] = {}
    for job, x in zip(jobs[start:], lat):
        by_kind.setdefault(job.kind, []).append(x)
    decode = [st for st in res.stats if st.batch_size]
    since = jobs[start].at if start < len(jobs) else 0.0
    steps = [(t, st.batch_size, st.accepted) for (t, _, _), st in zip(res.steps, decode)]
    quarters: list[dict[str, int]] = [{}, {}, {}, {}]
    for i, st in enumerate(decode):
        q = quarters[min(4 * i // max(len(decode), 1), 3)]
        for src, (_, acc) in st.by_source.items():
            q[src] = q.get(src, 0) + acc
    return {"tokens_per_step": tokens_per_step(steps, since),
            "mean_latency_s": statistics.fmean(lat) if lat else 0.0,
            "by_kind": {k: statistics.fmean(v) for k, v in sorted(by_kind.items())},
            "sources_by_quarter": quarters, "seconds": res.seconds}


def bench_history(models, profile, policy: str, parts: dict[str, list[Job]], rounds: int, warmup: float,
                  history_tokens: int, bar) -> dict:
    """Each part's schedule with the history off and on, `rounds` times, the order rotating; each run from an
    empty history. Returns per part: per-run figures and the on/off paired ratios."""
    arms = {"off": dataclasses.replace(models, history_tokens=0),
            "on": dataclasses.replace(models, history_tokens=history_tokens)}
    out = {}
    for name, jobs in parts.items():
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(rounds):
            for arm in rotated(list(arms), r):
                steps: list = []
                res = _run(arms[arm], profile, policy, jobs, MAX_BATCH, True, bar, steps)
                runs[arm].append(_figures(res, jobs, warmup))
        ratio = {key: paired_ratio([x[key] for x in runs["on"]], [x[key] for x in runs["off"]])
                 for key in ("tokens_per_step", "mean_latency_s")}
        kinds = sorted(runs["on"][0]["by_kind"]) if runs["on"] else []
        ratio["by_kind"] = {k: paired_ratio([x["by_kind"][k] for x in runs["on"]], [x["by_kind"][k] for x in runs["off"]])
                            for k in kinds}
        out[name] = {"requests": len(jobs), "runs": runs, "paired": ratio}
    return out


def replay_history(models, profile, policy: str, parts: dict[str, list[Job]], history_tokens: int, warmup: float) -> dict:
    """The same comparison on the profile's cost model (`bench.replay.replay`, deterministic): per part and arm,
    tokens per target step per request and mean latency after the warm-up, in virtual seconds."""
    from serve_app.bench.replay import replay

    out = {}
    for name, jobs in parts.items():
        row = {}
        for arm, n in (("off", 0), ("on", history_tokens)):
            rep = replay(dataclasses.replace(models, history_tokens=n), profile, policy, jobs, max_batch=MAX_BATCH)
            start = int(len(jobs) * warmup)
            since = jobs[start].at - jobs[0].at if start < len(jobs) else 0.0
            row[arm] = {"tokens_per_step": tokens_per_step(rep.steps, since),
                        "mean_latency_s": statistics.fmean(x for x, at in zip(rep.latencies, rep.arrivals)
                                                           if at >= jobs[min(start, len(jobs) - 1)].at),
                        "target_forwards_per_1k": rep.per_1k()["target_forwards"]}
        row["latency_ratio"] = row["on"]["mean_latency_s"] / row["off"]["mean_latency_s"] if row["off"]["mean_latency_s"] else None
        out[name] = row
    return out


def markdown(res: dict) -> str:
    lines = [f"# The suffix history on against off: {res['gpu_type']}, {res['target']} with {res['draft']}, policy {res['policy']}",
             "", f"{res['rounds']} rounds per part, the order rotating; every run from an empty history; latency after "
             f"the first {res['warmup']:.0%} of the requests. Ratios are on / off, paired by round (geometric mean "
             "[95% interval]).", ""]
    for name, part in res["parts"].items():
        p = part["paired"]
        on, off = part["runs"]["on"], part["runs"]["off"]
        lines += [f"## ({name}) {part['requests']} requests", "",
                  "| | off | on | on / off |", "|---|---|---|---|",
                  f"| tokens per target step per request | {statistics.median(x['tokens_per_step'] for x in off):.2f} | "
                  f"{statistics.median(x['tokens_per_step'] for x in on):.2f} | {fmt_paired(p['tokens_per_step'])} |",
                  f"| mean latency after warm-up | {statistics.median(x['mean_latency_s'] for x in off):.2f}s | "
                  f"{statistics.median(x['mean_latency_s'] for x in on):.2f}s | {fmt_paired(p['mean_latency_s'])} |"]
        for kind, r in p["by_kind"].items():
            lines.append(f"| latency: {kind} | {statistics.median(x['by_kind'][kind] for x in off):.2f}s | "
                         f"{statistics.median(x['by_kind'][kind] for x in on):.2f}s | {fmt_paired(r)} |")
        quarters = on[-1]["sources_by_quarter"]
        lines += ["", "Accepted draft tokens by source, per quarter of the last run with the history on: " +
                  "; ".join(f"Q{i + 1} " + ", ".join(f"{s} {n}" for s, n in sorted(q.items())) for i, q in enumerate(quarters)), ""]
    if res.get("replay"):
        lines += ["## On the profile's cost model (deterministic replay)", "",
                  "| part | tokens per target step per request, off / on | mean latency off / on (virtual s) | on / off |",
                  "|---|---|---|---|"]
        for name, r in res["replay"].items():
            lines.append(f"| ({name}) | {r['off']['tokens_per_step']:.2f} / {r['on']['tokens_per_step']:.2f} | "
                         f"{r['off']['mean_latency_s']:.2f} / {r['on']['mean_latency_s']:.2f} | {r['latency_ratio']:.3f}x |")
        lines.append("")
    return "\n".join(lines)


def chat_jobs(tokenizer, rng: random.Random, scale: float) -> list[Job]:
    """(b) plain chat, time-varying: what the history must not slow (its prompts come from a small set, so
    answers recur)."""
    return varying_jobs(tokenizer, rng, scale)[0]


LENGTHS = ["in one sentence", "in two sentences", "in three sentences", "in about fifty words", "as a short list",
           "for a beginner", "for an expert", "with one example"]
"""Ways to ask a question again that make it a different request (`unique_chat_jobs`)."""


def distinct_chat_texts() -> list[str]:
    """The bench's distinct chat questions, then each asked every other way in `LENGTHS`."""
    base = list(dict.fromkeys(LATENCY_PROMPTS + BENCH_PROMPTS + CREATIVE_PROMPTS + PROFILE_PROMPTS))
    return base + [f"{t} Answer {how}." for how in LENGTHS for t in base]


def unique_chat_jobs(tokenizer, rng: random.Random, scale: float) -> list[Job]:
    """(u) (b)'s schedule with every prompt asked once: the bench's distinct chat questions, then the same asked
    another way ("... Answer in one sentence."), shuffled. Nothing repeats but what answers share by nature, so
    the history can only cost here (its lookups), the control for (b)."""
    texts = distinct_chat_texts()
    jobs = varying_jobs(tokenizer, rng, scale)[0]  # (b)'s arrivals and lengths, drawn first as (b) draws them
    rng.shuffle(texts)
    if len(jobs) > len(texts):
        raise ValueError(f"(u) has {len(texts)} distinct prompts for {len(jobs)} requests: lower --scale")
    return [dataclasses.replace(j, prompt=chat_prompts(tokenizer, [t])[0]) for j, t in zip(jobs, texts)]


__all__ = ["KINDS", "bench_history", "chat_jobs", "distinct_chat_texts", "markdown", "repeating_jobs", "replay_history",
           "unique_chat_jobs"]
