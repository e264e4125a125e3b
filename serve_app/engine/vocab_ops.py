"""The sampling path's vocabulary passes in one C call each on a CPU (`vocab_ops.c`): a row's argmax, its logsumexp, its strided
block maxima (`sampling.BLOCK`), its largest values, a cut below a floor, top-k / top-p's floor, and the coupled
sampler's Gumbel-max choice.

`sampling` calls these where `fits` says they run (a CPU tensor of float32 or bfloat16 whose rows are contiguous,
the kernel built, ON); elsewhere torch's ops. The block maxima are torch's exactly; the logsumexp is within a few
float32 ulps of torch's; the largest values are topk's values (the ids of equal values may differ). All are
batch-invariant. `SPECSERVE_VOCAB_OPS=0` switches them off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from serve_app.engine import ckernels

SOURCE = Path(__file__).with_suffix(".c")
_DTYPES = (torch.float32, torch.bfloat16)
ON = True
"""`sampling` calls the kernels where they run (tests turn it off for torch's ops)."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    c_long, ptr, c_int = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    return ckernels.kernel(SOURCE, "SPECSERVE_VOCAB_OPS", {
        "row_logsumexp": [ptr, c_long, c_long, c_long, ptr, c_int, c_int],
        "block_max": [ptr, c_long, c_long, c_long, c_long, ptr, c_long, c_int, c_int],
        "top_values": [ptr, c_long, c_long, c_long, c_long, ptr, ptr, c_int, c_int],
        "cut_below": [ptr, c_long, c_long, c_long, ptr, c_int],
        "gumbel_argmax": [ptr, c_long, c_long, c_long, ptr, ptr, c_int, c_int],
        "top_p_floor": [ptr, c_long, c_long, c_long, ptr, ptr, ptr, c_long, c_int],
        "row_argmax": [ptr, c_long, c_long, c_long, ptr, c_int, c_int],
        "scale_rows": [ptr, c_long, c_long, c_long, ptr, ptr, c_long, c_int, c_int]})


def fits(x: torch.Tensor) -> bool:
    """The kernels run on these logits ([R, V]): a CPU tensor of float32 or bfloat16, each row contiguous, kernels
    built, ON."""
    return (ON and x.dim() == 2 and x.device.type == "cpu" and x.dtype in _DTYPES and x.stride(-1) == 1
            and _library() is not None)


def argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] long
    """Each row's first index of its largest value (NaN the largest): torch's max(dim=-1).indices."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.long)
    _library().row_argmax(x.data_ptr(), x.stride(0), rows, vocab, out.data_ptr(), int(x.dtype == torch.bfloat16),
                          torch.get_num_threads())
    return out


def scaled(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:  # [R, V], t [R] -> [R, V] float32, new
    """x / t[:, None] in float32 (t None: x.float()): torch's bits (a widening, then IEEE's division), one pass."""
    rows, vocab = x.shape
    t = None if t is None else t.to(torch.float32).contiguous()
    out = torch.empty(rows, vocab, dtype=torch.float32)
    _library().scale_rows(x.data_ptr(), x.stride(0), rows, vocab, None if t is None else t.data_ptr(), out.data_ptr(),
                          vocab, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def logsumexp(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] float32
    """log(sum(exp(x))) per row: -inf for a row of -inf."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32)
    _library().row_logsumexp(x.data_ptr(), x.stride(0), rows, vocab, out.data_ptr(), int(x.dtype == torch.bfloat16),
                             torch.get_num_threads())
    return out


def block_max(x: torch.Tensor, block: int) -> torch.Tensor:  # [R, V] -> [R, nb] float32
    """Each strided block's largest value (`block` tokens a block; block b < V // block holds tokens b,
    b + V // block, ...; a short last block the last V % block tokens)."""
    rows, vocab = x.shape
    nb = vocab // block + (vocab % block != 0)
    out = torch.empty(rows, nb, dtype=torch.float32)
    _library().block_max(x.data_ptr(), x.stride(0), rows, vocab, block, out.data_ptr(), nb, int(x.dtype == torch.bfloat16),
                         torch.get_num_threads())
    return out


WIDEST = 4096
"""top_values keeps its candidates on a thread's stack: at most this many."""


def top_values(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:  # [R, V] -> [R, width] x 2
    """x.topk(width): the `width` largest values of each row, descending, in x's dtype, and their ids (long); among
    equal values the smaller id first. width <= min(V, WIDEST)."""
    rows, vocab = x.shape
    if not 0 < width <= min(vocab, WIDEST):
        raise ValueError(f"top_values: width {width} outside 1..{min(vocab, WIDEST)}")
    vals = torch.empty(rows, width, dtype=torch.float32)
    ids = torch.empty(rows, width, dtype=torch.long)
    _library().top_values(x.data_ptr(), x.stride(0), rows, vocab, width, vals.data_ptr(), ids.data_ptr(),
                          int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return vals.to(x.dtype), ids


def cut_below_(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:  # [R, V] float32 in place, floor [R]
    """x.masked_fill_(x < floor[:, None], -inf) in one pass (x float32)."""
    if x.dtype != torch.float32:
        raise ValueError(f"cut_below_: float32 rows, not {x.dtype}")
    floor = floor.to(torch.float32).contiguous()
    rows, vocab = x.shape
    _library().cut_below(x.data_ptr(), x.stride(0), rows, vocab, floor.data_ptr(), torch.get_num_threads())
    return x


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # [R, V], keys [R] -> [R] long
    """`sampling.gumbel_argmax`'s choice, argmax(x + gumbel(keys)), in one call: the same noise bits up to its logs
    (about a float32 ulp from torch's), so the same token but where two scores lie within an ulp."""
    rows, vocab = x.shape
    keys = keys.to(torch.int32).contiguous()
    out = torch.empty(rows, dtype=torch.long)
    _library().gumbel_argmax(x.data_ptr(), x.stride(0), rows, vocab, keys.data_ptr(), out.data_ptr(),
                             int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def top_p_floor(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # [R, V] float32 -> [R]
    """The value each row is cut below under its top_k [R] (0: off) and top_p [R] (`sampling._truncate`'s threshold):
    NaN for a row whose nucleus is wider than WIDEST candidates (the caller's torch path takes it)."""
    if x.dtype != torch.float32:
        raise ValueError(f"top_p_floor: float32 rows, not {x.dtype}")
    rows, vocab = x.shape
    top_k, top_p = top_k.to(torch.long).contiguous(), top_p.to(torch.float32).contiguous()
    out = torch.empty(rows, dtype=torch.float32)
    _library().top_p_floor(x.data_ptr(), x.stride(0), rows, vocab, top_k.data_ptr(), top_p.data_ptr(), out.data_ptr(),
                           WIDEST, torch.get_num_threads())
    return out
