"""EAGLE-3 drafts on disk, in two formats; `--draft DIR` loads either (serve_app.models.load_draft).

specserve's own format (`save_eagle3`; what `specserve distill --method eagle3` writes):
  specserve_draft.json  format "specserve-eagle3-draft/1", the target's fingerprint, feature_layers,
                        target_hidden_size, num_tokens, draft_config (the one layer's Llama settings),
                        weights_sha256, and whatever the training records about itself
  model.safetensors     the draft's own weights under Eagle3Draft's names (fc, the layer, the norms,
                        lm_head, token_ids), float16; the embeddings are the target's, taken at load time

The published layout (`export_eagle3`): what SafeAILab/EAGLE and SpecForge write and vLLM
(model_executor/models/llama_eagle3.py) and SGLang (srt/models/llama_eagle3.py) load:
  config.json           architectures ["LlamaForCausalLMEagle3"] (vLLM also maps "Eagle3LlamaForCausalLM"),
                        the layer's Llama settings (hidden_size, intermediate_size, heads, head_dim,
                        rms_norm_eps, rope_theta / rope_scaling, max_position_embeddings), vocab_size (the
                        target's), draft_vocab_size, optional target_hidden_size, optional
                        eagle_config.eagle_aux_hidden_state_layer_ids (default: the inputs of target layers
                        2, N//2 and N-3)
  model.safetensors or pytorch_model.bin
                        fc.weight, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
                        input_layernorm, hidden_norm, post_attention_layernorm}.weight, norm.weight,
                        lm_head.weight, d2t (draft id i is target id i + d2t[i]); t2d is ignored.

Embeddings: EAGLE-3 trains with the target's embeddings frozen, so a head shares the target's. A head
that carries `embed_tokens.weight` anyway gets the target's when the two agree up to storage rounding
(no second copy in memory), and its own table otherwise, as vLLM does (SGLang always takes the
target's); a head whose hidden size differs from the target's must carry its own.

Layer ids: id i is the residual stream entering target layer i, as vLLM reads explicit ids (SGLang
reads them one layer later: it captures the input of layer i + 1); both servers concatenate the layers
in ascending order. Id N of an N-layer target is the last layer's output before the final norm, which
specserve captures and neither server does. The target must be a Llama-architecture model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from serve_app.drafting.layers import CONFIG_FILE, WEIGHTS_FILE, draft_id, target_fingerprint

log = logging.getLogger(__name__)

FORMAT = "specserve-eagle3-draft/1"
HF_CONFIG = "config.json"
TORCH_WEIGHTS = "pytorch_model.bin"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# float16, not bfloat16: three more mantissa bits for weights that are all far inside its range (a
# non-finite value after the cast is refused), and what the published EAGLE-3 heads ship in.
STORAGE_DTYPE = torch.float16
# Settings read from a draft config; the rest take LlamaConfig's defaults, as in vLLM and SGLang
# (so a head whose config names no rope_theta gets 10000, the base it was trained with).
LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
                "rope_parameters", "attention_bias", "mlp_bias")
TOP_LEVEL = ("fc.", "norm.", "lm_head.", "embed_tokens.")  # published names outside `midlayer.`


# ---- which format a directory holds ----------------------------------------------------------------
def eagle3_format(path: str | Path) -> str | None:
    """Which EAGLE-3 format a directory holds: "specserve", "published", or None (not an EAGLE-3 draft)."""
    path = Path(path)
    if _json_or_empty(path / CONFIG_FILE).get("format") == FORMAT:
        return "specserve"
    if set(_json_or_empty(path / HF_CONFIG).get("architectures") or []) & set(ARCHITECTURES):
        return "published"
    return None


def is_eagle3_dir(path: str | Path) -> bool:
    return eagle3_format(path) is not None


def eagle3_id(path: str | Path) -> str | None:
    """The first 8 hex digits of an EAGLE-3 directory's weights hash (None if it is not one): recorded
    in specserve's format, computed from the weights file for the published one."""
    fmt = eagle3_format(path)
    if fmt == "specserve":
        return draft_id(path)
    weights = _published_weights(Path(path)) if fmt == "published" else None
    if weights is None:
        return None
    st = weights.stat()
    return _cached_sha256(str(weights), st.st_size, st.st_mtime_ns)[:8]


