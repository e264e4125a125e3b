"""`specserve bench peer`'s pure parts: the command each side runs (a side may name its own dtype) and the report's
paired ratios, against each peer and against the fastest peer configuration at each level."""

from pathlib import Path

from serve_app.bench.peer import parse_side, report, side_command


def test_a_side_may_serve_in_its_own_dtype():
    assert parse_side("vllm", "bfloat16") == ("vllm", "bfloat16")
    assert parse_side("vllm@float32", "bfloat16") == ("vllm", "float32")
    cmd = side_command("vllm-ngram@float32", Path("/m"), "bfloat16", 8001, "/venv/python", 32)
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--speculative-config" in cmd
    ours = side_command("specserve-none", Path("/m"), "bfloat16", 8002, "", 32)
    assert ours[ours.index("--dtype") + 1] == "bfloat16" and ours[-2:] == ["--policy", "none"]
    assert "--separate-router" not in ours and side_command("specserve-separate", Path("/m"), "bfloat16", 8003, "", 32)[-1] == "--separate-router"


def _run(side, c, r, tps):
    return {"round": r, "side": side, "mode": "greedy", "concurrency": c, "tokens_per_s": tps,
            "mean_latency_s": 100 / tps, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "itl_p50_s": 1 / tps, "itl_p90_s": 2 / tps}


def test_the_report_pairs_each_side_with_the_fastest_peer_at_each_level():
    speeds = {("specserve", 1): 20, ("specserve", 8): 90, ("vllm", 1): 10, ("vllm", 8): 30,
              ("vllm@float32", 1): 8, ("vllm@float32", 8): 60}
    runs = [_run(s, c, r, v * (1 + r / 10)) for (s, c), v in speeds.items() for r in range(3)]
    text = report({"model": "m", "dtype": "bfloat16", "max_tokens": 8, "rounds": 3, "modes": ["greedy"],
                   "sides": ["specserve", "vllm", "vllm@float32"], "concurrencies": [1, 8], "runs": runs})
    best = text.split("| ours / best peer |")[1]
    assert "| specserve | 1 | vllm | 2.000x" in best  # bfloat16 vLLM is the faster one at 1 in flight
    assert "| specserve | 8 | vllm@float32 | 1.500x" in best  # float32 at 8
    assert "| specserve / vllm | 8 | 3.000x" in text


def test_a_servers_levels_never_ask_a_question_twice():
    from serve_app.bench.peer import PEER_PROMPTS, level_prompts

    for r in range(3):
        asks = level_prompts([1, 8, 32], r)
        assert [len(a) for a in asks] == [1, 8, 32]
        flat = [q for a in asks for q in a]
        assert len(set(flat)) == len(flat) == 41 and set(flat) <= set(PEER_PROMPTS)
    assert level_prompts([1], 0) != level_prompts([1], 1)  # rounds start at different questions
