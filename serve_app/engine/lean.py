"""A Llama decoder's packed forward over the paged pool, without transformers' per-layer wrappers.

transformers runs a decoder layer through several wrappers (output recording, keyword deprecation,
gradient-checkpointing dispatch, a causal-mask builder, the attention-interface lookup) and applies
rotary embeddings to queries and keys as a dozen small ops each. At batch 1 on a 2-core CPU skipping
them took a sixth off a step (results/lean-forward-cpu-2core.md). This forward calls the same modules for what carries
weights (norms, projections, MLP) and does the rest in few ops: one rotary for queries and keys
together, keys and values written straight into the pool, attention by the pool's backend.

Exact: the arithmetic is the model's own op for op (norms and MLP are its modules; rotary is
`x * cos + rotate_half(x) * sin` with rotate_half's negation moved onto sin, which IEEE rounding
leaves bit for bit the same), so outputs equal the wrapped forward's in any dtype.

Only plain Llama decoders take this path (`supports`): a model with anything else in its layers
(query/key norms, sliding windows, biases it adds elsewhere) runs transformers' forward.
"""

from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama as llama

from serve_app.engine import decoder_ops, direct
from serve_app.engine.packing import FusedPart


def supports(model) -> bool:
    """model is a transformers Llama causal LM whose layers are the stock Llama modules."""
    decoder = getattr(model, "model", None)
    if type(model) is not llama.LlamaForCausalLM or type(decoder) is not llama.LlamaModel:
        return False
    if len(decoder.layers) != model.config.num_hidden_layers:
        return False
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        return False  # split over devices: accelerate's hooks on each layer move its inputs
    return all(type(layer) is llama.LlamaDecoderLayer and type(layer.self_attn) is llama.LlamaAttention
               and type(layer.mlp) is llama.LlamaMLP for layer in decoder.layers)


def forward(model, ids: torch.Tensor, pos: torch.Tensor, batch, index: torch.Tensor,  # ids, pos [T]; index [N]
            capture: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
    """The final-norm hidden states [N, hidden] of the packed tokens at `index` (pos: their positions;
    batch: `kv.pack`'s PackedBatch, whose slots receive this forward's keys and values). capture: layer
    id -> filled with the residual stream entering that layer ([T, hidden]; the layer count: the last
    layer's output, before the final norm)."""
    decoder = model.model
    cache = batch.cache
    h = decoder.embed_tokens(ids)  # [T, hidden]
    cos, sin, half = rotation(decoder.rotary_emb, h, pos)  # [T, D] each, in h's dtype
    ops = decoder_ops.fits(h) and model.config.hidden_act == "silu"
    layers = decoder.layers
    calls = direct.layers(model, h.dtype) if ops and cache.attention == "gather" \
        and layers[0].self_attn.head_dim % 16 == 0 else None
    if calls is not None:  # the same kernels, called without the modules' wrappers
        h = calls.forward(h, cos, sin, batch, capture)
        if capture is not None and len(layers) in capture:
            capture[len(layers)] = h
        return decoder.norm(h[index])
    x = None  # with ops: the next layer's normed input, computed with the residual add that ends a layer
    for i, layer in enumerate(layers):
        if capture is not None and i in capture:
            capture[i] = h
        if not ops:
            h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin, half, batch, cache, False)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            continue
        if x is None:
            x = decoder_ops.add_rms_norm(h, None, *_norm(layer.input_layernorm))[1]
        a = _attention(layer.self_attn, x, cos, sin, half, batch, cache, True)
        h, x = decoder_ops.add_rms_norm(h, a, *_norm(layer.post_attention_layernorm))
        m = _mlp(layer.mlp, x)
        if i + 1 < len(layers):
            h, x = decoder_ops.add_rms_norm(h, m, *_norm(layers[i + 1].input_layernorm))
        else:
            h = h + m
    if capture is not None and len(layers) in capture:
        capture[len(layers)] = h
    return decoder.norm(h[index])


