"""What would go wrong on a GPU or in a Kubernetes pod, shown on a CPU: benchmark inputs and clocks
follow the model's device, the EAGLE-3 head's rotary frequencies stay float32 through every cast, a
draft host loads the target's weights only for drafts built from them, and torch's thread count
follows the CPUs a pod may use."""

from __future__ import annotations

import copy
import os
import types

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from conftest import tiny_llama
from serve_app import hardware, models
from serve_app.bench import engine as bench_engine
from serve_app.config import ModelConfig
from serve_app.drafting.eagle3 import Eagle3Draft, Float32Rotary
from serve_app.drafting.eagle3_io import export_eagle3, save_eagle3
from serve_app.drafting.ngram import NgramDraft
from serve_app.hardware import available_cpus, sync

META = torch.device("meta")


# ---- 1. bench engine: inputs on the model's device, the device synchronized around every clock read ----
class ElsewhereModel(nn.Module):
    """A model on another device (meta stands for cuda here): records where its inputs were made."""

    def __init__(self, log: list):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, device=META))
        self.config = LlamaConfig(vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
        self.log = log
        self.input_devices: set[torch.device] = set()

    def forward(self, input_ids, **kwargs):
        self.input_devices |= {t.device for t in [input_ids, *kwargs.values()] if isinstance(t, torch.Tensor)}
        self.log.append("forward")

    def generate(self, ids, attention_mask, max_new_tokens, **kwargs):
        self.input_devices |= {ids.device, attention_mask.device}
        self.log.append("forward")
        return torch.zeros(1, ids.shape[1] + max_new_tokens, dtype=torch.long)


@pytest.fixture
def timed(monkeypatch):
    """(log, model): sync and clock reads of serve_app.bench.engine, and the model's forwards, in order."""
    log: list = []
    monkeypatch.setattr(bench_engine, "sync", lambda device: log.append(("sync", torch.device(device))))
    clock = types.SimpleNamespace(perf_counter=lambda: log.append("clock") or len(log))
    monkeypatch.setattr(bench_engine, "time", clock)
    return log, ElsewhereModel(log)


def test_forward_ms_makes_inputs_on_the_models_device_and_syncs_before_each_clock(timed):
    log, model = timed
    bench_engine.forward_ms(model, context=4, reps=2)
    assert model.input_devices == {META}
    timed_step = [("sync", META), "clock", "forward", ("sync", META), "clock"]
    assert log == ["forward"] + timed_step * 2  # the prefill, then each timed forward between synced clocks


def test_hf_generate_makes_inputs_on_the_models_device_and_syncs_before_each_clock(timed):
    log, model = timed
    _, outs = bench_engine.hf_generate(model, [[1, 2], [3]], 2, types.SimpleNamespace(update=lambda n: None))
    assert model.input_devices == {META}
    assert log == [("sync", META), "clock", "forward", ("sync", META), "clock"] * 2
    assert outs == [[0, 0], [0, 0]]


def test_sync_waits_for_cuda_devices_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    sync("cpu")
    sync(torch.device("meta"))
    assert waited == []
    sync("cuda:1")
    assert waited == [torch.device("cuda:1")]


# ---- 2. the EAGLE-3 head's rotary frequencies stay float32 ---------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_llama(97, layers=2, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def draft(target):
    return Eagle3Draft.from_target(target, torch.arange(0, 97, 3), [0, 1, 2])


def rope_at(rotary: nn.Module, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, 1, D] at `position` for float32 inputs (the rotation before any rounding of its result)."""
    return rotary(torch.zeros(1, dtype=torch.float32), torch.tensor([[position]]))


def float32_rope_at(config, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from float32 frequencies made here: what the target computes (its loader keeps them float32)."""
    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.cat([position * inv_freq] * 2)
    return angles.cos(), angles.sin()


CASTS = {
    ".to(bfloat16)": lambda d: d.to(torch.bfloat16),
    ".to(dtype=bfloat16)": lambda d: d.to(dtype=torch.bfloat16),
    ".to(device, dtype)": lambda d: d.to("cpu", torch.bfloat16),
    ".half()": lambda d: d.half(),
    ".bfloat16()": lambda d: d.bfloat16(),
    "cast_own": lambda d: d.cast_own(torch.bfloat16),
}


@pytest.mark.parametrize("cast", CASTS.values(), ids=CASTS.keys())
def test_eagle3_inv_freq_stays_float32_through_casts(draft, cast):
    cast_draft = cast(copy.deepcopy(draft))
    assert cast_draft.fc.weight.dtype in (torch.bfloat16, torch.float16)  # the weights were cast
    assert cast_draft.rotary_emb.inv_freq.dtype == torch.float32
    assert cast_draft.rotary_emb.original_inv_freq.dtype == torch.float32
    for got, want in zip(rope_at(cast_draft.rotary_emb, 4000), float32_rope_at(draft.config, 4000)):
        torch.testing.assert_close(got[0, 0], want, atol=1e-5, rtol=0)


SAVES = {
    "specserve format": lambda draft, target, out: save_eagle3(draft, target, out, {}),
    "published format": lambda draft, target, out: export_eagle3(draft, out, target),
}


@pytest.mark.parametrize("save", SAVES.values(), ids=SAVES.keys())
def test_eagle3_inv_freq_stays_float32_when_loaded_for_a_bfloat16_target(draft, target, tmp_path, save):
    """The loader casts the head to the dtype of the target's embeddings (bfloat16 here)."""
    save(draft, target, tmp_path)
    bf16_target = copy.deepcopy(target).to(torch.bfloat16)
    loaded = models.load_draft(str(tmp_path), bf16_target, None)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    for got, want in zip(rope_at(loaded.rotary_emb, 4000), float32_rope_at(draft.config, 4000)):
        torch.testing.assert_close(got[0, 0], want, atol=1e-5, rtol=0)


def test_a_bfloat16_inv_freq_would_drift_and_device_moves_still_apply(draft):
    """The check above can fail: Llama's own rotary, cast to bfloat16, is radians off at position 4000."""
    plain = LlamaRotaryEmbedding(draft.config).to(torch.bfloat16)
    cos, _ = rope_at(plain, 4000)
    assert (cos[0, 0] - float32_rope_at(draft.config, 4000)[0]).abs().max() > 0.1
    moved = Float32Rotary(draft.config).to(META, torch.bfloat16)
    assert moved.inv_freq.device == META and moved.inv_freq.dtype == torch.float32


# ---- 3. the draft host loads the target's weights only for drafts built from them ----------------------
@pytest.fixture
def no_target_weights(monkeypatch, tiny_model_dirs):
    """Loading the target's weights fails the test; the draft's own load goes through."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    real = models._from_pretrained

    def only_drafts(spec, *args):
        assert spec != tiny_model_dirs["target"], "the target's weights were loaded"
        return real(spec, *args)

    monkeypatch.setattr(models, "load_target", refuse)
    monkeypatch.setattr(models, "_from_pretrained", only_drafts)


def test_a_separate_draft_is_hosted_without_the_targets_weights(no_target_weights, tiny_model_dirs):
    cfg = ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"])
    draft, tokenizer = models.load_draft_for_host(cfg)
    assert isinstance(draft, LlamaForCausalLM) and draft.config.num_hidden_layers == 1
    assert tokenizer.pad_token_id == 0
    # the vocabulary check still runs, from the target's tokenizer and config
    with pytest.raises(ValueError, match="draft tokenizer differs"):
        models.load_draft_for_host(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["other_vocab"]))


def test_an_eagle3_draft_is_hosted_with_the_targets_embeddings_alone(monkeypatch, tmp_path):
    """An EAGLE-3 head reads the target's embedding table and nothing else of it: its host reads that one tensor
    from the target's safetensors (the rest of the target stays on the meta device) and builds the same draft as
    from the whole target; the embedded default pair too."""
    from serve_app.bench.shapes import SHAPES, random_eagle3, random_llama, save_eagle3_dir, save_model_dir, vocab_tokenizer
    from serve_app.config import EMBEDDED

    target = random_llama(SHAPES["tiny-128k"], 2)
    tdir, edir = save_model_dir(target, vocab_tokenizer(128256), tmp_path / "t"), tmp_path / "e"
    save_eagle3_dir(random_eagle3(target), target, edir)
    cfg = ModelConfig(target=tdir, draft=str(edir), dtype="float32")
    whole = models.load_draft(str(edir), models.load_target(tdir, "float32")[0], None).state_dict()
    shell = models.load_target_embeddings(tdir)
    assert [n for n, p in shell.named_parameters() if not p.is_meta] == ["model.embed_tokens.weight"]
    monkeypatch.setattr(models, "load_target", lambda *a, **k: pytest.fail("the whole target was loaded"))
    monkeypatch.setattr(models, "_from_pretrained", lambda *a, **k: pytest.fail("the whole target was loaded"))
    draft, tokenizer = models.load_draft_for_host(cfg)
    own = draft.state_dict()
    assert own.keys() == whole.keys() and all(torch.equal(own[k], whole[k]) for k in own)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight) and len(tokenizer) == 128256
    draft, _ = models.load_draft_for_host(ModelConfig(target=EMBEDDED))  # the committed head of the embedded target
    assert isinstance(draft, Eagle3Draft) and draft.embed_tokens.weight.shape == (49152, 576)
    assert not any(p.is_meta for p in draft.parameters())


def test_the_vocabulary_size_is_checked_against_the_targets_config(tiny_model_dirs):
    config = models.load_target_config(tiny_model_dirs["target"])
    tokenizer = models.load_tokenizer(tiny_model_dirs["target"])
    draft = tiny_llama(config.vocab_size + 1, layers=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="vocabularies differ"):
        models.check_same_vocab(tokenizer, tokenizer, config, draft)


def test_an_ngram_draft_is_hosted_without_the_target(no_target_weights, monkeypatch, tiny_model_dirs):
    monkeypatch.setattr(models, "load_target_config", lambda spec: pytest.fail("ngram needs no config"))
    draft, tokenizer = models.load_draft_for_host(ModelConfig(target=tiny_model_dirs["target"], draft="ngram"))
    assert isinstance(draft, NgramDraft) and tokenizer.pad_token_id == 0


def test_drafts_built_from_the_targets_weights_still_get_them(tiny_model_dirs):
    draft, _ = models.load_draft_for_host(ModelConfig(target=tiny_model_dirs["target"], draft="truncated:1"))
    assert len(draft.model.layers) == 1
    # the committed drafts share the target's embeddings (EAGLE-3) or layers (layer-copy)
    assert models.draft_needs_target(str(models.EMBEDDED_DRAFT))
    assert models.draft_needs_target(str(models.EMBEDDED_LAYERS_DRAFT))
    assert not models.draft_needs_target(tiny_model_dirs["draft"]) and not models.draft_needs_target("ngram")
    with pytest.raises(ValueError, match="needs the loaded target"):
        models.load_draft("truncated:1", models.load_target_config(tiny_model_dirs["target"]), None)


def test_the_ray_draft_host_uses_it(no_target_weights, monkeypatch, tiny_model_dirs):
    """_ModelHost (the Ray actors' base, a plain class) loads a separate draft without the target, and
    sets torch's threads from available_cpus()."""
    from deployments.workers import _ModelHost

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(hardware, "available_cpus", lambda: 3)

    class DraftHost(_ModelHost):
        role = "draft"

    host = DraftHost(ModelConfig(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"]).model_dump())
    assert host.call("info")["role"] == "draft"
    assert threads == [3]


# ---- 4. CPUs a process may use: affinity and the cgroup quota ------------------------------------------
@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on 8 cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "250000 100000"}, 3),  # 2.5 CPUs: rounded up
    ({"cpu.max": "50000 100000"}, 1),  # half a CPU: at least 1
    ({"cpu.max": "1600000 100000"}, 8),  # a quota above the cores: the cores
    ({"cpu.max": "max 100000"}, 8),  # no quota
    ({"cpu/cpu.cfs_quota_us": "150000", "cpu/cpu.cfs_period_us": "100000"}, 2),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 8),  # v1, no quota
    ({"cpu/cpu.cfs_quota_us": "150000"}, 8),  # v1 without its period
    ({"cpu.max": "garbage"}, 8),
    ({}, 8),  # no cgroup files at all
], ids=["v2 2.5", "v2 0.5", "v2 above cores", "v2 max", "v1 1.5", "v1 -1", "v1 no period", "v2 garbage", "missing"])
def test_available_cpus_is_the_cores_capped_by_the_cgroup_quota(cores, tmp_path, files, expected):
    assert available_cpus(write(tmp_path, files)) == expected


def test_available_cpus_without_sched_getaffinity_counts_the_machine(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert available_cpus(write(tmp_path, {"cpu.max": "400000 100000"})) == 4
    assert available_cpus(tmp_path / "absent") == 16
