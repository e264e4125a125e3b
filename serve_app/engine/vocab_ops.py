"""The sampling path's vocabulary passes in one C call each on a CPU (`vocab_ops.c`): a row's argmax, its logsumexp, its strided
block maxima (`sampling.BLOCK`), its largest values, a cut below a floor, top-k / top-p's floor, and the coupled
sampler's Gumbel-max choice; and whole decisions a row at a time while it is in cache: `warp` (scale, floor, cut),
`draft_sample` (the draft's q and draw), `verify` / `choose` (the target's test, recovered, bonus or coupled token,
its warped rows never written out).

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
    lib = ckernels.kernel(SOURCE, "SPECSERVE_VOCAB_OPS", {
        "row_logsumexp": [ptr, c_long, c_long, c_long, ptr, c_int, c_int],
        "block_max": [ptr, c_long, c_long, c_long, c_long, ptr, c_long, c_int, c_int],
        "top_values": [ptr, c_long, c_long, c_long, c_long, ptr, ptr, c_int, c_int],
        "cut_below": [ptr, c_long, c_long, c_long, ptr, c_int],
        "gumbel_argmax": [ptr, c_long, c_long, c_long, ptr, ptr, c_int, c_int],
        "top_p_floor": [ptr, c_long, c_long, c_long, ptr, ptr, ptr, c_long, c_int],
        "row_argmax": [ptr, c_long, c_long, c_long, ptr, c_int, c_int],
        "scale_rows": [ptr, c_long, c_long, c_long, ptr, ptr, c_long, c_int, c_int],
        "warp_rows": [ptr, c_long, c_long, c_long, ptr, ptr, ptr, ptr, ptr, c_long, ptr, c_long, c_int, c_int],
        "draft_sample": [ptr, c_long, c_long, ptr, c_long, c_long, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, c_int,
                         c_int],
        "verify_rows": [ptr, c_long, c_long, ptr, c_long, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, c_long, ptr, ptr,
                        ptr, ptr, c_long, c_int, c_int],
        "use_wide_lanes": [c_int]})
    if lib is not None:
        lib.use_wide_lanes.restype = c_int
        lib.draft_sample.restype = c_long
    return lib


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


def warp(x: torch.Tensor, t: torch.Tensor | None, cut: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         out: torch.Tensor) -> torch.Tensor:  # x [R, V]; t, cut, top_k, top_p [R] -> floor [R] float32
    """out = x / t[:, None] in float32 (t None: widened alone), each row with cut[r] (int32 flags, `Warp.cut_flags`)
    then cut below its top-k / top-p floor, one row at a time while it is in cache: `scaled`, `top_p_floor` and
    `cut_below_`'s bits. Returns each row's floor (-inf for an uncut row; NaN where the nucleus outgrows WIDEST
    candidates: that row is scaled but not cut, for torch's loop). out: float32 [R, V], contiguous rows, or x itself
    when x is float32."""
    rows, vocab = x.shape
    t = None if t is None else t.to(torch.float32).contiguous()
    cut = cut.to(torch.int32).contiguous()
    top_k, top_p = top_k.to(torch.long).contiguous(), top_p.to(torch.float32).contiguous()
    floor = torch.empty(rows, dtype=torch.float32)
    _library().warp_rows(x.data_ptr(), x.stride(0), rows, vocab, None if t is None else t.data_ptr(), cut.data_ptr(),
                         top_k.data_ptr(), top_p.data_ptr(), out.data_ptr(), out.stride(0), floor.data_ptr(), WIDEST,
                         int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return floor


def draft_sample(x: torch.Tensor, rows: torch.Tensor, n: int, t: torch.Tensor, cut: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, u: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor,
                 ids: torch.Tensor) -> int:  # x [B, V]; rows [R]; t ... u, tokens [B]; values, ids [B, n]
    """For each of `rows`: the draft's q over its n most likely tokens, divided by t, cut by top-k / top-p where cut
    (`sampling._truncate` on those n; cut: int32 flags, `Warp.cut_flags`) and renormalized, into values (float32)
    and ids (int32), and a token drawn from it by u (`speculative.sample`'s inverse CDF) into tokens; -1 there for a
    row whose largest value is not finite (the caller's torch path takes it). Returns how many rows were left so.
    n <= min(V, WIDEST)."""
    b, vocab = x.shape
    if not 0 < n <= min(vocab, WIDEST):
        raise ValueError(f"draft_sample: width {n} outside 1..{min(vocab, WIDEST)}")
    rows = rows.to(torch.long).contiguous()
    t, u, cut = t.to(torch.float32).contiguous(), u.to(torch.float32).contiguous(), cut.to(torch.int32).contiguous()
    top_k, top_p = top_k.to(torch.long).contiguous(), top_p.to(torch.float32).contiguous()
    return _library().draft_sample(x.data_ptr(), x.stride(0), vocab, rows.data_ptr(), len(rows), n, t.data_ptr(),
                                   cut.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), u.data_ptr(), tokens.data_ptr(),
                                   values.data_ptr(), ids.data_ptr(), int(x.dtype == torch.bfloat16),
                                   torch.get_num_threads())


def verify(x: torch.Tensor, rows: torch.Tensor, t: torch.Tensor | None, cut: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, test: list[bool], d: torch.Tensor, q_values: torch.Tensor, q_ids: torch.Tensor,
           u: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x [A, V] raw logits; rows [R] into x; t, cut, top_k, top_p, d, u, keys [R]; q_values, q_ids [R, N]
    # -> token [R] long, accepted [R] bool
    """The target's sampled decision for rows of x in one C call, the warped rows never written out: each row
    warped (t None: unscaled; cut: int32 flags, as `warp`), then where `test` the rejection test of draft token d
    against q (accepted: the token is d) and on rejection the recovered token from the residual, elsewhere the
    Gumbel-max choice of the warped row under its key. Token -1 for a row whose nucleus outgrows WIDEST candidates
    (the caller's torch path takes it)."""
    r, vocab = len(rows), x.shape[1]
    i64, f32, i32 = torch.long, torch.float32, torch.int32
    rows, d = rows.to(i64).contiguous(), d.to(i64).contiguous()
    t = None if t is None else t.to(f32).contiguous()
    q_values, q_ids = q_values.to(f32).contiguous(), q_ids.to(i32).contiguous()
    u, keys, cut = u.to(f32).contiguous(), keys.to(i32).contiguous(), cut.to(i32).contiguous()
    top_k, top_p = top_k.to(i64).contiguous(), top_p.to(f32).contiguous()
    test_t = torch.tensor(test, dtype=i32)
    token, accepted = torch.empty(r, dtype=i64), torch.empty(r, dtype=i32)
    _library().verify_rows(x.data_ptr(), x.stride(0), vocab, rows.data_ptr(), r, None if t is None else t.data_ptr(),
                           cut.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), test_t.data_ptr(), d.data_ptr(),
                           q_values.data_ptr(), q_ids.data_ptr(), q_values.shape[1], u.data_ptr(), keys.data_ptr(),
                           token.data_ptr(), accepted.data_ptr(), WIDEST, int(x.dtype == torch.bfloat16),
                           torch.get_num_threads())
    return token, accepted.bool()


def choose(x: torch.Tensor, rows: torch.Tensor, t: torch.Tensor | None, cut: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # x [A, V]; rows, ... [R] -> [R] long
    """The coupled sampler's choice over each of `rows` of x warped (`verify` with nothing tested): a seeded row's
    token, the warped rows never written out. -1 for a row whose nucleus outgrows WIDEST candidates."""
    r = len(rows)
    no_q, no_ids = torch.zeros(r, 1), torch.zeros(r, 1, dtype=torch.int32)
    return verify(x, rows, t, cut, top_k, top_p, [False] * r, torch.zeros(r, dtype=torch.long), no_q, no_ids,
                  torch.zeros(r), keys)[0]


def wide_lanes(on: bool) -> bool:
    """Let the kernels use 16 lanes where the CPU has AVX-512 (on) or keep to 8 (tests hold the two to the same
    bits); returns the setting before."""
    return bool(_library().use_wide_lanes(int(on)))
