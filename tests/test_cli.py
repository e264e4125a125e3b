"""`specserve generate` on saved tiny models: output format, losslessness, and every bad input."""

import json
import subprocess
import sys

import pytest

from serve_app.cli import main


def write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def run(tmp_path, dirs, lines, *extra, draft=True):
    prompts = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "new_dir" / "out.jsonl"  # the CLI creates missing parent directories
    args = ["generate", "--prompts", prompts, "--out", str(out), "--target", dirs["target"], *extra]
    if draft and "--draft" not in extra:
        args += ["--draft", dirs["draft"]]
    code = main(args)
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return code, rows


GOOD = [
    {"prompt": "the cat sat on the mat"},
    {"messages": [{"role": "user", "content": "the dog ran"}]},
    {"prompt": "a big red dog", "max_tokens": 5},
]


def test_generate_writes_one_line_per_prompt_in_order(tmp_path, tiny_model_dirs):
    code, rows = run(tmp_path, tiny_model_dirs, GOOD, "--max-tokens", "12", "--batch-size", "2")
    assert code == 0 and len(rows) == 3
    for row in rows:
        assert set(row) >= {"text", "token_ids", "stats", "finish_reason"}
        assert row["stats"]["generated_tokens"] == len(row["token_ids"])
    assert len(rows[2]["token_ids"]) <= 5


@pytest.mark.parametrize("policy", ["fixed:1", "fixed:3", "fixed:7"])
def test_speculation_does_not_change_greedy_output(tmp_path, tiny_model_dirs, policy):
    _, plain = run(tmp_path, tiny_model_dirs, GOOD, "--max-tokens", "16", "--policy", "none")
    code, spec = run(tmp_path, tiny_model_dirs, GOOD, "--max-tokens", "16", "--policy", policy, "--batch-size", "2")
    assert code == 0
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    assert sum(r["stats"]["proposed"] for r in spec) > 0


def test_bad_lines_fail_alone_with_line_numbers(tmp_path, tiny_model_dirs, capsys):
    lines = [
        GOOD[0],
        {"prompt": "   "},
        "{not json",
        {"prompt": "the cat " * 40},
        {"messages": []},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "the cat", "colour": "red"},
        GOOD[1],
    ]
    code, rows = run(tmp_path, tiny_model_dirs, lines, "--max-model-len", "64", "--max-tokens", "8")
    err = capsys.readouterr().err
    assert code == 1 and len(rows) == 8
    assert "text" in rows[0] and "text" in rows[7]
    assert [("error" in r) for r in rows] == [False, True, True, True, True, True, True, False]
    assert "in.jsonl:2: prompt is empty" in err
    assert "in.jsonl:3: malformed JSON" in err
    assert "in.jsonl:4: prompt has" in err and "context limit is 64" in err
    assert "in.jsonl:5: 'messages' must be a non-empty list" in err
    assert "in.jsonl:6: max_tokens" in err
    assert "in.jsonl:7: unknown field(s) ['colour']" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "sometimes"], "unknown policy 'sometimes'"),
        (["--policy", "fixed:x"], "fixed needs a whole number"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--batch-size", "0"], "max_batch_size"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, tiny_model_dirs, capsys, extra, message):
    code, _ = run(tmp_path, tiny_model_dirs, GOOD, *extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_unusable_files_and_models_exit_2(tmp_path, tiny_model_dirs, capsys):
    assert main(["generate", "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot read prompts file" in capsys.readouterr().err
    empty = write(tmp_path / "empty.jsonl", [""])
    assert main(["generate", "--prompts", empty, "--out", str(tmp_path / "o")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    code, _ = run(tmp_path, tiny_model_dirs, GOOD, "--target", str(tmp_path / "nowhere"))
    assert code == 2 and "no such model directory" in capsys.readouterr().err


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny_model_dirs, capsys):
    code, _ = run(tmp_path, tiny_model_dirs, GOOD, "--policy", "fixed:2", "--draft", tiny_model_dirs["other_vocab"])
    err = capsys.readouterr().err
    assert code == 2 and "draft tokenizer differs from the target's" in err


def test_console_script_runs(tmp_path, tiny_model_dirs):
    prompts = write(tmp_path / "p.jsonl", GOOD[:1])
    out = tmp_path / "o.jsonl"
    exe = [sys.executable, "-m", "serve_app.cli"]
    proc = subprocess.run(
        exe + ["generate", "--prompts", prompts, "--out", str(out), "--target", tiny_model_dirs["target"],
               "--draft", "truncated:1", "--policy", "fixed:2", "--max-tokens", "6", "--seed", "3", "--temperature", "0.7"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())
    assert 1 <= len(row["token_ids"]) <= 6 and row["stats"]["proposed"] > 0


def test_every_command_prints_its_help():
    """`--help` formats every option's help text (a bare % in one made `simulate --help` crash)."""
    import argparse

    from serve_app.cli import _parser

    def walk(parser, path):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])

    commands = list(walk(_parser(), []))
    assert len(commands) > 10
    for path, parser in commands:
        assert parser.format_help(), path
