"""Predicted profiles: schema, the roofline model by hand, refusal rules, measured-wins, the paper's result.

No Ray and no models: ProfileStore and Router are exercised through their plain classes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from serve_app.hardware import gpu_type_name
from serve_app.profiling.profiles import Prediction, Profile, load_profile, load_profiles, replaces, save_profile
from serve_app.profiling.roofline import (GPUS, SHAPES, GpuSpec, ModelShape, Overheads, acceptance_for, forward_cost, forward_ms,
                                gpu_spec, model_shape, predict_for, predict_grid, predict_profile, smooth_max)

ROOT = Path(__file__).resolve().parent.parent
PREDICTION = {"hardware": "h", "hardware_source": "s", "memory_gb_s": 1, "tflops": 1, "memory_efficiency": 1,
              "compute_efficiency": 1, "forward_base_ms": 0, "forward_per_layer_ms": 0, "step_ms": 0,
              "step_per_seq_ms": 0, "context_tokens": 0, "acceptance_from": "assumed"}


def profile(source: str = "measured", gpu_type: str = "NVIDIA_L4", **over) -> Profile:
    body = {"gpu_type": gpu_type, "target": "t", "draft": "d", "dtype": "bfloat16", "best_k": {"1": 2},
            "acceptance": [0.7, 0.5], "acceptance_rate": 0.75, "source": source,
            "prediction": PREDICTION if source == "predicted" else None, **over}
    return Profile.model_validate(body)


# ---- schema ---------------------------------------------------------------------------------------
def test_old_profiles_load_as_measured_and_predicted_ones_round_trip(tmp_path):
    old = {"gpu_type": "x", "target": "t", "draft": "d", "best_k": {"1": 2}}  # written before `source` existed
    (tmp_path / "x.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "x.json").source == "measured"
    assert load_profile(ROOT / "profiles" / "cpu-2core.json").source == "measured"
    p = profile("predicted")
    save_profile(p, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back == p and back.source == "predicted" and back.prediction == Prediction(**PREDICTION)


@pytest.mark.parametrize("over, message", [
    ({"source": "predicted"}, "a predicted profile needs `prediction`"),
    ({"prediction": PREDICTION}, "a measured one has none"),
    ({"source": "guessed"}, "source"),
])
def test_source_and_prediction_must_agree(tmp_path, over, message):
    body = {"gpu_type": "x", "target": "t", "draft": "d", "best_k": {"1": 2}, **over}
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        load_profile(tmp_path / "p.json")


@pytest.mark.parametrize("device, gpu_type", [
    ("NVIDIA A100-SXM4-80GB", "NVIDIA_A100"), ("NVIDIA H100 80GB HBM3", "NVIDIA_H100"), ("NVIDIA L4", "NVIDIA_L4"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA_GeForce_RTX_4090"), ("NVIDIA A10G", "NVIDIA_A10G"), ("NVIDIA H200", "NVIDIA_H200"),
])
def test_gpu_type_names_keep_the_model_number(device, gpu_type):
    assert gpu_type_name(device) == gpu_type
    assert gpu_type in GPUS  # every card of the spec table is keyed as detect_gpu_type names it


# ---- the roofline model, by hand ------------------------------------------------------------------
TINY = ModelShape(name="tiny", layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10)
SLOW = GpuSpec(name="slow", memory_gb_s=1e-3, tflops_16bit=1e-5, tflops_fp32=5e-6, memory_gb=1, source="made up")
EXACT = Overheads(memory_efficiency=1, compute_efficiency=1, forward_base_ms=0.5, forward_per_layer_ms=0.25,
                  step_ms=0.1, step_per_seq_ms=0.01)


def test_bytes_and_flops_of_a_tiny_model_by_hand():
    # per layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48, MLP 3 x 4x8 = 96 -> 144; 2 layers + head 10x4 = 328
    assert TINY.weight_params() == 328
    assert TINY.kv_bytes_per_token("bfloat16") == 2 * 2 * 1 * 2 * 2  # K and V, 2 layers, 1 head of 2, 2 bytes
    # batch 2, 3 new tokens, 5 in the cache: weights 656 B + 2 sequences x 8 positions x 16 B of KV
    # FLOPs: 6 tokens x (2 x 328 + attention 4 x 2 layers x 2 heads x 2 dims x 8 positions = 256)
    assert forward_cost(TINY, "bfloat16", 2, 3, 5) == (656 + 256, 6 * (656 + 256))


def test_forward_time_joins_the_two_roofs_smoothly_plus_fixed_costs():
    # 1e6 B/s and 1e7 FLOP/s: batch 2 moves 912 B (0.912 ms) and does 5472 FLOPs (0.547 ms): memory-bound
    fixed = 0.5 + 0.25 * 2
    sharp, summed = EXACT.model_copy(update={"overlap_exponent": math.inf}), EXACT.model_copy(update={"overlap_exponent": 1})
    assert forward_ms(TINY, SLOW, "bfloat16", 2, 3, 5, sharp) == pytest.approx(0.912 + fixed)  # p -> inf: the max
    assert forward_ms(TINY, SLOW, "bfloat16", 2, 3, 5, summed) == pytest.approx(0.912 + 0.5472 + fixed)  # p = 1: the sum
    # p = 2 (the default): sqrt(0.912^2 + 0.5472^2) = 1.0636, above the larger roof, below the sum
    assert EXACT.overlap_exponent == 2
    assert forward_ms(TINY, SLOW, "bfloat16", 2, 3, 5, EXACT) == pytest.approx(1.0636 + fixed, abs=1e-4)
    # batch 20: 656 + 20 x 8 x 16 = 3216 B (3.2 ms) but 60 x 912 = 54720 FLOPs (5.5 ms): compute-bound
    assert forward_ms(TINY, SLOW, "bfloat16", 20, 3, 5, sharp) == pytest.approx(5.472 + fixed)
    assert forward_ms(TINY, SLOW, "bfloat16", 20, 3, 5, EXACT) == pytest.approx(math.hypot(3.216, 5.472) + fixed)
    # float32: twice the bytes, half the compute
    nbytes, flops = forward_cost(TINY, "float32", 2, 3, 5)
    assert forward_ms(TINY, SLOW, "float32", 2, 3, 5, EXACT) == pytest.approx(math.hypot(nbytes / 1e6, flops / 5e6) * 1e3 + fixed)
    assert smooth_max(0, 0, 2) == 0 and smooth_max(1, 1e-300, 1e6) == 1  # no 0/0, no overflow at a large p
    with pytest.raises(ValueError, match="float64"):
        SLOW.tflops("float64")
    with pytest.raises(ValueError, match="overlap_exponent"):
        Overheads(overlap_exponent=0.5)  # below 1 would make a forward faster than its slower roof


def test_grid_cells_are_draft_forwards_one_verification_and_the_rest():
    draft = TINY.model_copy(update={"layers": 1})
    g = predict_grid(TINY, draft, SLOW, "bfloat16", EXACT, context=5, max_k=2, batch_sizes=[1, 4])
    for i, b in enumerate([1, 4]):
        one = forward_ms(draft, SLOW, "bfloat16", b, 1, 5, EXACT)
        assert g.draft_ms[i] == pytest.approx([0, one, 2 * one], abs=1e-3)
        assert g.verify_ms[i] == pytest.approx([forward_ms(TINY, SLOW, "bfloat16", b, k + 1, 5, EXACT) for k in range(3)], abs=1e-3)
        assert g.other_ms[i] == pytest.approx([0.1 + 0.01 * b] * 3)


def test_predicted_profile_takes_best_k_from_the_grid_and_records_its_inputs():
    acc = acceptance_for("t", "d", "bfloat16", 3, rate=0.5)
    assert acc[0] == [0.5, 0.25, 0.125]
    p = predict_profile("NVIDIA_L4", GPUS["NVIDIA_L4"], ("t", SHAPES["smollm2-1.7b"]), ("d", SHAPES["smollm2-135m"]),
                        "bfloat16", acc, context=256, max_k=3, overheads=EXACT)
    assert p.source == "predicted" and p.prediction.tflops == 121 and p.prediction.context_tokens == 256
    assert p.prediction.overlap_exponent == 2  # the smooth corner is an assumption, recorded like the others
    assert "assumed per-token rate 0.5" in p.prediction.acceptance_from and "PREDICTED" in p.notes
    assert set(p.best_k) == set(p.latency.batch_sizes) and p.acceptance_rate == 0.5


# ---- shapes ---------------------------------------------------------------------------------------
def test_model_shapes_from_the_table_a_config_json_and_a_draft_directory(tmp_path):
    assert model_shape("HuggingFaceTB/SmolLM2-1.7B-Instruct") == SHAPES["smollm2-1.7b"]
    assert model_shape("embedded") == SHAPES["smollm2-135m"]
    assert model_shape("facebook/opt-6.7b").gated_mlp is False
    llama = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(llama))
    s = model_shape(str(tmp_path / "m"))
    assert (s.layers, s.hidden, s.kv_heads, s.vocab, s.gated_mlp) == (3, 64, 2, 100, True)
    opt = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 32, "ffn_dim": 128, "num_attention_heads": 4,
           "vocab_size": 50}
    (tmp_path / "m" / "config.json").write_text(json.dumps(opt))
    s = model_shape(str(tmp_path / "m"))
    assert (s.intermediate, s.kv_heads, s.gated_mlp) == (128, 4, False)
    from serve_app.models import EMBEDDED_DRAFT

    eagle = model_shape(str(EMBEDDED_DRAFT))  # one layer over the target's features, reduced head
    assert (eagle.layers, eagle.hidden, eagle.vocab) == (1, 576, 8191) and eagle.extra_params > 0


# ---- refusal rules --------------------------------------------------------------------------------
K8S_PAIR = ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def predict(gpu_type="NVIDIA_L4", pair=K8S_PAIR, dtype="bfloat16", **kw):
    return predict_for(gpu_type, *pair, dtype, 512, 4, [1, 8], **kw)


@pytest.mark.parametrize("call, message", [
    (lambda: predict("NVIDIA_X1"), "unknown GPU type 'NVIDIA_X1'.*known are NVIDIA_H100, .*NVIDIA_L4"),
    (lambda: gpu_spec("NVIDIA_GeForce"), "unknown GPU type"),
    (lambda: predict(pair=("org/mystery-7b", "HuggingFaceTB/SmolLM2-135M-Instruct"), rate=0.6),
     "no shape known for model 'org/mystery-7b'.*local directory holding its config.json"),
    (lambda: predict(), "needs its acceptance from exactly one source"),
    (lambda: predict(rate=0.6, acceptance_path=str(ROOT / "profiles" / "cpu-2core.json")), "exactly one source"),
    (lambda: predict(rate=1.5), r"must lie in \[0, 1\]"),
    (lambda: predict(acceptance_path=str(ROOT / "profiles" / "cpu-2core.json")),
     "measured with target 'SmolLM2-135M-Instruct'.*prediction is for target 'SmolLM2-1.7B-Instruct'"),
    (lambda: predict(pair=(K8S_PAIR[0], "none"), rate=0.6), "needs a draft model"),
    (lambda: predict(dtype="float64", rate=0.6), "float64"),
])
def test_predictions_are_refused_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_acceptance_comes_from_a_measured_profile_of_the_same_pair_and_dtype():
    measured = profile()
    acc, rate, origin = acceptance_for("t", "d", "bfloat16", 8, measured=measured, measured_name="m.json")
    assert acc == [0.7, 0.5] and rate == 0.75 and "m.json" in origin
    with pytest.raises(ValueError, match="measured with target 't', draft 'd' in bfloat16.*in float32"):
        acceptance_for("t", "d", "float32", 8, measured=measured)
    with pytest.raises(ValueError, match="holds no measured acceptance"):
        acceptance_for("t", "d", "bfloat16", 8, measured=profile("predicted"))


def test_cli_predicts_and_refuses(tmp_path, capsys):
    from serve_app.cli import main

    out = tmp_path / "NVIDIA_L4.json"
    args = ["profile", "--predict", "NVIDIA_L4", "--target", K8S_PAIR[0], "--draft", K8S_PAIR[1], "--max-k", "4"]
    assert main(args + ["--acceptance-rate", "0.6", "--out", str(out)]) == 0
    p = load_profile(out)
    assert p.source == "predicted" and p.dtype == "bfloat16" and out.with_suffix(".png").is_file()
    assert main(["profile", "--predict", "NVIDIA_Z9", "--acceptance-rate", "0.6", "--out", str(out)]) == 2
    assert "unknown GPU type 'NVIDIA_Z9'" in capsys.readouterr().err
    assert main(args + ["--out", str(out)]) == 2
    assert "--acceptance-rate A" in capsys.readouterr().err
    assert main(["profile", "--acceptance-rate", "0.6"]) == 2  # only with --predict
    assert "only go with --predict" in capsys.readouterr().err


# ---- a measured profile always wins -------------------------------------------------------------
def test_measured_wins_when_loading_a_directory(tmp_path):
    save_profile(profile("measured", notes="m"), tmp_path / "a-measured.json")
    save_profile(profile("predicted", notes="p"), tmp_path / "b-predicted.json")  # later file name, same type
    assert load_profiles(tmp_path)["NVIDIA_L4"].notes == "m"
    save_profile(profile("measured", notes="m2"), tmp_path / "c-measured.json")
    assert load_profiles(tmp_path)["NVIDIA_L4"].notes == "m2"  # two measured: the later file, as before
    assert replaces(None, profile("predicted")) and replaces(profile("predicted"), profile("predicted"))
    assert replaces(profile("measured"), profile("measured")) and not replaces(profile("measured"), profile("predicted"))


def test_profile_store_refuses_a_predicted_push_over_a_measured_profile(tmp_path):
    from deployments.profile_store import ProfileStore

    save_profile(profile("predicted"), tmp_path / "NVIDIA_L4.json")
    store = ProfileStore.func_or_class(str(tmp_path))
    assert store.get("NVIDIA_L4")[1]["source"] == "predicted"
    assert store.push(profile("predicted", notes="newer guess").model_dump()) == 2  # predicted over predicted
    assert store.push(profile("measured").model_dump()) == 3  # measured always replaces
    with pytest.raises(ValueError, match="a measured profile for NVIDIA_L4 .* is in use; a predicted one does not replace"):
        store.push(profile("predicted").model_dump())
    version, held = store.get("NVIDIA_L4")
    assert version == 3 and held["source"] == "measured"
    assert store.push(profile("measured", notes="re-measured").model_dump()) == 4


class FakeGauge:
    def __init__(self):
        self.values: dict[str, float] = {}

    def set(self, value, tags=None):
        self.values[tags["source"]] = value


def test_router_says_which_kind_of_profile_it_holds():
    from deployments.router import Router

    r = object.__new__(Router.func_or_class)
    r.m_profile, r.profile = FakeGauge(), None
    r._profile_gauge()
    assert r.profile_source() == "none" and r.m_profile.values == {"measured": 0, "predicted": 0, "none": 1}
    r.profile = profile("predicted")
    r._profile_gauge()
    assert r.profile_source() == "predicted" and r.m_profile.values == {"measured": 0, "predicted": 1, "none": 0}
    r.profile = profile("measured")
    r._profile_gauge()  # the predicted series drops to 0 instead of lingering
    assert r.m_profile.values == {"measured": 1, "predicted": 0, "none": 0}


# ---- the paper's qualitative result and the committed predictions --------------------------------
def test_opt_on_a100_best_k_falls_as_the_batch_grows_but_not_to_the_papers_1_2():
    """OPT-6.7B verified, OPT-125M drafting, float16 on an A100, per-token acceptance 0.8 (an
    assumption, not the paper's own figure), default overheads (smooth corner p = 2),
    512 tokens of context. What the model gives, pinned: best k 4 at batch 1 (paper: 4-5), 3 from
    batch 32 on (paper: 1-2 at batch 32), results/predict-opt-a100.md says why. The old sharp max
    (p -> inf) gave 3 at batch 32 too, and 2 from batch 64 on."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]

    def best_k(**over):
        return predict_profile("NVIDIA_A100", GPUS["NVIDIA_A100"], ("opt-6.7b", SHAPES["opt-6.7b"]),
                               ("opt-125m", SHAPES["opt-125m"]), "float16",
                               acceptance_for("opt-6.7b", "opt-125m", "float16", 8, rate=0.8), context=512, max_k=8,
                               batch_sizes=sizes, overheads=Overheads(**over)).best_k

    assert best_k() == {1: 4, 2: 4, 4: 4, 8: 4, 16: 4, 32: 3, 64: 3, 128: 3, 256: 3}
    assert best_k(overlap_exponent=math.inf) == {1: 4, 2: 4, 4: 4, 8: 4, 16: 5, 32: 3, 64: 2, 128: 2, 256: 2}


def test_committed_predictions_are_for_the_manifests_pair_and_reproducible():
    """profiles/<type>.json for every GPU type k8s/rayservice.yaml serves: predicted, for its model pair
    and dtype, and exactly what `specserve profile --predict` writes from the code as it is."""
    rs = next(d for d in yaml.safe_load_all((ROOT / "k8s" / "rayservice.yaml").read_text()) if d and d["kind"] == "RayService")
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    model, engine = args["model"], args["engine"]
    from serve_app.config import ModelConfig
    from serve_app.models import model_names

    pair = model_names(ModelConfig(target=model["target"], draft=model["draft"]))
    profiles = load_profiles(ROOT / "profiles")
    for group in args["groups"]:
        p = profiles[group["gpu_type"]]
        assert p.source == "predicted" and (p.target, p.draft, p.dtype) == (*pair, model["dtype"])
        p.check_pair(*pair, model["dtype"])  # what the manifest's Routers check
        assert max(p.latency.ks) == engine["max_k"] and "assumption" in p.notes
        again = predict_for(group["gpu_type"], model["target"], model["draft"], model["dtype"], p.prediction.context_tokens,
                            engine["max_k"], p.latency.batch_sizes, rate=p.acceptance_rate)
        assert again.latency == p.latency and again.best_k == p.best_k and again.prediction == p.prediction


# ---- the CPU check's pieces (the measurement itself is left to `specserve profile --check-prediction`)
def test_fitted_overheads_recover_a_grid_the_model_made_and_compare_finds_no_error():
    from serve_app.profiling.roofline import compare, fit_overheads

    draft = TINY.model_copy(update={"layers": 1})
    made = EXACT.model_copy(update={"forward_base_ms": 0.7, "forward_per_layer_ms": 0.3, "step_ms": 0.2, "step_per_seq_ms": 0.05})
    grid = predict_grid(TINY, draft, SLOW, "bfloat16", made, context=5, max_k=3, batch_sizes=[1, 2, 8])
    fitted = fit_overheads(grid, TINY, draft, SLOW, "bfloat16", context=5)
    assert fitted.forward_base_ms == pytest.approx(0.7, abs=2e-3) and fitted.forward_per_layer_ms == pytest.approx(0.3, abs=2e-3)
    assert (fitted.step_ms, fitted.step_per_seq_ms) == pytest.approx((0.2, 0.05), abs=2e-3)
    measured = profile(latency=grid.model_dump(), best_k={"1": 0, "2": 0, "8": 0}, acceptance=[0.6, 0.4, 0.2])
    result = compare(measured, predict_grid(TINY, draft, SLOW, "bfloat16", fitted, 5, 3, [1, 2, 8]))
    assert result["mean_abs_error"] < 0.01 and all(result["best_k_matches"].values())


def test_the_check_refuses_before_measuring_anything(capsys):
    from serve_app.cli import main
    from serve_app.profiling.roofline import check_for

    with pytest.raises(ValueError, match="compares with a measured latency grid"):
        check_for(str(ROOT / "profiles" / "NVIDIA_L4.json"), *K8S_PAIR, 512)
    with pytest.raises(ValueError, match="measured with target 'SmolLM2-135M-Instruct'"):
        check_for(str(ROOT / "profiles" / "cpu-2core.json"), *K8S_PAIR, 512)
    assert main(["profile", "--predict", "NVIDIA_L4", "--check-prediction", "x.json"]) == 2
    assert "different runs" in capsys.readouterr().err
