"""`lean.forward`'s layers as direct kernel calls: a model's weight addresses found once, not at every call.

`lean.forward` reaches each C kernel through a module and a wrapper: nn.Module's call, the packed weight's
freshness key, shape checks, an output tensor, then ctypes. A layer makes about ten such calls; on a 2-core Xeon
the wrappers of SmolLM2-135M's 30 layers took 4.2 ms of a 17 ms batch-1 forward (a model of the same depth at a
tiny width measures them alone). Here `Layers.build` gathers every layer's packed weights, biases and norms once,
a forward's activations live in a few buffers made once per forward, and a layer is nine ctypes calls with
integer arguments: the products (`bf16_amx` / `bf16_dot` / `bf16_linear`), the norms, the rotary with its pool
write, the paged attention and SiLU.

The same kernels with the same arguments as `lean.forward`'s path through `decoder_ops`: outputs equal it bit for
bit (tests/test_direct.py). Taken where every product of every layer is one of the project's kernels on this
CPU and the rest of the layer runs `decoder_ops` (`lean.forward` asks `layers`); elsewhere (oneDNN's float32
products, a GPU) `lean.forward` runs as before. Weights edited in place or replaced are seen: each forward
compares the weights' identities and versions with those the addresses were taken from (~20 us), and builds
again when they differ. `SPECSERVE_DIRECT=0` switches it off.
"""

from __future__ import annotations

import os
import weakref
from typing import NamedTuple

import torch

from serve_app.engine import attention, bf16_dot, bf16_linear, decoder_ops
from serve_app.engine.packing import FusedPart, PackedLinear

ON = os.environ.get("SPECSERVE_DIRECT", "1") != "0"
"""`lean.forward` takes this path where it runs (tests turn it off to compare)."""


class Product(NamedTuple):
    """One packed product's call: fn(x, rows, k, x's row stride, weight, n, bias, y, y's row stride, threads)."""

    fn: object  # a ctypes function: bf16_amx, bf16_dot or bf16_linear (one signature)
    weight: int  # the packed blocks' address
    n: int
    k: int
    bias: int | None  # float32, padded to whole blocks
    dtype: torch.dtype  # the activations it takes and gives
    keep: tuple  # the tensors those addresses point into


class Layer(NamedTuple):
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    norms: tuple  # (input norm's weight address, eps, post-attention norm's weight address, eps)
    layer_idx: int
    scaling: float


_BUILT: "weakref.WeakKeyDictionary[torch.nn.Module, Layers]" = weakref.WeakKeyDictionary()


def layers(model, dtype: torch.dtype) -> "Layers | None":
    """The model's direct calls for activations of `dtype` (built on first use and whenever a weight changed), or
    None where some product or op is not one of the project's kernels here."""
    if not ON:
        return None
    built = _BUILT.get(model)
    if built is None or not built.current(model):
        built = _BUILT[model] = Layers.build(model)
    return built if built.layers and built.dtype == dtype else None


def _weights(model) -> list[torch.Tensor]:
    """Every weight the calls read, found through the modules' own dicts (nn.Module's attribute lookup is ~10x
    slower): the projections' weights and biases and the norms'."""
    out = []
    for layer in model.model.layers._modules.values():
        parts = layer._modules
        for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            children = parts[block]._modules
            for name in names:
                lin = children[name]
                out.append(lin._parameters.get("weight"))
                out.append(lin.__dict__.get("bias", lin._parameters.get("bias")))
        out += [parts[n]._parameters["weight"] for n in ("input_layernorm", "post_attention_layernorm")]
    return out


def _version(w: torch.Tensor | None) -> int | None:
    return None if w is None else 0 if w.is_inference() else w._version  # inference tensors keep no counter


def _product(lin, *siblings) -> Product | None:
    """The call computing `lin` and its siblings side by side (a fused packing of all of them), or None."""
    if siblings:
        fused = getattr(lin, "fused", None)
        if not isinstance(lin, FusedPart) or any(getattr(s, "fused", None) is not fused for s in siblings) \
                or len(fused.linears) != 1 + len(siblings):
            return None
        packed, bias = fused.packs.get([m.weight for m in fused.linears]), fused._bias()
    elif type(lin) is PackedLinear:
        packed, bias = lin.packs.get([lin.weight]), None if lin.bias is None else lin.bias.detach()
    else:
        return None
    if isinstance(packed, bf16_dot.Pairs):
        fn = bf16_dot._amx().bf16_amx if bf16_dot.uses_amx(packed.in_features) else bf16_dot._library().bf16_dot
        dtype, n, k = torch.bfloat16, packed.out_features, packed.in_features
    elif isinstance(packed, bf16_linear.Bits):
        fn, dtype, n, k = bf16_linear._library().bf16_linear, torch.float32, packed.out_features, packed.blocks.shape[1]
    else:
        return None
    bias = bf16_linear.block_bias(bias, packed.blocks.shape[0])
    return Product(fn, packed.blocks.data_ptr(), n, k, None if bias is None else bias.data_ptr(), dtype,
                   (packed.blocks, bias))


