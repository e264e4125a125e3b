"""Attention backends: how one packed forward's queries read their keys and values from the paged pool.

Both take the same inputs (the packed rows: each row's fed tokens, its start position and its block table)
and give the same outputs; they differ in what they move:

  gather  copies each group's keys and values out of the pool (`pool[kv_slots]`) and calls SDPA on the
          copy: short rows (decoding, verifying) together, padded, grouped by context length; each long
          row (a prefill chunk) alone. Fastest on a CPU, where SDPA is a tuned kernel and the copy is a
          memcpy; on a GPU the copy is what costs (batch 64 x 8k context on an 8B shape: ~2 GB per layer).
  flex    torch's flex_attention over the whole pool in place: a block mask says which pool blocks each
          tile of 16 queries reads (its row's table), so a compiled kernel touches only those, and no
          key or value is copied. Each row's queries are padded to whole tiles (a tile never mixes rows).
          Compiled on CUDA; eager elsewhere (the eager path computes the dense mask: tests only).

`choose(name, device)` picks one at startup: `auto` is gather on a CPU and flex on CUDA when flex
passes a probe against gather there (else gather, logged). Measured on a 2-core CPU (`specserve bench
attention`): results/bench-attention-cpu-2core.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.engine import ckernels
from serve_app.pricing import pad_groups

log = logging.getLogger(__name__)

BACKENDS = ("gather", "flex")
"""Attention backends by name (`EngineConfig.attention_backend` also takes `auto`)."""

TRASH = 0
"""Block 0 is never handed out: padded reads in a batched attention call point there (masked)."""

SHORT_ROW = 16
"""gather: rows feeding at most this many tokens (or twice the fewest any row feeds) share one attention
call; longer ones (prefill chunks) get their own."""

TILE = 16
"""flex: queries per tile (a tile's queries all belong to one row, so it reads exactly that row's blocks)."""


@dataclass
class Row:
    """One packed row: its fed tokens are [offset, offset + n) of the forward, at positions [start, start + n)."""

    offset: int
    n: int
    start: int
    table: list[int]  # its pool blocks in position order


# ---- gather ---------------------------------------------------------------------------------------
@dataclass
class Group:
    """Rows attended together: queries q_index [B, T] into the packed tokens (pads repeat a real one),
    keys kv_slots [B, L] into the pool (pads: the trash block), mask [B, 1, T, L] (a query sees keys
    at positions <= its own); None: one row whose keys are exactly its queries, plain causal. The real
    (unpadded) queries: valid [N] their places in the flattened [B * T] output, at [N] their packed tokens
    (long indices made on the host: a boolean mask would be read back from the device at every layer)."""

    q_index: torch.Tensor
    valid: torch.Tensor
    at: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    spans: torch.Tensor | None = None  # [B, 3] each row's (offset, n, start), on the host: the C kernel's rows
    tables: torch.Tensor | None = None  # [B, blocks] each row's pool blocks, on the host (the trash block past them)
    block_size: int = 0

    def to(self, device) -> "Group":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Group(move(self.q_index), move(self.valid), move(self.at), move(self.kv_slots), move(self.mask),
                     self.spans, self.tables, self.block_size)


def gather_layout(rows: list[Row], pos: torch.Tensor, block_size: int) -> list[Group]:  # pos [T]
    # Rows feeding about as few tokens as the shortest (decoding, verifying) share padded attention calls,
    # grouped by context length (`pricing.pad_groups`, which the `padded` price reads too) so short contexts do
    # not pad to a long one's;
    # a row feeding many more (a prefill chunk) gets its own call, so nobody pads to its width.
    width = max(SHORT_ROW, 2 * min(r.n for r in rows))
    short = [r for r in rows if r.n <= width]
    groups = [_group([short[i] for i in g], pos, block_size) for g in pad_groups([r.start + r.n for r in short])]
    return groups + [_group([r], pos, block_size) for r in rows if r.n > width]


def _group(rows: list[Row], pos: torch.Tensor, bs: int) -> Group:
    # built as host lists and made tensors once each: a decode step's rows cost no tensor op apiece
    width = max(r.n for r in rows)
    length = max(r.start + r.n for r in rows)
    q_rows = [[r.offset + max(c - (width - r.n), 0) for c in range(width)] for r in rows]
    q_index = torch.tensor(q_rows, dtype=torch.long)  # [B, T]
    valid = torch.tensor([b * width + c for b, r in enumerate(rows) for c in range(width - r.n, width)], dtype=torch.long)
    at = torch.tensor([q for r, qs in zip(rows, q_rows) for q in qs[width - r.n:]], dtype=torch.long)
    nblk = -(-length // bs)
    tables = torch.tensor([r.table[:nblk] + [TRASH] * (nblk - len(r.table[:nblk])) for r in rows], dtype=torch.long)
    kv_slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(len(rows), -1)[:, :length]  # [B, L]
    if len(rows) == 1 and rows[0].start == 0:  # a prompt's first chunk: keys = its queries, plain causal
        return Group(q_index, valid, at, kv_slots, None)
    qpos = pos[q_index]  # [B, T]
    mask = torch.arange(length)[None, None, :] <= qpos[:, :, None]
    spans = torch.tensor([(r.offset, r.n, r.start) for r in rows], dtype=torch.long)
    return Group(q_index, valid, at, kv_slots, mask[:, None], spans, tables, bs)


def gather_attend(q, k_pool, v_pool, groups: list[Group], scaling, out: torch.Tensor | None = None) -> torch.Tensor:
    # q [T, H, D]; k_pool, v_pool [slots, kv_heads, D] -> out [T, H, D] (each group's rows written; new if None)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    gqa = q.shape[1] != k_pool.shape[1]
    for g in groups:  # index_select, not [index]: whole rows copied, not element by element (3-5x faster)
        if _kernel_fits(q, k_pool, v_pool, g):  # writes its rows of out in place
            _kernel_attend(q, k_pool, v_pool, g, scaling, out)
            continue
        qg = _rows(q, g.q_index).transpose(1, 2)  # [B, H, T, D]
        kg = _rows(k_pool, g.kv_slots).transpose(1, 2)  # [B, kv_heads, L, D]: the copy this backend makes
        vg = _rows(v_pool, g.kv_slots).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, is_causal=g.mask is None, scale=scaling, enable_gqa=gqa)
        out.index_copy_(0, g.at, o.transpose(1, 2).flatten(0, 1).index_select(0, g.valid))  # [N, H, D]
    return out


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # x [S, ...], index [B, L] -> [B, L, ...]
    return x.index_select(0, index.flatten()).unflatten(0, index.shape)


# ---- gather's C kernel for short rows on a CPU -----------------------------------------------------
KERNEL = Path(__file__).with_name("paged_attention.c")


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    """`paged_attention.c`, where this CPU runs it (AVX2 and FMA, a C compiler) and SPECSERVE_ATTENTION_KERNEL
    is not 0."""
    c_long, ptr = ctypes.c_long, ctypes.c_void_p
    common = [ptr, c_long, c_long, ptr, ptr, ptr, c_long, ptr, c_long, c_long, c_long, c_long, c_long, ctypes.c_float,
              ptr, ctypes.c_int]
    return ckernels.kernel(KERNEL, "SPECSERVE_ATTENTION_KERNEL", {"paged_attention": common + [ctypes.c_int],
                                                                 "paged_attention_bf16": common})


@functools.cache
def _bf16_scores() -> bool:
    """bfloat16 pools take the AVX512-BF16 item (scores by vdpbf16ps) where this CPU has it and
    SPECSERVE_ATTENTION_BF16 is not 0."""
    from serve_app.hardware import cpu_flags

    return os.environ.get("SPECSERVE_ATTENTION_BF16", "1") != "0" and \
        {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


KERNEL_ON = True
"""gather's short rows go to the C kernel where it runs (`specserve bench attention` turns it off for its
baseline: SDPA on the gathered copy)."""


def _kernel_fits(q, k_pool, v_pool, g: Group) -> bool:
    """A group of short rows (not a prompt's plain-causal chunk) on the CPU in float32 or bfloat16 (queries, keys and
    values read as they are, widened in registers; results rounded to the dtype): the C kernel's."""
    return KERNEL_ON and g.spans is not None and g.q_index.shape[1] <= SHORT_ROW and q.device.type == "cpu" \
        and q.dtype == k_pool.dtype == v_pool.dtype and q.dtype in (torch.float32, torch.bfloat16) and q.stride(2) == 1 \
        and k_pool.is_contiguous() and v_pool.is_contiguous() and q.shape[2] % 8 == 0 and _kernel() is not None


