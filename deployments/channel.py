"""The step's calls between a Router and its worker actors over one TCP connection each, not Ray task calls.

A Ray actor call took 3-7 ms there and back on the 2-core machine with nothing else running (several per step:
the draft's proposal, the target's verification), a message over a local TCP connection ~0.1 ms. So once a
worker's model has loaded, its model thread stays inside one long Ray call (`_ModelHost.serve_channel`) that
answers the Router's requests from a socket; Ray still starts, watches (`ping`), kills and replaces the actors,
and a dead actor's socket closes, which fails the step as a dead actor's Ray call did.

An EAGLE-style draft's features (the target's hidden states of the positions a verification made final) go
from the target's actor to the draft's over a connection of their own: the target sends them tagged, and
returns only the tag, which the Router passes on with the draft's commit (`FeatureTag`).
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from typing import NamedTuple

import torch

HEADER = struct.Struct("<Q")  # a message's length in bytes, then its pickle


class FeatureTag(NamedTuple):
    """Features a target sent its draft directly: verification `step` of that target, `part` 0 for the decoding
    rows, 1 for the prefill chunks (`Verdict.features` split as `scheduler.split_rows` does)."""

    step: int
    part: int


class _Pickler(pickle.Pickler):
    """Pickles a CPU tensor as its numpy array (torch's own reduction goes through `torch.save`: ~130 us to encode
    and ~170 to decode a step's empty proposal, against ~10 this way, both on a step's critical path)."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY and not obj.requires_grad:
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64, torch.float32,
          torch.float16}
"""Tensor dtypes numpy holds (bfloat16 is not one: those keep torch's reduction)."""


def encode(obj) -> bytes:
    """One message: its length, then its pickle (what cannot be pickled raises here, before anything is sent)."""
    buf = io.BytesIO()
    buf.write(bytes(HEADER.size))
    _Pickler(buf, protocol=5).dump(obj)
    data = buf.getbuffer()
    HEADER.pack_into(data, 0, len(data) - HEADER.size)
    return bytes(data)


def send(sock: socket.socket, obj) -> None:
    sock.sendall(encode(obj))


def _read(sock: socket.socket, n: int) -> memoryview:
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:])
        if not k:
            raise ConnectionError("the other end closed the connection")
        got += k
    return buf


def recv(sock: socket.socket):
    (n,) = HEADER.unpack(_read(sock, HEADER.size))
    return pickle.loads(_read(sock, n))


def connect(address: tuple[str, int], timeout_s: float | None) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one small write: send it now
    return sock


def listen(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(8)
    return sock


def pack_rows(rows: list[torch.Tensor]) -> tuple:
    """Per-row [n, F] tensors (one dtype) as (dtype name, row lengths, F, their bytes): one buffer to send."""
    if not rows:
        return ("", [], 0, b"")
    flat = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).cpu().contiguous()
    return (str(flat.dtype).removeprefix("torch."), [r.shape[0] for r in rows], flat.shape[-1],
            flat.view(torch.uint8).numpy().tobytes())


def unpack_rows(packed: tuple) -> list[torch.Tensor]:
    dtype, lengths, width, data = packed
    if not lengths:
        return []
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(-1, width)
    return list(flat.split(lengths))
