"""`lean.forward`'s layers as direct kernel calls: a model's weight addresses found once, not at every call.

`lean.forward` reaches each C kernel through a module and a wrapper: nn.Module's call, the packed weight's
freshness key, shape checks, an output tensor, then ctypes. A layer makes about ten such calls; on a 2-core Xeon
the wrappers of SmolLM2-135M's 30 layers took 4.2 ms of a 17 ms batch-1 forward (a model of the same depth at a
tiny width measures them alone). Here `Layers.build` gathers every layer's packed weights, biases and norms once
and a forward's activations live in a few buffers made once per forward. A decode or verify step (every attention
group the C kernel's) then runs all its layers in one C call (`decoder_layers` in decoder_ops.c; one a stretch
between captured layers); a step with a prefill chunk, whose attention goes through SDPA, calls the same kernels
layer by layer from Python with integer arguments. The offline batch-1 step 17.8 -> 12.0 ms, batch 32 28.1 -> 21.5.

The same kernels with the same arguments as `lean.forward`'s path through `decoder_ops`: outputs equal it bit for
bit (tests/test_direct.py). Taken where every product of every layer is one of the project's kernels on this
CPU (`bf16_amx` / `bf16_dot` / `bf16_linear`) and the rest of the layer runs `decoder_ops` (`lean.forward` asks
`layers`); elsewhere (oneDNN's float32 products, a GPU) `lean.forward` runs as before. Weights edited in place or
replaced are seen (`Layers.current`): the addresses are taken again. `SPECSERVE_DIRECT=0` switches it off.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from array import array
from typing import NamedTuple

import torch

from serve_app.engine import attention, bf16_dot, bf16_linear, decoder_ops
from serve_app.engine.packing import FusedPart, PackedLinear

ON = os.environ.get("SPECSERVE_DIRECT", "1") != "0"
"""`lean.forward` takes this path where it runs (tests turn it off to compare)."""


LAYER_FIELDS, K_POOL = 16, 14
"""`decoder_layers`' addresses a layer (decoder_ops.c's enum) and where its key pool's goes (the value pool's next)."""


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


_ASSIGNED = [0]
"""Modules and parameters assigned to any module in this process, counted by torch's global registration hooks: a
layer's module or weight replaced moves it, and a forward then compares the weights' identities again."""


def _count(*_) -> None:
    _ASSIGNED[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count)
torch.nn.modules.module.register_module_parameter_registration_hook(_count)

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
        self.weights, self.assigned = _weights(model), _ASSIGNED[0]
        self.tracked = [w for w in self.weights if w is not None and not w.is_inference()]  # inference tensors: no counter
        self.versions = [w._version for w in self.tracked]
        self.layers, self.dtype, self.norms = built, dtype, norms  # norms: the weights in `dtype` the addresses name
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.ints, self.floats = self._arrays() if built else (None, None)

    def current(self, model) -> bool:
        """`model`'s weights are the ones (the same tensors, not edited since) the addresses were taken from: their
        versions every time (~10 us), their identities after any module or parameter was assigned in this process."""
        if [w._version for w in self.tracked] != self.versions:
            return False
        if _ASSIGNED[0] != self.assigned:
            now = _weights(model)
            if len(now) != len(self.weights) or any(a is not b for a, b in zip(now, self.weights)):
                return False
            self.assigned = _ASSIGNED[0]
        return True

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

    def _arrays(self) -> tuple[array, array]:
        """The layers as `decoder_layers` reads them: LAYER_FIELDS addresses and LAYER_FLOATS numbers a layer (the
        pools' addresses left 0: a forward fills them)."""
        ints, floats = array("q"), array("f")
        for lay in self.layers:
            for p in (lay.qkv, lay.o, lay.gate_up, lay.down):
                ints += array("q", [_address(p.fn), p.weight, p.bias or 0])
            ints += array("q", [lay.norms[0], lay.norms[2], 0, 0])
            floats += array("f", [lay.norms[1], lay.norms[3], lay.scaling])
        return ints, floats

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch,  # h [T, hidden]; cos, sin [T, D]
                capture: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        """The residual stream after every layer ([T, hidden]; h is updated in place), as `lean.forward`'s layer
        loop computes it; capture as there."""
        step = _Step(self, h, cos, sin, batch)
        if step.rest:
            self._stepwise(step, capture)
        else:
            self._in_c(step, capture)
        return h + step.out  # the last layer's residual add (lean.forward's torch add: the same bits)

    def _in_c(self, s: "_Step", capture) -> None:
        """Every layer in one `decoder_layers` call, or one a stretch between captured layers."""
        ints, n = self.ints, len(self.layers)
        for i, lay in enumerate(self.layers):
            k_pool, v_pool = s.cache.pools(lay.layer_idx, s.like)
            ints[i * LAYER_FIELDS + K_POOL], ints[i * LAYER_FIELDS + K_POOL + 1] = k_pool.data_ptr(), v_pool.data_ptr()
        s.check(k_pool)
        table = array("q", [v for c in s.calls for v in c])
        bounds = sorted({0, n} | {i for i in (capture or ()) if 0 < i < n})
        for a, b in zip(bounds, bounds[1:]):
            if capture is not None and a in capture:
                capture[a] = s.h.clone()
            decoder_ops._library().decoder_layers(
                a, b, n, ints.buffer_info()[0], self.floats.buffer_info()[0], *s.buffers, s.t, s.hidden, self.heads,
                self.kv_heads, self.head_dim, s.inter, s.bf16, s.threads, *s.rotation, s.slots, len(s.calls),
                table.buffer_info()[0] if s.calls else None, _address(s.entry) if s.calls else None,
                s.tail[0] if s.tail else -1, int(a == 0))

    def _stepwise(self, s: "_Step", capture) -> None:
        """Layer by layer from Python: a step with a prefill chunk, whose attention is SDPA's."""
        ops = decoder_ops._library()
        hp, xp, qp, ap, op, gp, sp = s.buffers
        t, hidden, bf16, threads, hd, heads, kv = s.t, s.hidden, s.bf16, s.threads, self.head_dim, self.heads, \
            self.kv_heads
        for i, lay in enumerate(self.layers):
            if capture is not None and i in capture:
                capture[i] = s.h.clone()
            if i == 0:
                ops.add_rms_norm(hp, hidden, None, 0, None, hidden, lay.norms[0], lay.norms[1], xp, hidden, t, hidden,
                                 bf16, threads)
            _call(lay.qkv, xp, t, qp, threads)
            k_pool, v_pool = s.cache.pools(lay.layer_idx, s.like)
            s.check(k_pool)
            kp, vp = k_pool.data_ptr(), v_pool.data_ptr()
            ops.rotary(qp, s.width, hd, t, heads + kv, hd, *s.rotation, bf16, threads, kp, vp, s.slots, heads, kv)
            for spans, rows, tables, stride, bs in s.calls:
                s.entry(qp, s.width, hd, kp, vp, spans, rows, tables, stride, bs, heads, kv, hd, lay.scaling, ap,
                        threads, *s.tail)
            attention.gather_attend(s.q, k_pool, v_pool, s.rest, lay.scaling, s.att.view(t, heads, hd))
            _call(lay.o, ap, t, op, threads)
            ops.add_rms_norm(hp, hidden, op, hidden, hp, hidden, lay.norms[2], lay.norms[3], xp, hidden, t, hidden, bf16,
                             threads)
            _call(lay.gate_up, xp, t, gp, threads)
            ops.silu_mul(gp, 2 * s.inter, sp, s.inter, t, s.inter, bf16, threads)
            _call(lay.down, sp, t, op, threads)
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1].norms
                ops.add_rms_norm(hp, hidden, op, hidden, hp, hidden, nxt[0], nxt[1], xp, hidden, t, hidden, bf16,
                                 threads)


