"""Paged KV: fixed-size blocks, a block table per sequence, prefix caching, packed forwards.

Every layer's keys and values live in one pool of blocks ([blocks * block_size, kv_heads, head_dim]).
A sequence holds a block table: block i stores its positions [i * block_size, (i + 1) * block_size).
Blocks are taken as tokens arrive and given back when a sequence leaves, so memory follows the
tokens held (at most one partly filled block per sequence), not the longest row. A sequence's valid KV
is its first `kv_len` positions: rolling back rejected drafts is lowering `kv_len` (and returning
blocks past it), never copying caches.

Prefix caching: a full block of committed tokens is named by a hash of its tokens and of everything
before them (a chain), so a new sequence whose prompt starts with the same blocks takes them by
reference instead of computing them. A block no sequence holds stays cached until its memory is
needed, then the least recently used goes first. Shared blocks are full and never written again.

A forward is packed: the fed tokens of all sequences form one row [1, T] through the model's linear
layers (no padding compute: a 512-token prefill chunk and 32 decode rows cost 512 + 32 * (k + 1)
tokens), and attention (`paged_attention`, registered with transformers' AttentionInterface) reads
each sequence's keys and values from its blocks through an attention backend (`engine/attention.py`:
gather, which copies them out for SDPA, or flex_attention, which reads the pool in place).

Why not transformers' own paged cache (generation/continuous_batching): its SDPA path attends over the
whole packed batch with a [T, total keys] mask (the batch's cost squared) and its fast path needs the
flash-attn kernels; its allocator is tied to its own scheduler's request objects.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from serve_app.engine import attention
from serve_app.engine.attention import TRASH  # noqa: F401  (block 0: never handed out)

ATTENTION = "specserve_paged"
"""The attention implementation name a worker's model runs under during its forwards."""



class OutOfBlocks(RuntimeError):
    """The pool is at its limit and no cached block is free to evict (the engine's admission
    accounting keeps this from happening)."""


