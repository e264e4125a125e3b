"""EAGLE-3 drafts on disk: the published layout (as vLLM/SGLang load it), export, specserve's format,
their names, every refusal, and `specserve generate` with a head loaded from a directory.

Tiny random Llamas (tests/conftest.py); the tiny target has 2 layers, so its feature layers are given
explicitly: [0, 1, 2], where 2 is the last layer's output before the final norm.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from conftest import make_tokenizer, tiny_llama
from serve_app.cli import main
from serve_app.drafting.eagle3 import Eagle3Draft
from serve_app.drafting.eagle3_io import eagle3_format, export_eagle3, is_eagle3_dir, load_eagle3_dir, save_eagle3
from serve_app.models import display_name, load_draft, load_target

LAYERS = [0, 1, 2]
V, H, I = len(make_tokenizer()), 32, 64  # the tiny target: vocabulary 23, hidden 32, intermediate 64
PUBLISHED_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_target(tiny_model_dirs["target"], "float64")[0]


def published_head(seed=0, draft_vocab=10):
    """(config.json, tensors) of a tiny EAGLE-3 head laid out exactly as published heads are
    (SafeAILab/EAGLE, SpecForge): float16 weights, `midlayer.` names, d2t offsets, t2d mask."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values  # EAGLE's trainer sorts them

    def w(*shape, base=0.0):
        return (base + torch.randn(*shape, generator=g) * 0.2).to(torch.float16)

    tensors = {
        "fc.weight": w(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": w(32, 2 * H), "midlayer.self_attn.k_proj.weight": w(16, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(16, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, 32),
        "midlayer.mlp.gate_proj.weight": w(I, H), "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "midlayer.input_layernorm.weight": w(H, base=1), "midlayer.hidden_norm.weight": w(H, base=1),
        "midlayer.post_attention_layernorm.weight": w(H, base=1), "norm.weight": w(H, base=1),
        "lm_head.weight": w(draft_vocab, H),
        "d2t": token_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, token_ids, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": 256,
        "vocab_size": V, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYERS},
    }
    assert set(tensors) == PUBLISHED_NAMES
    return config, tensors