class _Step:
    """One forward's buffers, addresses and attention groups."""

    def __init__(self, plan: Layers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch):
        self.h, self.cache, self.batch = h, batch.cache, batch
        self.t, self.hidden = h.shape
        hd, heads, kv = plan.head_dim, plan.heads, plan.kv_heads
        self.width, self.inter = (heads + 2 * kv) * hd, plan.layers[0].gate_up.n // 2
        self.threads, self.bf16 = torch.get_num_threads(), int(h.dtype == torch.bfloat16)
        x, qkv, self.att, self.out = torch.empty_like(h), h.new_empty(self.t, self.width), \
            h.new_empty(self.t, heads * hd), torch.empty_like(h)
        gu, act = h.new_empty(self.t, 2 * self.inter), h.new_empty(self.t, self.inter)
        self.keep = (x, qkv, gu, act)
        self.buffers = [v.data_ptr() for v in (h, x, qkv, self.att, self.out, gu, act)]  # decoder_layers' order
        if not (cos.stride(1) == 1 and sin.stride() == cos.stride()):
            cos, sin = cos.contiguous(), sin.contiguous()
        self.rotation = (cos.data_ptr(), sin.data_ptr(), cos.stride(0))
        self.keep += (cos, sin)
        self.slots = batch.slots.data_ptr()
        self.like = qkv.view(self.t, -1, hd)[:, heads:heads + kv]  # the pools' shape past the slots, and their dtype
        self.q = qkv.view(self.t, -1, hd)[:, :heads]
        pools = self.cache.pools(plan.layers[0].layer_idx, self.like)  # made on a first forward: the kernel asks
        groups = [g for g in batch.layout if attention._kernel_fits(self.q, *pools, g)]
        self.rest = [g for g in batch.layout if not any(g is f for f in groups)]
        self.calls = [(g.spans.data_ptr(), g.spans.shape[0], g.tables.data_ptr(), g.tables.stride(0), g.block_size)
                      for g in groups]
        self.entry, self.tail = attention.kernel_entry(h.dtype, hd) if groups else (None, ())

    def check(self, k_pool: torch.Tensor) -> None:
        if self.batch.last_slot >= k_pool.shape[0]:
            raise RuntimeError(f"slot {self.batch.last_slot} past the pool's {k_pool.shape[0]}")  # never: reserved


def _address(fn) -> int:
    """A ctypes function's address (`decoder_layers` calls it)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def _call(p: Product, x: int, rows: int, y: int, threads: int) -> None:
    p.fn(x, rows, p.k, p.k, p.weight, p.n, p.bias, y, p.n, threads)

