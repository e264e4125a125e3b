"""bfloat16 products with the CPU's bfloat16 dot product (AVX512-BF16, `bf16_dot.c`), for a bfloat16 model's linears.

oneDNN packs bfloat16 weights on these CPUs too, but streams a decode step's weights at about 60% of what the
memory gives (the C file has the figures); this kernel reads them in the order they are stored and is
batch-invariant. Compiled on first use (`ckernels`); where the CPU lacks AVX512-BF16 or there is no compiler,
`available()` is False and packing keeps oneDNN. `SPECSERVE_BF16_DOT=0` switches it off.

Where the CPU has AMX (Intel Xeons since Sapphire Rapids) the same packed weights go to `bf16_amx.c` instead: one
tile instruction multiplies 16 rows by a 32 x 16 block, so rows cost next to nothing (SmolLM2-135M's projections and
head on 2 cores, weights in cache: 57.5 -> 11.1 ms at 32 rows, 18.6 -> 8.5 at 8, 7.0 -> 8.0 at 1; oneDNN's 15.0 /
11.5 / 12.0). Batch-invariant too, with its own bits (`SPECSERVE_BF16_AMX=0`: bf16_dot.c's).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from serve_app.engine import bf16_linear, ckernels

SOURCE = Path(__file__).with_suffix(".c")
BLOCK = bf16_linear.BLOCK  # 16 outputs a block, as bf16_linear.c packs them


@functools.cache
def _library() -> ctypes.CDLL | None:
    from serve_app.hardware import cpu_flags

    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags():
        return None
    c_long, ptr = ctypes.c_long, ctypes.c_void_p
    return ckernels.kernel(SOURCE, "SPECSERVE_BF16_DOT",
                           {"bf16_dot": [ptr, c_long, c_long, c_long, ptr, c_long, ptr, ptr, c_long, ctypes.c_int]})


AMX_SOURCE = Path(__file__).with_name("bf16_amx.c")
AMX_K = 32
"""`bf16_amx.c` multiplies whole k tiles of 32: a weight whose K is not a multiple keeps `bf16_dot.c`."""


@functools.cache
def _amx() -> ctypes.CDLL | None:
    """The AMX product (`bf16_amx.c`), where this CPU has AMX's bfloat16 tiles, Linux lends this process their state
    and `SPECSERVE_BF16_AMX` is not 0: the same weights' layout, far fewer instructions a row."""
    from serve_app.hardware import cpu_flags

    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or _library() is None:
        return None
    c_long, ptr = ctypes.c_long, ctypes.c_void_p
    lib = ckernels.kernel(AMX_SOURCE, "SPECSERVE_BF16_AMX",
                          {"bf16_amx": [ptr, c_long, c_long, c_long, ptr, c_long, ptr, ptr, c_long, ctypes.c_int]})
    if lib is None:
        return None
    lib.bf16_amx_init.restype = ctypes.c_int
    return lib if lib.bf16_amx_init() == 0 else None


def uses_amx(in_features: int) -> bool:
    """A weight of `in_features` is multiplied on AMX's tiles here (one kernel for every row count: batch-invariant)."""
    return in_features % AMX_K == 0 and _amx() is not None


def available() -> bool:
    """The kernel runs on this CPU (AVX512-BF16, a C compiler on first use)."""
    return _library() is not None


class Pairs(NamedTuple):
    """Weights packed for the kernel: bfloat16 in blocks of 16 outputs and pairs of k ([N / 16, K / 2, 16, 2],
    zero-padded outputs)."""

    blocks: torch.Tensor
    out_features: int
    in_features: int


def fits(weight: torch.Tensor) -> bool:
    """A bfloat16 weight [N, K] the kernel takes (K even), on a CPU where it runs."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0 and available()


def to_pairs(weight: torch.Tensor) -> Pairs:  # [N, K] bfloat16
    n, k = weight.shape
    blocks = bf16_linear.padded(weight).view(-1, BLOCK, k // 2, 2).transpose(1, 2)
    return Pairs(blocks.contiguous().view(torch.int16), n, k)


def linear(x: torch.Tensor, pairs: Pairs, bias: torch.Tensor | None) -> torch.Tensor:  # [..., K] -> [..., N]
    """x (bfloat16) times the weight packed in `pairs` (`to_pairs`), plus bias, in bfloat16 (float32 sums)."""
    n, k = pairs.out_features, pairs.in_features
    if x.shape[-1] != k:
        raise RuntimeError(f"linear: input of {x.shape[-1]} features for a weight of {[n, k]}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) % 2 or rows.storage_offset() % 2:  # k pairs read as 32-bit words
        rows = rows.contiguous()
    bias = bf16_linear.block_bias(bias, pairs.blocks.shape[0])
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        product = _amx().bf16_amx if uses_amx(k) else _library().bf16_dot
        product(rows.data_ptr(), rows.shape[0], k, rows.stride(0), pairs.blocks.data_ptr(), n,
                None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)