# ---- saving ----------------------------------------------------------------------------------------
def save_eagle3(draft, target: nn.Module, out_dir: str | Path, meta: dict) -> None:
    """Write `draft` in specserve's format. `meta` (the training's own record: recipe, losses, timings)
    goes into specserve_draft.json beside the format's fields, which it may not override."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own_embeddings = draft.embed_tokens is not target.get_input_embeddings()
    state = _own_state(draft, own_embeddings)
    state["token_ids"] = draft.token_ids
    save_file(_for_storage(state), str(out / WEIGHTS_FILE))
    config = {
        "format": FORMAT, "target_fingerprint": target_fingerprint(target),
        "feature_layers": list(draft.feature_layers), "target_hidden_size": _target_hidden(draft),
        "num_tokens": int(draft.token_ids.numel()), "draft_config": llama_fields(draft.config),
        # the weights' hash names the draft in profiles: a re-trained head makes old profiles stale
        "weights_sha256": _sha256(out / WEIGHTS_FILE),
    }
    clash = sorted(set(meta) & set(config))
    if clash:
        raise ValueError(f"save_eagle3: meta may not set the format's own fields {clash}")
    (out / CONFIG_FILE).write_text(json.dumps({**config, **meta}, indent=1))


def export_eagle3(draft, out_dir: str | Path, target: nn.Module | None = None) -> None:
    """Write `draft` in the published layout (config.json + model.safetensors) that vLLM and SGLang serve
    next to its target. With `target`: embeddings are written only if they are the draft's own, and layer
    ids that are the EAGLE-3 default are left out (vLLM and SGLang then both take that default; explicit
    ids SGLang reads one layer later than vLLM). Without: no embeddings, ids always written."""
    from safetensors.torch import save_file

    layers = [int(i) for i in draft.feature_layers]
    if layers != sorted(set(layers)):  # both servers concatenate the target's layers in ascending order
        raise ValueError(f"export_eagle3: feature layers {layers} must be ascending and distinct")
    own_embeddings = target is not None and draft.embed_tokens is not target.get_input_embeddings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {(k if k.startswith(TOP_LEVEL) else f"midlayer.{k}"): v for k, v in _own_state(draft, own_embeddings).items()}
    token_ids = draft.token_ids.cpu()
    state["d2t"] = token_ids - torch.arange(len(token_ids))  # draft id i -> target id i + d2t[i]
    # t2d: the inverse as a mask over the target's vocabulary; the servers skip it, EAGLE's trainer reads it
    state["t2d"] = torch.zeros(int(draft.vocab_size), dtype=torch.bool).index_fill_(0, token_ids, True)
    save_file(_for_storage(state), str(out / WEIGHTS_FILE))
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1,
        **llama_fields(draft.config),
        "draft_vocab_size": int(token_ids.numel()), "target_hidden_size": _target_hidden(draft),
        # SGLang takes the embeddings as the head when this is true: the head here is its own
        "tie_word_embeddings": False, "torch_dtype": str(STORAGE_DTYPE).removeprefix("torch."),
    }
    if target is None or not _is_default(layers, len(target.model.layers)):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}
    (out / HF_CONFIG).write_text(json.dumps(config, indent=1))


def llama_fields(config) -> dict:
    """The draft layer's Llama settings as plain JSON. Rope goes out as rope_theta + rope_scaling
    (null for plain rope): what transformers 4 and 5, vLLM and SGLang all read."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    plain = rope.get("rope_type", rope.get("type", "default")) == "default"
    heads = config.num_attention_heads
    return {
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
        "rope_theta": theta, "rope_scaling": None if plain else rope,
        "attention_bias": bool(getattr(config, "attention_bias", False)), "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }


# ---- loading ---------------------------------------------------------------------------------------
def load_eagle3_dir(path: str | Path, target: nn.Module):
    """An Eagle3Draft for `target` from a directory in either format, in the target's dtype and on its
    device. ValueError, saying what does not fit, for a draft of another target, layer ids or a hidden
    size or vocabulary that do not fit this target, and missing or corrupt files."""
    path = Path(path)
    fmt = eagle3_format(path)
    if fmt is not None:
        _require_llama(path, target)
    if fmt == "specserve":
        return _load_specserve(path, target)
    if fmt == "published":
        return _load_published(path, target)
    raise ValueError(f"{path} is not an EAGLE-3 draft: no {CONFIG_FILE} of format {FORMAT!r}, "
                     f"no {HF_CONFIG} with architectures {list(ARCHITECTURES)}")


def _load_specserve(path: Path, target: nn.Module):
    config = _json_or_empty(path / CONFIG_FILE)
    try:
        layers = [int(i) for i in config["feature_layers"]]
        target_hidden, num_tokens = int(config["target_hidden_size"]), int(config["num_tokens"])
        fields = dict(config["draft_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"draft {path}: corrupt {CONFIG_FILE}: {e!r}") from None
    fp = target_fingerprint(target)
    if config.get("target_fingerprint") != fp:
        raise ValueError(f"draft {path} was made for another target ({config.get('target', '?')}, fingerprint "
                         f"{config.get('target_fingerprint')}); this target is {fp}")
    state = _read_weights(path, path / WEIGHTS_FILE)
    token_ids = state.pop("token_ids", None)
    if token_ids is None or token_ids.numel() != num_tokens:
        raise ValueError(f"draft {path}: token set missing or not {num_tokens} long")
    return _build(path, target, fields, layers, target_hidden, state, token_ids)


def _load_published(path: Path, target: nn.Module):
    config = _json_or_empty(path / HF_CONFIG)
    try:
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{config['num_hidden_layers']} decoder layers (specserve's Eagle3Draft has one)")
        if config.get("norm_before_residual"):
            raise ValueError("norm_before_residual (Eagle3Draft's residual is the fused feature before its norm)")
        eagle = config.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError("use_aux_hidden_state false (no fc over the target's layers)")
        vocab = int(config["vocab_size"])
        target_hidden = int(config.get("target_hidden_size") or config["hidden_size"])
        draft_vocab = int(config.get("draft_vocab_size") or vocab)
        layers = (config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
                  or _default_layers(target))
        layers = sorted(int(i) for i in layers)  # vLLM and SGLang concatenate them in ascending order
    except KeyError as e:
        raise ValueError(f"draft {path}: {HF_CONFIG} lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"draft {path}: {HF_CONFIG} not supported: {e}") from None
    weights = _published_weights(path)
    if weights is None:
        raise ValueError(f"draft {path}: missing weights ({WEIGHTS_FILE} or {TORCH_WEIGHTS})")
    state = _read_weights(path, weights)
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)  # the inverse map as a mask over the target's vocabulary: d2t says it all
    if "lm_head.weight" not in state:
        raise ValueError(f"draft {path}: no lm_head.weight (a head that borrows the target's is not supported)")
    if d2t is not None and d2t.shape != (draft_vocab,):
        raise ValueError(f"draft {path}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {draft_vocab}")
    token_ids = torch.arange(draft_vocab) + (d2t.long() if d2t is not None else 0)  # no d2t: the first ids
    state = {name.removeprefix("midlayer."): t for name, t in state.items()}
    return _build(path, target, config, layers, target_hidden, state, token_ids)


def _build(path: Path, target: nn.Module, fields: dict, layers: list[int], target_hidden: int,
           state: dict[str, torch.Tensor], token_ids: torch.Tensor):
    """Check the draft against the target, then assemble it from Eagle3Draft-named weights."""
    from transformers import LlamaConfig

    from serve_app.drafting.eagle3 import Eagle3Draft

    vocab = int(fields["vocab_size"])
    _check_target(path, target, layers, target_hidden, vocab)
    if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
        raise ValueError(f"draft {path}: its token ids fall outside the target's vocabulary of {vocab}")
    if torch.unique(token_ids).numel() != token_ids.numel():
        raise ValueError(f"draft {path}: its token ids repeat (a corrupt d2t or token set)")
    cfg = LlamaConfig(num_hidden_layers=1, **{k: v for k, v in fields.items() if k in LLAMA_FIELDS and v is not None})
    cfg._attn_implementation = "sdpa"
    embed = _embeddings(path, target, state.pop("embed_tokens.weight", None), cfg)
    draft = Eagle3Draft(cfg, target_hidden, layers, token_ids, embed)
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes: e.g. fc not len(layers) x target hidden size wide
        raise ValueError(f"draft {path}: weights do not fit its config: {e}") from None
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"draft {path}: weights do not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    w = target.get_input_embeddings().weight  # the draft runs where and as the shared table does
    return draft.to(device=w.device, dtype=w.dtype).eval()


def _require_llama(path: Path, target: nn.Module) -> None:
    """The features are captured at the inputs of target.model.layers and the embeddings shared: checked
    on Llama targets only, so others are refused rather than trusted."""
    kind = getattr(getattr(target, "config", None), "model_type", None)
    if kind != "llama":
        raise ValueError(f"draft {path}: EAGLE-3 drafts need a Llama-architecture target; this one is "
                         f"{kind or type(target).__name__!r}")


def _check_target(path: Path, target: nn.Module, layers: list[int], target_hidden: int, vocab: int) -> None:
    tcfg = target.config
    n = len(target.model.layers)
    if not layers or any(not 0 <= i <= n for i in layers):
        raise ValueError(f"draft {path} reads target layers {layers}; this target has {n} layers (ids 0..{n})")
    if target_hidden != tcfg.hidden_size:
        raise ValueError(f"draft {path} reads target hidden states of size {target_hidden}; this target's "
                         f"hidden size is {tcfg.hidden_size}")
    tv = target.get_output_embeddings().weight.shape[0]
    if vocab != tv:
        raise ValueError(f"draft {path} is for a vocabulary of {vocab} tokens; this target's has {tv}")


def _embeddings(path: Path, target: nn.Module, table: torch.Tensor | None, cfg) -> nn.Embedding:
    """The token embeddings the draft layer reads: the target's, unless the head carries a table of its
    own that differs from them (see the module docstring)."""
    shared = target.get_input_embeddings()
    want = (cfg.vocab_size, cfg.hidden_size)
    if table is None:
        if tuple(shared.weight.shape) != want:
            raise ValueError(f"draft {path}: its layer reads embeddings of shape {list(want)} and brings none; "
                             f"the target's are {list(shared.weight.shape)}")
        return shared
    if tuple(table.shape) != want:
        raise ValueError(f"draft {path}: embed_tokens has shape {list(table.shape)}, its config says {list(want)}")
    w = shared.weight
    if w.shape == table.shape and torch.allclose(table.to(w.device, w.dtype), w, rtol=1e-2, atol=1e-3):
        return shared  # a frozen copy of the target's (how EAGLE-3 trains): share it
    log.info("draft %s brings its own embeddings (they differ from the target's): using them", path)
    return nn.Embedding.from_pretrained(table, freeze=True)


# ---- helpers ---------------------------------------------------------------------------------------
def _own_state(draft, with_embeddings: bool) -> dict[str, torch.Tensor]:
    """The draft's weights under Eagle3Draft's names, without the shared embeddings unless asked."""
    return {k: v for k, v in draft.state_dict().items() if with_embeddings or not k.startswith("embed_tokens.")}


def _target_hidden(draft) -> int:
    return draft.fc.in_features // len(draft.feature_layers)


def _for_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.to(STORAGE_DTYPE)
            if not torch.isfinite(t).all():
                raise ValueError(f"weight {name} does not fit {STORAGE_DTYPE} (values beyond its range)")
        out[name] = t.contiguous()
    return out


def _published_weights(path: Path) -> Path | None:
    for name in (WEIGHTS_FILE, TORCH_WEIGHTS):
        if (path / name).is_file():
            return path / name
    return None


def _read_weights(path: Path, file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)  # weights only: no code runs
        if not isinstance(state, dict):
            raise TypeError(f"holds a {type(state).__name__}, not a dict of tensors")
        return state
    except FileNotFoundError:
        raise ValueError(f"draft {path}: missing {file.name}") from None
    except Exception as e:  # safetensors and torch.load raise their own error types for damaged files
        raise ValueError(f"draft {path}: corrupt {file.name}: {e}") from None


def _json_or_empty(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _default_layers(target: nn.Module) -> list[int]:
    from serve_app.drafting.eagle3 import default_feature_layers

    return default_feature_layers(len(target.model.layers))


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=16)
def _cached_sha256(file: str, size: int, mtime_ns: int) -> str:
    """A published head's weights can be GBs, and display names are asked for often: hash a file once
    per size and modification time."""
    return _sha256(Path(file))


def _is_default(layers: list[int], num_layers: int) -> bool:
    """Whether `layers` are EAGLE-3's defaults for a target this deep (a shallow target has none)."""
    from serve_app.drafting.eagle3 import default_feature_layers

    try:
        return layers == default_feature_layers(num_layers)
    except ValueError:
        return False