def rotation(rotary_emb, like: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos [T, D], sin [T, D] with rotate_half's sign on its first half, half) for positions pos [T]."""
    cos, sin = rotary_emb(like, pos[None])  # [1, T, D] each, in like's dtype
    half = cos.shape[-1] // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1), half


def draft_supports(draft) -> bool:
    """An EAGLE-3 draft (`drafting.eagle3.Eagle3Draft`) whose layer is the stock Llama modules: `draft_step` runs it."""
    return type(draft.self_attn) is llama.LlamaAttention and type(draft.mlp) is llama.LlamaMLP \
        and all(type(n) is llama.LlamaRMSNorm for n in (draft.input_layernorm, draft.hidden_norm,
                                                        draft.post_attention_layernorm, draft.norm)) \
        and draft.config.hidden_act == "silu"


def draft_step(draft, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, batch) -> torch.Tensor:
    """`Eagle3Draft.step` over a packed batch (ids, pos [T]; hidden [T, H]) -> state [T, H], without transformers'
    wrappers: the same modules for what carries weights, this file's attention (rotary, the pool write and the
    paged attention in few calls) and the C norms where they run."""
    emb = draft.embed_tokens(ids).to(hidden.dtype)
    cos, sin, half = rotation(draft.rotary_emb, hidden, pos)
    ops = decoder_ops.fits(hidden)
    if ops:
        x = torch.cat([decoder_ops.add_rms_norm(emb, None, *_norm(draft.input_layernorm))[1],
                       decoder_ops.add_rms_norm(hidden, None, *_norm(draft.hidden_norm))[1]], dim=-1)  # [T, 2H]
        a = _attention(draft.self_attn, x, cos, sin, half, batch, batch.cache, True)
        h, x = decoder_ops.add_rms_norm(hidden, a, *_norm(draft.post_attention_layernorm))
        return h + _mlp(draft.mlp, x)
    x = torch.cat([draft.input_layernorm(emb), draft.hidden_norm(hidden)], dim=-1)
    h = hidden + _attention(draft.self_attn, x, cos, sin, half, batch, batch.cache, False)
    return h + draft.mlp(draft.post_attention_layernorm(h))


def _norm(norm) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon


def _attention(attn, x: torch.Tensor, cos, sin, half: int, batch, cache, ops: bool) -> torch.Tensor:  # x [T, hidden]
    t, d = x.shape[0], attn.head_dim
    heads = attn.config.num_attention_heads
    qkv = _qkv(attn, x).view(t, -1, d)  # [T, H + 2 KV, D], a new tensor
    kv_heads = (qkv.shape[1] - heads) // 2
    if ops and d % 16 == 0:  # queries and keys rotated in place, then keys and values to the pool, in one pass
        k_pool, v_pool = cache.pools(attn.layer_idx, qkv[:, heads:heads + kv_heads])
        if batch.last_slot >= k_pool.shape[0]:
            raise RuntimeError(f"slot {batch.last_slot} past the pool's {k_pool.shape[0]}")  # never: blocks are reserved
        decoder_ops.rotary(qkv, heads + kv_heads, cos, sin, (k_pool, v_pool, batch.slots, heads))
        qk = qkv
    else:  # queries and keys: one rotary for both
        qk = qkv[:, :heads + kv_heads]
        qk = qk * cos[:, None] + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin[:, None]
        cache.write(attn.layer_idx, qk[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], batch.slots)
    out = cache.attend(attn.layer_idx, qk[:, :heads], batch.layout, attn.scaling)  # [T, H, D]
    return attn.o_proj(out.reshape(t, heads * d))


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
    """down(silu(gate(x)) * up(x)), gate and up in one product when packing fused them."""
    return mlp.down_proj(decoder_ops.silu_mul(_side_by_side(x, mlp.gate_proj, mlp.up_proj)))


def _qkv(attn, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, (H + 2 KV) * D]
    return _side_by_side(x, attn.q_proj, attn.k_proj, attn.v_proj)


def _side_by_side(x: torch.Tensor, *linears) -> torch.Tensor:  # [T, in] -> [T, sum of outs]
    """Sibling projections' outputs side by side: one product when packing fused them, else each and a copy."""
    first = linears[0]
    if isinstance(first, FusedPart) and first.fused is getattr(linears[-1], "fused", None):
        return first.fused.whole(x)
    return torch.cat([lin(x) for lin in linears], dim=-1)
