"""`specserve` command line: generate, serve, drain, profile, profiles push, distill, bench (engine, acceptance, http, policies, step, batching), selfcheck, chaos, simulate.

Exit codes: 0 all requests succeeded; 1 some requests failed (each reported with its line number,
the others finished); 2 bad arguments or an unusable file/model (nothing was generated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from pydantic import ValidationError

from serve_app.config import EMBEDDED, EngineConfig, ModelConfig, SamplingParams


class UsageError(Exception):
    """A one-line error for the user; exits with status 2."""


def entry() -> int:
    """The `specserve` command: a process of its own, so denormal floats are zeros in all of it, set before
    torch starts its threads (they inherit it): see serve_app.engine.worker.denormals_flushed. It starts
    again at once with malloc's settings in its environment (`engine.allocator`: glibc reads them only
    at start), which every process it launches inherits (Ray's, the model actors). `main` (what tests
    and other code call) leaves the process as it found it."""
    from serve_app.engine.allocator import allocator_env

    env = allocator_env()
    if env and sys.platform.startswith("linux"):
        os.execve(sys.executable, [sys.executable, "-m", "serve_app.cli", *sys.argv[1:]], {**os.environ, **env})
    import torch

    torch.set_flush_denormal(True)
    return main()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # model loading and config errors
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description="Speculative decoding with continuous batching.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    g.add_argument("--prompts", required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    g.add_argument("--out", required=True, help="JSONL output, one line per input line, in input order")
    _model_args(g)
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks that print ratios against a baseline run in the same process")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine tokens/s vs Hugging Face generate (batch 1 and concurrent)")
    _model_args(be)
    be.add_argument("--max-tokens", type=int, default=64)
    be.add_argument("--num-prompts", type=int, default=4, help="prompts for the batch-1 runs")
    be.add_argument("--ks", default="1,2,4", help="fixed k values to run at batch 1")
    be.add_argument("--concurrency", type=int, default=16)
    be.add_argument("--rounds", type=int, default=3, help="rounds after the warm-up, every side once per round; medians")
    be.add_argument("--out", default=None,
                    help="writes OUT.json and OUT.md (default results/bench-engine-<hardware type>)")
    be.set_defaults(func=_cmd_bench_engine)
    ba = bsub.add_parser("acceptance", help="a draft's tokens per step at fixed:K on prompts it was not trained on")
    _model_args(ba)
    ba.add_argument("--k", type=int, default=4)
    ba.add_argument("--max-tokens", type=int, default=128)
    ba.add_argument("--batch-size", type=int, default=8)
    ba.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above 0: rejection sampling (unseeded) and the coupled sampler (seeded) side by side")
    ba.add_argument("--out", default=None,
                    help="writes OUT.json and OUT.md (default results/bench-acceptance-<hardware type>)")
    ba.set_defaults(func=_cmd_bench_acceptance)
    bh = bsub.add_parser("http", help="tokens/s through the HTTP endpoint vs the offline engine, same concurrency")
    _model_args(bh)
    bh.add_argument("--policy", default="none", help="none or fixed:K (the same k on both sides)")
    bh.add_argument("--max-tokens", type=int, default=48)
    bh.add_argument("--concurrency", type=int, default=8)
    bh.add_argument("--requests", type=int, default=16)
    bh.add_argument("--port", type=int, default=8011)
    bh.add_argument("--rounds", type=int, default=3, help="rounds after the warm-up, both sides once per round; medians")
    bh.add_argument("--out", default=None,
                    help="writes OUT.json and OUT.md (default results/bench-http-<hardware type>)")
    bh.set_defaults(func=_cmd_bench_http)

    bq = bsub.add_parser("peer", help="specserve against vLLM's server, same model and prompts, one server at a time, "
                                      "through HTTP (vLLM from `make peer`)")
    bq.add_argument("--vllm-python", default=".peer-venv/bin/python", help="the interpreter that has vLLM (make peer)")
    bq.add_argument("--sides", default="specserve,specserve-none,vllm,vllm@float32,vllm-ngram",
                    help="comma-separated: specserve (its defaults), specserve-none (--policy none), specserve-separate "
                         "(--separate-router: the Router as its own deployment), vllm, vllm-ngram "
                         "(n-gram speculation, k = 3); a side may add @DTYPE to serve in another dtype than --dtype "
                         "(vllm@float32)")
    bq.add_argument("--concurrency", default="1,8,32", help="comma-separated requests in flight")
    bq.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled (temperature 0.7, top_p 0.9)")
    bq.add_argument("--max-tokens", type=int, default=128)
    bq.add_argument("--rounds", type=int, default=3, help="rounds, every side once per round in rotated order")
    bq.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x in flight")
    bq.add_argument("--dtype", default="bfloat16", help="both servers' dtype (a side's @DTYPE overrides it)")
    bq.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-peer-<hardware type>)")
    bq.set_defaults(func=_cmd_bench_peer)

    bl = bsub.add_parser("linears", help="a decode step's linears by rows per call: bfloat16 weights (engine/bf16_linear) "
                                         "against float32 through oneDNN")
    bl.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated rows per call")
    bl.add_argument("--rounds", type=int, default=5, help="rounds, both formats once per round in rotated order")
    bl.add_argument("--layers", type=int, default=30, help="layers of the embedded model's shapes (and its head)")
    bl.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-linears-<hardware type>)")
    bl.set_defaults(func=_cmd_bench_linears)

    bs = bsub.add_parser("step", help="one engine step at real model shapes (random weights, few layers): device "
                                      "forwards, other device work and the rest, in process and through Ray actors")
    bs.add_argument("--shape", default="tiny-128k", help="target shape: llama-3.1-8b, llama-3.2-1b or tiny-128k")
    bs.add_argument("--layers", type=int, default=2, help="decoder layers of the target")
    bs.add_argument("--draft", default="independent", help="independent (a second random model) or eagle3 (a random "
                                                          "EAGLE-3 head reading the target's features)")
    bs.add_argument("--draft-shape", default=None, help="shape of an independent draft (default: the target shape's)")
    bs.add_argument("--draft-layers", type=int, default=1, help="decoder layers of an independent draft")
    bs.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    bs.add_argument("--k", type=int, default=4, help="speculation length (fixed:K)")
    bs.add_argument("--mixes", default="greedy,top_p1,top_p09,seeded,logprobs",
                    help="request mixes: greedy, top_p1, top_p09 (temperature 1), seeded (temperature 1 + seed), logprobs (greedy + 5)")
    bs.add_argument("--steps", type=int, default=5, help="timed steps per cell; medians over them")
    bs.add_argument("--warmup", type=int, default=2, help="untimed steps per cell first (the first prefills)")
    bs.add_argument("--prompt-tokens", type=int, default=128, help="tokens per (random) prompt")
    bs.add_argument("--peaked", type=float, default=8.0, help="logit standard deviation of the random heads (0: as initialised)")
    bs.add_argument("--runs", default="inprocess,ray", help="inprocess, ray (the workers' channels) and ray-calls (Ray "
                                                          "task calls), interleaved cell by cell; and serve "
                                                          "(the models behind `specserve serve`, streamed by a client)")
    bs.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    bs.add_argument("--device", default="cpu")
    bs.add_argument("--out", default=None,
                    help="writes OUT.json, OUT.md and OUT.png (default results/bench-step-<hardware type>)")
    bs.set_defaults(func=_cmd_bench_step)

    from serve_app.bench.batching import QUICK, BatchingBench

    full = {name: f.default for name, f in BatchingBench.model_fields.items()}
    csv = lambda xs: ",".join(str(x) for x in xs)
    bb = bsub.add_parser("batching", help="continuous batching at scale: a long prompt arriving while streams decode "
                                          "(A), a shared system prompt (B), through `specserve serve`; the per-step "
                                          "token budget's TTFT / stall curve in process (C)")
    _model_args(bb)
    bb.add_argument("--scenarios", default=csv(full["scenarios"]), help="comma-separated subset of A, B, C")
    bb.add_argument("--quick", action="store_true",
                    help=f"smoke run: {', '.join(f'{k} {csv(v) if isinstance(v, list) else v}' for k, v in QUICK.items())} "
                         "(the flags below override it)")
    bb.add_argument("--policy", default=full["policy"], help="none | fixed:K | lut | adaptive (services and engines)")
    bb.add_argument("--profile", default=None, help="C with lut / adaptive: profile (default profiles/<hardware type>.json)")
    bb.add_argument("--batch-size", type=int, default=None,
                    help=f"max batch size of services and engines, at least --streams + 1 (default {full['batch_size']})")
    bb.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help=f"A, B: the services' per-step token budget (default {full['max_num_batched_tokens']})")
    bb.add_argument("--streams", type=int, default=None,
                    help=f"A, C: streams decoding when the long prompt arrives (default {full['streams']})")
    bb.add_argument("--long-tokens", type=int, default=None,
                    help=f"A, C: tokens of the long prompt (default {full['long_tokens']})")
    bb.add_argument("--baseline-s", type=float, default=None,
                    help=f"A: seconds of decoding timed before it arrives (default {full['baseline_s']:g})")
    bb.add_argument("--system-tokens", type=int, default=None,
                    help=f"B: tokens of the shared system prompt (default {full['system_tokens']})")
    bb.add_argument("--requests", type=int, default=None,
                    help=f"B: requests sharing it, one after another (default {full['requests']})")
    bb.add_argument("--max-tokens", type=int, default=None, help=f"B: tokens per answer (default {full['max_tokens']})")
    bb.add_argument("--budgets", default=None,
                    help=f"C: comma-separated per-step token budgets (default {csv(full['budgets'])})")
    bb.add_argument("--rounds", type=int, default=None,
                    help=f"C: rounds over the budgets, order rotated; medians (default {full['rounds']})")
    bb.add_argument("--max-wait-s", type=float, default=None,
                    help=f"A, C: give up on the long prompt's first token after this long (default {full['max_wait_s']:g})")
    bb.add_argument("--port", type=int, default=None, help="the services' HTTP port (default: a free one)")
    bb.add_argument("--out", default=None,
                    help="writes OUT.json, OUT.md, OUT.png (C's curve) and OUT-a.png (A's gaps) "
                         "(default results/bench-batching-<hardware type>)")
    bb.set_defaults(func=_cmd_bench_batching)

    bk = bsub.add_parser("kv-memory", help="KV bytes allocated vs the bytes of the tokens held: 1 request of 1,800 "
                                            "tokens beside 31 of 100-300, after prefill (the paged pool vs rows)")
    bk.add_argument("--target", default="embedded", help="the model whose pair runs (default: the embedded pair)")
    bk.add_argument("--shapes", default="llama-3.1-8b", help="comma-separated real shapes (bench/shapes.py) run as random "
                                                          "models with --layers layers, bfloat16; empty: none")
    bk.add_argument("--layers", type=int, default=2)
    bk.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/kv-memory-<hardware type>)")
    bk.set_defaults(func=_cmd_bench_kv_memory)

    bs = bsub.add_parser("structured", help="JSON-schema requests with and without the grammar: answers that validate, "
                                             "tokens per step under speculation")
    bs.add_argument("--n", type=int, default=50, help="requests in the suite (default 50)")
    bs.add_argument("--k", type=int, default=4, help="fixed speculation length (default 4)")
    bs.add_argument("--max-tokens", type=int, default=200)
    bs.add_argument("--batch", type=int, default=16)
    bs.add_argument("--dtype", default="float32")
    bs.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-structured-<hardware type>)")
    bs.set_defaults(func=_cmd_bench_structured)

    bp = bsub.add_parser("predicted", help="Predicted Outputs on edits: target steps and latency with the original as "
                                            "the prediction against without it, outputs compared token for token")
    _model_args(bp)
    bp.set_defaults(dtype="float32")
    bp.add_argument("--policy", default="fixed:2", help="the draft's policy on both sides (default fixed:2)")
    bp.add_argument("--rounds", type=int, default=3, help="interleaved rounds after a warm-up; medians")
    bp.add_argument("--extra-tokens", type=int, default=32, help="max_tokens = the original's tokens + this")
    bp.add_argument("--max-predicted-tokens", type=int, default=EngineConfig.model_fields["max_predicted_tokens"].default)
    bp.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-predicted-<hardware type>)")
    bp.set_defaults(func=_cmd_bench_predicted)

    ba = bsub.add_parser("attention", help="attention backends (gather, its SDPA-only path, flex) on one layer's paged pool: ms per call, "
                                           "speed-up over gather, output difference")
    ba.add_argument("--cases", default="cpu", choices=["quick", "cpu", "gpu"],
                    help="quick: 4 x 256; cpu: 16 x 1k context; gpu: 32-64 x 2-8k (default cpu)")
    ba.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", "llama-3.1-8b"], help="heads of this model")
    ba.add_argument("--device", default="cpu")
    ba.add_argument("--dtypes", default="float32,bfloat16")
    ba.add_argument("--rounds", type=int, default=9)
    ba.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-attention-<hardware type>)")
    ba.set_defaults(func=_cmd_bench_attention)

    bx = bsub.add_parser("context", help="the profile's context axis: draft and verification ms per (context, batch, k)")
    _model_args(bx)
    bx.add_argument("--random", default=None, help="SHAPE:LAYERS, a random Llama at that shape and depth with a "
                                                   "truncated draft (e.g. llama-3.1-8b:32) instead of --target")
    bx.add_argument("--draft-layers", type=int, default=2, help="with --random: the draft's layers (default 2)")
    bx.add_argument("--contexts", default="64,512,2048", help="KV tokens per row to measure at (default %(default)s)")
    bx.add_argument("--batch-sizes", default="1,8,32")
    bx.add_argument("--ks", default="0,1,2,4")
    bx.add_argument("--reps", type=int, default=3, help="visits per k (median)")
    bx.add_argument("--deadline", type=float, default=None, help="seconds: cells not started by then stay empty")
    bx.add_argument("--into", default=None, help="a profile JSON whose latency grid takes the measured context axis")
    bx.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-context-<hardware type>)")
    bx.set_defaults(func=_cmd_bench_context)

    bg = bsub.add_parser("graphs", help="what captured CUDA graphs would buy a step: engine steps' wall against device "
                                        "busy time, and one forward per shape eager against captured by hand")
    _model_args(bg)
    bg.add_argument("--random", default="llama-3.1-8b:32", help="SHAPE:LAYERS, a random Llama with a truncated draft "
                                                                "(default %(default)s); 'none': --target / --draft")
    bg.add_argument("--draft-layers", type=int, default=2, help="with --random: the draft's layers (default 2)")
    bg.add_argument("--batch-sizes", default="1,8,32")
    bg.add_argument("--ks", default="0,2,4")
    bg.add_argument("--context", type=int, default=512, help="KV tokens per row (default %(default)s)")
    bg.add_argument("--steps", type=int, default=6, help="engine steps timed per (batch, k)")
    bg.add_argument("--reps", type=int, default=10, help="timed calls per forward (median)")
    bg.add_argument("--deadline", type=float, default=None, help="seconds: batch sizes not started by then are skipped")
    bg.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-graphs-<hardware type>)")
    bg.set_defaults(func=_cmd_bench_graphs)

    br = bsub.add_parser("replay", help="policies on a virtual clock (the profile's cost model): deterministic "
                                        "latency and work per 1k tokens on (b), (d), (e), and a closed-loop grid")
    _model_args(br)
    br.add_argument("--profile", default=None, help="profile JSON (default profiles/<hardware type>.json)")
    br.add_argument("--policies", default="none,fixed:1,fixed:2,fixed:3,fixed:4,lut,adaptive,budget")
    br.add_argument("--parts", default="b,d,e", help="of b (time-varying chat), d (mixed bursts), e (long documents)")
    br.add_argument("--scale", type=float, default=0.3, help="schedule length (1.0: bench policies' full length)")
    br.add_argument("--grid-batches", default="1,4,16", help="the closed-loop grid's batch sizes ('' skips the grid)")
    br.add_argument("--grid-contexts", default="64,512,2048", help="the grid's document lengths in tokens")
    br.add_argument("--grid-rounds", type=int, default=4, help="requests per stream in each grid cell, at least "
                                                               "8 streams' worth (each its own document)")
    br.add_argument("--deadline", type=float, default=None, help="seconds: grid cells not started by then stay empty "
                                                                  "(named in the results)")
    br.add_argument("--seed", type=int, default=0)
    br.add_argument("--seeds", type=int, default=1, help="schedules drawn from this many seeds (from --seed on), every "
                                                         "policy on each: paired ratios over seeds with intervals")
    br.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-replay-<hardware type>)")
    br.set_defaults(func=_cmd_bench_replay)

    bh = bsub.add_parser("history", help="the suffix history on against off: (f) repeating traffic (agent loops, "
                                         "extraction, rewrites, chat) and (b) plain chat, paired rounds")
    _model_args(bh)
    bh.add_argument("--profile", default=None, help="profile JSON (default profiles/<hardware type>.json)")
    bh.add_argument("--policy", default="budget")
    bh.add_argument("--parts", default="f,b", help="of f (repeating traffic), b (time-varying chat) and u (b's "
                                                   "schedule, no prompt asked twice)")
    bh.add_argument("--scale", type=float, default=1.0, help="schedule length ((f): 60 s x scale at 1.2 requests/s)")
    bh.add_argument("--rounds", type=int, default=3, help="paired rounds, the order rotating")
    bh.add_argument("--warmup", type=float, default=0.25, help="share of the requests left out of the latency")
    bh.add_argument("--history-tokens", type=int, default=1 << 20)
    bh.add_argument("--replay", action="store_true", help="also the deterministic replay on the profile's cost model")
    bh.add_argument("--seed", type=int, default=0)
    bh.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/bench-history-<hardware type>)")
    bh.set_defaults(func=_cmd_bench_history)

    bw = bsub.add_parser("proposal-width", help="a sampled row's top-N draft proposal: exact acceptance against the "
                                                 "full distribution; the coupled sampler's noise against iid Gumbel")
    bw.add_argument("--prompts", type=int, default=16)
    bw.add_argument("--max-tokens", type=int, default=48)
    bw.add_argument("--dtype", default="auto")
    bw.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/proposal-width-<hardware type>)")
    bw.set_defaults(func=_cmd_bench_proposal_width)

    bp = bsub.add_parser("policies", help="the paper's experiments: none, fixed:1..K, lut, adaptive in one run")
    _model_args(bp)
    bp.add_argument("--profile", default=None, help="profile JSON (default profiles/<hardware type>.json)")
    bp.add_argument("--out", default=None,
                    help="results directory: summary.md, results.json, PNGs (default results/bench-policies-<hardware type>)")
    bp.add_argument("--concurrency", default="1,2,4,8,16,32", help="(a) closed-loop concurrencies")
    bp.add_argument("--max-k", type=int, default=8, help="fixed:1 .. fixed:K are compared")
    bp.add_argument("--scale", type=float, default=1.0, help="scales request counts and the schedule's length")
    bp.add_argument("--parts", default="abc", help="which experiments: a uniform, b time-varying, c workload shift, "
                    "d bursts of mixed requests (chat, JSON, rewrites), e long documents between short chat")
    bp.add_argument("--policies", default=None, help="comma-separated policies (default none, fixed:1..K, lut, adaptive, "
                    "budget); ratios need at least one fixed:K")
    bp.add_argument("--repeat", type=int, default=1, help="rounds of every experiment (policies interleaved); medians")
    bp.add_argument("--seed", type=int, default=0)
    bp.set_defaults(func=_cmd_bench_policies)

    sc = sub.add_parser("selfcheck", help="check a (GPU) node before deploying: exact greedy and seeded output at "
                                          "every k, sampling, EAGLE-3, a tiny profile, the step benchmark; exit 1 "
                                          "if any check fails (needs no Ray, no network, no model download)")
    sc.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    sc.add_argument("--dtype", default="auto",
                    help="auto, float32, bfloat16 or float16 for the sampled, profile and step checks (the exact "
                         "checks run in float32)")
    sc.add_argument("--quick", action="store_true", help="small models and few steps (CI, a CPU)")
    sc.add_argument("--full", action="store_true", help="the whole GPU campaign: the checks, then `bench attention` "
                    "(gpu cases, llama-3.1-8b heads, on CUDA), this device's profile of a random Llama-3.1-8B "
                    "at full depth with a truncated draft, its context axis, a replay on it and a short `bench policies` "
                    "steered by it")
    sc.add_argument("--checks", default=None, help="comma-separated subset: greedy, sampled, seeded, eagle3, attention, "
                                                   "syncs, kv, profile, step ('' with --full: the campaign alone)")
    sc.add_argument("--stages", default=None,
                    help="with --full: the campaign's stages to run, in this order: attention, profile, context (the "
                         "profile's context axis at 512 / 4k / 16k), replay ((e) and the grid on that profile), policies "
                         "(default: all)")
    sc.add_argument("--deadline", type=float, default=None,
                    help="with --full: seconds after which no campaign stage starts (a lent GPU's time is short)")
    sc.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/selfcheck-<hardware type>)")
    sc.set_defaults(func=_cmd_selfcheck)

    d = sub.add_parser("distill", help="train a small reduced-vocabulary draft on text the target generates")
    d.add_argument("--target", default=EMBEDDED)
    d.add_argument("--out", required=True, help="output directory (re-running with it resumes)")
    d.add_argument("--method", choices=("layers", "eagle3"), default="layers",
                   help="layers: the target's first layers, retrained; eagle3: one layer over the target's features")
    d.add_argument("--steps", type=int, default=3, help="eagle3: draft steps unrolled in training (training-time test)")
    d.add_argument("--feature-layers", default=None,
                   help="eagle3: comma-separated target layers whose inputs the draft reads (default 2, N//2, N-3)")
    d.add_argument("--layers", type=int, default=2, help="draft decoder layers (initialised from the target's first)")
    d.add_argument("--tokens", type=int, default=8192, help="size of the reduced vocabulary")
    d.add_argument("--prompts", default="2400",
                   help='a number of seed prompts, or a JSONL file of prompts ({"prompt": ...} or {"messages": [...]} '
                        "per line, e.g. your own traffic) to continue (greedily, then sampled)")
    d.add_argument("--self-prompts", type=int, default=0,
                   help="also train on N chat requests the target writes itself (Magpie style; cached in OUT/work)")
    d.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt, besides the greedy one")
    d.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations")
    d.add_argument("--max-tokens", type=int, default=128, help="tokens generated per seed prompt")
    d.add_argument("--corpus", default=None,
                   help="eagle3: train from this corpus (`specserve corpus grow`), the target's features and "
                        "distributions recomputed by teacher-forced forwards; --prompts / --samples / --self-prompts "
                        "then do not apply")
    d.add_argument("--init", default=None, help="--corpus: keep training this EAGLE-3 draft (its token set is kept)")
    d.add_argument("--batch-tokens", type=int, default=4096, help="--corpus: tokens per training batch (padded)")
    d.add_argument("--generated-only", action="store_true",
                   help="--corpus: loss on generated positions only (not on the prompt's)")
    d.add_argument("--limit-tokens", type=int, default=None,
                   help="--corpus: train on the first sequences holding about this many generated tokens")
    d.add_argument("--device", default="cpu", help="--corpus: where the target and the draft run (cpu, cuda, cuda:N)")
    d.add_argument("--max-hours", type=float, default=None,
                   help="--corpus: stop at the first checkpoint after this long (re-run to resume)")
    d.add_argument("--epochs", type=float, default=5, help="training epochs (--corpus: may be fractional)")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default=None,
                   help="the target's dtype while it generates the training text (default float32), or with --corpus "
                        "in its teacher-forced forwards (default auto: as served); the draft trains in float32")
    d.set_defaults(func=_cmd_distill)

    co = sub.add_parser("corpus", help="the draft's training corpus: the target's own text as token ids, grown in "
                                        "resumable runs")
    cos = co.add_subparsers(dest="corpus_command", required=True)
    cg = cos.add_parser("grow", help="append rounds of prompts continued by the target (greedy and sampled) until "
                                     "--tokens new tokens are stored; commit the directory after each run")
    cg.add_argument("--target", default=EMBEDDED)
    cg.add_argument("--dtype", default="auto", help="the target's dtype while it writes (auto: bfloat16 where native)")
    cg.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda, cuda:N)")
    cg.add_argument("--out", default=None, help="corpus directory (default corpora/<target>)")
    cg.add_argument("--tokens", type=int, default=200_000, help="new generated tokens to add in this run")
    cg.add_argument("--max-rounds", type=int, default=None, help="stop after this many rounds even if short of --tokens")
    cg.add_argument("--max-batch", type=int, default=160, help="sequences decoded together (continuous batching)")
    cg.set_defaults(func=_cmd_corpus)
    cs = cos.add_parser("show", help="a corpus's totals, mix of kinds and sources, and its runs' speed")
    cs.add_argument("dir", nargs="?", default=None, help="corpus directory (default corpora/<embedded target>)")
    cs.set_defaults(func=_cmd_corpus)

    s = sub.add_parser("serve", help="start a local Ray cluster and serve the OpenAI-compatible HTTP endpoint")
    s.add_argument("--config", default=None, help="Serve config YAML (its first application's args); flags below are ignored")
    _model_args(s)
    s.add_argument("--policy", default="budget",
                   help="none | fixed:K | lut | adaptive | budget (default: a length per row, from the step's prices; "
                        "served here it beat adaptive at 1, 8 and 32 in flight, docs/benchmarks.md)")
    s.add_argument("--batch-size", type=int, default=32,
                   help="most requests decoded together; later ones wait (default %(default)s: the profile's largest "
                        "batch; at 8, 32 requests in flight ran 8 at a time)")
    _batching_args(s)
    s.add_argument("--max-queue", type=int, default=64)
    s.add_argument("--profiles-dir", default="profiles")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics export port of the local Ray node")
    s.add_argument("--access-log", action="store_true", help="log every request and internal call (off: errors and state changes only)")
    s.add_argument("--separate-router", action="store_true",
                   help="run the Router as its own deployment behind the ingress (by default the ingress hosts it: "
                        "no Ray hop per streamed token; separate, a Router replica that dies resumes its requests "
                        "on its replacement)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on Ctrl-C / SIGTERM: seconds in-flight requests get to finish (new ones get 503)")
    s.add_argument("--target-gpus", type=float, default=None,
                   help="GPUs for the target's worker (with --device cuda: default 1; 0.5 shares one with the draft)")
    s.add_argument("--draft-gpus", type=float, default=None,
                   help="GPUs for the draft's worker (with --device cuda: default 1 beside a whole target, else the target's)")
    s.set_defaults(func=_cmd_serve)

    ch = sub.add_parser("chaos", help="kill the target, the draft and a Router under load on a local service; "
                                      "optionally a soak (memory over time) and a burst")
    _model_args(ch)
    ch.set_defaults(dtype="float32")  # greedy texts compared token for token: float32 (bf16 varies with the batch)
    ch.add_argument("--policy", default="fixed:2", help="none | fixed:K | lut | adaptive")
    ch.add_argument("--users", type=int, default=4, help="closed-loop users during the kills")
    ch.add_argument("--max-tokens", type=int, default=64)
    ch.add_argument("--interval", type=float, default=20.0, help="seconds of load before each kill and after the last")
    ch.add_argument("--soak-minutes", type=float, default=0.0, help="then this long at --load of the capacity (0: no soak)")
    ch.add_argument("--load", type=float, default=0.7, help="soak arrival rate as a share of the measured capacity")
    ch.add_argument("--burst", type=float, default=0.0, help="then 30 s at this multiple of the capacity (0: no burst)")
    ch.add_argument("--capacity-s", type=float, default=60.0, help="seconds spent measuring capacity (soak, burst)")
    ch.add_argument("--port", type=int, default=8000)
    ch.add_argument("--out", default=None, help="results stem (default results/chaos-<hardware>)")
    ch.set_defaults(func=_cmd_chaos)

    sm = sub.add_parser("simulate", help="discrete-event simulation of the service on a fleet of hardware types, from profiles")
    sm.add_argument("--fleet", default=None, help="TYPE:N[,TYPE:N...]: replicas per hardware type (profile name)")
    sm.add_argument("--profiles", default="profiles", help="directory of profile JSON files")
    sm.add_argument("--shape", default=None, help="closed-loop users following a load shape (step, sine, spike, paper)")
    sm.add_argument("--trace", default=None, help="CSV of arrival_s,prompt_tokens,output_tokens (open loop)")
    sm.add_argument("--policy", default=None, help="comma-separated policies to compare (default none,fixed:1,fixed:2,"
                                                   "lut,adaptive; with --validate also fixed:4, fixed:8 and budget)")
    sm.add_argument("--duration", type=float, default=None, help="simulated seconds of a shape (default its nominal length)")
    sm.add_argument("--users-scale", type=float, default=1.0, help="multiplies the shape's user counts")
    sm.add_argument("--prompt-tokens", default="64", help="closed loop: tokens per prompt, N or LOW-HIGH (uniform)")
    sm.add_argument("--output-tokens", default="16-128", help="closed loop: tokens per answer, N or LOW-HIGH (uniform)")
    sm.add_argument("--max-batch", type=int, default=8)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--route", default="least-loaded", choices=["least-loaded", "group-total"],
                    help="least-loaded: the ingress (the group with the fewest in flight per replica, then its replica "
                         "with the fewest); group-total: the group with the fewest in flight, whatever its size")
    sm.add_argument("--engine", default="auto", choices=["auto", "step", "fleet"],
                    help="step: every engine step an event (exact); fleet: all replicas advanced together in ticks "
                         "(vectorised, for thousands of replicas); auto: fleet above 32 replicas")
    sm.add_argument("--tick", type=float, default=0.1, help="fleet engine: seconds per tick")
    sm.add_argument("--out", default=None, help="writes results.json, summary.md (and k_batch.png) here "
                                                "(default out/simulate, with --validate results/simulate-validate-<hardware>)")
    sm.add_argument("--validate", action="store_true",
                    help="replay `bench policies` (b) (or --part) for real on this machine, simulated from its profile and replayed per "
                         "row on a virtual clock: compare mean latency per policy, and every real step's time with the "
                         "cost model's price by (batch, k, context); exit 1 when an error is over --tolerance, the "
                         "order differs, or a bucket's median step error is over 10%%")
    sm.add_argument("--tolerance", type=float, default=0.10, help="--validate: largest relative error allowed")
    sm.add_argument("--tie", type=float, default=0.05,
                    help="--validate: policies the real run puts closer than this (relative) may come in either order")
    sm.add_argument("--scale", type=float, default=0.7, help="--validate: scales the schedule's length (as bench policies)")
    sm.add_argument("--part", default="b", choices=["b", "d", "e"],
                    help="--validate: the schedule: (b) time-varying chat, (d) mixed bursts of chat, JSON and rewrites, "
                         "(e) long documents between short chat (seeded as bench replay seeds them)")
    sm.add_argument("--repeat", type=int, default=3, help="--validate: real rounds (policies interleaved); medians")
    sm.add_argument("--profile", default=None, help="--validate: profile (default profiles/<hardware type>.json)")
    sm.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="--validate: simulate from the profile as it is (default: calibrate it on this machine first)")
    _model_args(sm)
    sm.set_defaults(func=_cmd_simulate)

    dr = sub.add_parser("drain", help="stop a running service admitting requests and wait for in-flight ones "
                                      "(the Kubernetes preStop hook)")
    dr.add_argument("--address", default="auto", help="Ray cluster address")
    dr.add_argument("--app", default="specserve", help="Serve application name")
    dr.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for in-flight requests")
    dr.set_defaults(func=_cmd_drain)

    bd = sub.add_parser("breakdown", help="where a running service's engine steps spend their time (ms per step: the "
                                          "workers' forwards, vocabulary work and the rest of their calls, Ray's hops, the "
                                          "Router's own work, the gap between steps), over a window of live traffic")
    bd.add_argument("--address", default="auto", help="Ray cluster address")
    bd.add_argument("--app", default="specserve", help="Serve application name")
    bd.add_argument("--window", type=float, default=10.0, help="seconds of traffic to average over")
    bd.add_argument("--json", action="store_true", help="print the raw breakdown as JSON")
    bd.set_defaults(func=_cmd_breakdown)

    pf = sub.add_parser("profile", help="measure latency over batch size x k and acceptance; write this hardware's profile")
    _model_args(pf)
    pf.add_argument("--out", default=None, help="profile JSON (default profiles/<hardware type>.json); a PNG heatmap goes beside it")
    pf.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes to measure")
    pf.add_argument("--max-k", type=int, default=8, help="measure k = 0 .. K")
    pf.add_argument("--reps", type=int, default=5, help="steps per (batch size, k) cell; the median is kept")
    pf.add_argument("--agree", type=float, default=0.05,
                    help="visit past --reps, up to --max-reps, until each cell's repeated visits agree within this "
                         "(relative gap between the medians of alternate rounds); 0: exactly --reps")
    pf.add_argument("--max-reps", type=int, default=None, help="most rounds a cell may take to agree (default 3 x --reps)")
    pf.add_argument("--prompts", type=int, default=16, help="prompts for the acceptance measurement")
    pf.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt for the acceptance measurement")
    pf.add_argument("--acceptance-only", action="store_true",
                    help="keep the latency grid of the profile at --out: measure its acceptance and the draft's "
                         "confidence curve again (--prompts, --max-tokens) and rewrite its best-k table from them")
    pf.add_argument("--copy-ks", default="auto",
                    help="k past --max-k where only the verification is measured: a row copying its prompt drafts up to "
                         "max_copy_tokens without a draft forward (auto: halfway to max_copy_tokens and it; '' none)")
    pf.add_argument("--copies-only", action="store_true",
                    help="keep the profile at --out: add its verification at --copy-ks, measured beside its grid's "
                         "longest k and scaled to them (--reps)")
    pf.add_argument("--chunk-context-only", action="store_true",
                    help="keep the profile at --out: add what a prompt chunk pays for the KV its row holds, measured on "
                         "one prompt of --context tokens (default 2048) and scaled to its chunk price")
    pf.add_argument("--predict", metavar="GPU_TYPE", default=None,
                    help="measure nothing: write a profile marked `source: predicted` for GPU_TYPE from the roofline "
                         "model (serve_app/profiling/roofline.py); needs --acceptance-rate or --acceptance-from")
    pf.add_argument("--acceptance-rate", type=float, default=None,
                    help="--predict: assumed per-token acceptance a (draft position i accepted with a^(i+1))")
    pf.add_argument("--acceptance-from", metavar="PROFILE", default=None,
                    help="--predict: take the acceptance from this measured profile of the same pair and dtype")
    pf.add_argument("--context", type=int, default=None,
                    help="--predict, --check-prediction: tokens of KV cache per sequence assumed in every cell "
                         "(default: 512 for --predict, the profile's recorded mean context for --check-prediction); "
                         "--chunk-context-only: the prompt's length (default 2048)")
    pf.add_argument("--check-prediction", metavar="PROFILE", default=None,
                    help="measure this machine's bandwidth and matmul speed, predict PROFILE's latency grid for its "
                         "pair (--target/--draft) and compare per cell; --out: results stem "
                         "(default results/predict-check-<its hardware type>)")
    pf.set_defaults(func=_cmd_profile)

    pr = sub.add_parser("profiles", help="manage the running service's speculation profiles")
    prs = pr.add_subparsers(dest="profiles_command", required=True)
    push = prs.add_parser("push", help="replace a hardware type's profile in the running service (no restart)")
    push.add_argument("file")
    push.add_argument("--address", default="auto", help="Ray cluster address")
    push.add_argument("--app", default="specserve", help="Serve application name")
    push.set_defaults(func=_cmd_profiles_push)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=EMBEDDED, help="embedded (default), hub id, local dir or .gguf")
    p.add_argument("--draft", default=None, help="draft model, truncated:N, or none (default: the target's default)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 where the hardware has it natively, else float32), float32, bfloat16, float16")
    p.add_argument("--device", default="cpu")


def _batching_args(p: argparse.ArgumentParser) -> None:
    """The KV pool and the per-step token budget; defaults are EngineConfig's (see its field docs)."""
    field = EngineConfig.model_fields
    p.add_argument("--max-num-batched-tokens", type=int, default=field["max_num_batched_tokens"].default,
                   help="per-step token budget: decoding rows feed k + 1 tokens each, prefill chunks take the rest "
                        "(smaller: running streams stall less while a long prompt prefills; larger: long prompts "
                        "reach their first token sooner); at least --batch-size (default %(default)s)")
    p.add_argument("--max-num-tokens", type=int, default=field["max_num_tokens"].default,
                   help="KV pool size in tokens per worker (default %(default)s)")
    p.add_argument("--block-size", type=int, default=field["block_size"].default,
                   help="tokens per KV block, the unit of allocation and of prefix caching (default %(default)s)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full (default: share the KV of identical prompt prefixes)")
    p.add_argument("--gpu-memory-utilization", type=float, default=field["gpu_memory_utilization"].default,
                   help="on a GPU: the share of its memory a worker may use; its KV pool takes what the weights and "
                        "a profiling forward leave, up to --max-num-tokens (default %(default)s)")
    p.add_argument("--attention-backend", default=field["attention_backend"].default, choices=["auto", "gather", "flex"],
                   help="how attention reads the paged KV pool (default %(default)s: gather on a CPU, flex on CUDA)")
    p.add_argument("--static-steps", default=field["static_steps"].default, choices=["auto", "graphs", "eager", "off"],
                   help="decoding and verification forwards at bucketed shapes, replayed as CUDA graphs (default "
                        "%(default)s: graphs on CUDA with flex attention; off elsewhere)")


