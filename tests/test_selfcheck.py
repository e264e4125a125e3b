"""`specserve selfcheck`: runs with torch + transformers alone, writes its results, exits 1 on any failure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_app import selfcheck
from serve_app.cli import main

ROOT = Path(__file__).resolve().parent.parent
# What a bare GPU box lacks: importing any of them fails in the child, so a stray import is caught.
BLOCKED = "ray", "matplotlib", "gguf", "openai", "fastapi"


@pytest.mark.slow  # ~2 min: every check and stage in a child process; CI runs it with the slow tier
def test_quick_cpu_campaign_passes_without_ray_or_matplotlib(tmp_path):
    """The GPU campaign's command (`selfcheck --full`) with --device cpu --quick: every check, then every stage
    (attention, profile, its context axis, the replay on it, policies), each with its results files."""
    stem = tmp_path / "selfcheck-cpu"
    code = (f"import sys; sys.modules.update(dict.fromkeys({BLOCKED!r})); from serve_app.cli import main; "
            f"sys.exit(main(['selfcheck', '--device', 'cpu', '--quick', '--full', '--out', {str(stem)!r}]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECSERVE_AUTO_DTYPE": "bfloat16"})  # the low-precision path, as on a GPU
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(stem.with_suffix(".json").read_text())
    assert [c["check"] for c in res["checks"]] == list(selfcheck.CHECKS) and res["passed"]
    assert res["dtype"] == "bfloat16" and res["torch"] == torch.__version__ and "provenance" in res
    for name in selfcheck.CHECKS:
        assert f"PASS {name}" in run.stdout
    md = stem.with_suffix(".md").read_text()
    assert "| greedy | PASS |" in md and "All checks passed." in md
    bench = json.loads((tmp_path / "selfcheck-cpu-attention.json").read_text())
    assert {b for c in bench["cases"] for b in c["backends"]} == {"gather", "gather-sdpa", "flex"}
    assert all(b["max_abs_diff"] < 1e-4 for c in bench["cases"] for b in c["backends"].values())
    campaign = json.loads((tmp_path / "selfcheck-cpu-campaign.json").read_text())
    grid = campaign["profile"]["latency"]
    assert grid["batch_sizes"] == [1, 4] and all(v > 0 for row in grid["verify_ms"] for v in row)
    assert grid["copy_ks"]  # a copy's verification past the grid, measured with it
    # the context stage measured the axis and put it into the saved profile, which the replay then priced with
    context = json.loads((tmp_path / "selfcheck-cpu-context.json").read_text())["grid"]
    saved = json.loads((tmp_path / "selfcheck-cpu-profile.json").read_text())["latency"]
    assert saved["context"] == context and len(context["contexts"]) == 2
    replay = json.loads((tmp_path / "selfcheck-cpu-replay.json").read_text())
    assert set(replay["parts"]["e"]["policies"]) == {"fixed:1", "fixed:2", "budget"}
    cells = json.loads((tmp_path / "selfcheck-cpu-replay-grid.json").read_text())["grid"]["cells"]
    assert [(c["batch"], c["context"]) for c in cells] == [(2, 128)]
    policies = json.loads((tmp_path / "selfcheck-cpu-policies" / "results.json").read_text())
    assert set(policies["uniform"]["4"]) == {"none", "fixed:1", "fixed:2", "lut", "adaptive"}
    assert (tmp_path / "selfcheck-cpu-policies" / "summary.md").is_file()


def test_a_failing_check_makes_it_exit_1_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("device lost\nsecond line")

    monkeypatch.setitem(selfcheck.CHECKS, "sampled", lambda ctx: (False, "broken on purpose", {}))
    monkeypatch.setitem(selfcheck.CHECKS, "profile", broken)
    stem = tmp_path / "sc"
    assert main(["selfcheck", "--device", "cpu", "--quick", "--checks", "sampled,profile,greedy", "--out", str(stem)]) == 1
    out = capsys.readouterr().out
    assert "FAIL sampled" in out and "broken on purpose" in out
    assert "FAIL profile" in out and "RuntimeError: device lost" in out and "second line" not in out
    assert "PASS greedy" in out  # after two failures
    res = json.loads(stem.with_suffix(".json").read_text())
    assert not res["passed"] and "Traceback" in res["checks"][1]["traceback"]
    assert "**FAIL**" in stem.with_suffix(".md").read_text()


def test_bad_settings_exit_2(tmp_path, capsys):
    assert main(["selfcheck", "--device", "cpu", "--checks", "nope", "--out", str(tmp_path / "x")]) == 2
    assert main(["selfcheck", "--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        assert main(["selfcheck", "--device", "cuda"]) == 2
        assert "--device cpu" in capsys.readouterr().err


def test_campaign_stages_run_apart_and_a_deadline_skips_the_rest(tmp_path, capsys):
    """A lent GPU's minutes are few: stages run on their own (a later one reads the profile an earlier run saved),
    and a stage that would start past --deadline is skipped, said, and leaves no files."""
    stem = str(tmp_path / "sc")
    base = ["selfcheck", "--device", "cpu", "--quick", "--full", "--checks", "", "--out", stem]
    assert main([*base, "--stages", "context"]) == 2  # no profile yet: refused, not a crash
    assert "run the campaign's profile stage first" in capsys.readouterr().err
    assert not (tmp_path / "sc-context.json").exists()
    assert main([*base, "--stages", "profile"]) == 0
    assert not (tmp_path / "sc.json").exists()  # --checks '': the campaign alone
    assert (tmp_path / "sc-profile.json").is_file() and not (tmp_path / "sc-context.json").exists()
    assert main([*base, "--stages", "context,replay", "--deadline", "0"]) == 0
    assert "context skipped" in capsys.readouterr().err and not (tmp_path / "sc-context.json").exists()
    assert main([*base, "--stages", "replay"]) == 0  # on the saved profile
    assert (tmp_path / "sc-replay.json").is_file()
    assert main([*base, "--stages", "profile,nope"]) == 2
    assert main(["selfcheck", "--device", "cpu", "--checks", "", "--out", stem]) == 2  # nothing to run


def test_the_attention_backend_can_be_named_for_a_whole_process(monkeypatch):
    from serve_app.engine import attention

    assert attention.choose("auto", "cpu") == "gather"
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "flex")
    assert attention.choose("auto", "cpu") == "flex"
    assert attention.choose("gather", "cpu") == "gather"  # a config's explicit choice wins
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="auto or one of"):
        attention.choose("auto", "cpu")
