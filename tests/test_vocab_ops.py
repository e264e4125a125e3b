"""The sampling path's vocabulary passes in C (`engine.vocab_ops`): a row's logsumexp within float32 rounding of the
exact value (and torch's special cases), block maxima torch's exactly, each row independent of the batch and the
threads, and the sampling functions built on them choosing what they chose with torch's ops."""

import math

import pytest
import torch

from serve_app.engine import sampling, vocab_ops
from serve_app.engine.sampling import BLOCK, Warp, gumbel_argmax, noise_key, warp_

pytestmark = pytest.mark.skipif(vocab_ops._library() is None, reason="no AVX2 + FMA or no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]
VOCABS = [128256, 1000, 37, 7]  # a Llama-3 vocabulary, tails past the 8-lane body, fewer tokens than a block


@pytest.fixture
def torch_ops():
    """vocab_ops off for the block: sampling's torch path."""
    vocab_ops.ON = False
    yield
    vocab_ops.ON = True


def _logits(rows: int, vocab: int, dtype, scale: float = 8.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_logsumexp_is_the_exact_value_to_float32_rounding(dtype, vocab):
    x = _logits(6, vocab, dtype)
    x[1, vocab // 2:] = float("-inf")  # a truncated row: its masked tokens add nothing
    x[2] = float("-inf")  # an empty row
    x[3, 0] = 200.0  # one token far above the rest: the others' exp underflow, nothing goes denormal
    exact = torch.logsumexp(x.double(), dim=-1)
    got = vocab_ops.logsumexp(x)
    assert got.dtype == torch.float32 and got[2].item() == float("-inf")
    finite = torch.isfinite(exact)
    assert torch.allclose(got[finite].double(), exact[finite], rtol=4e-7, atol=4e-7)
    assert sampling.logsumexp(x).equal(got)  # sampling's path goes through the kernel


def test_logsumexp_special_values_are_torchs():
    x = torch.zeros(3, 100)
    x[0, 7] = float("inf")
    x[1, 9] = float("nan")
    x[2, 11] = float("-inf")
    got, want = vocab_ops.logsumexp(x), torch.logsumexp(x, dim=-1)
    assert got[0].item() == math.inf and math.isnan(got[1].item())
    assert torch.allclose(got[2], want[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_alone_in_a_batch_and_on_any_threads(dtype):
    x = _logits(40, 50000, dtype, seed=1)  # 40 x 50k: over the threads' threshold
    together = vocab_ops.logsumexp(x)
    blocks = vocab_ops.block_max(x, BLOCK)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = vocab_ops.logsumexp(x)
    finally:
        torch.set_num_threads(threads)
    assert together.equal(one_thread)
    for r in (0, 17, 39):
        assert vocab_ops.logsumexp(x[r:r + 1]).equal(together[r:r + 1])
        assert vocab_ops.block_max(x[r:r + 1], BLOCK).equal(blocks[r:r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_block_max_is_torchs(dtype, vocab, torch_ops):
    wide = _logits(5, vocab + 3, dtype, seed=2)
    x = wide[:, :vocab]  # rows with a stride longer than the row
    x[4] = float("-inf")
    want = sampling._block_max(x)
    vocab_ops.ON = True
    got = sampling._block_max(x)
    assert got.shape == want.shape and got.dtype == torch.float32 and got.equal(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_warping_and_the_coupled_choice_are_unchanged(dtype, torch_ops):
    """top-p's threshold and Gumbel-max's choice over a 128k vocabulary, as torch's ops make them."""
    rows, vocab = 24, 128256
    x = _logits(rows, vocab, dtype, scale=4.0, seed=3)
    params = [type("P", (), {"temperature": 0.7, "top_k": 0, "top_p": p, "min_p": 0.0})()
              for p in (0.5, 0.9, 0.95, 1.0) * (rows // 4)]
    w = Warp.of(params, "cpu")
    keys = torch.tensor([noise_key(7, i) for i in range(rows)], dtype=torch.int32)
    want = warp_(x.float().clone(), w)  # float() of float32 is x itself: warp_ would change x
    want_choice = gumbel_argmax(want, keys)
    vocab_ops.ON = True
    got = warp_(x.float().clone(), w)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same tokens cut
    assert torch.equal(gumbel_argmax(got, keys), want_choice)


def test_warp_of_bfloat16_rows_is_the_warp_of_their_float32_copy():
    """warp_ widens a bfloat16 row as it divides by the temperature: the bits of a cast, then a division."""
    x = _logits(8, 5000, torch.bfloat16, scale=4.0, seed=4)
    for temperature, top_p in ((0.7, 0.9), (1.0, 0.8), (1.0, 1.0)):
        params = [type("P", (), {"temperature": temperature, "top_k": 0, "top_p": top_p, "min_p": 0.0})()] * 8
        w = Warp.of(params, "cpu")
        got = warp_(x.clone(), w)
        assert got.dtype == torch.float32 and got.equal(warp_(x.float(), w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 64, 512])
def test_top_values_are_topks(dtype, width):
    x = _logits(12, 128256, dtype, seed=5)
    x[1, :] = x[1, 0]  # every value equal: the smallest ids, in order
    x[2, 100:] = float("-inf")
    x[3, 7] = float("nan")  # never taken
    vals, ids = vocab_ops.top_values(x, width)
    want = x.float().nan_to_num(nan=float("-inf"), neginf=float("-inf")).topk(width, dim=-1).values.to(dtype)
    assert vals.dtype == dtype and vals.equal(want)
    assert x.gather(1, ids).equal(vals)  # each id holds its value
    assert all(len(set(row)) == width for row in ids.tolist())  # no id twice
    assert ids[1].tolist() == list(range(width))
    assert sampling._top_candidates(x, width)[0].equal(vals) or width * BLOCK * 4 > x.shape[1]
    for r in (0, 11):  # a row alone gives what it gave in the batch
        alone = vocab_ops.top_values(x[r:r + 1], width)
        assert alone[0].equal(vals[r:r + 1]) and alone[1].equal(ids[r:r + 1])


def test_top_values_refuses_a_width_it_cannot_hold():
    with pytest.raises(ValueError, match="width"):
        vocab_ops.top_values(torch.zeros(2, 10), 11)


def test_cut_below_is_a_masked_fill():
    x = _logits(5, 1003, torch.float32, seed=6)
    x[0, 3] = float("nan")
    x[2, 10] = x[2, 900] = 5.0  # equal to its floor: kept (the cut is strictly below)
    floor = torch.tensor([0.0, float("-inf"), 5.0, float("inf"), -3.0])
    want = x.clone().masked_fill_(x < floor[:, None], float("-inf"))
    got = x.clone()
    assert vocab_ops.cut_below_(got, floor) is got
    assert torch.equal(got.nan_to_num(nan=1e9), want.nan_to_num(nan=1e9))
    with pytest.raises(ValueError, match="float32"):
        vocab_ops.cut_below_(x.bfloat16(), floor)


def _keys(rows: int, seed: int = 7) -> torch.Tensor:
    return torch.tensor([noise_key(seed, i) for i in range(rows)], dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS + [49152, 16])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_gumbel_argmax_chooses_what_torchs_ops_choose(dtype, vocab, scale, torch_ops):
    """The coupled choice in one C call: the token torch's bounded Gumbel-max takes (and the full vocabulary's
    argmax of logits + noise), on flat and peaked rows, cut rows (-inf tails), a short last block, strided rows."""
    wide = _logits(48, vocab + 5, dtype, scale=scale, seed=int(scale * 10) + vocab)
    x = wide[:, :vocab]
    x[:6, max(vocab // 3, 1):] = float("-inf")
    keys = _keys(48)
    want = gumbel_argmax(x, keys)
    full = (x.float() + sampling.gumbel(keys, None, vocab)).max(dim=-1).indices
    vocab_ops.ON = True
    got = gumbel_argmax(x, keys)
    assert got.dtype == torch.long and got.equal(want) and got.equal(full)


def test_gumbel_argmax_scores_every_block_where_the_first_do_not_settle_it(torch_ops):
    """Rows where each block's largest logit sits beside its drawn minimum (never on it): many blocks' bounds beat the
    winner's score, and in some rows the winner's block ranks past the first 32 by bound, so the kernel goes on to
    every block, sorted."""
    rows, vocab = 32, 4096 + 7
    stride, nb = vocab // BLOCK, vocab // BLOCK + 1
    keys = _keys(rows, seed=11)
    e_min, at = sampling._block_minimum(keys[:, None], torch.arange(nb)[None].expand(rows, -1), vocab)
    size = torch.where(torch.arange(nb) < stride, BLOCK, vocab % BLOCK)
    beside = (at + 1) % size  # [R, nb]: each block's largest logit, one place past its minimum
    ids = torch.where(torch.arange(nb) < stride, torch.arange(nb) + beside * stride, BLOCK * stride + beside)
    x = torch.zeros(rows, vocab).scatter_(1, ids, 5.0)
    want = gumbel_argmax(x, keys)
    bound = sampling._block_max(x) - e_min.log()
    winner_block = torch.where(want < BLOCK * stride, want % stride, stride)
    rank = (bound > bound.gather(1, winner_block[:, None])).sum(dim=1)  # blocks ranked above the winner's
    assert (rank >= 32).any()  # the premise: some winners lie past the first 32 blocks
    vocab_ops.ON = True
    assert gumbel_argmax(x, keys).equal(want)


def test_gumbel_argmax_is_the_same_alone_in_a_batch_and_on_any_threads():
    x = _logits(40, 50000, torch.float32, scale=2.0, seed=5)
    keys = _keys(40, seed=3)
    together = vocab_ops.gumbel_argmax(x, keys)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert vocab_ops.gumbel_argmax(x, keys).equal(together)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 21, 39):
        assert vocab_ops.gumbel_argmax(x[r:r + 1], keys[r:r + 1]).equal(together[r:r + 1])


@pytest.mark.parametrize("vocab", [64, 1000, 49152])
@pytest.mark.parametrize("top_k", [0, 5, 200])
def test_top_p_floor_cuts_what_torchs_loop_cuts(vocab, top_k, torch_ops):
    """top-k / top-p's cut in one C call per row: the same tokens kept as torch's loop, but where a token's probability
    is below float32's resolution next to the mass before it (a top_p of 1.0 reached by rounding: the two exps differ
    by an ulp); flat rows, whose nucleus outgrows the kernel's candidates, go to torch's loop."""
    rows = 16
    x = _logits(rows, vocab, torch.float32, scale=4.0, seed=vocab + top_k)
    x[:2, vocab // 2:] = float("-inf")
    x[2] *= 0.001  # flat: its nucleus holds nearly every token
    k = torch.full((rows,), top_k, dtype=torch.long)
    p = torch.tensor([0.5, 0.9, 0.95, 1.0] * (rows // 4))
    want = sampling._truncate(x.clone(), k, p)
    vocab_ops.ON = True
    got = sampling._truncate(x.clone(), k, p)
    parted = torch.isinf(got) != torch.isinf(want)
    assert torch.equal(got[~parted], want[~parted])
    probs = torch.softmax(want, dim=-1)
    assert (probs[parted] < 1e-6).all(), probs[parted].max()
    assert parted[p < 1.0].sum() == 0  # below a top_p of 1 the rows' cuts are the same
    floor = vocab_ops.top_p_floor(x, k, p)
    assert torch.isnan(floor[2]) == (vocab > vocab_ops.WIDEST and top_k == 0)  # the flat row: torch's loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 100, 49152])
def test_argmax_is_torchs_max_indices(dtype, vocab):
    """The first largest, ties and all (bfloat16 rows are full of them), NaN counted largest, a row of -inf at 0;
    rows alone as in the batch."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g).to(dtype)
    x[1] = x[1].round()  # many equal values: the first of the largest
    x[2, vocab // 2] = float("nan")
    x[2, -1] = float("nan")
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    x[5, 0] = x[5].max()  # the largest at index 0 and elsewhere
    got = vocab_ops.argmax(x)
    assert torch.equal(got, x.max(dim=-1).indices)
    for r in (0, 2, 39):
        assert torch.equal(vocab_ops.argmax(x[r:r + 1]), got[r:r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1003, 70000])
def test_scaled_rows_are_torchs_division_bit_for_bit(dtype, vocab):
    """`vocab_ops.scaled`, warping's first pass: torch's x / t[:, None] (float32 by promotion), or x.float() without t."""
    x = _logits(5, vocab, dtype, seed=3)
    x[1, 17] = float("-inf")
    x[2, 5] = float("nan")
    t = torch.tensor([0.7, 1.0, 1.3, 0.05, 2.0])
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    same(vocab_ops.scaled(x, t), x / t[:, None])
    same(vocab_ops.scaled(x, None), x.float())
    same(vocab_ops.scaled(x[:, :vocab - 3], t), x[:, :vocab - 3] / t[:, None])  # rows with a stride


def _settings(rows: int, seed: int) -> Warp:
    """A mix of temperatures, top-p and top-k over rows."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    params = [type("P", (), {"temperature": pick([0.7, 1.0, 1.3]), "top_k": pick([0, 0, 20]),
                             "top_p": pick([0.9, 0.95, 1.0]), "min_p": 0.0})() for _ in range(rows)]
    return Warp.of(params, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 128256])
def test_verify_decides_as_torchs_ops(dtype, vocab):
    """`vocab_ops.verify`, the target's sampled decision in one call: the same accepted drafts and the same tokens
    (coupled choices, bonus tokens, recovered tokens from the residual) as verify_walk's ops one by one."""
    b, n = 40, 64
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(b, vocab, generator=g) * 8
    x[2::5] *= 0.05  # flat rows: nuclei of hundreds of tokens, past the few scored block by block
    x = x.to(dtype)
    w = _settings(b, vocab)
    rows = torch.arange(1, b)  # row 0 left out: rows index into x
    seeded = [r % 4 == 0 for r in range(b)]
    drafted = [0 if r % 4 == 1 else 1 for r in range(b)]  # r % 4 == 1: past its last draft, the bonus token
    test = [not seeded[r] and drafted[r] > 0 for r in rows.tolist()]
    # a draft q near the target's (its top 64 of a noisy copy); drafts from q's top 4, so some are accepted
    near = x.float() + torch.randn(b, vocab, generator=g)
    q_vals, q_ids = near.topk(n, dim=-1)
    q = q_vals.softmax(dim=-1)[:, None]  # [B, 1, N]: k = 1
    drafts = q_ids[torch.arange(b), torch.randint(4, (b,), generator=g)][:, None]  # [B, 1]
    keys = torch.randint(0, 2**31 - 1, (b, 2), generator=g, dtype=torch.int32)
    # uniforms 2% either side of each tested row's p(d) / q(d) where that is below 1: a test off by a few percent
    # decides some of them the other way
    p_d = sampling.warp_(x.clone(), w).log_softmax(dim=-1).gather(1, drafts).exp()[:, 0]
    ratio = p_d / (q[:, 0] * (q_ids == drafts)).sum(dim=1)
    side = torch.where(torch.arange(b) % 2 == 0, 0.98, 1.02)
    u = torch.where(ratio < 0.95, ratio * side, torch.rand(b, generator=g))[:, None]
    ws = w.rows(rows, rows.tolist())
    tok, ok = sampling._verify_rows(x, rows, rows, 0, ws, test, drafts, keys, q, q_ids[:, None].int(), u)
    want_tok, want_ok = torch.full((b,), -1), torch.zeros(b, dtype=torch.bool)
    picked = rows.tolist()
    sampling._sampled_rows(x, rows, rows, 0, ws, [seeded[r] for r in picked], [drafted[r] for r in picked], drafts,
                           keys, q, q_ids[:, None].int(), u, want_tok, want_ok)
    done = tok >= 0  # -1: a nucleus wider than the kernel's candidates, left to torch's ops (verify_walk)
    assert done.sum() >= len(rows) * 3 // 4
    want_tok, want_ok = want_tok[rows][done], want_ok[rows][done]
    tok, ok, tested = tok[done], ok[done], torch.tensor(test)[done]
    assert ok.equal(want_ok)
    assert 0 < int(ok.sum()) < int(tested.sum())  # both outcomes of the test reached
    assert tok[~ok].equal(want_tok[~ok]) and tok[ok].equal(drafts[rows, 0][done][ok])


def test_draft_sample_draws_what_torchs_ops_draw(torch_ops):
    """`vocab_ops.draft_sample`, the draft's q and draw in one call: q over the same tokens with torch's softmax's
    values to float32 rounding, the same tokens drawn by the same uniforms."""
    b, vocab = 32, 128256
    x = _logits(b, vocab, torch.float32, scale=4.0, seed=8)
    w = _settings(b, 8)
    greedy = torch.tensor([r % 8 == 0 for r in range(b)])
    keys = torch.tensor([noise_key(3, r) if r % 8 == 1 else -1 for r in range(b)], dtype=torch.int32)
    u = torch.rand(b, generator=torch.Generator().manual_seed(8))
    want = sampling.draft_choice(x.clone(), greedy, keys, w, u)
    vocab_ops.ON = True
    got = sampling.draft_choice(x.clone(), greedy, keys, w, u)
    assert got[0].equal(want[0])
    assert got[2].equal(want[2])
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)


def test_sixteen_lanes_give_the_eight_lanes_bits():
    """Where the CPU has AVX-512 the kernels read 16 lanes at a time: the same sums, candidates, cuts and choices."""
    x = _logits(12, 128256, torch.float32, scale=4.0, seed=9)
    x[1, 5000:] = float("-inf")  # most of a row cut: groups of lanes skipped
    xb = x.to(torch.bfloat16)
    k, p = torch.tensor([0, 0, 20] * 4), torch.tensor([0.9, 1.0, 0.95] * 4)

    keys = torch.tensor([noise_key(5, r) for r in range(12)], dtype=torch.int32)

    def everything():
        return (vocab_ops.logsumexp(x), vocab_ops.logsumexp(xb), *vocab_ops.top_values(x, 64),
                *vocab_ops.top_values(xb, 512), vocab_ops.top_p_floor(x, k, p), vocab_ops.argmax(xb),
                vocab_ops.gumbel_argmax(x * 0.05, keys), vocab_ops.gumbel_argmax(xb, keys))  # flat rows: many blocks

    before = vocab_ops.wide_lanes(False)
    try:
        narrow = everything()
        vocab_ops.wide_lanes(True)
        wide = everything()
    finally:
        vocab_ops.wide_lanes(before)
    for a, b in zip(narrow, wide):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_warp_in_one_call_is_the_passes_one_by_one(dtype):
    """`vocab_ops.warp` (scale, floor, cut a row while in cache) gives the bits of `scaled`, `top_p_floor` and
    `cut_below_` one after another, the floors too (NaN for a nucleus too wide, the row then left uncut)."""
    x = _logits(12, 49152, dtype, scale=4.0, seed=10)
    x[2] = x[2] * 0.001  # flat: its nucleus outgrows the kernel's candidates
    w = _settings(12, 10)
    cut = w.host[1]
    out = torch.empty(x.shape, dtype=torch.float32)
    floor = vocab_ops.warp(x, w.temperature, w.cut_flags(), w.top_k, w.top_p, out)
    want = vocab_ops.scaled(x, w.temperature)
    want_floor = torch.where(torch.tensor(cut), vocab_ops.top_p_floor(want, w.top_k, w.top_p), float("-inf"))
    torch.testing.assert_close(floor, want_floor, rtol=0, atol=0, equal_nan=True)
    vocab_ops.cut_below_(want, want_floor.nan_to_num(nan=float("-inf")))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_scaled_by_a_reciprocal_is_ieees_division_for_every_bfloat16_value():
    """`scaled` divides by a reciprocal and one correction (both lane widths): every bfloat16 value (zeros, -0,
    denormals, infinities, NaN among them) over temperatures from a hundredth to past the safe range's ends, and
    float32 rows across 2^-126 .. 2^127, come out as torch's division's bits."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]: each bit pattern
    g = torch.Generator().manual_seed(11)
    t = torch.cat([torch.tensor([0.01, 0.07, 0.7, 0.99999994, 1.0, 1.3, 2.0, 2**-27, 2**-28, 255.9, 256.0, 1e5]),
                   torch.rand(20, generator=g) * 3 + 0.05])
    rows = every[None].expand(len(t), -1).contiguous()
    scale = torch.exp2(torch.randint(-126, 127, (len(t), 70000), generator=g).float())
    wide = (torch.rand(len(t), 70000, generator=g) - 0.5) * scale
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    before = vocab_ops.wide_lanes(True)
    try:
        for lanes in (True, False):
            vocab_ops.wide_lanes(lanes)
            same(vocab_ops.scaled(rows, t), rows / t[:, None])
            same(vocab_ops.scaled(wide, t), wide / t[:, None])
    finally:
        vocab_ops.wide_lanes(before)


def test_verify_recovers_from_the_residual_of_a_wide_nucleus():
    """A nucleus too wide to score block by block (hundreds of tokens), the draft's q close below p on most of it:
    after a rejection the recovered token comes from max(0, p - q), whose mass there is what q left (a row cut after
    the residual would lose it: the residual's logits fall below the floor)."""
    b, vocab, n = 30, 600, 512
    g = torch.Generator().manual_seed(12)
    x = torch.randn(b, vocab, generator=g) * 0.05  # flat: ~95% of 600 tokens kept at top_p 0.95
    params = [type("P", (), {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "min_p": 0.0})()] * b
    w = Warp.of(params, "cpu")
    p = sampling.warp_(x.clone(), w).softmax(dim=-1)
    q_ids = x.topk(n, dim=-1).indices  # [B, n]
    q = (0.9 * p.gather(1, q_ids))[:, None]  # [B, 1, n]: a little below p on its support
    drafts = p.argmin(dim=-1, keepdim=True)  # a token the cut dropped: p = 0, always rejected
    keys = torch.randint(0, 2**31 - 1, (b, 2), generator=g, dtype=torch.int32)
    u = torch.rand(b, 1, generator=g)
    rows = torch.arange(b)
    tok, ok = sampling._verify_rows(x, rows, rows, 0, w, [True] * b, drafts, keys, q, q_ids[:, None].int(), u)
    want_tok, want_ok = torch.full((b,), -1), torch.ones(b, dtype=torch.bool)
    sampling._sampled_rows(x, rows, rows, 0, w, [False] * b, [1] * b, drafts, keys, q, q_ids[:, None].int(), u,
                           want_tok, want_ok)
    assert not ok.any() and not want_ok.any()
    assert tok.equal(want_tok)
    on_support = (q_ids == tok[:, None]).any(dim=1)
    assert 0 < int(on_support.sum()) < b  # recovered tokens both on q's support and off it
