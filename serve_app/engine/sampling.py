"""Vocabulary-sized work, on the worker's own device and vectorised over the batch.

Nothing here loops in Python over vocabulary-sized rows, and nothing vocabulary-sized leaves the
device: what crosses between actors is token ids and, for a sampled row, the draft's proposal
distribution over its own top-N tokens (`TOP_N` ids and values per drafted position).

- `warp_`: temperature, top-k and top-p on logits without sorting the vocabulary (a top-k pass finds
  the nucleus; only a row whose nucleus is wider than the candidates looks further).
- `draft_choice`: the draft's token per row: argmax (greedy), a sample from q = its warped top-N
  renormalized (sampled), or the coupled choice (seeded). Rejection sampling is exact
  for ANY proposal distribution as long as the target verifies against the one the draft really
  sampled from, so a top-N q costs nothing in exactness and only N numbers per position in transfer.
- `verify_walk`: the target's decision, position by position, only for rows still accepting: greedy
  rows compare the argmax, seeded rows the coupled choice, sampled rows run the rejection test against
  the sparse q and draw the recovered (residual) or bonus token.
- `gumbel_argmax`: an exact sample from a row of logits by Gumbel-max, scoring a few blocks of the
  vocabulary token by token and the rest by a per-block bound.
- `gumbel` / `noise_e`: the coupled sampler's noise, a counter-based hash of (seed, position, token id)
  in int32 arithmetic, so the same bits on every device, at any k, batch, draft or resume.
- `logprob_top`: the target's log-probabilities of the emitted tokens and their top alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serve_app.engine import vocab_ops
from serve_app.engine.speculative import accept_rejection, residual_logits_, sample

TOP_N = 64
"""Width of a sampled draft row's proposal: the draft samples from its warped distribution restricted
to its TOP_N most likely tokens (renormalized) and sends those ids and probabilities. At a chat
model's temperatures the top 64 hold nearly all of the draft's mass, so acceptance is unchanged
(results/bench-acceptance-sampling-*), and 64 x (4 + 4) bytes per drafted position keeps a batch of
32 at k = 4 under 64 KB."""

BLOCK = 16
"""The coupled sampler's noise, and every bound over the vocabulary, work on blocks of this many tokens.
A block is strided (`_blocks`): with S = vocab // BLOCK, block b < S holds tokens b, b + S, ...,
b + 15 S, and the vocab % BLOCK tokens past 16 S form one short last block. So a row's block maxima are
an elementwise max over 16 contiguous slices of it, one pass at the speed of a row max on a CPU, where
a reduction over 16 adjacent tokens (max_pool1d, amax over a [.., 16] view) is 12x slower."""
SCAN = (32, 256)
"""Blocks `gumbel_argmax` scores token by token, in rounds, before its bound decides whether any other
could win. Measured on random logits of scale 1-8 over a 128k vocabulary (16-token blocks): the
blocks whose bound reaches the winner's score number 3-10 at the median and at most 56."""

_MULT = (0x2545F491, 0x7FEB352D, 0x5BD1E995)  # odd, below 2**31: int32 products wrap the same everywhere
_MASK64 = 2**64 - 1
_SALT_MIN, _SALT_AT = 0x3C6EF372, 0x1B873593  # separate streams for a block's minimum and its position


# ---- the coupled sampler's noise ----------------------------------------------------------------
def noise_key(seed: int, position: int) -> int:
    """A 31-bit key for one (seed, position), mixed in Python integers (exact on any machine)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0x7FFFFFFF


def _hash32(ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # ids [N, M] or [M], keys [N, 1] int32
    """Murmur-style finalizer over int32 with wrapping products; shifts are made logical by masking
    (int32 >> is arithmetic). A pure-Python twin in the tests checks the bits. In place after the
    first op: at a 128k vocabulary each temporary is a pass over memory."""
    v = keys + ids * _MULT[0]
    v ^= (v >> 16).bitwise_and_(0xFFFF)
    v *= _MULT[1]
    v ^= (v >> 15).bitwise_and_(0x1FFFF)
    v *= _MULT[2]
    v ^= (v >> 16).bitwise_and_(0xFFFF)
    return v


def _expo(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # keys [N, 1] int32, ids [N, M] -> [N, M]
    """Exp(1) variables -log(u), u the hash's top 24 bits (exact in float32, never 0 or 1)."""
    u = _hash32(ids.to(torch.int32), keys).bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float().add_(0.5)
    return u.mul_(1.0 / 16777216).log_().neg_()


