"""Real model shapes, built as random Llama models with few layers (no download, no Ray).

A step at a Llama-3 shape costs what its vocabulary, hidden size and heads make it cost; the layer
count only scales the forwards. So `bench step` and `specserve selfcheck` build a shape from this
table with `layers` decoder layers (as few as the machine can run) and random weights from a fixed
seed. `tiny-128k` keeps Llama-3's vocabulary with a hidden size of 32: its forwards are nearly free,
so what remains of a step is everything else (sampling, the engine, transport between actors).

Random models spread their logits thinly (initializer std 0.02 x sqrt(hidden) is ~0.1 at hidden
32: nearly uniform over 128k tokens), and two nearly uniform distributions make rejection sampling
and the coupled sampler accept almost everything. `peaked` scales the head so logits have about
that standard deviation: sharp distributions, so an independent random draft's tokens are rejected
and every step makes one token per sequence (the steady state the benchmark wants to isolate).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field


class ModelShape(BaseModel):
    """The dimensions of a Llama-architecture model (its layer count is chosen per run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(ge=1)
    """Width of the residual stream."""
    num_attention_heads: int = Field(ge=1)
    """Query heads per layer."""
    num_key_value_heads: int = Field(ge=1)
    """Key/value heads per layer (grouped-query attention)."""
    intermediate_size: int = Field(ge=1)
    """Width of the MLP's hidden layer."""
    vocab_size: int = Field(ge=4)
    """Tokens in the vocabulary: the width of the head, of sampling and of draft distributions."""
    rope_theta: float = 500000.0
    """Rotary embedding base."""
    tie_word_embeddings: bool = False
    """The head shares the input embeddings' weights."""
    draft: str = "tiny-128k"
    """The shape an `independent` draft for this target gets by default (built with one layer)."""


SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                               vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False, draft="llama-3.2-1b"),
    "llama-3.2-1b": ModelShape(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                               vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True, draft="llama-3.2-1b"),
    "tiny-128k": ModelShape(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False, draft="tiny-128k"),
}

SPECIALS = ["<pad>", "<unk>", "<eos>"]  # ids 0, 1, 2
EOS_ID = 2
MAX_POSITIONS = 32768  # the context benchmarks reach 16k; the real models allow more, at no cost to a step
INIT_STD = 0.02  # LlamaConfig's initializer_range


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}: use one of {', '.join(SHAPES)}") from None


def llama_config(shape: ModelShape, layers: int):
    from transformers import LlamaConfig

    if layers < 1:
        raise ValueError(f"a model needs at least one layer, got {layers}")
    cfg = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=MAX_POSITIONS,
        rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_word_embeddings, initializer_range=INIT_STD,
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


QUIET = 0.2
"""How far a random target's layers past `quiet_from` move its residual stream, together, in units of one
unscaled layer's step: a `truncated:N` draft of the first N layers then agrees with the target's greedy token
about 0.6-0.7 of the time at any depth (measured at 8 and 32 layers of the Llama-3.2-1B shape, 6 of
Llama-3.1-8B's, bfloat16). Unscaled, each random layer adds about half the residual's norm, and at 32
layers the draft's tokens are never the target's (the first GPU campaign's profile measured 0.0)."""


def random_llama(shape: ModelShape, layers: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", peaked: float = 0.0, quiet_from: int | None = None):
    """A random LlamaForCausalLM of `shape` with `layers` layers. peaked > 0: the head is scaled so the
    logits' standard deviation is about `peaked` (see the module docstring; a tied head scales the
    embeddings with it, which the first norm undoes). quiet_from: the layers from that index on write
    into the residual stream QUIET / sqrt(their count) as loudly (their output projections scaled), so a
    draft of the first `quiet_from` layers agrees often; the forwards cost the same."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will run: an 8B-shaped head is 0.5 G values
        model = LlamaForCausalLM(llama_config(shape, layers))
    with torch.no_grad():
        if peaked > 0:
            # the final norm hands the head unit-scale features: logit std = std(W) * sqrt(hidden)
            model.lm_head.weight.mul_(peaked / (INIT_STD * shape.hidden_size ** 0.5))
        if quiet_from is not None and quiet_from < layers:
            # the deep layers' steps add up like a random walk: sqrt(count) keeps their sum QUIET at any depth
            scale = QUIET / (layers - quiet_from) ** 0.5
            for layer in model.model.layers[quiet_from:]:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    model.generation_config.eos_token_id = EOS_ID
    from serve_app.models import widened

    return widened(model.to(dtype), device).eval()  # bfloat16 on an AVX2 CPU: float32 over bfloat16 weights


def eagle3_layers(num_layers: int) -> list[int]:
    """Feature layers for an EAGLE-3 head over a target built with few layers: the published recipe
    (2, N//2, N-3) where it gives three distinct ids, else (0, N//2, N): the embedding output, the
    middle and the last layer's output (specserve's id N). One layer leaves two ids."""
    from serve_app.drafting.eagle3 import default_feature_layers

    try:
        return default_feature_layers(num_layers)
    except ValueError:
        return sorted({0, num_layers // 2, num_layers})


def random_eagle3(target, seed: int = 0, draft_vocab: int = 32000, peaked: float = 0.0):
    """A random EAGLE-3 head for `target` (not the from_target initialisation, which drafts like the
    target's top layers): one layer of the target's width, a reduced head over the first `draft_vocab`
    token ids (Llama-3's published heads draft over 32k), in the target's dtype and on its device."""
    import copy

    from serve_app.drafting.eagle3 import Eagle3Draft

    tcfg = target.config
    cfg = copy.deepcopy(tcfg)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    cfg._attn_implementation = "sdpa"
    layers = eagle3_layers(tcfg.num_hidden_layers)
    token_ids = torch.arange(min(draft_vocab, tcfg.vocab_size))
    embed = target.get_input_embeddings()
    torch.manual_seed(seed)
    with torch.device(embed.weight.device):
        draft = Eagle3Draft(cfg, tcfg.hidden_size, layers, token_ids, embed)
    if peaked > 0:
        with torch.no_grad():
            draft.lm_head.weight.mul_(peaked / (draft.lm_head.weight.std() * tcfg.hidden_size ** 0.5))
    return draft.cast_own(target.dtype).eval()


def vocab_tokenizer(vocab_size: int):
    """A WordLevel tokenizer covering every id of a `vocab_size` model: the specials at ids 0-2, then
    "t3" .. "t<V-1>" (token i is "t<i>"), so models save and load with it like real ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    # the profiler encodes its prompts as chats; words outside the vocabulary become <unk>
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    return fast


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random ids, never a special token."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIALS), vocab_size, (n, length), generator=g).tolist()


def save_model_dir(model, tokenizer, path: str | Path) -> str:
    """A directory `--target DIR` / `--draft DIR` (and the Ray worker actors) load from."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_eagle3_dir(draft, target, path: str | Path) -> str:
    """An EAGLE-3 head in specserve's format, loadable next to `target` saved elsewhere (the target's
    fingerprint, which the loader checks, survives a save and a reload in another dtype)."""
    from serve_app.drafting.eagle3_io import save_eagle3

    save_eagle3(draft, target, path, {"made_by": "serve_app.bench.shapes (random weights)"})
    return str(path)
