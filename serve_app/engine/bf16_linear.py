"""bfloat16 weights with float32 arithmetic on CPUs without bfloat16 instructions (`bf16_linear.c`).

A batch-1 decode step reads every weight once and waits on memory: bfloat16 weights halve the bytes.
CPUs with avx512_bf16 or AMX run a bfloat16 model through oneDNN (`packing`); AVX2-only CPUs (AMD
EPYC Zen 2/3, the project's 2-core machines) have no library path that reads bfloat16 weights at the
memory's pace (oneDNN will not pack them; torch's bfloat16 matmul, measured on SmolLM2-135M's five
projections and head, 30 layers: 28 ms at 1 row but 137 ms at 8 rows against 79 ms for float32). The
kernel here widens each weight to float32 in registers: 0.38-0.46x oneDNN's packed float32 time from 1 to
8 rows, 0.51-0.76x from 16 to 64 (`specserve bench linears`; figures in the C file).

It is compiled on first use with the machine's C compiler (`ckernels`); without a compiler, AVX2 or FMA,
`available()` is False: `auto` is float32 there and a bfloat16 model runs in bfloat16, as before. Outputs are
batch-invariant: a row's result does not depend on the other rows (see the C file).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from serve_app.engine import ckernels

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def _library() -> ctypes.CDLL | None:
    c_long, ptr = ctypes.c_long, ctypes.c_void_p
    return ckernels.kernel(SOURCE, "SPECSERVE_BF16_KERNEL",
                           {"bf16_linear": [ptr, c_long, c_long, c_long, ptr, c_long, ptr, ptr, c_long, ctypes.c_int]})


def available() -> bool:
    """The kernel runs on this CPU (AVX2 and FMA, a C compiler on first use)."""
    return _library() is not None


class Bits(NamedTuple):
    """Weights packed for the kernel: bfloat16 bits in blocks of 16 outputs ([N / 16, K, 16], zero-padded)."""

    blocks: torch.Tensor
    out_features: int


BLOCK = 16


def padded(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N rounded up to BLOCK, K] bfloat16
    """The weight in bfloat16 with zero rows to whole blocks of outputs (this kernel's and `bf16_dot`'s)."""
    n, k = weight.shape
    out = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.bfloat16)
    out[:n] = weight.detach()
    return out


def block_bias(bias: torch.Tensor | None, blocks: int) -> torch.Tensor | None:  # [N] -> [blocks * BLOCK] float32
    """A bias in float32, zero-padded to whole blocks (the kernels read it a block at a time)."""
    if bias is None:
        return None
    return torch.nn.functional.pad(bias.detach().float(), (0, blocks * BLOCK - bias.shape[0])).contiguous()


def to_bits(weight: torch.Tensor) -> Bits:  # [N, K] float
    n, k = weight.shape
    return Bits(padded(weight).view(-1, BLOCK, k).transpose(1, 2).contiguous().view(torch.int16), n)


def linear(x: torch.Tensor, bits: Bits, bias: torch.Tensor | None) -> torch.Tensor:  # [..., K] -> [..., N]
    """x (float32) times the bfloat16 weight packed in `bits` (`to_bits`), plus bias (float32 [N])."""
    n, k = bits.out_features, bits.blocks.shape[1]
    if x.shape[-1] != k:
        raise RuntimeError(f"linear: input of {x.shape[-1]} features for a weight of {[n, k]}")
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    bias = block_bias(bias, bits.blocks.shape[0])
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _library().bf16_linear(rows.data_ptr(), rows.shape[0], k, rows.stride(0), bits.blocks.data_ptr(), n,
                               None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)
