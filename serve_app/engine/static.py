"""Static steps: a decoding or verification forward's inputs written in place into persistent buffers sized by
bucket, so that on CUDA the forward is captured once per bucket as a graph and replayed (issue 56).

An eager step pays the host for every kernel it launches (an 8B-shape verification at batch 1: ~42 ms of
launches for ~5 ms of device work, results/gpu-h100/). A captured graph replays every kernel of the forward
in one launch, but it replays exactly what it recorded: the same tensors at the same addresses, of the same
shapes. So a step whose rows each feed at most one tile of tokens (decoding: 1; verification: 1 + k) is laid
out at a fixed shape, its bucket: `rows` rows (the batch padded up to the next of BATCH_BUCKETS) of `width`
tokens each (the longest row padded up to the next of WIDTH_BUCKETS). Row b's token c sits at b * width + c.
A padded token (a row past its own tokens, or a padding row) writes its keys and values into the trash block
and its outputs are never read. Prefill chunks, wider rows and larger batches stay eager (`kv.pack`).

The flex attention layout of a bucket is fixed too: each row is one tile of TILE queries, and its block mask
(`attention.FlexLayout`) is built once per bucket over the persistent buffers, which each step rewrites in
place: which blocks each row's tile reads (`kv_idx` is pool-wide, as flex_attention takes it, but only its first
columns are written), the rows' tables, each block's index in its table (`block_pos`: written for the step's
blocks only: a stale entry names a block no row of this step holds, which the mask's table check rejects).
No step does work in proportion to the pool; only a pool that grows (on a CPU) or a larger bucket than the
buffers hold reallocates them, and drops the layouts and graphs built over them.

On a CPU (tests, `static_steps: eager`) the same buffers feed the same forward eagerly: the outputs equal the
packed path's token for token (tests/test_static.py), which is what makes the replayed graph's trustworthy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from serve_app.engine.attention import TILE, TRASH, FlexLayout
from serve_app.engine.kv import PackedBatch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Rows a static step is padded to (the next one up); a larger batch runs eager."""

WIDTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
"""Tokens per row a static step is padded to: every 1 + k up to 8 exactly (speculation's widths), then 12 and
16 (one flex tile); a row feeding more (a prefill chunk, a draft's backlog) makes the step eager."""

