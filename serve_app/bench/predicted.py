"""Predicted Outputs on edits: `specserve bench predicted`.

Each case asks the model to return a file or a document with a small change (rename a variable, fix a
typo, change a value), and the prediction is the original text, as an editor plugin would send it. Every
case runs alone (batch 1, greedy, float32 by default), without and with the prediction, in interleaved
rounds on one engine. Reported per case and over the cases whose answer keeps at least 80% of the
original (the edits Predicted Outputs is for): target steps (the verification forwards the request took
part in), latency, and whether the answer is the same token for token (it must be: the prediction is only
a draft). A case whose answer rewrites everything is reported too, so what the prediction does there
(nothing proposed once the alignment is lost) is seen.
"""

from __future__ import annotations

import difflib
import statistics
import time

from serve_app.bench.rounds import rotated, summary

CODE_1 = '''def total_price(items, tax_rate):
    """Return the price of all items with tax."""
    total = 0
    for item in items:
        total += item["price"] * item["quantity"]
    total = total * (1 + tax_rate)
    return round(total, 2)


def cheapest(items):
    """Return the cheapest item."""
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''

CODE_2 = '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count

    def reset(self):
        self.count = 0


def main():
    counter = Counter()
    for _ in range(10):
        counter.increment()
    print("count:", counter.count)
'''

CODE_3 = '''import json


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if "name" not in config:
        raise ValueError("config needs a name")
    config.setdefault("retries", 3)
    config.setdefault("timeout", 30)
    return config
'''

PROSE_1 = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
           "dollars for adults and six dollars for children. Visitors can see paintings from the sixteenth "
           "century, a room of old maps, and a small garden with a fountain. The cafe on the ground floor "
           "serves coffee, tea and sandwiches. Guided tours start every hour from the main hall.")

PROSE_2 = ("Dear team, the quarterly meeting will take place on Thursday in room four. Please bring your "
           "reports and be ready to talk about the goals for the next quarter. Lunch will be served after "
           "the meeting. If you cannot attend, send your report to Maria before Wednesday. Thank you, and "
           "see you on Thursday.")

PROSE_3 = ("To make pancakes, mix two cups of flour, two eggs, one cup of milk and a spoon of sugar in a bowl. "
           "Heat a pan with a little butter. Pour a small amount of batter into the pan and cook until bubbles "
           "form, then turn it over. Serve the pancakes warm with honey or fruit.")

CASES = [
    ("code-rename", CODE_1, "Rename the variable `total` to `subtotal` in this Python code. Reply with the full code only."),
    ("code-docstring", CODE_2, "Add a docstring to the `reset` method of this Python code. Reply with the full code only."),
    ("code-default", CODE_3, "Change the default timeout from 30 to 60 in this Python code. Reply with the full code only."),
    ("code-print", CODE_2, "Change the message printed in `main` to \"total:\". Reply with the full code only."),
    ("prose-hours", PROSE_1, "Change the closing time to seven in the evening. Reply with the full text only."),
    ("prose-day", PROSE_2, "Change the day of the meeting from Thursday to Friday. Reply with the full text only."),
    ("prose-milk", PROSE_3, "Change the recipe to use two cups of milk. Reply with the full text only."),
    ("prose-typo", PROSE_1.replace("fountain", "fountian"), "Fix the spelling mistake in this text. Reply with the full text only."),
]
"""(name, original text, instruction): the original is both in the prompt and the prediction."""


def kept(answer: list[int], original: list[int]) -> float:
    """How much of the original the answer keeps: difflib's ratio of the two token sequences."""
    return difflib.SequenceMatcher(None, answer, original, autojunk=False).ratio()