class Layers:
    """A model's layers as direct calls (`build`), and the forward over them (`forward`)."""

    def __init__(self, model, built: list[Layer] | None, dtype: torch.dtype | None = None,
                 norms: list[torch.Tensor] = ()):  # built None: the model cannot take this path (remembered)
        self.weights = _weights(model)
        self.versions = [_version(w) for w in self.weights]
        self.layers, self.dtype, self.norms = built, dtype, norms  # norms: the weights in `dtype` the addresses name
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.head_dim = attn.head_dim

    def current(self, model) -> bool:
        """`model`'s weights are the ones (the same tensors, not edited since) the addresses were taken from."""
        now = _weights(model)
        return len(now) == len(self.weights) and all(a is b for a, b in zip(now, self.weights)) \
            and [_version(w) for w in now] == self.versions

    @classmethod
    def build(cls, model) -> "Layers":
        if model.config.hidden_act != "silu":
            return cls(model, None)
        built, norms, dtypes = [], [], set()
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            products = (_product(a.q_proj, a.k_proj, a.v_proj), _product(a.o_proj),
                        _product(m.gate_proj, m.up_proj), _product(m.down_proj))
            if any(p is None for p in products):
                return cls(model, None)
            dtypes |= {p.dtype for p in products}
            pair = []
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                w = norm.weight.detach().to(products[0].dtype).contiguous()
                norms.append(w)
                pair += [w.data_ptr(), norm.variance_epsilon]
            built.append(Layer(*products, tuple(pair), a.layer_idx, a.scaling))
        if len(dtypes) != 1:
            return cls(model, None)
        return cls(model, built, dtypes.pop(), norms)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch,  # h [T, hidden]; cos, sin [T, D]
                capture: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        """The residual stream after every layer ([T, hidden], h itself updated in place), as `lean.forward`'s layer
        loop computes it; capture as there."""
        t, hidden = h.shape
        hd, heads, kv = self.head_dim, self.heads, self.kv_heads
        width = (heads + 2 * kv) * hd
        cache, threads, bf16 = batch.cache, torch.get_num_threads(), int(h.dtype == torch.bfloat16)
        x, att, out = torch.empty_like(h), h.new_empty(t, heads * hd), torch.empty_like(h)
        qkv = h.new_empty(t, width)
        inter = self.layers[0].gate_up.n // 2
        gu, act = h.new_empty(t, 2 * inter), h.new_empty(t, inter)
        hp, xp, qp, ap, op, gp, sp = (v.data_ptr() for v in (h, x, qkv, att, out, gu, act))
        if not (cos.stride(1) == 1 and sin.stride() == cos.stride()):
            cos, sin = cos.contiguous(), sin.contiguous()
        cp, snp, cs = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
        slots = batch.slots.data_ptr()
        like = qkv.view(t, -1, hd)[:, heads:heads + kv]  # the pools' shape past the slots, and their dtype
        q_heads = qkv.view(t, -1, hd)[:, :heads]
        groups = [g for g in batch.layout if attention._kernel_fits(q_heads, like, like, g)]
        rest = [g for g in batch.layout if not any(g is f for f in groups)]
        calls = [(g.spans.data_ptr(), g.spans.shape[0], g.tables.data_ptr(), g.tables.stride(0), g.block_size)
                 for g in groups]
        entry, tail = attention.kernel_entry(h.dtype, hd) if groups else (None, ())
        norm_fn = decoder_ops._library().add_rms_norm
        last = len(self.layers) - 1
        for i, lay in enumerate(self.layers):
            if capture is not None and i in capture:
                capture[i] = h.clone()
            if i == 0:
                norm_fn(hp, hidden, None, 0, None, hidden, lay.norms[0], lay.norms[1], xp, hidden, t, hidden, bf16,
                        threads)
            _call(lay.qkv, xp, t, qp, threads)
            k_pool, v_pool = cache.pools(lay.layer_idx, like)
            if batch.last_slot >= k_pool.shape[0]:
                raise RuntimeError(f"slot {batch.last_slot} past the pool's {k_pool.shape[0]}")  # never: reserved
            kp, vp = k_pool.data_ptr(), v_pool.data_ptr()
            decoder_ops._library().rotary(qp, width, hd, t, heads + kv, hd, cp, snp, cs, bf16, threads, kp, vp, slots,
                                          heads, kv)
            for spans, rows, tables, stride, bs in calls:
                entry(qp, width, hd, kp, vp, spans, rows, tables, stride, bs, heads, kv, hd, lay.scaling, ap, threads,
                      *tail)
            if rest:
                attention.gather_attend(q_heads, k_pool, v_pool, rest, lay.scaling, att.view(t, heads, hd))
            _call(lay.o, ap, t, op, threads)
            norm_fn(hp, hidden, op, hidden, hp, hidden, lay.norms[2], lay.norms[3], xp, hidden, t, hidden, bf16, threads)
            _call(lay.gate_up, xp, t, gp, threads)
            decoder_ops._library().silu_mul(gp, 2 * inter, sp, inter, t, inter, bf16, threads)
            _call(lay.down, sp, t, op, threads)
            if i < last:
                nxt = self.layers[i + 1].norms
                norm_fn(hp, hidden, op, hidden, hp, hidden, nxt[0], nxt[1], xp, hidden, t, hidden, bf16, threads)
        return h + out  # the last layer's residual add (lean.forward's torch add: the same bits)


def _call(p: Product, x: int, rows: int, y: int, threads: int) -> None:
    p.fn(x, rows, p.k, p.k, p.weight, p.n, p.bias, y, p.n, threads)

