"""GPUs per role: config, validation and the `serve` flags (Ray's placement of them: tests/test_serve.py)."""

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig, GroupConfig
from serve_app.cli import _gpu_group, _parser


def test_each_role_asks_for_its_own_gpus_and_falls_back_to_num_gpus():
    g = GroupConfig(target_gpus=0.75, draft_gpus=0.25, worker_cpus=2)
    assert g.bundle("target", {"accelerator_type:L4": 0.001}) == {"CPU": 2, "GPU": 0.75, "accelerator_type:L4": 0.001}
    assert g.bundle("draft", {}) == {"CPU": 2, "GPU": 0.25}
    old = GroupConfig(num_gpus=0.5)
    assert old.gpus("target") == old.gpus("draft") == 0.5
    assert GroupConfig().bundle("target", {}) == {"CPU": 1}  # no GPU key at all on a CPU group


def test_gpu_counts_ray_cannot_give_are_refused_up_front():
    with pytest.raises(ValidationError, match="draft_gpus = 1.5: a count above 1 must be a whole number"):
        GroupConfig(target_gpus=2, draft_gpus=1.5)
    with pytest.raises(ValidationError, match="the draft worker asks Ray for no GPU"):
        AppConfig(model={"target": "some/model", "draft": "some/draft", "device": "cuda"},
                  groups=[{"target_gpus": 1, "draft_gpus": 0}])
    with pytest.raises(ValidationError, match="target and draft worker asks Ray for no GPU"):
        AppConfig(model={"target": "some/model", "draft": "some/draft", "device": "cuda"})
    # a draft that holds no model needs no GPU; a CPU deployment's counts are logical (placement only)
    AppConfig(model={"target": "some/model", "draft": "ngram", "device": "cuda"}, groups=[{"target_gpus": 1}])
    AppConfig(model={"target": "some/model", "draft": "some/draft", "device": "cpu"}, groups=[{"num_gpus": 0.5}])


@pytest.mark.parametrize("flags,want", [
    ([], (0.0, 0.0)),
    (["--device", "cuda"], (1.0, 1.0)),
    (["--device", "cuda", "--target-gpus", "0.5"], (0.5, 0.5)),
    (["--device", "cuda", "--target-gpus", "0.75", "--draft-gpus", "0.25"], (0.75, 0.25)),
])
def test_serve_flags_place_each_role(flags, want):
    args = _parser().parse_args(["serve", *flags])
    g = _gpu_group(args)
    assert (g["target_gpus"], g["draft_gpus"]) == want
    GroupConfig(**g)


def test_the_draft_runs_one_torch_thread_unless_told():
    assert GroupConfig().threads("draft") == 1 and GroupConfig().threads("target") == 0  # 0: all the CPUs
    assert GroupConfig(torch_threads=4).threads("draft") == 1
    assert GroupConfig(torch_threads=4, draft_torch_threads=0).threads("draft") == 4  # 0: as the target
    assert GroupConfig(draft_torch_threads=3).threads("draft") == 3
    with pytest.raises(ValidationError):
        GroupConfig(draft_torch_threads=-1)


def test_serve_hosts_the_router_in_the_ingress_unless_told():
    from serve_app.cli import _app_config

    assert AppConfig(**_app_config(_parser().parse_args(["serve"]))).router_in_ingress
    assert not AppConfig(**_app_config(_parser().parse_args(["serve", "--separate-router"]))).router_in_ingress
    assert not AppConfig().router_in_ingress  # a Serve config file keeps its Router deployments unless it asks
    with pytest.raises(ValidationError, match="exactly one group"):
        AppConfig(router_in_ingress=True, groups=[{"name": "A"}, {"name": "B"}])
    with pytest.raises(ValidationError, match="no ingress_resources"):
        AppConfig(router_in_ingress=True, ingress_resources={"head": 0.001})


def test_policy_none_starts_no_default_draft_but_a_named_one():
    assert AppConfig(engine={"policy": "none"}).model.draft == "none"  # the embedded target's draft: never used
    assert AppConfig(engine={"policy": "adaptive"}).model.draft is None  # the target's default draft
    assert AppConfig(engine={"policy": "none"}, model={"draft": "ngram"}).model.draft == "ngram"
