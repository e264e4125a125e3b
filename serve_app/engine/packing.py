"""Linear weights packed once for the CPU's matmul library (oneDNN), and sibling projections fused.

A plain `nn.Linear` on a CPU hands its row-major weight to MKL on every call; on an AVX2-only CPU (AMD
EPYC, the project's 2-core machines) that path streams a batch-1 float32 projection at about half the
memory bandwidth and is slower still with a few rows. oneDNN's `_linear_pointwise` over a weight
reordered once into its own blocked layout reads a wide matrix at the bandwidth. Narrow matrices gain
less, so projections that read the same input are fused into one wide one: a decoder layer's
q / k / v, and its MLP's gate / up (SmolLM2's shapes, 2 threads, 30 layers of those five: batch 1
35.5 -> 23.9 ms, batch 8 50.7 -> 32.3 ms; the head 16.8 -> 9.3 ms).

Float32 stays float32: outputs agree with the unpacked model to rounding (a few 1e-7 relative), as two
BLAS libraries do; the packing hint only changes speed, never results. Packing is for inference (no
autograd through a packed weight).

bfloat16 weights on a CPU without bfloat16 arithmetic (`--dtype bfloat16`, or `auto` there: models.py
loads them, then widens the model to float32) are float32 weights that a bfloat16 holds exactly. Those are
kept as bfloat16 bits instead and multiplied by `bf16_linear` (float32 arithmetic, half the bytes to read):
the same products as the float32 path, to rounding, at about half a decode step's linear time.

A bfloat16 model on a CPU with AVX512-BF16 (where oneDNN packs bfloat16 too) is multiplied by `bf16_dot`
instead: the same bfloat16 dot product oneDNN uses, read in the weights' stored order, 0.70x oneDNN's time for
SmolLM2's 30 layers of projections at 1 to 8 rows and 0.88-0.92x at 32-64, even from 128 to 512 (one layout
for every row count), and batch-invariant (`SPECSERVE_BF16_DOT=0`: oneDNN's). Where the CPU has AMX (Intel Xeons),
the same packed weights go to AMX's tiles (`bf16_amx.c`, through `bf16_dot.linear`): rows then cost next to nothing.

`ModelWorker` packs its model in place on CPU devices unless `SPECSERVE_PACK_WEIGHTS=0`.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from serve_app.engine import bf16_dot, bf16_linear

# Every (rows, in, out) shape compiles one oneDNN primitive (about 1 ms) kept in a process-wide cache; a
# served model meets a few hundred (rows vary by step), past the default 1,024 with a draft beside it.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

ROWS_HINT = 8
"""The row count oneDNN lays the weights out for: within ~10% of the best layout from 1 to 32 rows."""
FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections a module calls one after the other on the same input (Llama-style attention and
MLP), in the order it calls them."""


def available() -> bool:
    """oneDNN is built into this torch."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def supports(dtype: torch.dtype) -> bool:
    """oneDNN packs this dtype on this CPU (float32 always; bfloat16 needs avx512 or avx_ne_convert)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        _packed(torch.zeros(8, 8, dtype=dtype))
        return True
    except RuntimeError:
        return False


def wanted(device: torch.device) -> bool:
    """Pack on CPU devices, unless `SPECSERVE_PACK_WEIGHTS=0`."""
    return device.type == "cpu" and os.environ.get("SPECSERVE_PACK_WEIGHTS", "1") != "0" and available()


def _packed(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> oneDNN's blocked layout
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=ROWS_HINT)


def _bf16_exact(weights: list[torch.Tensor]) -> bool:
    """Float32 weights that bfloat16 holds exactly (a bfloat16 model widened by models.py), on a CPU where
    `bf16_linear` runs and oneDNN does not pack bfloat16 itself."""
    return all(w.dtype == torch.float32 for w in weights) and not supports(torch.bfloat16) \
        and bf16_linear.available() and all(torch.equal(w, w.to(torch.bfloat16).float()) for w in weights)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
    if isinstance(packed, bf16_dot.Pairs):  # bfloat16 weights and activations (`_Packs`)
        return bf16_dot.linear(x, packed, bias)
    if isinstance(packed, bf16_linear.Bits):  # bfloat16 weights, float32 activations (`_Packs`)
        return bf16_linear.linear(x, packed, bias)
    if x.shape[-1] != packed.shape[1]:  # oneDNN's own message would not say which shapes
        raise RuntimeError(f"linear: input of {x.shape[-1]} features for a weight of {list(packed.shape)}")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _key(weights: list[torch.Tensor]) -> tuple:
    # what a packed copy was made from: a weight replaced, edited in place (_version) or converted changes it
    # (a tensor made under inference_mode keeps no version counter)
    return tuple((id(w), w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype) for w in weights)


