"""The prompt sets stay apart: no figure is measured on a draft's training prompts or on the profile's."""

import re

import pytest

from serve_app.drafting import distill
from serve_app.bench.prompt_sets import EVAL_SETS, MORE_CHAT_PROMPTS, PROFILE_PROMPTS

TEMPLATES = distill.TEMPLATES + distill.MORE_TEMPLATES + distill.CODE_TEMPLATES + distill.MORE_CODE_TEMPLATES


def normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def template_of(text: str) -> str | None:
    """The distillation template `text` is an instance of, if any (any topic, not just the built-in ones)."""
    for tpl in TEMPLATES:
        pattern = re.escape(tpl).replace(re.escape("{t}"), ".+")
        if re.fullmatch(pattern, text, flags=re.IGNORECASE | re.DOTALL):
            return tpl
    return None


SETS = {**EVAL_SETS, "chat": MORE_CHAT_PROMPTS, "profile": PROFILE_PROMPTS, "distillation": distill.seed_prompts()}


@pytest.mark.parametrize("a, b", [(a, b) for i, a in enumerate(SETS) for b in list(SETS)[i + 1:]])
def test_sets_are_pairwise_disjoint(a, b):
    shared = {normal(x) for x in SETS[a]} & {normal(x) for x in SETS[b]}
    assert not shared, f"{a} and {b} share {sorted(shared)[:3]}"


@pytest.mark.parametrize("name", [*EVAL_SETS, "chat", "profile"])
def test_no_profile_or_evaluation_prompt_is_a_distillation_template(name):
    hits = {x: template_of(x) for x in SETS[name] if template_of(x)}
    assert not hits, hits


def test_template_check_can_fail():
    assert template_of("Write a haiku about autumn leaves.") == "Write a haiku about {t}."
    assert template_of("Compose a haiku about falling autumn leaves.") is None


def test_sets_have_no_duplicates_and_enough_prompts():
    for name, texts in SETS.items():
        assert len({normal(x) for x in texts}) == len(texts), name
    assert len(PROFILE_PROMPTS) >= 32  # one distinct prompt per row of the largest profiled batch