def _blocks(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:  # ids [...] -> block, offset [...]
    """Each token's block and its place in it (see BLOCK): in int32, where division is cheap on CPUs."""
    stride = vocab // BLOCK
    ids = ids.to(torch.int32)
    full = ids < stride * BLOCK
    s = max(stride, 1)  # no full block (vocab < BLOCK): every token is in the short one
    return torch.where(full, ids % s, stride), torch.where(full, ids // s, ids - stride * BLOCK)


def _block_size(blocks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Tokens in each block: BLOCK, or vocab % BLOCK for the short last one."""
    return torch.where(blocks < vocab // BLOCK, BLOCK, vocab % BLOCK)


def _block_minimum(keys: torch.Tensor, blocks: torch.Tensor, vocab: int, where: bool = True):
    """For rows keyed [N, 1] and block ids [N, M]: the smallest Exp(1) of each block's tokens, E_min ~
    Exp(size), and (where=True) which of them (0 .. size-1) holds it, uniform (a mask for full blocks;
    the short last block takes a modulo)."""
    size = _block_size(blocks, vocab)
    e_min = _expo(keys + _SALT_MIN, blocks) / size
    if not where:
        return e_min, None
    h = _hash32(blocks.to(torch.int32), keys + _SALT_AT).bitwise_and_(0x7FFFFFFF)
    return e_min, torch.where(size == BLOCK, h & (BLOCK - 1), h % size)


def _block_max(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, nb] float32
    """The largest value of each block: an elementwise max over the 16 strided slices of a row (one C pass on a
    CPU, `vocab_ops`)."""
    if vocab_ops.fits(x):
        return vocab_ops.block_max(x, BLOCK)
    rows, vocab = x.shape
    stride = vocab // BLOCK
    parts = [x[:, : stride * BLOCK].reshape(rows, BLOCK, stride).amax(dim=1)] if stride else []
    if vocab % BLOCK:
        parts.append(x[:, stride * BLOCK :].amax(dim=-1, keepdim=True))
    return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).float()


def _block_ids(blocks: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:  # [R, m] -> [R, m*BLOCK] x 2
    """Every token id of the given blocks, in block order and within a block ascending (clamped into the
    vocabulary), and which of them are real (the short last block's padding is not)."""
    stride = vocab // BLOCK
    at = torch.arange(BLOCK, device=blocks.device)
    b = blocks[:, :, None]
    ids = torch.where(b < stride, b + at * stride, stride * BLOCK + at).reshape(blocks.shape[0], -1)
    return ids.clamp(max=vocab - 1), ids < vocab


def _top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:  # [R, V] -> [R, width] x 2
    """x.topk(width) (values descending, ids) without a top-k pass over the whole vocabulary: on a CPU one C
    pass (`vocab_ops.top_values`); elsewhere the `width` largest values lie in the `width` blocks with the
    largest maxima. Which of several equal values make the cut may differ between the two."""
    vocab = x.shape[-1]
    if width * BLOCK * 4 > vocab:
        return x.topk(width, dim=-1)
    if vocab_ops.fits(x) and width <= vocab_ops.WIDEST:  # one C pass over each row
        return vocab_ops.top_values(x, width)
    ids, real = _block_ids(_block_max(x).topk(width, dim=-1).indices, vocab)
    vals, at = x.gather(1, ids).masked_fill_(~real, float("-inf")).topk(width, dim=-1)
    return vals, ids.gather(1, at)


def noise_e(keys: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:  # keys [N], ids [N, M] -> [N, M]
    """The coupled sampler's exponential race variables E(x) ~ Exp(1), independent over tokens, a function
    of (key, token id, vocabulary size) only. Built by block: a block's minimum E_min and its position
    come from the block's own hash; every other token of it gets E_min + Exp(1) from its own hash
    (given the minimum, the others are the minimum plus independent Exp(1): memorylessness), which is
    exactly the joint law of iid Exp(1) variables. `gumbel_argmax` then bounds a whole block by its
    largest logit - log E_min."""
    keys = keys.to(torch.int32)[:, None]
    block, offset = _blocks(ids, vocab)
    e_b, at_b = _block_minimum(keys, block, vocab)
    return torch.where(offset == at_b, e_b, e_b + _expo(keys, ids))


def gumbel(keys: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:  # [N, M or V] float32
    """Gumbel(0, 1) noise -log E(x) for rows keyed by `keys` [N] (int32, from noise_key) at token ids
    [N, M], or at every token when ids is None: the same (key, id) gives the same noise whatever else
    is in the batch. argmax(logits + gumbel) is an exact sample from softmax(logits) (Gumbel-max)."""
    if ids is None:
        ids = torch.arange(vocab, device=keys.device)[None, :].expand(len(keys), -1)
    return noise_e(keys, ids, vocab).log_().neg_()


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, reads: bool = True) -> torch.Tensor:  # [R, V] -> [R] long
    """argmax(logits + gumbel(keys)) without the whole vocabulary's noise where it cannot matter. A token
    of block b scores logit - log E(x) <= max logit in b - log E_min(b): score the blocks with the
    highest such bound token by token; once the best score beats the next block's bound, no other
    token can win. Rows still open after the last round take every token's noise. Exact.
    reads=False: every token's noise at once, so the host never reads which rows are open (on a GPU a pass over
    the vocabulary costs less than a wait for the device; `accept_all`)."""
    if vocab_ops.fits(logits):  # on a CPU: one C call (the same choice, its logs within an ulp of torch's)
        return vocab_ops.gumbel_argmax(logits, keys)
    rows, vocab = logits.shape
    if not reads:
        return (logits.float() + gumbel(keys, None, vocab)).max(dim=-1).indices
    nb = (vocab + BLOCK - 1) // BLOCK
    every = torch.arange(nb, device=logits.device)[None, :].expand(rows, -1)
    e_min, _ = _block_minimum(keys.to(torch.int32)[:, None], every, vocab, where=False)
    bound = _block_max(logits).sub_(e_min.log_())  # [R, nb]
    choice = torch.empty(rows, dtype=torch.long, device=logits.device)
    todo = torch.arange(rows, device=logits.device)
    for m in SCAN:
        m = min(m, nb)
        top_bound, top_blocks = _pick(bound, todo).topk(min(m + 1, nb), dim=-1)
        ids, real = _block_ids(top_blocks[:, :m], vocab)
        scores = _pick(logits, todo).gather(1, ids).float().sub_(noise_e(keys[todo], ids, vocab).log_())
        best, at = scores.masked_fill_(~real, float("-inf")).max(dim=-1)
        choice[todo] = ids.gather(1, at[:, None]).squeeze(1)
        if m == nb:
            return choice
        todo = todo[top_bound[:, m] >= best]  # the next block might hold a better token
        if not len(todo):
            return choice
    choice[todo] = (_pick(logits, todo).float() + gumbel(keys[todo], None, vocab)).max(dim=-1).indices
    return choice


def _index(rows: list[int], device) -> torch.Tensor:  # [R] long
    """Row positions partitioned on the host, as an index on the device (a host-to-device copy, never a read back)."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


# ---- warping ------------------------------------------------------------------------------------
@dataclass
class Warp:
    """Per-row sampling settings on the worker's device."""

    temperature: torch.Tensor  # [N] float32, > 0
    top_k: torch.Tensor  # [N] long, 0 = off
    top_p: torch.Tensor  # [N] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [N] float32, 0 = off; None: off for every row
    host: tuple[list[bool], list[bool], list[int]] | None = None  # per row (scaled, cut, top_k) on the host,
    #                                   so warping decides which rows to touch, and how wide, without reading the device
    _cut: torch.Tensor | None = field(default=None, repr=False)  # `cut_flags`, once made

    @classmethod
    def of(cls, params: list, device) -> "Warp":
        """From SamplingParams (greedy rows get temperature 1: they are never warped)."""
        min_p = [getattr(p, "min_p", 0.0) for p in params]
        temps = [p.temperature or 1.0 for p in params]
        return cls(torch.tensor(temps, dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None,
                   ([t != 1.0 for t in temps], [p.top_k > 0 or p.top_p < 1.0 for p in params], [p.top_k for p in params]))

    def cut_flags(self) -> torch.Tensor:  # [N] int32
        """Which rows top-k / top-p cut (1) or leave whole (0), for the C kernels; made once per Warp."""
        if self._cut is None:
            self._cut = (torch.tensor(self.host[1], dtype=torch.int32) if self.host is not None
                         else ((self.top_k > 0) | (self.top_p < 1.0)).int())
        return self._cut

    def divisor(self) -> torch.Tensor | None:  # [N] float32 or None
        """The temperatures the C kernels divide rows by, or None where no row is scaled (known on the host)."""
        return self.temperature if self.host is None or any(self.host[0]) else None

    def warps(self) -> bool:
        """warp_ would change some row (not known on the host: assume so)."""
        return self.host is None or self.min_p is not None or any(self.host[0]) or any(self.host[1])

    def rows(self, index: torch.Tensor, host_index: list[int] | None = None) -> "Warp":
        """The settings of rows `index` (host_index: the same rows as a host list, which keeps `host`)."""
        host = None if self.host is None or host_index is None else \
            tuple([flags[i] for i in host_index] for flags in self.host)
        return Warp(self.temperature[index], self.top_k[index], self.top_p[index],
                    None if self.min_p is None else self.min_p[index], host)


def warp_(logits: torch.Tensor, w: Warp, reads: bool = True) -> torch.Tensor:  # [N, V] -> [N, V] float32
    """Temperature, then min-p, then top-k, then top-p on the top-k renormalized distribution (a token stays while
    the mass strictly before it is below top_p; the first always stays), on a tensor the caller owns: a float32
    one is changed in place and returned; another dtype gives a new float32 tensor (the temperature divides as
    it widens: one pass, where a cast then a division would be two; the same bits). Dropped tokens get -inf, so
    softmax of the result is the distribution a request samples from. A token tied with the last kept one is
    kept too (the cut is a threshold on the logit). On a CPU without min-p one C call per row (`vocab_ops.warp`:
    the row scaled, searched and cut while in cache; the same bits as the passes one by one). reads=False: the
    top-p cut never reads the device (`_floor`)."""
    top_k = None  # the cut rows' top_k on the host, where known
    if w.host is not None:  # decided on the host
        scaled, cut = any(w.host[0]), w.host[1]
        top_k = [w.host[2][i] for i, c in enumerate(cut) if c]
    else:
        scaled = bool((w.temperature != 1.0).any())
        cut = ((w.top_k > 0) | (w.top_p < 1.0)).tolist()
    cut_rows = [i for i, c in enumerate(cut) if c]
    if w.min_p is None and vocab_ops.fits(logits):
        out = logits if logits.dtype == torch.float32 else torch.empty(logits.shape, dtype=torch.float32)
        floor = vocab_ops.warp(logits, w.temperature if scaled else None, w.cut_flags(), w.top_k, w.top_p, out)
        wide = torch.isnan(floor).nonzero().squeeze(1)
        if len(wide):  # a nucleus wider than the kernel's candidates: torch's loop, then its cut
            rows = out.index_select(0, wide)
            out[wide] = _cut_below_(rows, _floor(rows, w.top_k[wide], w.top_p[wide]))
        return out
    if logits.dtype != torch.float32:
        if vocab_ops.fits(logits):
            logits = vocab_ops.scaled(logits, w.temperature if scaled else None)  # torch's bits in one pass
        else:
            logits = logits / w.temperature[:, None] if scaled else logits.float()  # float32 by type promotion
    elif scaled:
        logits /= w.temperature[:, None]
    if w.min_p is not None:
        _min_p_(logits, w.min_p)
    if len(cut_rows) == logits.shape[0]:
        _truncate(logits, w.top_k, w.top_p, top_k, reads)
    elif cut_rows:
        rows = _index(cut_rows, logits.device)
        logits[rows] = _truncate(logits[rows], w.top_k[rows], w.top_p[rows], top_k, reads)
    return logits


def argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] long
    """x.max(dim=-1).indices (the first largest; NaN the largest): on a CPU one C call (`vocab_ops`; torch's
    reduction over a batch-32 row block of a 49k vocabulary took ~0.8 ms), elsewhere torch's."""
    if vocab_ops.fits(x):
        return vocab_ops.argmax(x)
    return x.max(dim=-1).indices


def logsumexp(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]
    """torch.logsumexp over the last dimension in fewer passes: on a CPU one C call that reads a row twice and
    writes nothing (`vocab_ops`); elsewhere a max, then exp's sum (a row max is cheap, torch's general reduction
    is not: ~1.6x faster on a 128k vocabulary). Rows of -inf give -inf."""
    if vocab_ops.fits(x):
        return vocab_ops.logsumexp(x)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    return (x - m).exp_().sum(dim=-1).log_().add_(m[:, 0])


def _min_p_(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:  # [R, V] scaled logits, [R]
    """min-p: -inf for tokens less likely than min_p times the most likely one (p < min_p * p_max is
    logit < max logit + log(min_p)); a row with min_p 0 keeps everything."""
    floor = x.amax(dim=-1) + torch.log(min_p.clamp(min=1e-30))  # [R]
    floor = torch.where(min_p > 0, floor, torch.full_like(floor, float("-inf")))
    return _cut_below_(x, floor)


def _cut_below_(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:  # [R, V] in place, floor [R]
    """-inf for every value of a row below its floor (one C pass on a CPU, `vocab_ops`)."""
    if x.dtype == torch.float32 and vocab_ops.fits(x):
        return vocab_ops.cut_below_(x, floor)
    return x.masked_fill_(x < floor[:, None], float("-inf"))


def _truncate(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              top_k_host: list[int] | None = None, reads: bool = True) -> torch.Tensor:  # [R, V]
    """Apply top-k / top-p to rows of scaled logits: -inf below each row's floor (`_floor`; on a CPU one C call,
    `vocab_ops.top_p_floor`, with torch's loop for a row whose nucleus outgrows its candidates)."""
    if x.dtype == torch.float32 and vocab_ops.fits(x):
        floor = vocab_ops.top_p_floor(x, top_k, top_p)
        wide = torch.isnan(floor).nonzero().squeeze(1)
        if len(wide):
            floor[wide] = _floor(x.index_select(0, wide), top_k[wide], top_p[wide])
        return _cut_below_(x, floor)
    return _cut_below_(x, _floor(x, top_k, top_p, top_k_host, reads))


def _floor(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           top_k_host: list[int] | None = None, reads: bool = True) -> torch.Tensor:  # [R, V] -> [R]
    """The smallest value each row keeps under top-k / top-p, from a top-`width` pass; a row whose nucleus may
    reach past the candidates is redone wider (8x, up to the whole vocabulary). top_k_host: top_k on the
    host, where the caller knows it (the first width is then chosen without reading the device). reads=False:
    no row is redone (which would read which rows are done): a nucleus that may outgrow the candidates is found
    over the whole vocabulary at once."""
    vocab = x.shape[-1]
    k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [R]
    if top_k_host is not None:
        widest, all_k = max(min(k, vocab) if k > 0 else vocab for k in top_k_host), all(k > 0 for k in top_k_host)
    else:
        widest, all_k = torch.stack([k_eff.max(), (top_k > 0).all().long()]).tolist()  # one read, not two
    width = min(vocab, max(64, widest) if all_k else 64)
    if not reads and not (all_k and widest <= width):
        width = vocab
    # the whole vocabulary's normalizer: needed unless every row's top-k lies among the first candidates
    total = logsumexp(x)[:, None] if not all_k or widest > width else None  # [R, 1]
    threshold = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    todo = torch.arange(x.shape[0], device=x.device)

    while len(todo):
        vals = _top_candidates(_pick(x, todo), width)[0]  # [T, width], descending
        ranks = torch.arange(width, device=x.device)[None, :]
        in_k = ranks < k_eff[todo, None]
        # top-k renormalizes over its k tokens: known once they are all among the candidates; with
        # top-k off the whole vocabulary's normalizer holds; a top-k wider than the candidates waits
        within = k_eff[todo] <= width
        norm = torch.logsumexp(vals.masked_fill(~in_k, float("-inf")), dim=-1, keepdim=True)
        if total is not None:
            norm = torch.where(within[:, None], norm, total[todo])
        probs = (vals - norm).exp().masked_fill(~in_k, 0.0)
        keep = in_k & (probs.cumsum(dim=-1) - probs < top_p[todo, None])
        kept = keep.sum(dim=-1)  # [T] >= 1
        if width == vocab or (all_k and widest <= width):  # every row is done (a top-k within the candidates,
            # or the whole vocabulary): nothing to read back
            threshold[todo] = vals.gather(1, (kept - 1)[:, None]).squeeze(1)
            break
        done = (within | ((kept < width) & (k_eff[todo] == vocab))).tolist()  # the loop's one read
        fin = _index([i for i, d in enumerate(done) if d], x.device)
        if len(fin):
            threshold[todo[fin]] = vals[fin].gather(1, (kept[fin] - 1)[:, None]).squeeze(1)
        todo = todo[_index([i for i, d in enumerate(done) if not d], x.device)]
        width = min(vocab, width * 8)
    return threshold


# ---- the draft's side ---------------------------------------------------------------------------
def draft_choice(
    logits: torch.Tensor,  # [B, V] the draft's logits at one drafted position
    greedy: torch.Tensor,  # [B] bool
    keys: torch.Tensor,  # [B] int32 noise keys, -1 for rows without a seed (sampled by uniforms)
    w: Warp,
    u: torch.Tensor,  # [B] uniforms for sampled rows
    top_n: int = TOP_N,
    kind: tuple[list[bool], list[bool]] | None = None,  # (greedy, keys >= 0) per row where the caller knows them
    reads: bool = True,  # False: no read of the device (a seeded row's choice and cut over the whole vocabulary)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """tokens [B], and for the unseeded sampled rows' exact verification q's values [B, N] and ids
    [B, N] (zero rows for greedy and seeded rows, which the target verifies by its own choice, not by
    q; None when every row is greedy). A seeded row makes the coupled choice over its whole warped
    row, as the target does, so a draft equal to the target is always accepted."""
    dev = logits.device
    if kind is None:  # the rows' kinds read to the host in one transfer, then partitioned there (one sync, not five)
        kind = torch.stack([greedy.long(), (keys >= 0).long()]).tolist()
    if not any(kind[0]) and not any(kind[1]) and w.min_p is None and vocab_ops.fits(logits):
        # every row plain (the usual sampled batch): q and the draws in one C call, nothing partitioned; a row with no
        # finite logit (rare) sends the batch through the partitioning below
        b, n = logits.shape[0], min(top_n, logits.shape[-1])
        tokens, values = torch.empty(b, dtype=torch.long), torch.empty((b, n), dtype=torch.float32)
        support = torch.empty((b, n), dtype=torch.int32)
        if not vocab_ops.draft_sample(logits, torch.arange(b), n, w.temperature, w.cut_flags(), w.top_k, w.top_p, u,
                                      tokens, values, support):
            return tokens, values, support
    g = [i for i, x in enumerate(kind[0]) if x]
    if len(g) == len(kind[0]):
        return argmax(logits), None, None
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=dev)
    if g:
        gi = _index(g, dev)
        tokens[gi] = argmax(logits.index_select(0, gi))
    n = min(top_n, logits.shape[-1])
    seeded = [i for i, (x, y) in enumerate(zip(*kind)) if y and not x]
    if seeded:  # the coupled choice over the draft's whole warped row, as the target makes it
        rows = _index(seeded, dev)
        ws = w.rows(rows, seeded)
        if ws.min_p is None and vocab_ops.fits(logits):  # on a CPU one C call, the warped rows never written out
            tokens[rows] = chosen = vocab_ops.choose(logits, rows, ws.divisor(), ws.cut_flags(), ws.top_k, ws.top_p,
                                                     keys[rows])
            seeded = [b for b, t in zip(seeded, chosen.tolist()) if t < 0]  # a nucleus too wide: torch's ops below
            rows = _index(seeded, dev)
            ws = w.rows(rows, seeded)
    if seeded:
        x = warp_(_warpable(logits, rows), ws, reads) if ws.warps() else _pick(logits, rows)  # unwarped: no copy
        tokens[rows] = gumbel_argmax(x, keys[rows], reads)
    plain_rows = [i for i, (x, y) in enumerate(zip(*kind)) if not x and not y]
    plain = _index(plain_rows, dev)
    values = torch.zeros((logits.shape[0], n), dtype=torch.float32, device=logits.device)
    support = torch.zeros((logits.shape[0], n), dtype=torch.int32, device=logits.device)
    if len(plain) and w.min_p is None and vocab_ops.fits(logits):  # q and the draw in one C call a row
        if vocab_ops.draft_sample(logits, plain, n, w.temperature, w.cut_flags(), w.top_k, w.top_p, u, tokens, values,
                                  support):  # rows with no finite logit: torch's ops below
            plain_rows = [b for b, t in zip(plain_rows, tokens.index_select(0, plain).tolist()) if t < 0]
        else:
            plain_rows = []
        plain = _index(plain_rows, dev)
    if not len(plain):
        return tokens, values, support
    # q: the warped draft distribution over its top-n tokens, renormalized (top-k / top-p applied
    # within them: any q is exact, this one stays close to the draft's own). A positive temperature
    # keeps the order, so the top-n of the raw logits are the top-n of the scaled ones.
    vals, ids = _top_candidates(_pick(logits, plain), n)  # [R, n] descending
    vals = vals.float() / w.temperature[plain, None]
    if w.min_p is not None:  # the top-n hold the row's maximum, so min-p cuts them as it would the row
        _min_p_(vals, w.min_p[plain])
    top_k = None if w.host is None else [w.host[2][i] for i in plain_rows]
    if w.host is None or any(w.host[1][i] for i in plain_rows):  # else no row cuts (top_p 1, top_k 0): as warp_
        vals = _truncate(vals, w.top_k[plain], w.top_p[plain], top_k)
    q = vals.softmax(dim=-1)  # [R, n]
    tokens[plain] = ids.gather(1, sample(q, u[plain])[:, None]).squeeze(1)
    values[plain], support[plain] = q, ids.int()
    return tokens, values, support


# ---- the target's side --------------------------------------------------------------------------
def verify_walk(
    logits,  # [B, k+1, V] the target's logits after each fed draft position, or a function
    #          (rows [A], j) -> [A, V] that makes them on demand (`worker.LazyLogits`)
    drafts: torch.Tensor,  # [B, k] long, on logits' device
    greedy: torch.Tensor,  # [B] bool
    keys: torch.Tensor,  # [B, k+1] int32 noise keys per position: seeded rows' from (seed, position),
    #                      unseeded sampled rows' random (their recovered / bonus draw), -1 for greedy
    seeded: torch.Tensor,  # [B] bool: the coupled sampler's rows
    w: Warp,
    q_values: torch.Tensor | None,  # [B, k, N] the draft's q for unseeded sampled rows (zeros elsewhere)
    q_ids: torch.Tensor | None,  # [B, k, N] its token ids
    accept_u: torch.Tensor,  # [B, k] uniforms for the rejection tests
    process=None,  # (x [A, V], rows [A], j) -> x: a request's controls (`controls.Controls.apply`), or None
    lengths: torch.Tensor | None = None,  # [B] long: row b drafted lengths[b] <= k tokens; None: all k
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] long, next_token [B] long
    """Walk the k+1 positions, touching only rows that accepted every draft so far: greedy rows accept
    while the draft equals the argmax, seeded rows while it equals the target's coupled choice (so the
    text is the target's coupled sample whatever k is), sampled rows by rejection sampling against q.
    A row leaves the walk with its recovered token at its first rejection, or its bonus token after
    its last draft (position k, or lengths[b]). Cost: a few vocabulary passes per row and position
    actually reached."""
    bsz, k = drafts.shape
    dev = drafts.device
    if lengths is None:
        lengths = torch.full((bsz,), k, dtype=torch.long, device=dev)
    # Which rows are greedy, seeded and how far they drafted is read to the host once; from then on the
    # walk partitions rows there, so a position costs one device-to-host read (which rows accepted), plus
    # one where sampled rows were rejection-tested (which were rejected), whatever the batch holds.
    kind = torch.stack([greedy.long(), seeded.long(), lengths.long()]).tolist()
    is_greedy, is_seeded, drafted_to = kind[0], kind[1], kind[2]
    num_acc = torch.zeros(bsz, dtype=torch.long, device=dev)
    next_tok = torch.zeros(bsz, dtype=torch.long, device=dev)
    live = list(range(bsz))  # rows still walking (host)
    if isinstance(logits, torch.Tensor):
        flat = logits.reshape(bsz * (k + 1), logits.shape[-1])  # [B*(k+1), V]: rows are contiguous, copies are cheap

        def logits_at(rows, j):
            return flat.index_select(0, rows * (k + 1) + j)
    else:
        logits_at = logits

    def at(idx: list[int]) -> torch.Tensor:
        return _index(idx, dev)

    for j in range(k + 1):
        if not live:
            break
        active = at(live)
        token = torch.empty(len(live), dtype=torch.long, device=dev)
        accepted = torch.zeros(len(live), dtype=torch.bool, device=dev)
        x = logits_at(active, j)  # [A, V]: a fresh tensor
        if process is not None:
            x = process(x, active, j)
        g = [i for i, b in enumerate(live) if is_greedy[b]]
        if len(g) == len(live):
            token = argmax(x)
        else:
            if g:  # in the logits' own dtype, as an all-greedy batch takes it
                gi = at(g)
                token[gi] = argmax(x.index_select(0, gi))
            other = [i for i, b in enumerate(live) if not is_greedy[b]]  # positions in `live`
            rows = at(other)
            ws = w.rows(active[rows], [live[i] for i in other])
            if ws.min_p is None and vocab_ops.fits(x):  # on a CPU one C call, the warped rows never written out
                test = [not is_seeded[live[i]] and drafted_to[live[i]] > j for i in other]
                tok, ok = _verify_rows(x, rows, active[rows], j, ws, test, drafts, keys, q_values, q_ids, accept_u)
                token[rows], accepted[rows] = tok, ok
                other = [i for i, t in zip(other, tok.tolist()) if t < 0]  # a nucleus too wide: torch's ops below
                if other:
                    rows = at(other)
                    ws = w.rows(active[rows], [live[i] for i in other])
            if other:
                _sampled_rows(x, rows, active[rows], j, ws, [is_seeded[live[i]] for i in other],
                              [drafted_to[live[i]] for i in other], drafts, keys, q_values, q_ids, accept_u,
                              token, accepted)
        if j < k:  # greedy and seeded rows accept while their choice is the draft (and they drafted j)
            by_choice = at([i for i, b in enumerate(live) if (is_greedy[b] or is_seeded[b]) and drafted_to[b] > j])
            if len(by_choice):
                accepted[by_choice] = token[by_choice] == drafts[active[by_choice], j]
        # which rows accepted: read once, then indexed from the host (a boolean mask would read it again)
        acc = accepted.tolist()
        stop = at([i for i, a in enumerate(acc) if not a])
        if len(stop):
            next_tok[active[stop]] = token[stop]
        go = [i for i, a in enumerate(acc) if a]
        if go:
            num_acc[active[at(go)]] += 1
        live = [live[i] for i in go]
    return num_acc, next_tok


def accept_all(
    logits: torch.Tensor,  # [B, k+1, V] the target's logits after each fed draft position
    drafts: torch.Tensor,  # [B, k] long, on logits' device
    kinds: list[str],  # per row, on the host: "greedy", "seeded" (the coupled sampler) or "sampled"
    lengths: list[int],  # per row, on the host: tokens it drafted (<= k)
    keys: torch.Tensor,  # [B, k+1] int32 noise keys (as verify_walk's)
    w: Warp,
    q_values: torch.Tensor | None,  # [B, k, N] the draft's q for sampled rows (as verify_walk's)
    q_ids: torch.Tensor | None,  # [B, k, N]
    accept_u: torch.Tensor,  # [B, k] uniforms for the rejection tests
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] long, next_token [B] long, on the device
    """verify_walk's verdicts with no read of the device: every row's decision at every position at once, then the
    accepted prefix by a cumulative product. A position's decision depends only on its own logits and its own
    randomness (keys, uniforms drawn per position up front), so deciding positions the walk never reaches changes
    nothing: the same tokens, from vocabulary passes the walk would skip. Worth it where a read stalls a stream (a
    GPU: `ModelWorker.one_pass`); a CPU walks. Rows with controls (grammars, penalties) walk: their masks follow
    the accepted prefix. Greedy rows take the argmax in the logits' dtype, as the walk does."""
    bsz, width, vocab = logits.shape
    k = width - 1
    dev = logits.device
    token = torch.empty((bsz, width), dtype=torch.long, device=dev)
    accepted = torch.zeros((bsz, k), dtype=torch.bool, device=dev)
    greedy = [b for b, kind in enumerate(kinds) if kind == "greedy"]
    if len(greedy) == bsz:
        token = argmax(logits.reshape(-1, vocab)).view(bsz, width)
    elif greedy:
        g = _index(greedy, dev)
        token[g] = argmax(logits.index_select(0, g).reshape(-1, vocab)).view(-1, width)
    rest = [b for b, kind in enumerate(kinds) if kind != "greedy"]
    if rest:
        flat = [b for b in rest for _ in range(width)]  # each row's positions, in order: rows of [R * (k+1), V]
        at, rest_at = _index(flat, dev), _index(rest, dev)
        x = warp_(logits.index_select(0, rest_at).reshape(-1, vocab), w.rows(at, flat), reads=False)
        pos = torch.arange(width, device=dev).repeat(len(rest))  # [R * (k+1)]
        row_keys = keys[at, pos]
        choice = gumbel_argmax(x, row_keys, reads=False)  # seeded rows' coupled choice; sampled rows' bonus token
        plain = [i for i, b in enumerate(flat) if kinds[b] == "sampled" and i % width < k]  # rejection-tested
        if plain and q_values is not None:
            p_i = _index(plain, dev)
            xs, rb, j = x.index_select(0, p_i), at[p_i], pos[p_i]
            lse = logsumexp(xs)
            d = drafts[rb, j]
            ids, vals = q_ids[rb, j].long(), q_values[rb, j]
            q_x = (vals * (ids == d[:, None])).sum(dim=1)
            ok = accept_rejection((xs.gather(1, d[:, None]).squeeze(1) - lse).exp(), q_x, accept_u[rb, j])
            recovered = gumbel_argmax(residual_logits_(xs, lse, vals, ids), row_keys[p_i], reads=False)
            tested = torch.tensor([lengths[flat[i]] > i % width for i in plain], device=dev)
            choice[p_i] = torch.where(tested, recovered, choice[p_i])  # past its last draft: the bonus token
            accepted[rb, j] = ok
        token[rest_at] = choice.view(len(rest), width)
    by_choice = [b for b, kind in enumerate(kinds) if kind != "sampled"]  # greedy and seeded: accepted while equal
    if by_choice and k:
        c = _index(by_choice, dev)
        accepted[c] = token[c, :k] == drafts[c]
    accepted &= torch.arange(k, device=dev) < torch.tensor(lengths, device=dev)[:, None]
    num = accepted.long().cumprod(dim=1).sum(dim=1)
    return num, token.gather(1, num[:, None]).squeeze(1)


def _verify_rows(x, rows, rows_b, j, w, test, drafts, keys, q_values, q_ids, accept_u):
    """`vocab_ops.verify` for rows `rows` of position j's logits x (rows_b: their batch rows; w: their settings;
    test: which are rejection-tested): token [R], accepted [R]."""
    r, k = len(test), drafts.shape[1]
    if any(test):
        q_v, q_i, u = q_values[rows_b, j], q_ids[rows_b, j], accept_u[rows_b, j]
    else:  # nothing tested (seeded rows, bonus tokens): no proposal to read, and past the last draft none exists
        q_v, q_i, u = torch.zeros((r, 1)), torch.zeros((r, 1), dtype=torch.int32), torch.zeros(r)
    return vocab_ops.verify(x, rows, w.divisor(), w.cut_flags(), w.top_k, w.top_p, test,
                            drafts[rows_b, min(j, k - 1)] if k else torch.zeros(r, dtype=torch.long), q_v, q_i, u,
                            keys[rows_b, j])


def _sampled_rows(x, rows, rows_b, j, w, seeded, drafted_to, drafts, keys, q_values, q_ids, accept_u, token, accepted):
    """verify_walk's decision for the sampled rows `rows` of position j's logits x [A, V] with torch's ops (rows_b:
    their batch rows; w: their settings; seeded, drafted_to: theirs on the host): into token and accepted."""
    x = warp_(_pick(x, rows), w)  # [R, V] float32: x is fresh
    cr = [r for r, sd in enumerate(seeded) if sd]
    if cr:  # the coupled choice: the emitted token depends only on p and the seed
        cr_t = _index(cr, x.device)
        token[rows[cr_t]] = gumbel_argmax(_pick(x, cr_t), keys[rows_b[cr_t], j])
    plain = [r for r, sd in enumerate(seeded) if not sd]
    bonus = _index([r for r in plain if drafted_to[r] <= j], x.device)
    s = _index([r for r in plain if drafted_to[r] > j], x.device)
    if len(bonus):  # past the row's last draft: the bonus token, from p
        token[rows[bonus]] = gumbel_argmax(_pick(x, bonus), keys[rows_b[bonus], j])
    if len(s):  # rejection test against the draft's q, then the recovered token
        xs, sb = _pick(x, s), rows_b[s]
        lse = logsumexp(xs)
        d = drafts[sb, j]
        ids, vals = q_ids[sb, j].long(), q_values[sb, j]
        q_x = (vals * (ids == d[:, None])).sum(dim=1)
        ok = accept_rejection((xs.gather(1, d[:, None]).squeeze(1) - lse).exp(), q_x, accept_u[sb, j])
        accepted[rows[s]] = ok
        rej = (~ok).nonzero().squeeze(1)
        if len(rej):
            r = residual_logits_(_pick(xs, rej), lse[rej], vals[rej], ids[rej])
            token[rows[s[rej]]] = gumbel_argmax(r, keys[sb[rej], j])


def _pick(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [N, V] -> [R, V]
    """Rows of x; x itself when that is every row (a copy of a vocabulary-sized block is a pass)."""
    return x if len(rows) == x.shape[0] else x.index_select(0, rows)


def _warpable(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [N, V] -> [R, V]
    """Rows of x that `warp_` may take, which changes a float32 tensor in place: those a copy (one, never two),
    another dtype's as they are (warp_ widens them into a new tensor)."""
    out = _pick(x, rows)
    return out.clone() if out is x and x.dtype == torch.float32 else out


def logprob_top(
    logits: torch.Tensor,  # [R, T, V] raw target logits at the emitted positions
    tokens: torch.Tensor,  # [R, T] long: the emitted token at each position
    top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # chosen [R, T], top values [R, T, top], top ids [R, T, top]
    """Log-probabilities (before temperature / top-k / top-p) of the emitted tokens and the `top` most
    likely alternatives, on the device; only these small tensors leave it."""
    lsm = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), dim=-1)
    chosen = lsm.gather(-1, tokens[..., None]).squeeze(-1)
    vals, ids = lsm.topk(top, dim=-1) if top else (lsm[..., :0], tokens[..., None][..., :0])
    return chosen, vals, ids


__all__ = ["TOP_N", "Warp", "accept_all", "draft_choice", "gumbel", "gumbel_argmax", "logprob_top", "noise_e", "noise_key", "verify_walk",
           "warp_"]
