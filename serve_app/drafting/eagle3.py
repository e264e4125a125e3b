"""An EAGLE-3 draft: one decoder layer that drafts from the target's own hidden states.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) reads the target's residual stream at three layers
(by default the inputs of layers 2, N//2 and N-3 of an N-layer target), fuses them (fc: 3H -> H), and
runs ONE decoder layer over [norm(embedding of the next token); norm(fused feature)]; a final norm
and a head over a reduced draft vocabulary predict the token after it. The layer's output state
(before the final norm) stands in for the target's feature in the following draft steps, so k
drafts cost k small forwards. Training unrolls those steps ("training-time test") so the layer
learns to feed on its own states.

Position p of the draft pairs the target's feature f_p (what the target computed at token p) with
the embedding of token p + 1 and predicts token p + 2. The head covers `token_ids` (draft id i is
target id token_ids[i]); logits come back over the full vocabulary with -inf elsewhere, so the draft
proposes only inside its set while the target verifies over everything: greedy stays identical to
the target, and rejection sampling stays exact.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding


def default_feature_layers(num_layers: int) -> list[int]:
    """The target layers whose inputs EAGLE-3 reads: a low, a middle and a high one."""
    layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) < 3 or min(layers) < 0:
        raise ValueError(f"a target of {num_layers} layers has no default EAGLE-3 feature layers "
                         "(2, N//2, N-3 must be distinct): name them explicitly")
    return layers


class Float32Rotary(LlamaRotaryEmbedding):
    """Llama's rotary embedding with its frequencies (inv_freq) kept in float32 through every cast of
    the draft (`.to(torch.bfloat16)`, `.half()`, `.to(device, dtype)`, cast_own, the loader's cast to
    the target's dtype). In bfloat16 (8 mantissa bits) an inverse frequency is off by up to 2^-9 of
    itself, so position p's angle is off by up to p x inv_freq x 2^-9 rad: radians at a few thousand
    tokens for the fast-turning frequencies. The draft's rotations would then disagree with the
    target's (whose loader keeps inv_freq in float32), and acceptance would fall silently as contexts
    grow. cos and sin still come out in the input's dtype."""

    def _apply(self, fn, recurse=True):
        kept = dict(self._buffers)  # the float32 frequencies, before fn casts them
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if before is not None and after is not None and before.is_floating_point():
                # where fn put them (a device move applies), as float32 from the unrounded values
                self._buffers[name] = before.to(device=after.device, dtype=torch.float32)
        return self


class Eagle3Draft(nn.Module):
    def __init__(self, config, target_hidden_size: int, feature_layers: list[int], token_ids: torch.Tensor,
                 embed_tokens: nn.Embedding):
        """config: a LlamaConfig for the draft's one layer (hidden size, heads, rope, vocab_size = the
        target's full vocabulary). embed_tokens: the target's embeddings, shared and frozen."""
        super().__init__()
        self.config = config
        self.feature_layers = list(feature_layers)
        self.vocab_size = config.vocab_size
        h = config.hidden_size
        self.fc = nn.Linear(len(feature_layers) * target_hidden_size, h, bias=False)
        self.embed_tokens = embed_tokens
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        # q, k and v read [embedding; feature]: twice the hidden size
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Float32Rotary(config)
        self.register_buffer("token_ids", token_ids.clone().long(), persistent=False)  # [N] draft id -> target id
        self.lm_head = nn.Linear(h, len(token_ids), bias=False)
        self.embed_tokens.weight.requires_grad_(False)

    @property
    def worker_class(self):
        from serve_app.drafting.eagle3_worker import EagleWorker

        return EagleWorker

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_output_embeddings(self):
        return self.lm_head

    @classmethod
    def from_target(cls, target: nn.Module, token_ids: torch.Tensor, feature_layers: list[int] | None = None):
        """A fresh draft for `target`: its one layer starts from the target's last layer (the hidden half of
        q/k/v; the embedding half starts at zero), its head from the target's head rows of `token_ids`, and
        fc from picking the last feature layer's stream, so before training it already drafts like a
        shortcut through the target's top."""
        tcfg = target.config
        layers = feature_layers or default_feature_layers(tcfg.num_hidden_layers)
        cfg = copy.deepcopy(tcfg)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:1]
        cfg._attn_implementation = "sdpa"
        base = target.model
        draft = cls(cfg, tcfg.hidden_size, layers, token_ids, base.embed_tokens).cast_own(target.dtype)
        last = base.layers[-1]
        h = tcfg.hidden_size
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                new, old = getattr(draft.self_attn, name), getattr(last.self_attn, name)
                new.weight.zero_()
                new.weight[:, h:] = old.weight
                if new.bias is not None:
                    new.bias.copy_(old.bias)
            draft.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
            draft.mlp.load_state_dict(last.mlp.state_dict())
            draft.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
            draft.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
            draft.norm.load_state_dict(base.norm.state_dict())
            draft.fc.weight.zero_()
            draft.fc.weight[:, -h:] = torch.eye(h)
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[token_ids])
        return draft.eval()

    def cast_own(self, dtype: torch.dtype) -> "Eagle3Draft":
        """Cast the draft's own weights, not the target's embeddings it shares (`.to(dtype)` would cast
        those too, under the target's feet)."""
        for name, module in self.named_children():
            if name != "embed_tokens":
                module.to(dtype)
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., len(layers) * H_target] -> [..., H]
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for every position given.

        input_ids [B, T]: token p + 1 at draft position p; hidden [B, T, H]: the fused target feature
        f_p, or the draft's own state from the step before; position_ids [B, T]; attention_mask as the
        model's attention implementation wants it ([B, 1, T, S]); past_key_values: a cache the layer
        writes its keys and values into (layer index 0).
        Returns (logits [B, K, V] over the full vocabulary for the last K = logits_to_keep positions,
        all when 0; -inf outside the draft's tokens, and state [B, T, H] to feed the next step).
        """
        state = self.step(input_ids, hidden, position_ids, attention_mask, past_key_values)
        kept = state[:, -logits_to_keep:] if logits_to_keep else state
        return self.full_logits(kept), state

    def full_logits(self, state: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        """Logits over the target's whole vocabulary: -inf outside the draft's tokens."""
        return self.spread(self.reduced_logits(state))

    def spread(self, small: torch.Tensor) -> torch.Tensor:  # [..., N] -> [..., V]
        """Reduced logits over the target's whole vocabulary: -inf outside the draft's tokens."""
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_ids] = small
        return full

    def step(self, input_ids, hidden, position_ids, attention_mask=None, past_key_values=None,
             **attention_kwargs) -> torch.Tensor:
        """The decoder layer alone: [B, T] ids and [B, T, H] features -> [B, T, H] output state
        (attention_kwargs go to the attention implementation, e.g. a paged forward's batch)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        rope = self.rotary_emb(hidden, position_ids)
        attn, _ = self.self_attn(x, position_embeddings=rope, attention_mask=attention_mask,
                                 past_key_values=past_key_values, **attention_kwargs)
        h = hidden + attn  # the residual stream continues from the feature, not from the embedding
        return h + self.mlp(self.post_attention_layernorm(h))

    def reduced_logits(self, state: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., N]
        return self.lm_head(self.norm(state))
