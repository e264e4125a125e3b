"""The docs stay honest: links resolve, commands exist, the README stays a front page.

Checks README.md and every docs/*.md page, without Ray or models (fast):
- every docs/*.md page is linked from the README, and every relative link or image in the README and
  docs/ points to an existing file (and, with a #fragment, to an existing heading there);
- every `make <target>` shown (code blocks and inline code) is a target of the Makefile;
- every `specserve <subcommand> ... --flag` shown is accepted by the real CLI parser: subcommands and
  option strings are read from `serve_app.cli._parser()` itself, so the check follows the CLI as it
  changes instead of a list kept here;
- the README's Quick start holds exactly `make serve` and `make test`, and the README stays short;
- the module map in docs/architecture.md names every module of serve_app/ and deployments/, and no
  module that is gone; the architecture picture exists.
The last test feeds the checkers broken pages, so a checker that cannot fail is caught too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from serve_app.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200
QUICK_START = ["make serve", "make test"]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# `specserve` in command position: line start, after a shell operator, `--` (kubectl exec), `# =` (a
# comment spelling out what a make target runs), an opening backtick, or after a path such as .venv/bin/;
# not `kubectl -n specserve ...`.
SPECSERVE = re.compile(r"(?:^|&&|;|\$\(|\s--|#\s*=?|`)\s*(?:[\w.\-]*/)*specserve(?=\s|$)(?P<rest>.*)")
MAKE = re.compile(r"(?:^|&&|;|\$\(|`)\s*make\s+(?P<args>.*)")
COMMAND_END = re.compile(r"`|\s#|\s\|\s|;|&&")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


# ---- reading markdown -------------------------------------------------------------------------------
def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def split_markdown(text: str) -> tuple[list[str], list[list[str]]]:
    """(prose lines, code blocks); a code block is its lines with `\\` continuations joined."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            if block is None:
                block = []
            else:
                blocks.append(join_continuations(block))
                block = None
        elif block is None:
            prose.append(line)
        else:
            block.append(line)
    if block is not None:
        blocks.append(join_continuations(block))
    return prose, blocks


def join_continuations(lines: list[str]) -> list[str]:
    out, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def inline_code(prose: list[str]) -> list[str]:
    return [m.group(2).strip() for line in prose for m in INLINE_CODE.finditer(line)]


def command_lines(text: str) -> list[str]:
    """Where commands are shown: every code-block line and every inline code span."""
    prose, blocks = split_markdown(text)
    return [line for block in blocks for line in block] + inline_code(prose)


