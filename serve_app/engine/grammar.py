"""Structured outputs: a request's grammar, matched token by token with llguidance.

A `Guide` holds one sequence's matcher. Under speculation the matcher walks ahead over the drafted
tokens and comes back: the target computes the mask of every position it verifies (`masks`: the
matcher consumes the valid drafts one by one, then rolls back), and consumes what was accepted once
the walk has decided (`advance`); the draft masks each of its own proposals and rolls back to the
committed tokens at commit. A draft token the grammar forbids has probability 0 under the masked
target, so it is always rejected, and the masks past it are never read.

Masks are bitmasks, one bit per vocabulary id ([rows, ceil(V / 32)] int32); `apply_mask_` turns them
into -inf logits on the worker's device.
"""

from __future__ import annotations

import json

import torch

from serve_app.config import StructuredOutput

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as `json.dumps` writes it: one space after ',' and ':', no other whitespace. Flexible whitespace
lets a small model run on with newlines and indents forever; a fixed style cannot."""

_TOKENIZERS: dict[tuple[int, int], object] = {}
_CLOSERS: dict[tuple[int, int], torch.Tensor] = {}
_ON_DEVICE: dict[tuple[int, str], torch.Tensor] = {}

CLOSING_CHARS = {'"': 0.6, "}": 0.5, "]": 0.5, ",": -0.5}
"""What ends a JSON string, object or array, and how much each counts. Near the end of its token budget a
structured request favours the allowed tokens holding them (`closing_bias`), so its answer closes before
the budget cuts it: a small model can otherwise run a string of digits or an array on until max_tokens
and return JSON that does not parse. A token closing a string and its object (`"}`) counts most; a
comma counts against (it opens another member)."""


def closing_bias(remaining: int, max_tokens: int) -> float:
    """Logit bias for closing tokens when `remaining` tokens are left after this one: 0 outside the last
    window (a quarter of the budget, 16 to 48 tokens), then rising from 4 to 16."""
    window = min(48, max(16, max_tokens // 4))
    if remaining >= window:
        return 0.0
    return 4.0 + 12.0 * (1 - remaining / window)


def closers(tokenizer, vocab_size: int) -> torch.Tensor:  # [V] float32: each token's closing weight
    key = (id(tokenizer), vocab_size)
    if key not in _CLOSERS:
        out = torch.zeros(vocab_size)
        for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))):
            if t is not None:
                out[i] = sum(w for c, w in CLOSING_CHARS.items() if c in t)
        _CLOSERS[key] = out
    return _CLOSERS[key]


def lltokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face tokenizer over the model's vocabulary (built once: ~0.3 s)."""
    key = (id(tokenizer), vocab_size)
    if key not in _TOKENIZERS:
        import llguidance.hf

        _TOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    return _TOKENIZERS[key]


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a request's constraint."""
    from llguidance import LLMatcher

    if spec.json_schema is not None or spec.json_object:
        schema = spec.json_schema if spec.json_schema is not None else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