class _Packs:
    """A packed copy of some weights (concatenated along their outputs), made on first use and again whenever one
    of them changes; a copy of a module (deepcopy, pickle) leaves it behind and packs again. The copy is oneDNN's
    layout, or bfloat16 bits where every weight is a bfloat16 widened (`_bf16_exact`), or pairs for the bfloat16
    dot product where the weights are bfloat16 and the CPU has it (`bf16_dot`)."""

    def __init__(self):
        self.packed, self.key = None, None

    def get(self, weights: list[torch.Tensor]) -> torch.Tensor | bf16_linear.Bits:
        key = _key(weights)
        if key != self.key:
            w = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            if _bf16_exact(weights):
                self.packed = bf16_linear.to_bits(w)
            elif bf16_dot.fits(w):
                self.packed = bf16_dot.to_pairs(w)
            else:
                self.packed = _packed(w)
            self.key = key
        return self.packed

    def __getstate__(self):
        return {"packed": None, "key": None}


def _plain_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the packed kernels are not for: autograd, an input of another dtype (F.linear says why), a dtype
    oneDNN does not pack here (a packed model converted to it)."""
    return x.dtype != weight.dtype or torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad) \
        or not supports(weight.dtype)


class PackedLinear(nn.Linear):
    """An `nn.Linear` computed from a packed copy of its weight: same inputs, same outputs to rounding. The
    weight stays its parameter (a tied head shares the embedding's; the plain weights and the packed copy
    together take twice the weights' memory)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packs = _Packs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if _plain_path(x, self.weight):
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return _linear(x, self.packs.get([self.weight]), bias)


class FusedLinears:
    """Sibling projections of one input as one packed matrix. The first sibling computes them all and keeps
    the rest for the next siblings, which take their slice when handed the same input tensor (else, called
    alone, they compute the whole product and slice it: correct, only slower)."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears  # the plain modules (their weights and biases), not children of anything
        ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
        self.spans = list(zip([0] + ends[:-1], ends))
        self.packs = _Packs()
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def __getstate__(self):
        return {**self.__dict__, "_input": None, "_output": None}

    def _bias(self) -> torch.Tensor | None:
        if all(lin.bias is None for lin in self.linears):
            return None
        return torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                          for lin in self.linears])

    def whole(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., sum of outs]
        """Every sibling's output side by side, in one product (the plain modules' three when unpackable)."""
        if _plain_path(x, self.linears[0].weight):
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        return _linear(x, self.packs.get([m.weight for m in self.linears]), self._bias())

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out_i]
        lin = self.linears[i]
        if _plain_path(x, lin.weight):
            return lin(x)
        if i == 0 or x is not self._input:
            packed = self.packs.get([m.weight for m in self.linears])
            self._input, self._output = x, _linear(x, packed, self._bias())
        lo, hi = self.spans[i]
        out = self._output[..., lo:hi]
        if i == len(self.spans) - 1:
            self._input = self._output = None  # the last sibling read its part: hold nothing between forwards
        return out


class FusedPart(nn.Linear):
    """Sibling i of a `FusedLinears`, in the place of the `nn.Linear` it replaced (whose weight it shows)."""

    def __init__(self, fused: FusedLinears, i: int):
        nn.Module.__init__(self)
        lin = fused.linears[i]
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.fused, self.i = fused, i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.i, x)


def _plain(m) -> bool:
    return type(m) is nn.Linear and m.weight.device.type == "cpu" and supports(m.weight.dtype)


def pack_linears(model: nn.Module) -> int:
    """Replace the float32 / bfloat16 `nn.Linear`s of a CPU model by packed ones, in place, fusing the
    siblings `FUSE` names where all are plain and alike. Returns how many were replaced (0 without oneDNN;
    packing twice replaces nothing more)."""
    if not available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for names in FUSE:
            lins = [getattr(parent, n, None) for n in names]
            if all(_plain(m) for m in lins) and \
                    len({(m.in_features, m.weight.dtype) for m in lins}) == 1:
                fused = FusedLinears(lins)
                for i, n in enumerate(names):
                    setattr(parent, n, FusedPart(fused, i))
                replaced += len(lins)
        for name, child in list(parent.named_children()):
            if _plain(child):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
