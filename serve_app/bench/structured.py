"""Structured outputs under speculation: do answers validate, and what does the grammar do to tokens per step?

`specserve bench structured` runs a suite of JSON-schema requests (topics x schema styles: flat, strict
with enums and bounds, nested objects and arrays, optional fields, $defs) on the engine in process,
greedy, with the grammar and without it (the same prompts asking for JSON in words), at a fixed k.
It reports, for each: answers that parse and validate against their schema, finish reasons, and tokens
per sequence step (generated tokens / steps), acceptance of drafted tokens, and wall time.
"""

from __future__ import annotations

import json
import time

TOPICS = [
    ("person", "a person named Ann who is 31 and lives in Paris",
     {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}),
    ("book", "the novel Dune by Frank Herbert, published in 1965",
     {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}}),
    ("product", "a red cotton t-shirt that costs 19.99 dollars and is in stock",
     {"name": {"type": "string"}, "price": {"type": "number"}, "in_stock": {"type": "boolean"}}),
    ("weather", "sunny weather in Madrid with a temperature of 28 degrees",
     {"city": {"type": "string"}, "condition": {"type": "string"}, "temperature_c": {"type": "number"}}),
    ("recipe", "a simple pancake recipe",
     {"dish": {"type": "string"}, "servings": {"type": "integer"}, "minutes": {"type": "integer"}}),
    ("movie", "the movie Inception, directed by Christopher Nolan in 2010",
     {"title": {"type": "string"}, "director": {"type": "string"}, "year": {"type": "integer"}}),
    ("event", "a team meeting on Monday at 10 am in room 4",
     {"title": {"type": "string"}, "day": {"type": "string"}, "room": {"type": "integer"}}),
    ("flight", "flight AF123 from Paris to New York, leaving at 9:30",
     {"number": {"type": "string"}, "origin": {"type": "string"}, "destination": {"type": "string"}}),
    ("company", "a small bakery called Sunrise with 12 employees",
     {"name": {"type": "string"}, "industry": {"type": "string"}, "employees": {"type": "integer"}}),
    ("song", "the song Yesterday by the Beatles",
     {"title": {"type": "string"}, "artist": {"type": "string"}, "minutes": {"type": "number"}}),
    ("task", "a task to buy milk tomorrow, high priority, not done yet",
     {"task": {"type": "string"}, "due": {"type": "string"}, "done": {"type": "boolean"}}),
    ("city", "the city of Tokyo, capital of Japan, with about 14 million people",
     {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}}),
    ("animal", "a cat called Tom who is 4 years old",
     {"name": {"type": "string"}, "species": {"type": "string"}, "age": {"type": "integer"}}),
]