def check(spec: StructuredOutput, tokenizer, vocab_size: int) -> None:
    """Raise ValueError naming what is wrong with a constraint (before the request is queued)."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(spec)
    except ValueError as e:
        raise ValueError(f"structured output: {e}") from None
    error = LLMatcher.validate_grammar(text, lltokenizer(tokenizer, vocab_size))
    if error:
        raise ValueError(f"structured output: {error.strip()}")


class Guide:
    """One sequence's grammar state, at its committed tokens between calls."""

    def __init__(self, spec: StructuredOutput, tokenizer, vocab_size: int, generated: list[int] = (),
                 stop_ids: list[int] = ()):
        from llguidance import LLMatcher

        self.vocab = vocab_size
        self.closers = closers(tokenizer, vocab_size)  # [V] on the CPU; `closers_on` for the worker's device
        lltok = lltokenizer(tokenizer, vocab_size)
        self.matcher = LLMatcher(lltok, grammar_text(spec))
        if self.matcher.is_error():
            raise ValueError(f"structured output: {self.matcher.get_error()}")
        # End-of-sequence ends the request, not the grammar's walk: it is allowed where the grammar may
        # end, but never consumed (a matcher rolled back over its own stop loses its state).
        self.stop_ids = set(stop_ids) | set(lltok.eos_tokens)
        self.ahead = 0  # tokens consumed past the committed ones (the draft's own proposals)
        self.ended_ahead = False  # the draft proposed an end-of-sequence: nothing after it matters
        self.advance(list(generated))  # a resumed or preempted request: its output so far

    def closers_on(self, device) -> torch.Tensor:  # [V]
        """The closing weights on `device`, copied there once per tokenizer (they are read at every
        position near the end of a structured request's budget: a vocabulary-sized copy each time would
        be a host-to-device transfer per row and position on a GPU)."""
        key = (id(self.closers), str(device))
        if key not in _ON_DEVICE:
            _ON_DEVICE[key] = self.closers.to(device)
        return _ON_DEVICE[key]

    def words(self) -> int:
        return (self.vocab + 31) // 32

    def mask_into(self, out: torch.Tensor) -> None:  # out [W] int32, contiguous, on the CPU
        """The mask of the next position."""
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def masks(self, drafts: list[int]) -> torch.Tensor:  # -> [k+1, W] int32
        """Masks of the k+1 positions a verification scores: after the committed tokens, then after each
        valid draft (positions past the first invalid draft stay all-allowed: the walk never gets there)."""
        out = torch.full((len(drafts) + 1, self.words()), -1, dtype=torch.int32)
        drafts = self._until_stop(drafts)
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for j in range(valid + 1):
            self.mask_into(out[j])
            if j < valid:
                self.matcher.consume_token(drafts[j])
        if valid:
            self.matcher.rollback(valid)
        return out

    def step_ahead(self, token: int) -> None:
        """Consume a proposed (not yet committed) token; `settle` rolls these back."""
        self.ended_ahead |= token in self.stop_ids
        if self.ended_ahead or self.matcher.is_stopped() or not self.matcher.validate_tokens([token]):
            return  # an unmasked draft (n-gram) may propose anything: later masks then do not matter
        self.matcher.consume_token(token)
        self.ahead += 1

    def settle(self, new: list[int]) -> None:
        """Back to the committed tokens, then on through the newly committed ones."""
        if self.ahead:
            self.matcher.rollback(self.ahead)
            self.ahead = 0
        self.ended_ahead = False
        self.advance(new)

    def _until_stop(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                return tokens[:i]
        return tokens

    def advance(self, new: list[int]) -> None:
        for t in self._until_stop(new):
            if self.matcher.is_stopped():
                return  # end of the grammar: only end-of-sequence follows, and nothing after it
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"structured output: committed token {t} breaks the grammar "
                                   f"({self.matcher.get_error()})")


def allowed(bits: torch.Tensor, vocab: int, device) -> torch.Tensor:  # bits [R, W] int32 -> [R, V] bool
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((bits.to(device)[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()


def apply_mask_(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:  # [R, V], bits [R, W] int32
    """-inf where a row's bitmask has a 0 bit (in place). A row left with no finite logit (a draft whose
    reduced vocabulary holds none of the tokens the grammar allows, e.g. a forced quote it never writes)
    becomes uniform over the allowed tokens instead: any proposal distribution keeps verification exact,
    and a forced token is then proposed with probability 1."""
    ok = allowed(bits, logits.shape[-1], logits.device)
    logits.masked_fill_(~ok, float("-inf"))
    dead = torch.isinf(logits.amax(dim=-1))
    if bool(dead.any()):
        logits[dead] = torch.zeros_like(logits[dead]).masked_fill_(~ok[dead], float("-inf"))
    return logits
