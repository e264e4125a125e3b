"""`--dtype auto`: bfloat16 where the hardware has it natively, float16 on CUDA GPUs that only emulate it,
float32 elsewhere; profiles keep their dtype."""

from __future__ import annotations

import pytest
import torch

from serve_app import models
from serve_app.config import ModelConfig
from serve_app.models import load_target, resolve_dtype


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv("SPECSERVE_AUTO_DTYPE", raising=False)


@pytest.mark.parametrize("native, kernel, expected", [
    (True, True, "bfloat16"), (True, False, "bfloat16"),  # avx512_bf16 / AMX: oneDNN computes bfloat16
    (False, True, "bfloat16"),  # AVX2 + FMA: bfloat16 weights, float32 arithmetic (engine/bf16_linear)
    (False, False, "float32"),  # neither
])
def test_auto_follows_the_cpus_bfloat16(unpinned, monkeypatch, native, kernel, expected):
    from serve_app.engine import bf16_linear

    monkeypatch.setattr(models, "cpu_has_bf16", lambda: native)
    monkeypatch.setattr(bf16_linear, "available", lambda: kernel)
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float16", "cpu") == "float16"  # an explicit dtype is never changed


def test_auto_is_the_default_and_can_be_pinned(monkeypatch, tiny_model_dirs):
    assert ModelConfig().dtype == "auto"
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "float64")
    target, _, _ = load_target(tiny_model_dirs["target"], "auto")
    assert target.dtype == torch.float64
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "int8")
    with pytest.raises(ValueError, match="SPECSERVE_AUTO_DTYPE='int8'"):
        resolve_dtype("auto")
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelConfig(dtype="fp8")


def test_a_target_worker_reports_its_resolved_dtype(unpinned, monkeypatch, tiny_model_dirs):
    from serve_app.engine.worker import ModelWorker

    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)
    target, _, _ = load_target(tiny_model_dirs["target"], "auto")
    assert ModelWorker(target, "target", 0).info()["dtype"] == "bfloat16"


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), "bfloat16"), ((8, 0), "bfloat16"),  # H100, A100: native bfloat16
    ((7, 5), "float16"), ((7, 0), "float16"),  # T4, V100: bfloat16 only emulated, float16 tensor cores
    ((6, 1), "float32"),  # P40: neither is fast
])
def test_auto_on_cuda_follows_the_compute_capability(unpinned, monkeypatch, capability, expected):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # says yes to emulation: not asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    assert resolve_dtype("auto", "cuda:1") == expected
    assert resolve_dtype("auto", "auto") == expected  # device_map="auto": the current device
    assert asked == ["cuda:1", None]
    assert resolve_dtype("bfloat16", "cuda") == "bfloat16"  # an explicit dtype is never changed
