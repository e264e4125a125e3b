"""`specserve bench ...`: benchmarks whose figures are ratios against a baseline run in the same process.

One module per benchmark (no import circles: rounds.py and engine.py's runners are the shared parts):
  engine.py      engine vs Hugging Face generate (batch 1 and concurrent), fixed k vs plain decoding
  acceptance.py  tokens per step at fixed k on the evaluation prompt sets (counts, not timings)
  http.py        the HTTP service vs the offline engine at the same concurrency
  policies.py    the paper's experiments: every policy under uniform, time-varying and shifting load
  rounds.py      what they share: interleaved rounds, medians and spread, results files under results/
Prompts come from serve_app/bench/prompt_sets.py (evaluation sets only; never the profile's or distillation's).
"""