def _kernel_attend(q, k_pool, v_pool, g: Group, scaling, out) -> None:  # q, out [T, H, D]; pools [slots, KV, D]
    h, d = q.shape[1], q.shape[2]
    args = (q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(), v_pool.data_ptr(), g.spans.data_ptr(),
            g.spans.shape[0], g.tables.data_ptr(), g.tables.stride(0), g.block_size, h, k_pool.shape[1], d,
            d ** -0.5 if scaling is None else scaling, out.data_ptr(), torch.get_num_threads())
    fn, tail = kernel_entry(k_pool.dtype, d)
    fn(*args, *tail)


def kernel_entry(dtype: torch.dtype, d: int) -> tuple:
    """(the C kernel's function for pools of `dtype` and head size d, the arguments it takes after the common ones)."""
    bf16 = dtype == torch.bfloat16
    if bf16 and d % 32 == 0 and _bf16_scores():
        return _kernel().paged_attention_bf16, ()
    return _kernel().paged_attention, (int(bf16),)


# ---- flex -----------------------------------------------------------------------------------------
@dataclass
class FlexLayout:
    """Where the packed queries sit in whole tiles and which pool blocks each tile reads."""

    pad_index: torch.Tensor  # [Tpad] packed token each padded query repeats (pads repeat their row's last)
    real: torch.Tensor  # [T] where each packed token sits among the padded queries
    q_pos: torch.Tensor  # [Tpad] position of each padded query
    q_row: torch.Tensor  # [Tpad] row of each padded query
    tables: torch.Tensor  # [rows, max blocks] each row's blocks (TRASH past its end)
    block_pos: torch.Tensor  # [pool blocks] a held block's index in its tables (one per block: a shared
    #                          prefix block sits at the same index in every table holding it)
    kv_num_blocks: torch.Tensor  # [tiles] int32 blocks each tile reads
    tile_tables: torch.Tensor  # [tiles, most blocks a tile reads] int32 those blocks (0 past each tile's)
    block_size: int
    pool_blocks: int
    mask: object = None  # the forward's BlockMask, built at its first layer and reused by the others

    def to(self, device) -> "FlexLayout":
        t = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return FlexLayout(**{**t, "mask": None})

    def block_mask(self, slots: int):
        """flex_attention's block mask for this forward: tile t reads blocks tile_tables[t] of the pool (a
        key's block must also be in the query row's table, at or before the query: `mask_mod`). Built once
        per forward on the layout's device: only the small per-tile tables crossed from the host, not the
        [tiles, pool blocks] index flex_attention takes."""
        if self.mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            tiles, width = self.tile_tables.shape
            kv_idx = torch.zeros((tiles, self.pool_blocks), dtype=torch.int32, device=self.tile_tables.device)
            kv_idx[:, :width] = self.tile_tables
            self.mask = BlockMask.from_kv_blocks(self.kv_num_blocks[None, None], kv_idx[None, None],
                                                 BLOCK_SIZE=(TILE, self.block_size), mask_mod=self.mask_mod(),
                                                 seq_lengths=(self.pad_index.shape[0], slots))
        return self.mask

    def mask_mod(self):
        """flex_attention's mask_mod over this layout's tensors (read where they are: a static step's are
        rewritten in place each step): a key is seen by a query of the row whose table holds the key's block,
        at or before the query's position."""
        bs, tables, block_pos, q_pos, q_row = self.block_size, self.tables, self.block_pos, self.q_pos, self.q_row

        def mask_mod(b, h, qi, ki):
            blk = ki // bs
            j = block_pos[blk]  # < tables' width: block_pos holds table indices only
            return (tables[q_row[qi], j] == blk) & (j * bs + ki % bs <= q_pos[qi])

        return mask_mod