MODES = ("auto", "graphs", "eager", "off")
"""`EngineConfig.static_steps`: auto (graphs on CUDA with flex attention, else off), graphs, eager (the static
buffers without capture: a CPU's tests, or a GPU's A/B of capture alone), off."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n, or None when n is past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class Shape:
    """A bucket's fixed inputs and outputs: views of the persistent buffers at the bucket's sizes."""

    ids: torch.Tensor  # [1, rows * width]
    pos: torch.Tensor  # [1, rows * width]
    slots: torch.Tensor  # [rows * width]
    index: torch.Tensor  # [rows * width] every token's output (the caller picks its own outside the graph)
    layout: FlexLayout
    graph: object = None  # torch.cuda.CUDAGraph once captured; False where capture failed (eager from then on)
    out: torch.Tensor | None = None  # [rows * width, hidden] the captured forward's output (the graph's memory)


class StaticSteps:
    """A worker's persistent step buffers, the bucket shapes over them and (on CUDA) their captured graphs."""

    def __init__(self, device: torch.device, capture: bool):
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.rows = self.table_width = self.pool_blocks = 0  # what the buffers hold now
        self.shapes: dict[tuple[int, int], Shape] = {}
        self.pool = None  # CUDA graphs' shared memory pool
        self.captured = self.replays = self.eager_runs = 0

    # ---- which steps ------------------------------------------------------------------------
    def key(self, fed: list[list[int]]) -> tuple[int, int] | None:
        """(rows, width) of the bucket that holds this step's rows, or None: the step runs packed."""
        widest = max((len(f) for f in fed), default=0)
        if not widest:
            return None
        rows, width = bucket(len(fed), BATCH_BUCKETS), bucket(widest, WIDTH_BUCKETS)
        return None if rows is None or width is None else (rows, width)

    # ---- buffers ----------------------------------------------------------------------------
    def _ensure(self, rows: int, table_width: int, pool_blocks: int) -> None:
        """Buffers for `rows` rows of tables `table_width` wide over a pool of `pool_blocks`; reallocating
        (and dropping every shape and graph over the old ones) only when one of those outgrows them."""
        if rows <= self.rows and table_width <= self.table_width and pool_blocks == self.pool_blocks:
            return
        # room for the largest bucket at once (a batch that grows would otherwise drop every graph captured for the
        # smaller ones), tables of 64 blocks and up in powers of two (a growing context reallocates rarely)
        rows, table_width = BATCH_BUCKETS[-1], max(table_width, self.table_width, 64)
        table_width = 1 << (table_width - 1).bit_length()
        dev = self.device
        tokens = rows * WIDTH_BUCKETS[-1]
        self.ids_buf = torch.zeros((1, tokens), dtype=torch.long, device=dev)
        self.pos_buf = torch.zeros((1, tokens), dtype=torch.long, device=dev)
        self.slots_buf = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.index_buf = torch.arange(tokens, device=dev)
        self.q_pos = torch.zeros(rows * TILE, dtype=torch.long, device=dev)
        self.tables = torch.full((rows, table_width), TRASH, dtype=torch.long, device=dev)
        self.block_pos = torch.zeros(pool_blocks, dtype=torch.long, device=dev)  # block 0 (trash) stays at 0
        self.kv_num = torch.ones(rows, dtype=torch.int32, device=dev)
        self.kv_idx = torch.zeros((rows, pool_blocks), dtype=torch.int32, device=dev)
        self.rows, self.table_width, self.pool_blocks = rows, table_width, pool_blocks
        self.shapes.clear()

    def _shape(self, rows: int, width: int, block_size: int) -> Shape:
        key = (rows, width)
        if key not in self.shapes:
            dev, t = self.device, rows * width
            cols = torch.arange(TILE, device=dev).clamp(max=width - 1)
            row = torch.arange(rows, device=dev)
            lay = FlexLayout(
                pad_index=(row[:, None] * width + cols).flatten(),  # a tile's padded queries repeat its last token
                real=(row[:, None] * TILE + torch.arange(width, device=dev)).flatten(),
                q_pos=self.q_pos[: rows * TILE], q_row=row[:, None].expand(rows, TILE).flatten(), tables=self.tables[:rows],
                block_pos=self.block_pos, kv_num_blocks=self.kv_num[:rows], tile_tables=self.kv_idx[:rows],
                block_size=block_size, pool_blocks=self.pool_blocks)
            lay.mask = static_block_mask(lay)
            self.shapes[key] = Shape(self.ids_buf[:, :t], self.pos_buf[:, :t], self.slots_buf[:t], self.index_buf[:t],
                                     lay)
        return self.shapes[key]

    # ---- a step -----------------------------------------------------------------------------
    def fill(self, cache, sids: list[str], fed: list[list[int]], starts: list[int], key: tuple[int, int],
             pad_id: int) -> tuple[Shape, torch.Tensor]:
        """Reserve the rows' blocks and write this step into its bucket's buffers. Returns the shape and where
        each packed token (in `kv.pack`'s order: rows in order, each its fed tokens) sits among the static ones."""
        rows, width = key
        bs = cache.block_size
        ids, pos, slots, q_pos, kv_num, where = [], [], [], [], [], []
        tables, blocks, block_at = [], [], []
        for b, (sid, tokens, start) in enumerate(zip(sids, fed, starts)):  # host lists, made tensors once each
            n = len(tokens)
            if not n:  # a row feeding nothing: a padding row
                ids += [pad_id] * width; pos += [0] * width; slots += [TRASH * bs] * width  # noqa: E702
                q_pos += [0] * TILE; kv_num.append(1); tables.append([])  # noqa: E702
                continue
            cache.reserve(sid, start + n)
            table = cache.tables[sid]
            last = start + n - 1
            ids += tokens + [pad_id] * (width - n)
            pos += list(range(start, start + n)) + [last] * (width - n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)] + [TRASH * bs] * (width - n)
            q_pos += list(range(start, last + 1)) + [last] * (TILE - n)
            where += range(b * width, b * width + n)
            reads = table[: last // bs + 1]
            kv_num.append(len(reads))
            tables.append(reads)
            blocks += reads
            block_at += range(len(reads))
        pad = rows - len(fed)
        ids += [pad_id] * (pad * width); pos += [0] * (pad * width); slots += [TRASH * bs] * (pad * width)  # noqa: E702
        q_pos += [0] * (pad * TILE); kv_num += [1] * pad; tables += [[]] * pad  # noqa: E702
        most = max(len(t) for t in tables)
        self._ensure(rows, most, cache.num_blocks)
        shape = self._shape(rows, width, bs)
        grid = [blk for t in tables for blk in t + [TRASH] * (most - len(t))]  # [rows, most] row-major
        # one host tensor, one copy to the device, then each buffer's part copied on the device
        staged = torch.tensor(ids + pos + slots + q_pos + kv_num + grid + blocks + block_at, dtype=torch.long)
        staged = staged.to(self.device, non_blocking=True)
        parts = staged.split([len(ids), len(pos), len(slots), len(q_pos), rows, len(grid), len(blocks), len(blocks)])
        for dst, src in zip((shape.ids[0], shape.pos[0], shape.slots, self.q_pos[: rows * TILE], self.kv_num[:rows]), parts):
            dst.copy_(src)
        self.tables[:rows, :most].copy_(parts[5].view(rows, most))
        self.kv_idx[:rows, :most].copy_(parts[5].view(rows, most))
        if blocks:
            self.block_pos.index_copy_(0, parts[6], parts[7])
        return shape, torch.tensor(where, dtype=torch.long)

    def run(self, forward, shape: Shape, cache, key: tuple[int, int]) -> torch.Tensor:
        """forward(ids, pos, batch, index) -> [rows * width, hidden] over the shape's buffers: replayed from its
        graph where capture is on (captured at the bucket's first step), else run eagerly."""
        batch = PackedBatch(shape.slots, shape.layout, cache)  # per step: its cached last slot is this step's
        batch._on[self.device] = batch

        def eager():
            return forward(shape.ids, shape.pos, batch, shape.index)

        if not self.capture or shape.graph is False:
            self.eager_runs += 1
            return eager()
        if shape.graph is None:
            try:
                shape.out = self._capture(shape, eager)
                self.captured += 1
                log.info("captured a CUDA graph for a static step of %d rows x %d tokens", *key)
            except Exception as e:  # a forward that will not capture runs eager: slower, never wrong
                shape.graph = False
                log.warning("CUDA graph capture failed for %d rows x %d tokens (eager from now on): %s", *key, e)
                self.eager_runs += 1
                return eager()
        shape.graph.replay()
        self.replays += 1
        return shape.out

    def _capture(self, shape: Shape, eager) -> torch.Tensor:
        # warm up on a side stream first (compiles flex for this shape; the allocator settles), then record
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            eager()  # writes this step's keys and values: the replay below writes the same again
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = eager()
        shape.graph = graph
        return out

    def stats(self) -> dict:
        return {"shapes": len(self.shapes), "captured": self.captured, "replays": self.replays,
                "eager_runs": self.eager_runs}


def static_block_mask(lay: FlexLayout):
    """The bucket's BlockMask over the layout's persistent tensors, built once: each step rewrites what they
    hold, and the mask (its kernel's block lists and `mask_mod`'s tables) reads them where they are. Without
    the transposed (query-side) lists, which only a backward pass reads and which would be stale."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(lay.kv_num_blocks[None, None], lay.tile_tables[None, None],
                                    BLOCK_SIZE=(TILE, lay.block_size), mask_mod=lay.mask_mod(),
                                    seq_lengths=(lay.pad_index.shape[0], lay.pool_blocks * lay.block_size),
                                    compute_q_blocks=False)


def resolve(mode: str, device: torch.device, backend: str) -> StaticSteps | None:
    """The worker's static steps for `EngineConfig.static_steps` on `device` with attention `backend`: flex only
    (gather's groups are shaped by the rows' context lengths). `auto` takes the SPECSERVE_STATIC_STEPS environment
    variable's mode where it names one (a whole process, its checks and benchmarks included, as
    SPECSERVE_ATTENTION_BACKEND pins the attention backend)."""
    if mode == "auto":
        mode = os.environ.get("SPECSERVE_STATIC_STEPS", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"static_steps {mode!r}: one of {', '.join(MODES)}")
    if backend != "flex" or mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return StaticSteps(device, capture=mode in ("auto", "graphs"))


__all__ = ["BATCH_BUCKETS", "MODES", "Shape", "StaticSteps", "WIDTH_BUCKETS", "bucket", "resolve", "static_block_mask"]
