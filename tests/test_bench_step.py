"""`bench step`: real shapes built small, one step's time split, in process and through Ray actors."""

import json

import pytest
import torch

from serve_app.bench.shapes import (SHAPES, eagle3_layers, random_eagle3, random_llama, random_prompts,
                                    save_eagle3_dir, save_model_dir, vocab_tokenizer)
from serve_app.bench.step import StepBench, bench_step, plot_step, run_inprocess, step_markdown

FIELDS = {"run", "batch", "mix", "k", "step_ms", "forward_ms", "other_device_ms", "outside_ms", "kb_per_step",
          "tokens_per_step"}
TINY = StepBench(shape="tiny-128k", layers=1, batch_sizes=[2], k=2, mixes=["greedy", "seeded"], steps=2, warmup=1,
                 prompt_tokens=8, dtype="float32")

def test_shapes_table_has_the_real_configs():
    big, small, tiny = SHAPES["llama-3.1-8b"], SHAPES["llama-3.2-1b"], SHAPES["tiny-128k"]
    assert (big.hidden_size, big.num_attention_heads, big.num_key_value_heads, big.intermediate_size,
            big.vocab_size, big.rope_theta, big.tie_word_embeddings) == (4096, 32, 8, 14336, 128256, 500000.0, False)
    assert (small.hidden_size, small.intermediate_size, small.tie_word_embeddings) == (2048, 8192, True)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.vocab_size) == (32, 4, 2, 128256)


def test_peaked_head_makes_sharp_distributions_and_eagle3_layers_fit():
    model = random_llama(SHAPES["tiny-128k"], 1, peaked=8.0)
    with torch.no_grad():
        logits = model(torch.tensor(random_prompts(1, 6, 128256))).logits
    assert 6 < logits.std() < 10 and logits.softmax(-1).max(-1).values.mean() > 0.2
    assert eagle3_layers(32) == [2, 16, 29] and eagle3_layers(2) == [0, 1, 2] and eagle3_layers(4) == [0, 2, 4]


def test_quiet_deep_layers_let_a_truncated_draft_agree_at_any_depth():
    from serve_app.models import truncated_draft

    ids = torch.tensor(random_prompts(2, 32, 128256))

    def agree(target) -> float:
        with torch.no_grad():
            return (target(ids).logits.argmax(-1) == truncated_draft(target, 1)(ids).logits.argmax(-1)).float().mean()

    # unscaled, every random layer moves the residual stream: a deep target's first layer almost never agrees
    assert agree(random_llama(SHAPES["tiny-128k"], 16)) < 0.2
    quiet = random_llama(SHAPES["tiny-128k"], 16, quiet_from=1)
    assert agree(quiet) > 0.6 and agree(random_llama(SHAPES["tiny-128k"], 4, quiet_from=1)) > 0.6
    assert quiet.model.layers[0].mlp.down_proj.weight.std() > 5 * quiet.model.layers[1].mlp.down_proj.weight.std()


def test_saved_shapes_load_as_the_actors_load_them(tmp_path):
    from serve_app.models import load_draft, load_target

    target = random_llama(SHAPES["tiny-128k"], 2)
    tok = vocab_tokenizer(128256)
    assert len(tok) == 128256 and tok.decode([3, 128255]) == "t3 t128255"
    save_model_dir(target, tok, tmp_path / "t")
    save_eagle3_dir(random_eagle3(target), target, tmp_path / "e")
    loaded, ltok, _ = load_target(str(tmp_path / "t"), "float32")
    draft = load_draft(str(tmp_path / "e"), loaded, ltok)
    assert draft.feature_layers == [0, 1, 2] and draft.token_ids.numel() == 32000


def test_inprocess_run_reports_every_field():
    rows = run_inprocess(TINY)
    assert [(r["batch"], r["mix"]) for r in rows] == [(2, "greedy"), (2, "seeded")]
    for r in rows:
        assert FIELDS <= set(r) and r["run"] == "inprocess" and r["kb_per_step"] is None
        assert len(r["step_ms"]["rounds"]) == 2 and r["step_ms"]["median"] > 0
        assert r["outside_ms"]["median"] <= r["step_ms"]["median"]
        assert r["tokens_per_step"] == 1.0  # a random peaked draft: every draft rejected


def test_markdown_and_plot_show_both_runs(tmp_path):
    rows = run_inprocess(TINY.model_copy(update={"mixes": ["greedy"], "steps": 1}))
    rows += [{**r, "run": "ray", "kb_per_step": {"median": 2.0, "spread": 0.1},
              "outside_ratio": {"median": 3.0, "min": 2.5, "max": 4.0}} for r in rows]
    res = {**TINY.model_dump(), "mixes": ["greedy"], "runs": ["inprocess", "ray"], "draft_shape": "tiny-128k",
           "rows": rows}
    md = step_markdown(res)
    assert "## inprocess" in md and "## ray" in md and "| 2 | greedy |" in md and "3.00x (2.50-4.00)" in md
    assert plot_step(res, tmp_path / "step.png").stat().st_size > 1000


@pytest.mark.integration
def test_ray_run_counts_bytes_and_cli_writes_files(tmp_path, capsys):
    """One small case through real worker actors (local Ray), via the CLI: json, md and png."""
    import inspect

    from deployments.workers import RemoteWorker

    assert "count_bytes" in inspect.signature(RemoteWorker).parameters  # renamed: fail here, never skip
    from serve_app.cli import main

    stem = tmp_path / "step"
    assert main(["bench", "step", "--shape", "tiny-128k", "--layers", "1", "--batch-sizes", "2", "--k", "2",
                 "--mixes", "top_p09", "--steps", "2", "--warmup", "1", "--prompt-tokens", "8", "--dtype", "float32",
                 "--out", str(stem)]) == 0
    res = json.loads(stem.with_suffix(".json").read_text())
    ray_row = next(r for r in res["rows"] if r["run"] == "ray")
    assert ray_row["kb_per_step"]["median"] > 0 and len(ray_row["outside_ratio"]["rounds"]) == 2
    assert stem.with_suffix(".md").exists() and stem.with_suffix(".png").exists()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        StepBench(mixes=["nucleus"])
    with pytest.raises(ValueError):
        StepBench(draft="ngram")
    with pytest.raises(ValueError, match="unknown run"):
        bench_step(TINY, runs=["gpu"])
