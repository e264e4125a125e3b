"""A small draft with a reduced-vocabulary head (as in FR-Spec), sharing the target's embeddings.

The draft is a few decoder layers over the target's (frozen, shared) token embeddings, a final norm,
and a head over only the N most frequent tokens of the target's own outputs. It returns full-vocabulary
logits with -inf outside that set, so it proposes only within the set while the target still verifies
over the full vocabulary: greedy decoding stays identical to the target's, and rejection sampling
stays exact (q is simply zero outside the set).

On disk (a directory): `specserve_draft.json` (config + the target's fingerprint) and
`model.safetensors` (the draft's own weights: layers, norm, head, token set). Shared weights are
taken from the target at load time.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

CONFIG_FILE = "specserve_draft.json"
WEIGHTS_FILE = "model.safetensors"


class ReducedVocabDraft(nn.Module):
    def __init__(self, target: nn.Module, num_layers: int, token_ids: torch.Tensor, init_layers: list[int] | None = None):
        super().__init__()
        tcfg = target.config
        cfg = copy.deepcopy(tcfg)
        cfg.num_hidden_layers = num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:num_layers]
        self.config = cfg
        base = target.model
        # A decoder of num_layers, built empty, then filled: embeddings and rotary shared with the
        # target, layers and norm copied (trainable), head over the reduced token set.
        with torch.device("meta"):
            body = type(base)(cfg)
        body.embed_tokens = base.embed_tokens
        body.rotary_emb = base.rotary_emb
        picks = init_layers if init_layers is not None else list(range(num_layers))
        body.layers = nn.ModuleList(copy.deepcopy(base.layers[i]) for i in picks)
        for i, layer in enumerate(body.layers):
            layer.self_attn.layer_idx = i  # the cache is indexed by the draft's own layer numbers
        body.norm = copy.deepcopy(base.norm)
        self.body = body
        full_head = target.get_output_embeddings().weight  # [V, H]
        self.vocab_size = full_head.shape[0]
        self.register_buffer("token_ids", token_ids.clone().long(), persistent=False)  # [N]
        self.head = nn.Linear(full_head.shape[1], len(token_ids), bias=False, dtype=full_head.dtype)
        with torch.no_grad():
            self.head.weight.copy_(full_head[token_ids])
        self.body.embed_tokens.weight.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def get_output_embeddings(self):
        return self.head

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, N]
        return self.head(hidden)

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=False, logits_to_keep: int = 0, **kwargs):
        out = self.body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                        past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):  # the positions to keep ([N])
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        small = self.reduced_logits(hidden)  # [B, T, N]
        full = small.new_full((*small.shape[:2], self.vocab_size), float("-inf"))
        full[..., self.token_ids] = small
        return CausalLMOutputWithPast(logits=full, past_key_values=past_key_values)

    def own_state(self) -> dict[str, torch.Tensor]:
        """The draft's own weights (everything but the shared embeddings)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("body.embed_tokens")}
        state["token_ids"] = self.token_ids
        return state


def target_fingerprint(target: nn.Module) -> str:
    """Identifies the target whose embeddings a draft shares: its shape and layer count, and the
    sign pattern of a slice of its embeddings (unchanged when the target loads in another dtype)."""
    emb = target.get_input_embeddings().weight.detach()
    signs = (emb[:: max(1, emb.shape[0] // 256), :64] > 0).cpu().numpy()
    digest = hashlib.sha256(signs.tobytes()).hexdigest()[:16]
    layers = getattr(target.config, "num_hidden_layers", 0)
    return f"{type(target).__name__}-{emb.shape[0]}x{emb.shape[1]}x{layers}-{digest}"


def save_draft(draft: ReducedVocabDraft, target: nn.Module, out_dir: str | Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in draft.own_state().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    # The weights' hash names this draft in profiles, so a re-distilled draft in the same directory
    # is not steered by a profile measured with its predecessor.
    digest = hashlib.sha256((out / WEIGHTS_FILE).read_bytes()).hexdigest()
    config = {"format": "specserve-reduced-vocab-draft/1", "num_layers": len(draft.body.layers),
              "num_tokens": int(draft.token_ids.numel()), "target_fingerprint": target_fingerprint(target),
              "weights_sha256": digest, **meta}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def is_draft_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def draft_id(path: str | Path) -> str | None:
    """The first 8 hex digits of a draft directory's weights hash (None if unreadable or absent)."""
    try:
        return str(json.loads((Path(path) / CONFIG_FILE).read_text())["weights_sha256"])[:8]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_draft_dir(path: str | Path, target: nn.Module) -> ReducedVocabDraft:
    """Load a distilled draft for `target`; clear errors for missing, corrupt or foreign drafts."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        num_layers, num_tokens = int(config["num_layers"]), int(config["num_tokens"])
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a specserve draft: no {CONFIG_FILE}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"draft {path}: corrupt {CONFIG_FILE}: {e}") from None
    fp = target_fingerprint(target)
    if config.get("target_fingerprint") != fp:
        raise ValueError(
            f"draft {path} was made for another target ({config.get('target', '?')}, fingerprint "
            f"{config.get('target_fingerprint')}); this target is {fp}"
        )
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except FileNotFoundError:
        raise FileNotFoundError(f"draft {path}: missing {WEIGHTS_FILE}") from None
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"draft {path}: corrupt {WEIGHTS_FILE}: {e}") from None
    token_ids = state.pop("token_ids", None)
    if token_ids is None or token_ids.numel() != num_tokens:
        raise ValueError(f"draft {path}: token set missing or not {num_tokens} long")
    draft = ReducedVocabDraft(target, num_layers, token_ids)
    dtype = target.get_output_embeddings().weight.dtype
    missing, unexpected = draft.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("body.embed_tokens")]
    if missing or unexpected:
        raise ValueError(f"draft {path}: weights do not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return draft.to(target.get_output_embeddings().weight.device).eval()