def links(text: str) -> list[str]:
    prose, _ = split_markdown(text)
    return [m.group(1) for line in prose for m in LINK.finditer(INLINE_CODE.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_markdown(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


# ---- the checkers (each returns a list of problems) -------------------------------------------------
def broken_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... not checked offline
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: link to {target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: link to {target}: no heading with anchor #{fragment} there")
    return problems


def makefile_targets(makefile: Path) -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_][\w.\-]*)\s*:(?!=)", makefile.read_text(), flags=re.M))


def unknown_make_targets(page: Path, targets: set[str]) -> list[str]:
    problems = []
    for line in command_lines(page.read_text(encoding="utf-8")):
        for m in MAKE.finditer(line):
            args = COMMAND_END.split(m.group("args"))[0].split()
            named = [a for a in args if "=" not in a and not a.startswith("-")]
            for target in named[:1]:
                if target not in targets:
                    problems.append(f"{page.name}: `make {target}`: no such Makefile target")
    return problems


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def check_specserve_command(rest: str, root: argparse.ArgumentParser) -> str | None:
    """None if `specserve <rest>` names real subcommands and only their flags, else why not."""
    parser, path = root, ["specserve"]
    for token in rest.split():
        choices = subparsers(parser)
        if not choices or token.startswith("-"):
            break
        if token in choices:
            parser = choices[token]
            path.append(token)
        elif re.fullmatch(r"[a-z][a-z-]*", token):
            return f"`{' '.join(path)} {token}`: no such subcommand (known: {', '.join(sorted(choices))})"
        else:  # a placeholder such as `...` or `/`: a reference to the command, not a use of it
            break
    known = option_strings(parser)
    bad = [f for f in FLAG.findall(rest) if f not in known]
    if bad:
        return f"`{' '.join(path)}` does not accept {', '.join(bad)} (it takes {', '.join(sorted(known))})"
    return None


def bad_specserve_commands(page: Path, root: argparse.ArgumentParser) -> list[str]:
    problems = []
    for line in command_lines(page.read_text(encoding="utf-8")):
        for m in SPECSERVE.finditer(line):
            rest = COMMAND_END.split(m.group("rest"))[0]
            why = check_specserve_command(rest, root)
            if why:
                problems.append(f"{page.name}: {why}: {line.strip()}")
    return problems


def section(text: str, title: str) -> str:
    """The text under `## title` up to the next heading of the same or a higher level."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, flags=re.M | re.S)
    return m.group(1) if m else ""


def quick_start_commands(text: str) -> list[str]:
    _, blocks = split_markdown(section(text, "Quick start"))
    commands = [re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip() for block in blocks for line in block]
    return [c for c in commands if c]


# ---- the tests --------------------------------------------------------------------------------------
def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README.read_text(encoding="utf-8"))}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_and_images_resolve(page):
    assert not broken_links(page)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_make_targets_shown_exist(page):
    assert not unknown_make_targets(page, makefile_targets(ROOT / "Makefile"))


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_specserve_commands_shown_are_accepted_by_the_cli_parser(page):
    assert not bad_specserve_commands(page, _parser())


def test_docs_show_every_specserve_subcommand_somewhere():
    """A subcommand the CLI has but no page shows is undocumented."""
    shown = "\n".join(line for p in pages() for line in command_lines(p.read_text(encoding="utf-8")))

    def walk(parser, path):
        for name, sub in subparsers(parser).items():
            yield from ([path + [name]] if not subparsers(sub) else walk(sub, path + [name]))

    missing = [" ".join(p) for p in walk(_parser(), ["specserve"]) if not re.search(rf"{' '.join(p)}(?=\s|`|$)", shown)]
    assert not missing, f"CLI commands no page shows: {missing}"


def test_quick_start_is_exactly_make_serve_and_make_test():
    text = README.read_text(encoding="utf-8")
    assert quick_start_commands(text) == QUICK_START
    mentioned = {m.group("args").split()[0] for line in command_lines(section(text, "Quick start"))
                 for m in MAKE.finditer(line) if m.group("args").split()}
    assert mentioned == {"serve", "test"}


def test_readme_stays_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_figures_come_from_committed_results_written_by_the_benchmarks():
    """README's headline figures cite results files; each was written by the command it names."""
    import json

    headline = section(README.read_text(encoding="utf-8"), "Headline figures")
    cited = {(README.parent / t.partition("#")[0]).resolve() for t in links(headline)}
    results = {p for p in cited if "results" in p.parts}
    assert len(results) >= 4, f"the headline figures cite too few results files: {sorted(results)}"
    for md in sorted(results):
        data = md.with_name("results.json") if md.name == "summary.md" else md.with_suffix(".json")
        command = json.loads(data.read_text())["provenance"]["command"]
        assert command and command.startswith(("specserve bench", "specserve chaos", "specserve simulate")), (data, command)
        assert command in md.read_text(encoding="utf-8"), f"{md} does not say what wrote it"


def test_architecture_picture_exists_and_is_shown():
    png = DOCS / "architecture.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (DOCS / "architecture.py").is_file()
    for page in (README, DOCS / "architecture.md"):
        shown = {(page.parent / t).resolve() for t in links(page.read_text(encoding="utf-8"))}
        assert png.resolve() in shown, f"{page.name} does not show docs/architecture.png"


def module_map() -> dict[str, str]:
    """The module map block of docs/architecture.md, split by top-level directory (`serve_app/`, ...)."""
    _, blocks = split_markdown((DOCS / "architecture.md").read_text(encoding="utf-8"))
    block = next(b for b in blocks if any(line.startswith("serve_app/") for line in b))
    parts: dict[str, str] = {}
    current = None
    for line in block:
        if line and not line[0].isspace():
            current = line.split()[0].rstrip("/")
            parts[current] = ""
        elif current:
            parts[current] += line + "\n"
    return parts


@pytest.mark.parametrize("package", ["serve_app", "deployments"])
def test_module_map_matches_the_code(package):
    listed = module_map().get(package)
    assert listed is not None, f"docs/architecture.md's module map has no {package}/ section"
    names = re.findall(r"(?<![\w/.])(\w+\.(?:py|yaml))\b", listed)
    files = [p for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts]
    unlisted = sorted(str(p.relative_to(ROOT / package)) for p in files if p.name != "__init__.py" and p.name not in names)
    gone = sorted(set(names) - {p.name for p in files})
    assert not unlisted, f"modules of {package}/ missing from the module map in docs/architecture.md: {unlisted}"
    assert not gone, f"the module map in docs/architecture.md names modules {package}/ no longer has: {gone}"


def test_http_api_names_every_chat_and_completions_request_field():
    """Every field deployments/openai_fields.py sorts (OpenAI's and vLLM's, both endpoints) is named in
    docs/http-api.md's request-fields section, so none is undocumented."""
    from deployments import openai_fields

    text = section((DOCS / "http-api.md").read_text(encoding="utf-8"), "Chat and completions request fields")
    assert text, "docs/http-api.md has no 'Chat and completions request fields' section"
    named = set(inline_code(text.splitlines()))
    fields = openai_fields.fields("chat") | openai_fields.fields("completions")
    missing = sorted(f for f in fields if f not in named)
    assert not missing, f"request fields docs/http-api.md does not name: {missing}"


def test_the_checks_can_fail(tmp_path):
    """Each checker finds the mistake planted in a small broken page."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real page\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# x\n\n[ok](docs/real.md#a-section) [gone](docs/missing.md) [bad anchor](docs/real.md#nope)\n"
        "![picture](docs/missing.png)\n\n"
        "Run `make serve`, `make no-such-target` or `specserve bench engine --no-such-flag`.\n\n"
        "```bash\n.venv/bin/specserve generate --prompts a.jsonl \\\n    --out b.jsonl --bogus 1\n"
        "specserve frobnicate --out x\nkubectl -n specserve apply -f k8s/rayservice.yaml\n```\n"
    )
    assert len(broken_links(page)) == 3
    assert unknown_make_targets(page, {"serve", "test"}) == ["README.md: `make no-such-target`: no such Makefile target"]
    problems = bad_specserve_commands(page, _parser())
    assert len(problems) == 3, problems  # --no-such-flag, --bogus (after a line continuation), frobnicate
    assert any("--no-such-flag" in p for p in problems) and any("--bogus" in p for p in problems)
    assert any("frobnicate" in p for p in problems)
    assert quick_start_commands("# x\n\n## Quick start\n\n```bash\nmake serve\nmake run\n```\n") != QUICK_START