def _style(style: str, props: dict) -> dict:
    keys = list(props)
    if style == "flat":
        return {"type": "object", "properties": props, "required": keys}
    if style == "strict":  # what OpenAI's strict mode asks for: every key required, nothing else allowed
        strict = dict(props)
        strict["rating"] = {"type": "string", "enum": ["low", "medium", "high"]}
        return {"type": "object", "properties": strict, "required": list(strict), "additionalProperties": False}
    if style == "nested":
        return {"type": "object", "additionalProperties": False, "required": ["item", "tags"],
                "properties": {"item": {"type": "object", "properties": props, "required": keys[:2],
                                        "additionalProperties": False},
                               "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}}
    if style == "optional":  # one key required, the rest optional
        return {"type": "object", "properties": props, "required": keys[:1]}
    assert style == "defs"
    return {"type": "object", "$defs": {"entry": {"type": "object", "properties": props, "required": keys,
                                                  "additionalProperties": False}},
            "properties": {"entries": {"type": "array", "items": {"$ref": "#/$defs/entry"}, "maxItems": 2}},
            "required": ["entries"], "additionalProperties": False}


STYLES = ["flat", "strict", "nested", "optional", "defs"]


def suite(n: int = 50) -> list[dict]:
    """n requests: {name, messages, schema}, cycling topics and styles."""
    out = []
    for i in range(n):
        topic, what, props = TOPICS[i % len(TOPICS)]
        style = STYLES[(i // len(TOPICS) + i) % len(STYLES)]
        out.append({"name": f"{topic}-{style}", "schema": _style(style, props),
                    "messages": [{"role": "user", "content": f"Describe {what} as a JSON object."}]})
    return out


def validates(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(models, k: int, cases: list[dict], grammar: bool, max_tokens: int, batch: int) -> dict:
    """One pass of the suite through a fresh engine; per-case results and totals."""
    from serve_app.config import EngineConfig, SamplingParams
    from serve_app.engine.scheduler import Engine

    engine = Engine.from_models(models, EngineConfig(policy=f"fixed:{k}", max_batch_size=batch))
    tok = models.tokenizer
    reqs = []
    for c in cases:
        ids = tok.encode(tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        structured = {"json_schema": c["schema"]} if grammar else None
        reqs.append(engine.submit(ids, SamplingParams(max_tokens=max_tokens, structured=structured)))
    t0 = time.perf_counter()
    engine.run(reqs)
    wall = time.perf_counter() - t0
    rows = []
    for c, r in zip(cases, reqs):
        text = tok.decode(r.output_ids, skip_special_tokens=True)
        rows.append({"name": c["name"], "valid": validates(text, c["schema"]), "tokens": len(r.output_ids),
                     "steps": r.stats.steps, "finish": "stop" if len(r.output_ids) < max_tokens else "length",
                     "text": text})
    steps = sum(x["steps"] for x in rows)
    return {"k": k, "grammar": grammar, "valid": sum(x["valid"] for x in rows), "n": len(rows),
            "tokens": sum(x["tokens"] for x in rows), "steps": steps,
            "tokens_per_step": sum(x["tokens"] for x in rows) / max(steps, 1),
            "accepted": sum(r.stats.accepted for r in reqs), "proposed": sum(r.stats.proposed for r in reqs),
            "wall_s": wall, "cases": rows}


def markdown(runs: list[dict]) -> str:
    lines = ["| grammar | k | valid JSON (schema) | finished by length | tokens per step | drafted accepted | tokens | wall s | ms per token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        length = sum(c["finish"] == "length" for c in r["cases"])
        acc = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        lines.append(f"| {'on' if r['grammar'] else 'off'} | {r['k']} | {r['valid']} / {r['n']} | {length} | "
                     f"{r['tokens_per_step']:.2f} | {acc:.2f} | {r['tokens']} | {r['wall_s']:.0f} | "
                     f"{1000 * r['wall_s'] / max(r['tokens'], 1):.1f} |")
    bad = [f"- {c['name']} (grammar {'on' if r['grammar'] else 'off'}): {c['text'][:160]!r}"
           for r in runs for c in r["cases"] if not c["valid"]]
    return "\n".join(lines) + "\n" + ("\nAnswers that do not validate:\n" + "\n".join(bad) + "\n" if bad else "")


def main(n: int, k: int, max_tokens: int, batch: int, dtype: str, out: str | None) -> int:
    """`specserve bench structured`: the suite with and without the grammar; results/bench-structured-<hw>."""
    from tqdm import tqdm

    from serve_app.bench.rounds import default_stem, write_results
    from serve_app.config import ModelConfig
    from serve_app.models import load_models

    models = load_models(ModelConfig(dtype=dtype))
    cases = suite(n)
    runs = [run(models, k, cases, grammar, max_tokens, batch) for grammar in tqdm((True, False), desc="passes")]
    text = (f"{n} JSON-schema requests on the embedded pair (greedy, fixed k = {k}, max_tokens {max_tokens}, "
            f"batch {batch}, {dtype}); tokens per step = generated tokens / sequence steps.\n\n" + markdown(runs))
    print(text)
    paths = write_results(out or default_stem("bench-structured"), {"runs": runs}, text)
    print("results:", ", ".join(str(p) for p in paths))
    return 0 if runs[0]["valid"] == runs[0]["n"] else 1
