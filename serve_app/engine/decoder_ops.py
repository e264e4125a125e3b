"""A decoder layer's small ops in one C call each on a CPU (`decoder_ops.c`): residual add + RMSNorm, rotary, SiLU * up.

`lean.forward` calls these where `fits` says they run (a CPU tensor of float32 or bfloat16, the kernel built);
elsewhere it runs torch's ops. Outputs are torch's to rounding (the C file says where they may differ), and
batch-invariant. `SPECSERVE_DECODER_OPS=0` switches them off (torch's ops, bit for bit transformers').
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
"""`lean.forward` calls the kernels where they run (tests and benchmarks turn it off for torch's ops)."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    c_long, ptr, c_int = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    return ckernels.kernel(SOURCE, "SPECSERVE_DECODER_OPS", {
        "add_rms_norm": [ptr, c_long, ptr, c_long, ptr, c_long, ptr, ctypes.c_float, ptr, c_long, c_long, c_long,
                         c_int, c_int],
        "rotary": [ptr, c_long, c_long, c_long, c_long, c_long, ptr, ptr, c_long, c_int, c_int, ptr, ptr, ptr, c_long,
                   c_long],
        "silu_mul": [ptr, c_long, ptr, c_long, c_long, c_long, c_int, c_int],
        "decoder_layers": [c_long, c_long, c_long, ptr, ptr] + [ptr] * 7 + [c_long] * 6 + [c_int, c_int, ptr, ptr, c_long,
                                                                                    ptr, c_long, ptr, ptr, c_int, c_int]})


def fits(h: torch.Tensor) -> bool:
    """The kernels run on these activations ([T, hidden]): a CPU tensor of float32 or bfloat16, kernels built, ON."""
    return ON and h.device.type == "cpu" and h.dtype in _DTYPES and _library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:  # [T, D] with its last dimension contiguous
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # h, delta [T, D]; weight [D]
    """(h + delta, its RMSNorm times weight) as new tensors [T, D]; without delta (h, the norm of h)."""
    h = _rows(h)
    t, d = h.shape
    normed = torch.empty_like(h)
    out = None
    if delta is not None:
        delta = _rows(delta)
        out = torch.empty_like(h)
    w = weight if weight.dtype == h.dtype and weight.is_contiguous() else weight.detach().to(h.dtype).contiguous()
    _library().add_rms_norm(h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
                            0 if delta is None else delta.stride(0), None if out is None else out.data_ptr(), d,
                            w.data_ptr(), eps, normed.data_ptr(), d, t, d, int(h.dtype == torch.bfloat16),
                            torch.get_num_threads())
    return (h if out is None else out), normed


def rotary(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, store=None) -> None:
    """Rotate the first `heads` heads of qkv ([T, heads + more, D], each head contiguous) in place by cos and
    sin_signed ([T, D] in qkv's dtype; sin with rotate_half's negation on its first half). store: (k_pool, v_pool,
    slots, first) to then write each row's key heads (first .. first + KV - 1, KV = the pools' heads) and the value
    heads after them at pool slots [T] (pools [slots, KV, D], contiguous, qkv's dtype)."""
    t, _, d = qkv.shape
    if qkv.stride(2) != 1 or cos.stride(1) != 1 or sin_signed.stride() != cos.stride():
        raise ValueError("rotary: heads and cos / sin rows must be contiguous, cos and sin alike")
    kp = vp = slots = None
    first = kv = 0
    if store is not None:
        k_pool, v_pool, slots_t, first = store
        kv = k_pool.shape[1]
        if not (k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype == qkv.dtype
                and k_pool.shape[1:] == v_pool.shape[1:] == (kv, d) and slots_t.dtype == torch.int64
                and slots_t.is_contiguous() and slots_t.shape == (t,) and first + 2 * kv <= qkv.shape[1]):
            raise ValueError("rotary: pools must be contiguous [slots, KV, D] in qkv's dtype, slots int64 [T]")
        kp, vp, slots = k_pool.data_ptr(), v_pool.data_ptr(), slots_t.data_ptr()
    _library().rotary(qkv.data_ptr(), qkv.stride(0), qkv.stride(1), t, heads, d, cos.data_ptr(),
                      sin_signed.data_ptr(), cos.stride(0), int(qkv.dtype == torch.bfloat16), torch.get_num_threads(),
                      kp, vp, slots, first, kv)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up, gate and up side by side (the fused gate / up projection's output)."""
    gate_up = _rows(gate_up)
    t, two_i = gate_up.shape
    out = gate_up.new_empty(t, two_i // 2)
    _library().silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), t, two_i // 2,
                        int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out