def run_case(engine, tok, case: tuple[str, str, str], with_prediction: bool, extra_tokens: int) -> dict:
    from serve_app.config import SamplingParams

    name, original, instruction = case
    messages = [{"role": "user", "content": f"{instruction}\n\n{original}"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    pred = tok.encode(original, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(pred) + extra_tokens, predicted_output=pred if with_prediction else [])
    t0 = time.perf_counter()
    [req] = [engine.submit(ids, params)]
    engine.run([req])
    return {"name": name, "output": req.output_ids, "steps": req.stats.steps, "latency_s": time.perf_counter() - t0,
            "tokens": len(req.output_ids), "kept": kept(req.output_ids, pred),
            "accepted_prediction_tokens": req.stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": req.stats.rejected_prediction_tokens}


def bench_predicted(models, policy: str, rounds: int, extra_tokens: int, max_predicted_tokens: int,
                    cases: list = CASES) -> tuple[dict, str]:
    """Every case without and with its prediction, `rounds` interleaved rounds after a warm-up; results and markdown."""
    from tqdm import tqdm

    from serve_app.config import EngineConfig
    from serve_app.engine.scheduler import Engine

    engine = Engine.from_models(models, EngineConfig(policy=policy, max_batch_size=4,
                                                     max_predicted_tokens=max_predicted_tokens))
    tok = models.tokenizer
    run_case(engine, tok, cases[0], True, 8)  # warm-up: first forwards, allocator
    sides = [False, True]
    runs = {side: {c[0]: [] for c in cases} for side in sides}
    for r in tqdm(range(rounds), desc="rounds"):
        for case in cases:
            for side in rotated(sides, r):
                runs[side][case[0]].append(run_case(engine, tok, case, side, extra_tokens))
    rows = []
    for case in cases:
        plain, pred = runs[False][case[0]], runs[True][case[0]]
        rows.append({"name": case[0], "tokens": plain[0]["tokens"], "kept": plain[0]["kept"],
                     "same": all(a["output"] == b["output"] for a, b in zip(plain, pred)),
                     "steps": plain[0]["steps"], "steps_predicted": pred[0]["steps"],
                     "latency_s": summary([x["latency_s"] for x in plain]),
                     "latency_predicted_s": summary([x["latency_s"] for x in pred]),
                     "speedup": summary([a["latency_s"] / b["latency_s"] for a, b in zip(plain, pred)]),
                     "accepted_prediction_tokens": pred[0]["accepted_prediction_tokens"],
                     "rejected_prediction_tokens": pred[0]["rejected_prediction_tokens"],
                     "text": tok.decode(plain[0]["output"], skip_special_tokens=True)})
    edits = [r for r in rows if r["kept"] >= 0.8]
    total = {}
    if edits:
        total = {"cases": len(edits), "steps_ratio": sum(r["steps"] for r in edits) / max(sum(r["steps_predicted"] for r in edits), 1),
                 "latency_ratio": (sum(r["latency_s"]["median"] for r in edits)
                                   / sum(r["latency_predicted_s"]["median"] for r in edits)),
                 "median_speedup": statistics.median(r["speedup"]["median"] for r in edits),
                 "all_same": all(r["same"] for r in edits)}
    results = {"policy": policy, "rounds": rounds, "max_predicted_tokens": max_predicted_tokens, "rows": rows,
               "edits": total, "all_same": all(r["same"] for r in rows)}
    return results, markdown(results)


def markdown(res: dict) -> str:
    lines = [f"Edits at batch 1, greedy, policy {res['policy']} (prompt lookup on), max_predicted_tokens "
             f"{res['max_predicted_tokens']}, {res['rounds']} interleaved rounds; latency: median (range); "
             "speed-up: median of the per-round ratios.", "",
             "| case | tokens | kept | same output | target steps without / with | latency without s | latency with s "
             "| speed-up | prediction accepted / rejected |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        a, b = r["latency_s"], r["latency_predicted_s"]
        lines.append(f"| {r['name']} | {r['tokens']} | {r['kept']:.2f} | {'yes' if r['same'] else '**no**'} | "
                     f"{r['steps']} / {r['steps_predicted']} | {a['median']:.2f} ({a['min']:.2f}-{a['max']:.2f}) | "
                     f"{b['median']:.2f} ({b['min']:.2f}-{b['max']:.2f}) | {r['speedup']['median']:.2f}x | "
                     f"{r['accepted_prediction_tokens']} / {r['rejected_prediction_tokens']} |")
    e = res["edits"]
    if e:
        lines += ["", f"**Edits keeping >= 80% of the original ({e['cases']} of {len(res['rows'])} cases)**: "
                      f"{e['steps_ratio']:.2f}x fewer target steps, {e['latency_ratio']:.2f}x lower latency (sums), "
                      f"median per-case speed-up {e['median_speedup']:.2f}x; outputs identical: "
                      f"{'yes' if e['all_same'] else 'NO'}."]
    else:
        lines += ["", "No case kept >= 80% of its original."]
    return "\n".join(lines) + "\n"