def write_published(path, config, tensors, weights_file="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights_file.endswith(".safetensors"):
        save_file(tensors, str(path / weights_file))
    else:
        torch.save(tensors, path / weights_file)
    return str(path)


def built_directly(target, tensors):
    """The Eagle3Draft those tensors describe, assembled by hand (no loader involved)."""
    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=256, vocab_size=V, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    d2t = tensors["d2t"]
    draft = Eagle3Draft(cfg, H, LAYERS, torch.arange(len(d2t)) + d2t, target.model.embed_tokens)
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in ("d2t", "t2d"):
                draft.get_parameter(name.removeprefix("midlayer.")).copy_(t)
    return draft.to(torch.float64).eval()


def outputs(draft, seed=0):
    """(logits, state) of one draft forward over random tokens and target features, 6 positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 6), generator=g)
    hidden = draft.fuse(torch.randn(2, 6, 3 * H, generator=g, dtype=torch.float64))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return draft(ids, hidden, torch.arange(6).expand(2, 6), attention_mask=mask)


def assert_same(a, b):
    (la, sa), (lb, sb) = outputs(a), outputs(b)
    assert torch.equal(la, lb) and torch.equal(sa, sb)
    assert torch.isfinite(la).sum() == 2 * 6 * len(b.token_ids)  # -inf outside the draft's tokens


def trained_looking(target, seed=0, tokens=None, layers=LAYERS):
    """A draft as training would leave it: from_target plus noise, rounded to what float16 storage keeps
    (so a save/load round trip can be compared exactly)."""
    draft = Eagle3Draft.from_target(target, torch.arange(0, V, 2) if tokens is None else tokens, layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.startswith("embed_tokens."):  # the target's own, shared
                p.copy_((p + torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05).to(torch.float16))
    return draft


# ---- the published layout ---------------------------------------------------------------------------
@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_published_head_loads_and_matches_the_same_weights_built_directly(tmp_path, target, weights_file):
    config, tensors = published_head()
    d = write_published(tmp_path / "head", config, tensors, weights_file)
    assert eagle3_format(d) == "published"
    draft = load_draft(d, target, None)
    assert isinstance(draft, Eagle3Draft) and draft.dtype == torch.float64
    assert draft.feature_layers == LAYERS and draft.embed_tokens is target.model.embed_tokens
    assert draft.token_ids.tolist() == (torch.arange(10) + tensors["d2t"]).tolist()
    assert_same(draft, built_directly(target, tensors))


def test_published_head_defaults_and_embeddings(tmp_path, target):
    """No layer ids: the EAGLE-3 default for the target's depth. An embedding table equal to the target's is
    shared (one copy in memory); a different one is the head's own and used, as vLLM does."""
    config, tensors = published_head()
    del config["eagle_config"]
    with pytest.raises(ValueError, match="a target of 2 layers has no default EAGLE-3 feature layers"):
        load_eagle3_dir(write_published(tmp_path / "default", config, tensors), target)
    config["eagle_aux_hidden_state_layer_ids"] = LAYERS  # vLLM also reads them at the top level
    same = dict(tensors, **{"embed_tokens.weight": target.model.embed_tokens.weight.detach().to(torch.float16)})
    draft = load_eagle3_dir(write_published(tmp_path / "same", config, same), target)
    assert draft.embed_tokens is target.model.embed_tokens
    own = torch.randn(V, H, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    draft = load_eagle3_dir(write_published(tmp_path / "own", config, dict(tensors, **{"embed_tokens.weight": own})), target)
    assert draft.embed_tokens is not target.model.embed_tokens
    assert torch.equal(draft.embed_tokens.weight, own.to(torch.float64))
    ref = built_directly(target, tensors)
    ref.embed_tokens = torch.nn.Embedding.from_pretrained(own.to(torch.float64))
    assert_same(draft, ref)
    export_eagle3(draft, tmp_path / "export", target)  # an own table travels with the head
    assert torch.equal(load_file(str(tmp_path / "export" / "model.safetensors"))["embed_tokens.weight"], own)
    assert_same(load_eagle3_dir(tmp_path / "export", target), ref)


def test_layer_ids_are_read_in_ascending_order_and_default_ones_stay_implicit(tmp_path, target):
    config, tensors = published_head()
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 0, 1]  # the servers concatenate 0, 1, 2
    draft = load_eagle3_dir(write_published(tmp_path / "unsorted", config, tensors), target)
    assert draft.feature_layers == LAYERS
    assert_same(draft, built_directly(target, tensors))
    draft.feature_layers = [2, 0, 1]
    with pytest.raises(ValueError, match="ascending and distinct"):
        export_eagle3(draft, tmp_path / "x")

    deep = tiny_llama(V, layers=8, seed=3)  # EAGLE-3's default for 8 layers: the inputs of 2, 4 and 5
    draft = trained_looking(deep, layers=None)
    export_eagle3(draft, tmp_path / "default", deep)
    assert "eagle_config" not in json.loads((tmp_path / "default" / "config.json").read_text())
    loaded = load_eagle3_dir(tmp_path / "default", deep)
    assert loaded.feature_layers == [2, 4, 5]
    assert_same(loaded, draft)


def test_export_writes_the_published_layout_and_loads_back(tmp_path, target):
    draft = trained_looking(target)
    export_eagle3(draft, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == V and config["draft_vocab_size"] == 12 and config["target_hidden_size"] == H
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["tie_word_embeddings"] is False and config["rope_scaling"] is None
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(tensors) == PUBLISHED_NAMES  # no embeddings: the target's are shared
    assert (torch.arange(12) + tensors["d2t"]).tolist() == list(range(0, V, 2))
    assert tensors["t2d"].nonzero().flatten().tolist() == list(range(0, V, 2))
    assert tensors["fc.weight"].dtype == torch.float16
    loaded = load_draft(str(tmp_path / "out"), target, None)
    assert_same(loaded, draft)
    export_eagle3(loaded, tmp_path / "again")  # and what it loaded exports to the same bytes
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()


# ---- specserve's format -----------------------------------------------------------------------------
def test_specserve_format_round_trip_and_its_name_follows_the_weights(tmp_path, target):
    draft = trained_looking(target)
    out = tmp_path / "tiny-eagle"
    save_eagle3(draft, target, out, {"target": "target", "method": "eagle3", "epochs": 1})
    config = json.loads((out / "specserve_draft.json").read_text())
    assert config["format"] == "specserve-eagle3-draft/1" and config["feature_layers"] == LAYERS
    assert config["method"] == "eagle3" and config["draft_config"]["hidden_size"] == H
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    assert is_eagle3_dir(out) and eagle3_format(out) == "specserve"
    assert_same(load_draft(str(out), target, None), draft)
    name = display_name(str(out))
    assert name == f"tiny-eagle@{config['weights_sha256'][:8]}"
    with torch.no_grad():
        draft.lm_head.weight[0, 0] += 1
    save_eagle3(draft, target, out, {"target": "target"})  # re-trained into the same directory
    assert display_name(str(out)) != name and display_name(str(out)).startswith("tiny-eagle@")
    with pytest.raises(ValueError, match="may not set"):
        save_eagle3(draft, target, tmp_path / "x", {"format": "mine"})


def test_published_name_carries_a_hash_of_its_weights(tmp_path, target):
    config, tensors = published_head()
    d = write_published(tmp_path / "head", config, tensors)
    name = display_name(d)
    assert name.startswith("head@") and len(name) == len("head@") + 8
    tensors["lm_head.weight"][0, 0] += 1
    write_published(tmp_path / "head", config, tensors)
    assert display_name(d) != name and display_name(d).startswith("head@")


# ---- refusals ---------------------------------------------------------------------------------------
def broken_published(change):
    config, tensors = published_head()
    change(config, tensors)
    return config, tensors


PUBLISHED_ERRORS = [
    ("layer ids", lambda c, t: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 3]),
     r"reads target layers \[0, 1, 3\]; this target has 2 layers"),
    ("hidden size", lambda c, t: c.update(target_hidden_size=48), "hidden states of size 48; this target's hidden size is 32"),
    ("vocabulary", lambda c, t: c.update(vocab_size=V + 5), f"vocabulary of {V + 5} tokens; this target's has {V}"),
    ("d2t outside", lambda c, t: t["d2t"].add_(V), "outside the target's vocabulary"),
    ("d2t length", lambda c, t: t.update(d2t=t["d2t"][:5]), "d2t has shape"),
    ("fc width", lambda c, t: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]), "do not fit its config"),
    ("two layers", lambda c, t: c.update(num_hidden_layers=2), "2 decoder layers"),
    ("norm first", lambda c, t: c.update(norm_before_residual=True), "norm_before_residual"),
    ("missing weight", lambda c, t: t.pop("midlayer.hidden_norm.weight"), "missing .'hidden_norm.weight'"),
    ("no head", lambda c, t: t.pop("lm_head.weight"), "no lm_head.weight"),
    ("embeddings shape", lambda c, t: t.update({"embed_tokens.weight": torch.zeros(V, 16)}), r"embed_tokens has shape \[23, 16\]"),
    ("no hidden size", lambda c, t: c.pop("hidden_size"), "config.json lacks 'hidden_size'"),
]