def flex_layout(rows: list[Row], pos: torch.Tensor, block_size: int, pool_blocks: int) -> FlexLayout:
    bs = block_size
    pad_index, real, q_pos, q_row, tile_blocks = [], [], [], [], []
    padded = 0  # padded queries so far
    for i, r in enumerate(rows):
        tiles = -(-r.n // TILE)
        cols = torch.arange(tiles * TILE)
        real.append(padded + cols[: r.n])
        padded += tiles * TILE
        pad_index.append(r.offset + torch.clamp(cols, max=r.n - 1))
        q_pos.append(r.start + torch.clamp(cols, max=r.n - 1))
        q_row.append(torch.full((tiles * TILE,), i))
        for t in range(tiles):  # a tile reads its row's blocks up to its last query's position
            tile_blocks.append(r.table[: (r.start + min(r.n, (t + 1) * TILE) - 1) // bs + 1])
    # the tables' width in powers of two, at least 2: the compiled kernel's mask reads them, and a width that
    # changes every step (or is 1, which torch.compile specializes) recompiles it until its recompile limit,
    # after which flex_attention runs unfused (dense over the pool)
    width = 1 << max(1, (max(len(r.table) for r in rows) - 1).bit_length())
    tables = torch.full((len(rows), width), TRASH, dtype=torch.long)
    block_pos = torch.zeros(pool_blocks, dtype=torch.long)
    for i, r in enumerate(rows):
        t = torch.tensor(r.table, dtype=torch.long)
        tables[i, : len(t)] = t
        block_pos[t] = torch.arange(len(t))
    kv_num = torch.tensor([len(b) for b in tile_blocks], dtype=torch.int32)
    tile_tables = torch.zeros(len(tile_blocks), max(len(b) for b in tile_blocks), dtype=torch.int32)
    for t, b in enumerate(tile_blocks):
        tile_tables[t, : len(b)] = torch.tensor(b, dtype=torch.int32)
    return FlexLayout(torch.cat(pad_index), torch.cat(real), torch.cat(q_pos), torch.cat(q_row), tables, block_pos,
                      kv_num, tile_tables, bs, pool_blocks)


COMPILE_FLEX: bool | None = None
"""Compile flex_attention: None = on CUDA only (`bench attention` sets True to time it compiled on a CPU)."""

_compiled: dict = {}


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if not (device.type == "cuda" if COMPILE_FLEX is None else COMPILE_FLEX):
        # eager: correct but dense over the pool (tests); compiled flex on a CPU is slower than gather
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention
    if device.type not in _compiled:  # dynamic on CUDA: the number of queries changes every step
        import torch._dynamo

        # each batch shape's first sizes of 0 / 1 and each pool size compile once: past dynamo's default limit
        # of 8, flex_attention would fall back to its unfused path (dense scores over the pool) for good
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled[device.type] = torch.compile(flex_attention, dynamic=device.type == "cuda")
    return _compiled[device.type]


def kernel_options(block_size: int) -> dict:
    """The compiled (Triton) kernel's tiles: they must divide the block mask's blocks (a tile of TILE queries,
    a pool block of keys), which its default tiles (64-128) do not. A pool block size that 16 does not divide
    fails the startup probe, and `auto` falls back to gather."""
    return {"BLOCK_M": TILE, "BLOCK_N": next((n for n in (64, 32, 16) if block_size % n == 0), block_size)}


def flex_attend(q, k_pool, v_pool, lay: FlexLayout, scaling) -> torch.Tensor:
    # q [T, H, D]; k_pool, v_pool [slots, kv_heads, D] -> [T, H, D]
    bs, mask = lay.block_size, lay.block_mask(k_pool.shape[0])
    qp = q[lay.pad_index].transpose(0, 1)[None]  # [1, H, Tpad, D]
    extra = {"kernel_options": kernel_options(bs)} if q.is_cuda else {}
    o = _flex_fn(q.device)(qp, k_pool.transpose(0, 1)[None], v_pool.transpose(0, 1)[None], block_mask=mask,
                           scale=scaling, enable_gqa=q.shape[1] != k_pool.shape[1], **extra)
    return o[0].transpose(0, 1)[lay.real]  # [T, H, D]


# ---- choosing -------------------------------------------------------------------------------------
def layout(backend: str, rows: list[Row], pos: torch.Tensor, block_size: int, pool_blocks: int):
    """What `attend` needs for this forward, built on the host (moved to the device with the batch)."""
    if backend == "flex":
        return flex_layout(rows, pos, block_size, pool_blocks)
    return gather_layout(rows, pos, block_size)


def move(lay, device):
    """A layout (`layout`'s result: flex's FlexLayout or gather's groups) on `device`."""
    return lay.to(device) if isinstance(lay, FlexLayout) else [g.to(device) for g in lay]


def attend(backend: str, q, k_pool, v_pool, lay, scaling) -> torch.Tensor:
    # q [T, H, D]; k_pool, v_pool [slots, kv_heads, D] -> [T, H, D]
    if backend == "flex":
        return flex_attend(q, k_pool, v_pool, lay, scaling)
    return gather_attend(q, k_pool, v_pool, lay, scaling)


def choose(name: str, device, block_size: int = 16) -> str:
    """The backend a worker on `device` runs: `name`, or for `auto` the SPECSERVE_ATTENTION_BACKEND
    environment variable's backend where it names one (as vLLM's VLLM_ATTENTION_BACKEND: a whole process, its
    profilers and benchmarks included, kept on one kernel), else gather on a CPU and flex on CUDA if it passes
    `probe` there at the pool's block size (compiles, and matches gather)."""
    if name == "auto":
        name = os.environ.get("SPECSERVE_ATTENTION_BACKEND", "auto") or "auto"
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention backend must be auto or one of {BACKENDS}, got {name!r}")
        return name
    device = torch.device(device)
    if device.type != "cuda":
        return "gather"
    try:
        err = probe("flex", device, block_size=block_size)
    except Exception as e:  # flex missing or failing to compile here: gather works everywhere
        log.warning("attention: flex_attention failed its probe on %s (%s); using gather", device, e)
        return "gather"
    if err > 2e-2:
        log.warning("attention: flex_attention differs from gather by %.3g on %s; using gather", err, device)
        return "gather"
    return "flex"


PROBE_ROWS = [(0, 40), (35, 3), (70, 1), (18, 5)]
"""The startup probe's batch as (start, fed tokens) per row: a prefill chunk and ragged decoding rows."""


def probe(backend: str, device, dtype=torch.float32, seed: int = 0, block_size: int = 16,
          rows_spec: list[tuple[int, int]] = PROBE_ROWS, shared_prefix_blocks: int = 0) -> float:
    """Largest difference between `backend` and gather on `device` on a random batch (`random_batch`: GQA,
    blocks shuffled over the pool)."""
    q, kp, vp, rows, pos, bs, nblk = random_batch(rows_spec, seed=seed, block_size=block_size,
                                                  shared_prefix_blocks=shared_prefix_blocks)
    args = [t.to(device, dtype) for t in (q, kp, vp)]
    want = attend("gather", *args, move(layout("gather", rows, pos, bs, nblk), device), None)
    got = attend(backend, *args, move(layout(backend, rows, pos, bs, nblk), device), None)
    return (got.float() - want.float()).abs().max().item()


def random_batch(rows_spec: list[tuple[int, int]], heads: int = 8, kv_heads: int = 2, head_dim: int = 32,
                 block_size: int = 16, seed: int = 0, shared_prefix_blocks: int = 0):
    """A random pool and packed batch: rows_spec = (start, fed tokens) per row; blocks shuffled over the pool;
    the first `shared_prefix_blocks` blocks of every row are the same blocks (a prefix-cache hit).
    Returns q [T, H, D], k_pool, v_pool [slots, kv_heads, D], rows, positions [T], block size, pool blocks."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    need = [-(-(s + n) // bs) for s, n in rows_spec]
    nblk = 1 + sum(need) + 3  # the trash block, every row's own, a few free
    perm = (torch.randperm(nblk - 1, generator=g) + 1).tolist()
    shared = perm[:shared_prefix_blocks]
    rows, pos, offset, taken = [], [], 0, shared_prefix_blocks
    for (s, n), blocks in zip(rows_spec, need):
        own = blocks - len(shared)
        table = shared + perm[taken: taken + max(own, 0)]
        taken += max(own, 0)
        rows.append(Row(offset, n, s, table))
        pos.append(torch.arange(s, s + n))
        offset += n
    q = torch.randn(offset, heads, head_dim, generator=g)
    kp = torch.randn(nblk * bs, kv_heads, head_dim, generator=g)
    vp = torch.randn(nblk * bs, kv_heads, head_dim, generator=g)
    return q, kp, vp, rows, torch.cat(pos), bs, nblk
