"""Shared fixtures: tiny random Llama models and a tiny tokenizer, built offline in the test.

Tiny models run in float64: batched and unbatched forwards then agree to ~1e-15, so greedy
comparisons test the algorithm, not float noise between different batch shapes.
"""

from __future__ import annotations

import copy
import os
import random
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `--dtype auto` means bfloat16 on CPUs with native bf16 (this one): pin it to float32 here, in this
# process and the Ray workers it starts, so greedy equality stays bit-exact across batch shapes.
# Tests of auto itself clear it (test_dtype.py).
os.environ.setdefault("SPECSERVE_AUTO_DTYPE", "float32")
# Serve's handles between deployments by value over gRPC, as `specserve serve` and the pods have them: Serve reads
# it once at import, and a handle bound in this process keeps what this process read.
os.environ.setdefault("RAY_SERVE_USE_GRPC_BY_DEFAULT", "1")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "big", "red", "blue", "is", "it", "very"]
SPECIALS = ["<pad>", "<unk>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def make_tokenizer(words=WORDS) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + ["system", "user", "assistant", ":"] + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, layers: int = 2, seed: int = 0, dtype=torch.float64, eos: int | None = None):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = eos
    return model


def sharp_pair(vocab: int, sharpen: float):
    """A 2-layer target and a 1-layer draft over a tiny vocabulary, their heads scaled by `sharpen`: random tiny
    models are near-uniform, sharpened they differ clearly (what a sampling-exactness check needs)."""
    target, draft = tiny_llama(vocab, layers=2, seed=10), tiny_llama(vocab, layers=1, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)
        draft.lm_head.weight.mul_(sharpen)
    return target, draft


def exact_marginals(model, prompt: list[int], vocab: int):
    """The exact distributions of the 2nd and 3rd sampled tokens after `prompt` (temperature 1), summed over
    every first and second token."""
    def dist(prefix):
        with torch.no_grad():
            return model(torch.tensor([prefix])).logits[0, -1].softmax(-1)

    p1 = dist(prompt)
    p2 = {a: dist(prompt + [a]) for a in range(vocab)}
    m2 = sum(p1[a] * p2[a] for a in range(vocab))
    m3 = sum(p1[a] * p2[a][b] * dist(prompt + [a, b]) for a in range(vocab) for b in range(vocab))
    return m2, m3


def assert_marginals(reqs, t2, t3, vocab: int, tol: float = 0.04) -> None:
    """The requests' 2nd and 3rd tokens follow t2 and t3 within `tol` total variation."""
    n = len(reqs)
    f2 = torch.bincount(torch.tensor([r.output_ids[1] for r in reqs]), minlength=vocab).double() / n
    f3 = torch.bincount(torch.tensor([r.output_ids[2] for r in reqs]), minlength=vocab).double() / n
    assert (f2 - t2).abs().sum() / 2 < tol, (f2, t2)
    assert (f3 - t3).abs().sum() / 2 < tol, (f3, t3)


def perturbed(model, scale: float, seed: int = 1):
    """A copy of model with small noise: a draft that agrees often but not always."""
    torch.manual_seed(seed)
    near = copy.deepcopy(model)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn_like(p) * scale)
    return near


def save_serving_pair(root) -> None:
    """root/target and root/draft: tiny models + tokenizer for live-service tests. EOS is made
    unlikely (random tiny models would often stop at once), so answers run to max_tokens."""
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<eos>")
    for name, seed, layers in [("target", 0, 2), ("draft", 5, 1)]:
        model = tiny_llama(len(tok), layers, seed=seed, dtype=torch.float32, eos=eos)
        with torch.no_grad():
            model.lm_head.weight[eos] = 0
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)


class IdTokenizer:
    """Decodes ids as space-separated numbers; enough for engine tests on raw token ids."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


@pytest.fixture(autouse=True)
def seeded_streams(request):
    """Every test starts Python's and torch's generators from a seed of its own (its id's hash): an unseeded
    request's uniforms (a worker's per-sequence generator is seeded from Python's `random`) and any random
    choice in the test then repeat run to run, so a statistical failure reproduces."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)
    return seed


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(97, layers=2, seed=0)


@pytest.fixture(scope="session")
def tiny_drafts(tiny_target):
    """Drafts that agree never-ish (random), sometimes (perturbed) and always (identical weights)."""
    return {
        "random": tiny_llama(97, layers=1, seed=1),
        "near": perturbed(tiny_target, 0.01),
        "same": tiny_target,
    }


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Saved tiny target + draft with the tiny tokenizer, and a draft with another vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    n = len(tok)
    eos = tok.convert_tokens_to_ids("<eos>")
    dirs = {}
    for name, model, t in [
        ("target", tiny_llama(n, 2, seed=0, dtype=torch.float32, eos=eos), tok),
        ("draft", tiny_llama(n, 1, seed=3, dtype=torch.float32, eos=eos), tok),
        ("other_vocab", tiny_llama(n + 3, 1, seed=4, dtype=torch.float32, eos=eos), make_tokenizer(WORDS + ["x", "y", "z"])),
    ]:
        d = root / name
        model.save_pretrained(d)
        t.save_pretrained(d)
        dirs[name] = str(d)
    return dirs


_EXIT = {"status": None}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave at once when the run is reported: once (2026-11-30, after 989 passed) the interpreter's teardown
    segfaulted in a C extension's exit (torch's and Ray's threads are still about then), and make saw a failure
    for a run that passed. Nothing is left to do at this point: every report is written."""
    import sys

    if _EXIT["status"] is not None and os.environ.get("SPECSERVE_TEST_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])