@pytest.mark.parametrize("what, change, message", PUBLISHED_ERRORS, ids=[e[0] for e in PUBLISHED_ERRORS])
def test_published_head_that_does_not_fit_is_refused(tmp_path, target, what, change, message):
    d = write_published(tmp_path / "head", *broken_published(change))
    with pytest.raises(ValueError, match=message):
        load_draft(d, target, None)


def test_missing_or_corrupt_files_and_foreign_targets_are_refused(tmp_path, target):
    config, tensors = published_head()
    d = tmp_path / "head"
    write_published(d, config, tensors)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt model.safetensors"):
        load_eagle3_dir(d, target)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing weights"):
        load_eagle3_dir(d, target)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        load_eagle3_dir(tmp_path, target)

    out = tmp_path / "mine"
    save_eagle3(trained_looking(target), target, out, {"target": "target"})
    other = tiny_llama(V, layers=2, seed=9)  # same shapes, other weights: another fingerprint
    with pytest.raises(ValueError, match="made for another target"):
        load_eagle3_dir(out, other)
    good = (out / "specserve_draft.json").read_text()
    (out / "specserve_draft.json").write_text(good.replace('"feature_layers"', '"layers"'))
    with pytest.raises(ValueError, match="corrupt specserve_draft.json"):
        load_eagle3_dir(out, target)
    (out / "specserve_draft.json").write_text(good)
    (out / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="corrupt model.safetensors"):
        load_eagle3_dir(out, target)
    (out / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing model.safetensors"):
        load_eagle3_dir(out, target)


def test_a_target_of_another_architecture_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    d = write_published(tmp_path / "head", *published_head())
    with pytest.raises(ValueError, match="need a Llama-architecture target; this one is 'qwen2'"):
        load_draft(d, qwen, None)


# ---- the CLI ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["published", "specserve"])
def test_generate_with_an_eagle3_directory_gives_the_target_alone_tokens(tmp_path, tiny_model_dirs, target, fmt):
    head = tmp_path / "head"
    draft = trained_looking(target, tokens=torch.arange(V))
    if fmt == "published":
        export_eagle3(draft, head)
    else:
        save_eagle3(draft, target, head, {"target": "target"})
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "the cat sat on the mat"}, {"messages": [{"role": "user", "content": "the dog ran"}]},
        {"prompt": "a big red dog", "max_tokens": 5}]))

    def generate(*extra):
        out = tmp_path / f"out{len(extra)}.jsonl"
        assert main(["generate", "--prompts", str(prompts), "--out", str(out), "--target", tiny_model_dirs["target"],
                     "--max-tokens", "16", "--batch-size", "2", *extra]) == 0
        return [json.loads(x) for x in out.read_text().splitlines()]

    plain = generate("--policy", "none")
    spec = generate("--draft", str(head), "--policy", "fixed:3")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["proposed"] for r in spec) > 0