def _batching_config(args) -> dict:
    """EngineConfig fields from the flags `_batching_args` adds."""
    return {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_tokens": args.max_num_tokens,
            "block_size": args.block_size, "prefix_caching": args.prefix_caching,
            "gpu_memory_utilization": args.gpu_memory_utilization, "attention_backend": args.attention_backend,
            "static_steps": args.static_steps}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="none", help="none | fixed:K | lut | adaptive")
    p.add_argument("--profile", default=None, help="profile for lut / adaptive (default profiles/<hardware type>.json)")
    p.add_argument("--batch-size", type=int, default=8, help="most requests decoded together")
    p.add_argument("--max-num-tokens", type=int, default=None, help="KV budget in tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")


def _configs(args) -> tuple[ModelConfig, EngineConfig]:
    from serve_app.engine.policy import make_policy, needs_profile

    try:
        if not needs_profile(args.policy):
            make_policy(args.policy)  # unknown policies fail before any model loads
        mc = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)
        extra = {k: v for k, v in (("max_num_tokens", args.max_num_tokens), ("max_model_len", args.max_model_len)) if v}
        ec = EngineConfig(policy=args.policy, max_batch_size=args.batch_size, **extra)
    except ValidationError as e:
        raise UsageError(_first_error(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if ec.policy == "none" and mc.draft is None:
        mc.draft = "none"  # plain decoding needs no draft
    return mc, ec


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def read_jobs(path: str, defaults: dict) -> list[dict]:
    """One job per line: {'line', 'prompt'|'messages', 'params'} or {'line', 'error'}."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read prompts file {path}: {e}") from None
    jobs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        job: dict = {"line": i}
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("expected a JSON object")
            unknown = set(obj) - {"prompt", "messages", *SamplingParams.model_fields}
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}")
            job["prompt"], job["messages"] = obj.get("prompt"), obj.get("messages")
            fields = {**defaults, **{k: v for k, v in obj.items() if k in SamplingParams.model_fields}}
            job["params"] = SamplingParams(**fields)
        except json.JSONDecodeError as e:
            job["error"] = f"malformed JSON: {e.msg} (column {e.colno})"
        except ValidationError as e:
            job["error"] = _first_error(e)
        except ValueError as e:
            job["error"] = str(e)
        jobs.append(job)
    if not jobs:
        raise UsageError(f"prompts file {path} holds no prompts")
    return jobs


def cmd_generate(args) -> int:
    mc, ec = _configs(args)
    try:
        defaults = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        ).model_dump()
    except ValidationError as e:
        raise UsageError(_first_error(e)) from None
    jobs = read_jobs(args.prompts, defaults)
    from serve_app.engine.policy import make_policy, needs_profile

    policy = make_policy(ec.policy, find_profile(args.profile, mc) if needs_profile(ec.policy) else None)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        out_file = open(args.out, "w", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e}") from None

    from serve_app.models import load_models
    from serve_app.engine.scheduler import Engine

    engine = Engine.from_models(load_models(mc), ec, policy)
    results = asyncio.run(_generate_all(engine, jobs))
    failed = 0
    with out_file:
        for job, res in zip(jobs, results):
            if "error" in res:
                failed += 1
                print(f"{args.prompts}:{job['line']}: {res['error']}", file=sys.stderr)
            out_file.write(json.dumps(res, ensure_ascii=False) + "\n")
    return 1 if failed else 0


async def _generate_all(engine, jobs: list[dict]) -> list[dict]:
    """Every job through the continuous batcher at once; the engine admits up to its batch size."""
    from serve_app.prompts import encode_prompt

    async def one(job: dict) -> dict:
        if "error" in job:
            return {"error": job["error"]}
        try:
            ids = encode_prompt(engine.tokenizer, job["prompt"], job["messages"])
            text, token_ids = [], []
            async for out in engine.generate(ids, job["params"]):
                text.append(out.text)
                token_ids += out.token_ids
                if out.finished:
                    if out.error:
                        return {"error": out.error}
                    return {
                        "text": "".join(text),
                        "token_ids": token_ids,
                        "finish_reason": out.finish_reason,
                        "stats": out.stats.to_dict(),
                    }
        except ValueError as e:
            return {"error": str(e)}
        return {"error": "generation ended without a final output"}

    return await asyncio.gather(*(one(j) for j in jobs))


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated whole numbers ("1,2,4"), or a UsageError naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated whole numbers, e.g. 1,2,4, got {text!r}") from None


def _write_bench(args, name: str, results: dict, markdown: str) -> None:
    from serve_app.bench.rounds import default_stem, write_results

    print("\n" + markdown)
    json_path, md_path = write_results(args.out or default_stem(f"bench-{name}"), results, markdown)
    print(f"results: {json_path}, {md_path}")


def _bench_model(args) -> ModelConfig:
    return ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)


def _cmd_bench_engine(args) -> int:
    from serve_app.bench.engine import bench_engine

    ks = int_list(args.ks, "--ks")
    if args.rounds < 1 or args.num_prompts < 1 or args.concurrency < 2 or args.max_tokens < 1 or any(k < 1 for k in ks):
        raise UsageError("need --rounds, --num-prompts, --max-tokens >= 1, --concurrency >= 2 (batch 1 is measured "
                         "anyway) and --ks values >= 1")
    _write_bench(args, "engine", *bench_engine(_bench_model(args), args.max_tokens, args.num_prompts, ks,
                                                args.concurrency, args.rounds))
    return 0


def _cmd_bench_acceptance(args) -> int:
    from serve_app.bench.acceptance import bench_acceptance

    if not 1 <= args.k <= 32 or args.max_tokens < 1 or args.batch_size < 1 or not 0 <= args.temperature <= 2:
        raise UsageError("need 1 <= --k <= 32, --max-tokens >= 1, --batch-size >= 1 and 0 <= --temperature <= 2")
    _write_bench(args, "acceptance", *bench_acceptance(_bench_model(args), args.k, args.max_tokens, args.batch_size,
                                                        args.temperature))
    return 0


def _cmd_bench_step(args) -> int:
    from serve_app.bench.rounds import default_stem, write_results
    from serve_app.bench.step import StepBench, bench_step, plot_step

    try:
        cfg = StepBench(shape=args.shape, layers=args.layers, draft=args.draft, draft_shape=args.draft_shape,
                        draft_layers=args.draft_layers, batch_sizes=int_list(args.batch_sizes, "--batch-sizes"),
                        k=args.k, mixes=[m.strip() for m in args.mixes.split(",") if m.strip()], steps=args.steps,
                        warmup=args.warmup, prompt_tokens=args.prompt_tokens, peaked=args.peaked, dtype=args.dtype,
                        device=args.device)
    except ValidationError as e:
        raise UsageError(_first_error(e)) from None
    results, markdown = bench_step(cfg, [r.strip() for r in args.runs.split(",") if r.strip()])
    print("\n" + markdown)
    stem = args.out or default_stem("bench-step")
    json_path, md_path = write_results(stem, results, markdown)
    png = plot_step(results, f"{stem}.png")
    print(f"results: {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0


def _cmd_bench_batching(args) -> int:
    from serve_app.bench.batching import BatchingBench, bench_batching, plot_curve
    from serve_app.bench.rounds import default_stem, write_results
    from serve_app.engine.policy import make_policy, needs_profile

    given = {"scenarios": args.scenarios.split(","), "policy": args.policy, "batch_size": args.batch_size,
             "max_num_batched_tokens": args.max_num_batched_tokens, "streams": args.streams,
             "long_tokens": args.long_tokens, "baseline_s": args.baseline_s, "system_tokens": args.system_tokens,
             "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
             "max_wait_s": args.max_wait_s, "port": args.port,
             "budgets": int_list(args.budgets, "--budgets") if args.budgets else None}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        cfg = BatchingBench.quick(**given) if args.quick else BatchingBench(**given)
        mc = _bench_model(args)
        if not needs_profile(cfg.policy):
            make_policy(cfg.policy)  # an unknown policy fails before anything starts
    except ValidationError as e:
        raise UsageError(_first_error(e)) from None
    profile = find_profile(args.profile, mc) if "C" in cfg.scenarios and needs_profile(cfg.policy) else None
    stem = str(args.out or default_stem("bench-batching"))
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    results, markdown = bench_batching(mc, cfg, profile, stem)
    png = None
    if "C" in results:
        png = plot_curve(results["C"]["rows"], f"{stem}.png", f"C: {cfg.streams} streams decoding, a "
                         f"{results['C']['long_prompt_tokens']}-token prompt arrives; points: per-step token budget")
    print("\n" + markdown)
    json_path, md_path = write_results(stem, results, markdown)
    plots = [p for p in (png, results.get("A", {}).get("plot")) if p]
    print(f"results: {json_path}, {md_path}" + "".join(f", {p}" for p in plots))
    return 0


def _cmd_bench_kv_memory(args) -> int:
    from serve_app.bench.kvmem import kv_memory, markdown, write

    results = [kv_memory(args.target)]
    results += [kv_memory(shape=s.strip(), layers=args.layers) for s in args.shapes.split(",") if s.strip()]
    print(markdown(results))
    print("results:", ", ".join(write(results, args.out)))
    return 0


def _cmd_bench_structured(args) -> int:
    from serve_app.bench.structured import main

    return main(args.n, args.k, args.max_tokens, args.batch, args.dtype, args.out)


def _cmd_bench_predicted(args) -> int:
    from serve_app.bench.predicted import bench_predicted
    from serve_app.models import load_models

    if args.rounds < 1 or args.extra_tokens < 0 or not 1 <= args.max_predicted_tokens <= 256:
        raise UsageError("need --rounds >= 1, --extra-tokens >= 0 and 1 <= --max-predicted-tokens <= 256")
    results, markdown = bench_predicted(load_models(_bench_model(args)), args.policy, args.rounds, args.extra_tokens,
                                        args.max_predicted_tokens)
    _write_bench(args, "predicted", results, markdown)
    return 0 if results["all_same"] else 1


def _cmd_bench_attention(args) -> int:
    from serve_app.bench.attention import bench_attention

    results, markdown = bench_attention(args.cases, args.shape, args.device, args.dtypes.split(","), args.rounds)
    _write_bench(args, "attention", results, markdown)
    return 0 if all(b["max_abs_diff"] < (2e-2 if c["dtype"] == "float32" else 1e-1)
                    for c in results["cases"] for b in c["backends"].values()) else 1


def _cmd_bench_context(args) -> int:
    from serve_app.bench.context import bench_context, merge_into_profile, random_models
    from serve_app.models import load_models

    if args.random:
        models, _ = random_models(args.random, args.draft_layers, args.device, args.dtype)
        label = args.random
    else:
        models = load_models(_bench_model(args))
        label = models.target_name
    results, markdown = bench_context(models, int_list(args.batch_sizes, "--batch-sizes"), int_list(args.ks, "--ks"),
                                      int_list(args.contexts, "--contexts"), args.reps, args.deadline, label)
    _write_bench(args, "context", results, markdown)
    if args.into:
        merge_into_profile(args.into, results["grid"], results["chunk_context"])
        print(f"context axis added to {args.into}")
    return 0


def _cmd_bench_graphs(args) -> int:
    from serve_app.bench.context import random_models
    from serve_app.bench.graphs import graphs_markdown, probe_graphs
    from serve_app.models import load_models

    if args.steps < 1 or args.reps < 1 or args.context < 1:
        raise UsageError("--steps, --reps and --context must be >= 1")
    if args.random != "none":
        models, _ = random_models(args.random, args.draft_layers, args.device, args.dtype)
        label = args.random
    else:
        models = load_models(_bench_model(args))
        label = models.target_name
    device = next(models.target.parameters()).device
    name = torch_device_name(device)

    def write(res):
        _write_bench(args, "graphs", {**res, "device": name, "label": label}, graphs_markdown({**res, "device": name}, label))

    res = probe_graphs(models, int_list(args.batch_sizes, "--batch-sizes"), int_list(args.ks, "--ks"), args.context,
                       args.steps, args.reps, args.deadline, on_batch=write)
    write(res)
    return 0


def torch_device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cmd_bench_replay(args) -> int:
    from serve_app.bench import replay as rp
    from serve_app.models import load_models
    from serve_app.hardware import detect_gpu_type
    from serve_app.profiling.profiles import load_profile

    if args.seeds < 1:
        raise UsageError("--seeds must be >= 1")
    if args.grid_rounds < 1:
        raise UsageError("--grid-rounds must be >= 1")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in rp.PARTS]:
        raise UsageError(f"--parts: unknown part {unknown[0]!r} ({', '.join(rp.PARTS)})")
    batches = int_list(args.grid_batches, "--grid-batches") if args.grid_batches else []
    contexts = int_list(args.grid_contexts, "--grid-contexts")
    models = load_models(_bench_model(args))
    profile = load_profile(args.profile or f"profiles/{detect_gpu_type()}.json")
    if profile.latency is None:
        raise UsageError("replay needs a profile with a latency grid (its cost model)")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    res = rp.run_replay(models, profile, policies, parts, args.scale, args.seed, args.seeds, batches, contexts,
                        args.grid_rounds, args.deadline)
    _write_bench(args, "replay", res, rp.markdown(res, policies))
    return 0


def _cmd_bench_history(args) -> int:
    import random

    from tqdm import tqdm

    from serve_app.bench import repeating
    from serve_app.hardware import detect_gpu_type
    from serve_app.models import load_models
    from serve_app.profiling.profiles import load_profile

    if args.rounds < 1 or not 0 <= args.warmup < 1 or args.history_tokens < 64:
        raise UsageError("need --rounds >= 1, 0 <= --warmup < 1 and --history-tokens >= 64")
    models = load_models(_bench_model(args))
    profile = load_profile(args.profile or f"profiles/{detect_gpu_type()}.json")
    tok, parts = models.tokenizer, {}
    for name in [p.strip() for p in args.parts.split(",") if p.strip()]:
        rng = random.Random(args.seed)
        if name == "f":
            parts[name] = repeating.repeating_jobs(tok, rng, args.scale)
        elif name == "b":
            parts[name] = repeating.chat_jobs(tok, rng, args.scale)
        elif name == "u":
            parts[name] = repeating.unique_chat_jobs(tok, rng, args.scale)
        else:
            raise UsageError(f"--parts: unknown part {name!r} (f, b, u)")
    res = {"gpu_type": profile.gpu_type, "target": models.target_name, "draft": models.draft_name, "policy": args.policy,
           "rounds": args.rounds, "warmup": args.warmup, "scale": args.scale, "history_tokens": args.history_tokens}
    with tqdm(total=2 * args.rounds * sum(len(j) for j in parts.values()), desc="history", unit="req") as bar:
        res["parts"] = repeating.bench_history(models, profile, args.policy, parts, args.rounds, args.warmup,
                                               args.history_tokens, bar)
    if args.replay:
        res["replay"] = repeating.replay_history(models, profile, args.policy, parts, args.history_tokens, args.warmup)
    _write_bench(args, "history", res, repeating.markdown(res))
    return 0


def _cmd_bench_proposal_width(args) -> int:
    from serve_app.bench.proposal_width import run

    return run(args.prompts, args.max_tokens, args.dtype, args.out)


def _cmd_selfcheck(args) -> int:
    from serve_app.selfcheck import SelfCheck, main_selfcheck

    try:
        cfg = SelfCheck(device=args.device, dtype=args.dtype, quick=args.quick)
    except ValidationError as e:
        raise UsageError(_first_error(e)) from None
    from serve_app.bench.campaign import STAGES, run_campaign

    names = None if args.checks is None else [c.strip() for c in args.checks.split(",") if c.strip()]
    stages = ([s.strip() for s in args.stages.split(",") if s.strip()] if args.stages is not None else list(STAGES)) \
        if args.full else []
    if unknown := [s for s in stages if s not in STAGES]:
        raise UsageError(f"--stages: unknown stage(s) {unknown}: use some of {', '.join(STAGES)}")
    if names == [] and not stages:
        raise UsageError("--checks '' runs no check: name some, or add --full for the campaign alone")
    rc = main_selfcheck(cfg, args.out, names) if names != [] else 0
    if stages:  # beside the checks' files: STEM-attention, -campaign, -profile.json, -context, -replay, -policies/
        run_campaign(args.device, args.dtype, args.quick, args.out, stages, args.deadline)
    return rc


def _app_config(args) -> dict:
    if args.config:
        import yaml

        try:
            with open(args.config) as f:
                return yaml.safe_load(f)["applications"][0].get("args", {})
        except (OSError, KeyError, IndexError, TypeError, yaml.YAMLError) as e:
            raise UsageError(f"cannot read Serve config {args.config}: {e}") from None
    return {
        "model": {"target": args.target, "draft": args.draft, "dtype": args.dtype, "device": args.device},
        "engine": {"policy": args.policy, "max_batch_size": args.batch_size, **_batching_config(args)},
        "max_queue": args.max_queue,
        "profiles_dir": args.profiles_dir,
        "drain_timeout_s": args.drain_timeout,
        "access_log": args.access_log,
        "router_in_ingress": not args.separate_router,
        "groups": [_gpu_group(args)],
    }


def _gpu_group(args) -> dict:
    """The one engine group of `serve`: on CUDA one GPU per role unless told (0.5 + 0.5 shares one)."""
    cuda = args.device.startswith("cuda")
    target = args.target_gpus if args.target_gpus is not None else (1.0 if cuda else 0.0)
    draft = args.draft_gpus if args.draft_gpus is not None else (1.0 if cuda and target >= 1 else target)
    return {"target_gpus": target, "draft_gpus": draft}


def _cmd_distill(args) -> int:
    from serve_app.drafting.distill import distill
    from serve_app.drafting.self_prompts import load_prompts
    from serve_app.models import load_target

    # --prompts: a whole number picks that many seed prompts; anything else names a JSONL file,
    # read (and checked) now, before the model loads.
    num_prompts, prompts = (int(args.prompts), None) if args.prompts.lstrip("-").isdigit() else (None, args.prompts)
    if prompts is not None:
        if not os.path.isfile(prompts):
            raise UsageError(f"--prompts {prompts}: no such file (give a number of seed prompts or a JSONL file of prompts)")
        try:
            prompts = load_prompts(prompts)
        except ValueError as e:
            raise UsageError(f"--prompts: {e}") from None
    if (args.layers < 1 or args.tokens < 16 or args.epochs < 1 or args.samples < 0 or args.self_prompts < 0
            or (num_prompts is not None and num_prompts < 0)):
        raise UsageError("--layers and --epochs must be >= 1, --prompts, --samples and --self-prompts >= 0, --tokens >= 16")
    if num_prompts == 0 and not args.self_prompts:
        raise UsageError("nothing to train on: --prompts 0 needs --self-prompts N")
    if args.samples and not 0 < args.temperature <= 2:
        raise UsageError("--temperature must be in (0, 2]")
    if args.steps < 1:
        raise UsageError("--steps must be >= 1")
    layers = None
    if args.feature_layers:
        try:
            layers = [int(x) for x in args.feature_layers.split(",")]
        except ValueError:
            raise UsageError(f"--feature-layers: expected comma-separated layer numbers, got {args.feature_layers!r}") from None
    if args.corpus is not None:
        return _distill_from_corpus(args, layers)
    if args.epochs != int(args.epochs):
        raise UsageError("--epochs: a whole number (fractional epochs only with --corpus)")
    args.epochs = int(args.epochs)
    target, tokenizer, name = load_target(args.target, args.dtype or "float32")
    if args.method == "eagle3":
        from serve_app.drafting.eagle3_train import distill_eagle3

        n = target.config.num_hidden_layers
        if layers is not None and (len(layers) != 3 or not all(0 <= i <= n for i in layers)):
            raise UsageError(f"--feature-layers: three layers in 0..{n} for this target")
        try:
            meta = distill_eagle3(target, tokenizer, name, args.out, num_prompts, args.samples, args.temperature,
                                  args.max_tokens, args.epochs, args.batch_size, args.lr, args.seed, args.tokens,
                                  args.steps, layers, prompts=prompts, self_prompts=args.self_prompts)
        except ValueError as e:  # e.g. no default feature layers for a shallow target
            raise UsageError(str(e)) from None
        print(f"EAGLE-3 draft written to {args.out} (per epoch: {meta['history']})")
        return 0
    meta = distill(target, tokenizer, name, args.out, args.layers, args.tokens, num_prompts, args.samples,
                   args.temperature, args.max_tokens, args.epochs, args.batch_size, args.lr, args.seed,
                   prompts=prompts, self_prompts=args.self_prompts)
    print(f"draft written to {args.out} (epoch losses {meta['losses']})")
    return 0


def _distill_from_corpus(args, layers: list[int] | None) -> int:
    import time

    from serve_app.drafting.eagle3_corpus import distill_from_corpus
    from serve_app.models import load_target

    if args.method != "eagle3":
        raise UsageError("--corpus trains an EAGLE-3 draft: add --method eagle3")
    if args.epochs <= 0 or args.batch_tokens < 16:
        raise UsageError("--epochs must be > 0 and --batch-tokens >= 16")
    target, tokenizer, name = load_target(args.target, args.dtype or "auto", args.device)
    deadline = time.time() + 3600 * args.max_hours if args.max_hours else None
    try:
        meta = distill_from_corpus(target, tokenizer, name, args.corpus, args.out, args.init, args.epochs,
                                   args.batch_tokens, args.lr, args.seed, args.tokens, args.steps, layers,
                                   generated_only=args.generated_only, limit_tokens=args.limit_tokens, deadline=deadline)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"EAGLE-3 draft written to {args.out} from {meta['generated_tokens']} corpus tokens "
          f"(history {meta['history']})")
    return 0


def _default_corpus(target: str) -> str:
    from serve_app.models import display_name

    return os.path.join("corpora", display_name(target).lower())


def _cmd_corpus(args) -> int:
    from pathlib import Path

    from serve_app.drafting.corpus import grow, read_manifest

    if args.corpus_command == "show":
        path = Path(args.dir or _default_corpus(EMBEDDED))
        manifest = read_manifest(path)
        if manifest is None:
            raise UsageError(f"{path} holds no corpus (no corpus.json)")
        print(json.dumps({k: manifest[k] for k in ("target", "settings", "rounds", "totals", "runs")}, indent=1))
        return 0
    if args.tokens < 1 or args.max_batch < 1:
        raise UsageError("--tokens and --max-batch must be >= 1")
    from serve_app.models import LoadedModels, load_target

    target, tokenizer, name = load_target(args.target, args.dtype, args.device)
    models = LoadedModels(target, None, tokenizer, name, "none")
    out = args.out or _default_corpus(args.target)
    try:
        manifest = grow(models, out, args.tokens, max_batch=args.max_batch, max_rounds=args.max_rounds)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run, totals = manifest["runs"][-1], manifest["totals"]
    print(f"{out}: +{run['tokens_added']} generated tokens in {run['seconds']:.0f}s ({run['tokens_per_s']} tokens/s); "
          f"now {totals['sequences']} sequences, {totals['generated_tokens']} generated tokens, "
          f"{totals['bytes'] / 1e6:.1f} MB; kinds {totals['kinds']}")
    return 0


def _cmd_profile(args) -> int:
    from serve_app.profiling.profiler import plot_profile, run_profile

    if sum(map(bool, (args.predict, args.check_prediction, args.acceptance_only, args.copies_only,
                      args.chunk_context_only))) > 1:
        raise UsageError("--predict, --check-prediction, --acceptance-only, --copies-only and --chunk-context-only are "
                         "different runs: pass one")
    if (args.acceptance_rate is not None or args.acceptance_from) and not args.predict:
        raise UsageError("--acceptance-rate / --acceptance-from only go with --predict (a measured profile measures it)")
    if args.context is not None and args.context < 0:
        raise UsageError("--context must be >= 0")
    if args.check_prediction:
        from serve_app.bench.rounds import RESULTS_DIR, write_results
        from serve_app.profiling.profiles import load_profile
        from serve_app.profiling.roofline import check_for

        stem = args.out or str(RESULTS_DIR / f"predict-check-{load_profile(args.check_prediction).gpu_type}")
        data, markdown = check_for(args.check_prediction, args.target, args.draft, args.context)
        print(markdown)
        json_path, md_path = write_results(stem, data, markdown)
        print(f"results: {json_path}, {md_path}")
        return 0
    sizes = sorted(set(int_list(args.batch_sizes, "--batch-sizes")))
    if not sizes or sizes[0] < 1 or not 1 <= args.max_k <= 32 or args.reps < 1 or args.prompts < 1 or args.max_tokens < 1:
        raise UsageError("need batch sizes >= 1, 1 <= --max-k <= 32, and --reps, --prompts, --max-tokens >= 1")
    if args.agree < 0 or (args.max_reps is not None and args.max_reps < args.reps):
        raise UsageError("--agree must be >= 0 and --max-reps at least --reps")
    if args.copy_ks == "auto":
        from serve_app.profiling.profiler import copy_ks_for

        copy_ks = copy_ks_for(args.max_k, EngineConfig.model_fields["max_copy_tokens"].default)
    else:
        copy_ks = sorted(set(int_list(args.copy_ks, "--copy-ks"))) if args.copy_ks.strip() else []
        if copy_ks and copy_ks[0] <= args.max_k:
            raise UsageError(f"--copy-ks must lie past --max-k {args.max_k}")
    if args.predict:
        from pathlib import Path

        from serve_app.profiling.profiles import save_profile
        from serve_app.profiling.roofline import predict_for

        # auto: bfloat16, which every GPU in the spec table computes natively
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        context = 512 if args.context is None else args.context  # a prompt of a few hundred tokens and some output
        profile = predict_for(args.predict, args.target, args.draft, dtype, context, args.max_k, sizes,
                              args.acceptance_rate, args.acceptance_from)
        path = Path(args.out or f"profiles/{profile.gpu_type}.json")
        save_profile(profile, path)
        plot_profile(profile, path.with_suffix(".png"))
        print(f"PREDICTED profile for {profile.gpu_type} written to {path} (heatmap {path.with_suffix('.png')}); "
              "a measured profile replaces it")
    elif args.copies_only:
        from serve_app.profiling.profiler import remeasure_copies

        mc = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)
        try:
            profile, path, found = remeasure_copies(mc, args.out, copy_ks, args.reps)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(str(e)) from None
        g = profile.latency
        print(f"verification at k = {g.copy_ks} added to {path} (scaled by {[round(f, 3) for f in found['factors']]}):")
        for b, row, top in zip(g.batch_sizes, g.copy_verify_ms, g.verify_ms):
            print(f"  batch {b}: k = {g.ks[-1]} {top[-1]:.1f} ms, " + ", ".join(f"k = {k} {v:.1f} ms" for k, v in zip(g.copy_ks, row)))
        return 0
    elif args.chunk_context_only:
        from serve_app.profiling.profiler import remeasure_chunk_context

        mc = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)
        try:
            profile, path, found = remeasure_chunk_context(mc, args.out, args.context or 2048)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(str(e)) from None
        a, b = profile.latency.chunk_context_ms
        n = found["budget"]
        print(f"chunk context price added to {path}: a chunk of n tokens after s held pays s x ({a:.5f} + {b:.7f} n) ms "
              f"(a {n}-token chunk after 2,048 tokens: {2048 * (a + b * n):.1f} ms more than at the start, "
              f"{profile.latency.chunk_ms(1, n):.1f} ms)")
        return 0
    elif args.acceptance_only:
        from serve_app.profiling.profiler import remeasure_acceptance

        mc = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)
        try:
            profile, path = remeasure_acceptance(mc, args.out, args.prompts, args.max_tokens)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(str(e)) from None
        print(f"acceptance of {path} measured again; its latency grid kept (confidence curve {profile.confidence_curve})")
    else:
        mc = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device)
        profile, path = run_profile(mc, args.out, sizes, args.max_k, args.reps, args.prompts, args.max_tokens, copy_ks,
                                    args.agree or None, args.max_reps or 3 * args.reps)
        print(f"profile for {profile.gpu_type} written to {path} (heatmap {path.with_suffix('.png')})")
    print(f"acceptance per position {profile.acceptance}, fitted rate {profile.acceptance_rate}")
    print("best k by batch size: " + ", ".join(f"{b}: {k}" for b, k in profile.best_k.items()))
    return 0


def _cmd_serve(args) -> int:
    from deployments.local import run_forever

    from pydantic import ValidationError as PydanticError

    try:
        run_forever(_app_config(args), args.host, args.port, args.metrics_port)
    except PydanticError as e:
        raise UsageError(_first_error(e)) from None
    return 0


def _cmd_chaos(args) -> int:
    from serve_app.bench.chaos import chaos
    from serve_app.bench.rounds import default_stem, write_results

    if args.users < 1 or args.max_tokens < 1 or args.interval <= 0 or args.soak_minutes < 0 or args.burst < 0 \
            or not 0 < args.load <= 1.5:
        raise UsageError("need --users >= 1, --max-tokens >= 1, --interval > 0, --soak-minutes >= 0, --burst >= 0, "
                         "0 < --load <= 1.5")
    stem = str(args.out or default_stem("chaos"))
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    results, markdown = chaos(_bench_model(args), args.policy, args.users, args.max_tokens, args.interval, args.port,
                              args.soak_minutes, args.load, args.burst, args.capacity_s, stem)
    print("\n" + markdown)
    json_path, md_path = write_results(stem, results, markdown)
    print(f"results: {json_path}, {md_path}")
    return 0


def _simulated_policies(policies: list[str]) -> None:
    """The fleet simulators model one k per step: a per-row policy is refused up front, not run wrong."""
    from serve_app.engine.policy import PER_ROW_POLICIES

    if set(policies) & set(PER_ROW_POLICIES):
        raise UsageError("simulate models one k per step for the whole batch; `budget` (a length per row) is "
                         "modelled by the row-aware replay: `specserve bench replay`, or `simulate --validate`")


def _cmd_simulate(args) -> int:
    from serve_app.profiling.profiles import load_profiles
    from serve_app.sim.run import run_simulations
    from serve_app.sim.simulate import read_trace

    if args.validate:
        return _cmd_simulate_validate(args)
    args.out = args.out or "out/simulate"
    if not args.fleet:
        raise UsageError("need --fleet TYPE:N[,...] (or --validate)")
    try:
        fleet = {t: int(n) for t, _, n in (part.rpartition(":") for part in args.fleet.split(","))}
    except ValueError:
        raise UsageError("--fleet: TYPE:N[,TYPE:N...], e.g. cpu-2core:4,NVIDIA_A100:2") from None
    if not fleet or any(not t or n < 1 for t, n in fleet.items()) or (args.shape is None) == (args.trace is None):
        raise UsageError("need --fleet TYPE:N[,...] with N >= 1, and exactly one of --shape or --trace")
    profiles = load_profiles(args.profiles)
    if args.tick <= 0:
        raise UsageError("--tick must be > 0 seconds")
    kwargs = {"prompt_tokens": _token_range(args.prompt_tokens, "--prompt-tokens"),
              "output_tokens": _token_range(args.output_tokens, "--output-tokens"), "max_batch": args.max_batch,
              "seed": args.seed, "route": args.route, "engine": args.engine, "tick_s": args.tick}
    if args.trace:
        kwargs["trace"] = read_trace(args.trace)
    else:
        shape = _load_shape(args.shape)
        nominal = shape.nominal_s()
        duration = args.duration or nominal
        kwargs.update(users_at=lambda t: shape.users_at(t * nominal / duration) * args.users_scale, duration_s=duration)
    policies = [p.strip() for p in (args.policy or "none,fixed:1,fixed:2,lut,adaptive").split(",") if p.strip()]
    _simulated_policies(policies)
    try:
        _, markdown = run_simulations(fleet, profiles, policies, args.out, **kwargs)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print("\n" + markdown + f"\nwritten to {args.out}/")
    return 0


def _token_range(text: str, flag: str) -> "int | tuple[int, int]":
    """N, or LOW-HIGH (drawn uniformly per request)."""
    low, _, high = text.partition("-")
    try:
        out = (int(low), int(high)) if high else int(low)
    except ValueError:
        raise UsageError(f"{flag}: N or LOW-HIGH, e.g. 64 or 16-128") from None
    values = out if isinstance(out, tuple) else (out, out)
    if values[0] < 1 or values[1] < values[0]:
        raise UsageError(f"{flag}: need 1 <= LOW <= HIGH")
    return out


def _cmd_simulate_validate(args) -> int:
    from serve_app.bench.rounds import default_stem
    from serve_app.bench.simcheck import validate
    from serve_app.models import load_models

    policies = [p.strip() for p in (args.policy or "none,fixed:1,fixed:2,fixed:4,fixed:8,lut,adaptive,budget").split(",")
                if p.strip()]  # budget too: the row-aware replay models it (the one-k simulator leaves it out)
    if args.fleet or args.shape or args.trace or args.tolerance <= 0 or args.tie < 0 or args.scale <= 0 or args.repeat < 1:
        raise UsageError("--validate runs its own schedule on this machine: no --fleet, --shape or --trace; "
                         "--tolerance and --scale > 0, --tie >= 0, --repeat >= 1")
    mc = _bench_model(args)
    profile = find_profile(args.profile, mc)
    out = args.out or str(default_stem("simulate-validate" + ("" if args.part == "b" else f"-{args.part}")))
    _, markdown, passed = validate(load_models(mc), profile, policies, out, args.scale, args.seed, args.repeat,
                                   args.tolerance, args.tie, calibrate=args.calibrate, part=args.part)
    print("\n" + markdown + f"\nwritten to {out}/")
    return 0 if passed else 1


def _load_shape(name: str):
    """A Locust load shape from the repository's loadtest/ (beside serve_app/; needs locust)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path and os.path.isdir(os.path.join(repo, "loadtest")):
        sys.path.append(repo)
    try:
        from loadtest.shapes import load_shape
    except ImportError as e:
        raise UsageError(f"--shape needs the repository's loadtest/ and locust (make install): {e}") from None
    try:
        return load_shape(name)()
    except ValueError as e:
        raise UsageError(str(e)) from None


def _connect(address: str) -> None:
    """Join a running Ray cluster as a driver (drain, breakdown)."""
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as e:
        raise UsageError(f"no running Ray cluster at {address}: {e}") from None


def _cmd_drain(args) -> int:
    from deployments.local import drain

    _connect(args.address)
    left = drain(args.timeout, args.app)
    print(f"drained: {left} requests still in flight")
    return 0 if left == 0 else 1


def _cmd_breakdown(args) -> int:
    import json

    from deployments.local import breakdown

    _connect(args.address)
    groups = breakdown(args.window, args.app)
    if args.json:
        print(json.dumps(groups, indent=2))
        return 0
    for name, b in groups.items():
        print(format_breakdown(name, b))
    return 0


def format_breakdown(group: str, b: dict) -> str:
    """A Router.breakdown as lines of text: the step, then each part of it, in ms per step."""
    if "error" in b:
        return f"group {group}: {b['error']}"
    if not b["steps"]:
        return f"group {group}: no steps in the window"
    lines = [f"group {group}: {b['steps']} steps, {b['tokens']} tokens, {b['step_ms']:.1f} ms a step"]
    for role in ("target", "draft"):
        w = b.get(role)
        if w is None:
            continue
        if "forward_ms" not in w:
            lines.append(f"  {role:<7} wait {w['wait_ms']:7.1f}  (worker not answering)")
            continue
        lines.append(f"  {role:<7} wait {w['wait_ms']:7.1f} = forward {w['forward_ms']:.1f} + vocabulary {w['sample_ms']:.1f}"
                     f" + rest of call {w['call_other_ms']:.1f} + hops {w['hops_ms']:.1f}  ({w['calls_per_step']:.2f} calls)")
        if w.get("ahead_ms"):
            lines.append(f"          looked ahead {w['ahead_ms']:.1f} ms a step, {w['ahead_hits']:.0%} of steps answered from it "
                         "(hops net of the overlap)")
    lines.append(f"  router  {b['router_ms']:7.1f}   gap between steps {b['gap_ms']:.1f}")
    return "\n".join(lines)


def _cmd_profiles_push(args) -> int:
    from serve_app.profiling.profiles import load_profile

    profile = load_profile(args.file)  # a malformed file fails here, before touching the service
    import ray
    from ray import serve

    try:
        # a driver already connected (a notebook, a test) pushes over its own connection
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False, ignore_reinit_error=True)
        version = serve.get_deployment_handle("ProfileStore", app_name=args.app).push.remote(profile.model_dump()).result()
    except ConnectionError as e:
        raise UsageError(f"no running Ray cluster at {args.address}: {e}") from None
    except ValueError as e:  # refused by the store (a predicted profile where a measured one is held): its message
        raise UsageError(f"{args.file} not pushed: {getattr(e, 'cause', e)}") from None
    print(f"{profile.source} profile for {profile.gpu_type} is now version {version}; routers pick it up within seconds")
    return 0


def find_profile(path: str | None, mc: ModelConfig):
    """The profile at `path`, else profiles/<this hardware type>.json; checked against the model pair."""
    from serve_app.models import model_names, resolve_dtype
    from serve_app.hardware import detect_gpu_type
    from serve_app.profiling.profiles import load_profile

    path = path or f"profiles/{detect_gpu_type()}.json"
    if not os.path.isfile(path):
        raise UsageError(f"no profile at {path}: run `specserve profile` on this machine first (or pass --profile)")
    profile = load_profile(path)
    profile.check_pair(*model_names(mc), resolve_dtype(mc.dtype, mc.device))
    return profile


def _cmd_bench_policies(args) -> int:
    from serve_app.bench.policies import bench_policies
    from serve_app.engine.policy import make_policy, needs_profile
    from serve_app.bench.rounds import default_stem
    from serve_app.models import load_models

    cs = sorted(set(int_list(args.concurrency, "--concurrency")))
    if (not cs or cs[0] < 1 or not 1 <= args.max_k <= 8 or args.scale <= 0 or not set(args.parts) <= set("abcde")
            or args.repeat < 1):
        raise UsageError("need concurrencies >= 1, 1 <= --max-k <= 8, --scale > 0, --repeat >= 1 and --parts from a-e")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    for p in policies or []:
        if not needs_profile(p):
            make_policy(p)  # unknown specs fail before any model loads
    if policies is not None and not any(p.startswith("fixed:") for p in policies):
        raise UsageError("--policies needs at least one fixed:K (every ratio is against the best fixed k)")
    mc = _bench_model(args)
    profile = find_profile(args.profile, mc)
    out = args.out or str(default_stem("bench-policies"))
    bench_policies(load_models(mc), profile, out, cs, args.max_k, args.scale, args.seed, args.parts, args.repeat,
                   policies)
    print(open(os.path.join(out, "summary.md")).read())
    return 0


def _cmd_bench_http(args) -> int:
    from serve_app.bench.http import bench_http

    if args.policy in ("lut", "adaptive") or args.rounds < 1:
        raise UsageError("bench http runs the same k on both sides: --policy none or fixed:K; --rounds >= 1")
    _write_bench(args, "http", *bench_http(_bench_model(args), args.policy, args.max_tokens, args.concurrency,
                                            args.requests, args.port, args.rounds))
    return 0


def _cmd_bench_linears(args) -> int:
    from serve_app.bench.linears import bench_linears

    if args.rounds < 1 or args.layers < 1:
        raise UsageError("--rounds and --layers >= 1")
    _write_bench(args, "linears", *bench_linears(int_list(args.rows, "--rows"), args.rounds, args.layers))
    return 0


def _cmd_bench_peer(args) -> int:
    import tempfile
    from pathlib import Path

    from serve_app.bench.peer import SIDES, bench_peer, parse_side
    from serve_app.models import DTYPES, embedded_source

    sides, modes = args.sides.split(","), args.modes.split(",")
    kinds = [parse_side(s, args.dtype) for s in sides]
    if not all(k in SIDES and (d == "auto" or d in DTYPES) for k, d in kinds) or not set(modes) <= {"greedy", "sampled"} \
            or args.rounds < 1 or args.max_tokens < 1:
        raise UsageError(f"--sides from {', '.join(SIDES)} (each may add @DTYPE); --modes greedy,sampled; --rounds, --max-tokens >= 1")
    with tempfile.TemporaryDirectory(prefix="specserve-peer-") as work:
        _write_bench(args, "peer", *bench_peer(embedded_source(), args.vllm_python, int_list(args.concurrency, "--concurrency"),
                                                args.rounds, args.max_tokens, modes, args.dtype, sides, Path(work),
                                                args.requests_per_level))
    return 0


if __name__ == "__main__":
    sys.exit(entry())