@dataclass
class KVStats:
    """Prefix-cache counters (tokens), in vLLM's terms: queries = prompt tokens looked up, hits = found."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class PagedKV(Cache):
    """HF-compatible cache over a block pool per layer, with block tables and a prefix cache."""

    def __init__(self, block_size: int = 16, max_blocks: int = 4096, prefix_caching: bool = True,
                 attention_backend: str = "gather", preallocate: bool = False) -> None:
        super().__init__(layers=[])
        self.attention = attention_backend
        """The attention backend its forwards run (`engine/attention.py`, already chosen: not `auto`)."""
        self.block_size = block_size
        self.max_blocks = max_blocks
        """Most blocks the pool may grow to (block 0, the trash block, included)."""
        self.prefix_caching = prefix_caching
        self.keys: list[torch.Tensor] = []  # per layer [num_blocks * block_size, kv_heads, head_dim]
        self.values: list[torch.Tensor] = []
        self.num_blocks = max_blocks if preallocate else 1  # blocks the pool has now (grown on demand,
        # amortised, where memory is shared; all at once where it is sized for the pool, a GPU's)
        self.free: list[int] = list(range(self.num_blocks - 1, 0, -1))
        self.refs: dict[int, int] = {}  # block -> sequences holding it
        self.tables: dict[str, list[int]] = {}  # sequence -> its blocks in position order
        self.chains: dict[str, list[bytes]] = {}  # sequence -> hashes of its first full, committed blocks
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.roots: dict[str, bytes] = {}  # sequence -> the hash its first block chains from (its cache salt's)
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, oldest first
        self.stats = KVStats()
        self.batch: PackedBatch | None = None  # the forward under way

    # ---- blocks ------------------------------------------------------------------------------
    def match_prefix(self, sid: str, tokens: list[int], salt: str | None = None) -> int:
        """Start sequence sid with the cached blocks its tokens begin with; returns the tokens they
        cover. The block holding the last token is never taken: it must be computed for its logits.
        salt: the request's cache salt; its blocks are named under it, so only sequences with the same
        salt share them (one tenant's prompts cannot be probed by another's timings)."""
        table, chain = self.tables.setdefault(sid, []), self.chains.setdefault(sid, [])
        if table:
            raise ValueError(f"sequence {sid!r} already holds blocks")
        if salt:
            self.roots[sid] = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        full = (len(tokens) - 1) // bs
        self.stats.queries += full * bs
        parent = self.roots.get(sid, b"")
        for i in range(full):
            h = _block_hash(parent, tokens[i * bs : (i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            self._hold(block)
            table.append(block)
            chain.append(h)
            parent = h
        self.stats.hits += len(table) * bs
        return len(table) * bs

    def reserve(self, sid: str, end: int) -> None:
        """Make sid's table cover positions [0, end)."""
        table = self.tables.setdefault(sid, [])
        while len(table) * self.block_size < end:
            table.append(self._take())

    def ensure(self, blocks: int) -> None:
        """Grow the pool now (with an eighth of slack) if `blocks` more than those held would not fit:
        called when prompts are admitted, so a long prompt's pool growth (a copy of every layer's pool)
        happens once, not every few chunks of its prefill."""
        want = min(self.max_blocks, (1 + len(self.refs) + blocks) * 9 // 8)
        if want > self.num_blocks:
            self.free[:0] = range(want - 1, self.num_blocks - 1, -1)  # new blocks are taken after the old
            self.num_blocks = want

    def trim(self, sid: str, kv_len: int) -> None:
        """Give back sid's blocks past its valid KV (speculative positions rolled back)."""
        table = self.tables.get(sid)
        keep = -(-kv_len // self.block_size)
        while table and len(table) > keep:
            self._drop(table.pop())

    def commit(self, sid: str, tokens: list[int], kv_len: int) -> None:
        """Name sid's full blocks of committed tokens ([0, kv_len)) so later sequences can share them."""
        if not self.prefix_caching:
            return
        table, chain, bs = self.tables[sid], self.chains[sid], self.block_size
        while (len(chain) + 1) * bs <= kv_len:
            i = len(chain)
            h = _block_hash(chain[-1] if chain else self.roots.get(sid, b""), tokens[i * bs : (i + 1) * bs])
            chain.append(h)
            if h not in self.by_hash:  # else another sequence computed the same block first: keep theirs
                self.by_hash[h], self.hash_of[table[i]] = table[i], h

    def release(self, sid: str) -> None:
        """Sequence sid leaves: its blocks go back (named ones stay cached until evicted)."""
        for block in self.tables.pop(sid, []):
            self._drop(block)
        self.chains.pop(sid, None)
        self.roots.pop(sid, None)

    def slots(self, sid: str, positions: torch.Tensor) -> torch.Tensor:  # [N] positions -> [N] pool slots
        """Where positions of sequence sid live in the pool (its table must cover them)."""
        bs = self.block_size
        return torch.tensor(self.tables[sid], dtype=torch.long)[positions // bs] * bs + positions % bs

    def held_blocks(self) -> int:
        """Blocks some sequence holds (shared ones once)."""
        return len(self.refs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _hold(self, block: int) -> None:
        self.refs[block] = self.refs.get(block, 0) + 1
        self.lru.pop(block, None)

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block]:
            return
        del self.refs[block]
        if block in self.hash_of:
            self.lru[block] = None  # cached: reusable by a later prompt until its memory is needed
        else:
            self.free.append(block)

    def _take(self) -> int:
        if not self.free:
            if self.num_blocks < self.max_blocks:  # grow by an eighth: few copies, little slack
                grow = min(self.max_blocks, max(self.num_blocks + 1, self.num_blocks * 9 // 8, 16)) - self.num_blocks
                self.free.extend(range(self.num_blocks + grow - 1, self.num_blocks - 1, -1))
                self.num_blocks += grow
            elif self.lru:
                block, _ = self.lru.popitem(last=False)
                del self.by_hash[self.hash_of.pop(block)]
                self.stats.evictions += 1
                self.free.append(block)
            else:
                raise OutOfBlocks(f"KV pool full: {self.max_blocks} blocks of {self.block_size} tokens held")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    # ---- transformers' Cache interface -----------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [1, kv_heads, T, head_dim] for the packed tokens of this forward
        slots = self.batch.on(key_states.device).slots
        self.write(layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), slots)
        return key_states, value_states  # attention reads the pool (`paged_attention`), not these

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Store one forward's keys and values ([T, kv_heads, head_dim] each) of a layer at pool slots [T]."""
        k_pool, v_pool = self.pools(layer_idx, keys)
        k_pool.index_copy_(0, slots, keys)
        v_pool.index_copy_(0, slots, values)

    def pools(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's key and value pools ([slots, kv_heads, head_dim]), made on its first write (`like`: keys
        [T, kv_heads, head_dim] of the pools' dtype and device) and grown to the blocks handed out."""
        if layer_idx == len(self.keys):
            shape = (0, like.shape[1], like.shape[2])
            self.keys.append(like.new_zeros(shape))
            self.values.append(like.new_zeros(shape))
        self._fit(layer_idx)
        return self.keys[layer_idx], self.values[layer_idx]

    def attend(self, layer_idx: int, q: torch.Tensor, layout, scaling: float) -> torch.Tensor:
        """Attention of a forward's queries ([T, heads, head_dim]) over a layer's pool, by this cache's
        backend, as `layout` (the batch's) says -> [T, heads, head_dim]."""
        return attention.attend(self.attention, q, self.keys[layer_idx], self.values[layer_idx], layout, scaling)

    def _fit(self, layer_idx: int) -> None:
        """Grow a layer's pool to the blocks handed out (a copy, amortised: growth is by an eighth)."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        want = self.num_blocks * self.block_size
        if k.shape[0] < want:
            extra = (want - k.shape[0], *k.shape[1:])
            self.keys[layer_idx] = torch.cat([k, k.new_zeros(extra)])
            self.values[layer_idx] = torch.cat([v, v.new_zeros(extra)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # models ask only without position_ids; we always give them

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.keys)


def _block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


# ---- packed forwards ---------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """Where one forward's tokens go and what each attends to (`layout`: the attention backend's)."""

    slots: torch.Tensor  # [T] pool slot of each fed token
    layout: object  # attention.layout(backend, ...): gather's groups or flex's tiles
    cache: PagedKV
    _on: dict = field(default_factory=dict)  # device -> this batch there (a model split over devices)

    @functools.cached_property
    def last_slot(self) -> int:
        """The highest slot this forward writes (a C write checks it against the pool's size once)."""
        return int(self.slots.max()) if len(self.slots) else -1

    def on(self, device) -> "PackedBatch":
        if device not in self._on:
            self._on[device] = PackedBatch(self.slots.to(device, non_blocking=True), attention.move(self.layout, device),
                                           self.cache, {})
        return self._on[device]


def pack(cache: PagedKV, sids: list[str], fed: list[list[int]], starts: list[int], device,
         ) -> tuple[torch.Tensor, torch.Tensor, PackedBatch]:
    """input_ids [1, T] and position_ids [1, T] of every row's fed tokens in order (row b feeds fed[b]
    at positions starts[b], starts[b] + 1, ...), with blocks reserved for them; and the PackedBatch
    that tells `paged_attention` where they go. Rows feeding nothing are left out."""
    ids, pos, slots = [], [], []
    rows: list[attention.Row] = []
    bs = cache.block_size
    for sid, tokens, start in zip(sids, fed, starts):  # host lists, made tensors once: no tensor op a row
        n = len(tokens)
        if not n:
            continue
        cache.reserve(sid, start + n)
        table = cache.tables[sid]
        rows.append(attention.Row(len(ids), n, start, table))
        ids += tokens
        where = range(start, start + n)
        pos += where
        slots += [table[p // bs] * bs + p % bs for p in where]
    pos_t = torch.tensor(pos, dtype=torch.long)
    lay = attention.layout(cache.attention, rows, pos_t, cache.block_size, cache.num_blocks)
    batch = PackedBatch(torch.tensor(slots, dtype=torch.long), lay, cache)
    batch = batch.on(torch.device(device))
    return (torch.tensor([ids], device=device), pos_t[None].to(device), batch)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the paged pool for a packed forward (query [1, H, T, D]), by the cache's backend
    (`engine/attention.py`). Workers set this implementation only around their own forwards, which
    always pass `specserve_batch`."""
    batch: PackedBatch | None = kwargs.pop("specserve_batch", None)
    if batch is None:  # a model wrapper dropped the attention kwargs: attending to this forward's keys
        raise RuntimeError(  # alone would be silently wrong, so refuse
            f"{type(module).__name__}: a paged forward reached attention without its batch layout "
            "(`specserve_batch`): the model must pass its forward's keyword arguments down to attention")
    batch = batch.on(query.device)
    cache = batch.cache
    q = query[0].transpose(0, 1)  # [T, H, D]
    return cache.attend(module.layer_idx, q, batch.layout, scaling)[None], None  # [1, T, H, D]


AttentionInterface.register(ATTENTION, paged_attention)


# ---- pool size from device memory --------------------------------------------------------------
def kv_bytes_per_token(config, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes one token's keys and values take over the attention layers of a model with this (HF) config.
    layers: those the model really runs (a draft of a target's first layers keeps the target's config); None:
    the config's num_hidden_layers."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = layers or text.num_hidden_layers
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def attention_layers(model) -> int:
    """Attention modules that write the KV cache (each has its `layer_idx`), 0 if none is found."""
    return len({m.layer_idx for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")})


def kv_pool_tokens(total: int, used: int, utilization: float, share: float, per_token: int) -> int:
    """KV tokens that fit in `utilization` x `share` of a device's `total` bytes beside `used` bytes (the
    weights and one forward's peak activations): vLLM's gpu_memory_utilization, per role on a shared GPU.
    Raises when nothing fits: the model alone fills the part of the device it may use."""
    room = int(total * utilization * share) - used
    if room < per_token:
        raise ValueError(f"no room for a KV pool: {used / 2**30:.2f} GiB used of the {total * utilization * share / 2**30:.2f} GiB "
                         f"this worker may use ({utilization:g} gpu_memory_utilization x {share:g} of a "
                         f"{total / 2**30:.1f} GiB device); raise gpu_memory_utilization or give the role more GPU")
    return room // per_token


def cuda_memory(model, probe_tokens: int) -> tuple[int, int]:
    """(peak bytes this process has allocated on the model's GPU during one forward of `probe_tokens`
    tokens, the GPU's total bytes): the profiling forward vLLM runs before sizing its KV cache."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, probe_tokens), dtype=torch.long, device=device), use_cache=False)
    except Exception as e:  # a draft that is no causal LM on its own (an EAGLE-3 head reads the target's
        # features): its weights are what it holds; its activations are a layer's, small beside the target's
        logging.getLogger(__name__).info("KV sizing: no profiling forward for %s (%s)", type(model).__name__, e)
    torch.cuda.synchronize(device)
    _, total = torch.cuda.mem_get_info(device)
    return torch.cuda.max_memory_allocated(device), total
