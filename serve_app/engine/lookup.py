"""Prompt lookup: copying what followed the longest repeated suffix of a sequence's own context.

`NgramIndex` is one sequence's index (the `ngram` draft's whole proposal, `drafting/ngram.py`). Beside a model
draft (`ModelWorker`, EAGLE-3 included) the same lookup proposes for the rows where copying agrees better than
the model: an answer that rewrites, corrects or quotes its prompt repeats long runs of it, which a small
draft model predicts badly (the embedded EAGLE-3 head: 1.3 tokens per step on a typo fix that copies a
paragraph; lookup: 5.9 at k = 8). `CopyRecord` keeps a row's own record of how its copies fared; a row copies
when that record, for the suffix it matched, beats the model draft's confidence at the first position.
Both are functions of the context and the model's distribution, never of a token drawn, so choosing the
source keeps rejection sampling exact (a copied token is verified against a one-hot q).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.engine.history import RESYNC_WINDOW


class NgramIndex:
    """One sequence's context and the index of its n-grams (min_n..max_n tokens): what followed each one
    last time. Also the model drafts' prompt lookup beside their own proposals (`ModelWorker`)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, tokens: list[int] = ()):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []  # committed tokens: prompt + output
        self.index: dict[tuple[int, ...], int] = {}
        """n-gram -> position right after its most recent occurrence that has a successor, so
        tokens[index[g]] is what followed g last time. The sequence's own suffix is never indexed until a
        token follows it, so a lookup finds an earlier occurrence only."""
        self.counts: dict[int, int] = {}  # token -> occurrences in tokens
        self.most_frequent = 0  # the first token to reach the highest count: the no-match filler
        self.extend(list(tokens))

    def match(self, k: int) -> tuple[list[int], int]:
        """The k tokens after the most recent earlier occurrence of the longest matching suffix, and that
        suffix's length (0: no match).

        A recent match runs into the suffix itself (a loop of period len - e): the copy then reads
        its own output, as LZ77 does, which continues the loop. No match (with min_n = 1: the last
        token is new to this context): the sequence's most frequent token, repeated. It costs one
        counter update per token and is right more often than repeating the last token (replaying the
        target's greedy answers to the evaluation sets at k = 4: +0.02 tokens per step; +0.09 on the
        structured set when answers end at EOS); re-matching after it gains nothing more.
        """
        toks = self.tokens
        n_tok = len(toks)
        for n in range(min(self.max_n, n_tok), self.min_n - 1, -1):
            e = self.index.get(tuple(toks[n_tok - n :]))
            if e is not None:
                out: list[int] = []
                for i in range(k):
                    out.append(toks[e + i] if e + i < n_tok else out[e + i - n_tok])
                return out, n
        return [self.most_frequent] * k, 0

    def extend(self, new: list[int]) -> None:
        """Append tokens and index every n-gram that now has a successor: those ending at the old
        end and inside the new tokens (not the new suffix)."""
        start = max(len(self.tokens), 1)
        self.tokens.extend(new)
        toks = self.tokens
        for t in new:
            c = self.counts[t] = self.counts.get(t, 0) + 1
            if c > self.counts.get(self.most_frequent, 0):
                self.most_frequent = t
        for e in range(start, len(toks)):  # the n-grams ending right before position e
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.index[tuple(toks[e - n : e])] = e


@dataclass
class CopyRecord:
    """A model-drafted sequence's prompt lookup: its index, and how its copies fared."""

    index: NgramIndex
    hits: float = 0.0
    """Copied tokens the target accepted."""
    tries: float = 0.0
    """Copied tokens the target judged (up to and including the first rejection)."""
    copied: int = 0
    """Tokens the outstanding proposal copied (0: the model drafted it)."""
    tokens: list[int] = field(default_factory=list)
    """The outstanding proposal's copy (what lookup proposed for this step)."""
    from_history: bool = False
    """The outstanding copy came from the suffix history of earlier outputs (`engine.history`)."""
    history_hits: float = 0.0
    """The same as `hits` for the row's copies from the history."""
    history_tries: float = 0.0
    """The same as `tries` for the row's copies from the history."""
    history_at: int = -1
    """Where in the history the outstanding copy started (an absolute position)."""
    cursor: int = -1
    """Where the row's text left the earlier output it last copied from the history with some accepted (the
    first of that output's tokens the target did not take; -1: none): `SuffixHistory.resync_rows` picks it up
    again there."""
    since: int = 0
    """Tokens the row committed since it left that output."""

    PRIOR = 2.0  # judged copies' worth of the prior

    def estimate(self, n: int) -> float:
        """Chance a copied token is accepted, for a match of n tokens: the prior grows with n (a longer match
        is a more specific context), the row's own record takes over as it grows."""
        prior = min(0.2 * n, 0.8)
        return (self.hits + self.PRIOR * prior) / (self.tries + self.PRIOR)

    def settle(self, new: list[int], window: int = RESYNC_WINDOW) -> None:
        """The committed tokens of a step: score the outstanding copy, follow where the row stands in the
        history output it copied (dropped `window` tokens after it left it), then index them."""
        self.since += len(new)
        if self.copied:
            accepted = len(new) - 1
            hits, tries = min(accepted, self.copied), min(accepted + 1, self.copied)
            if self.from_history:
                self.history_hits += hits
                self.history_tries += tries
                if hits and self.history_at >= 0:  # a copy that failed at once was no text the row followed: the
                    # cursor stays (a running row's output, `history_at` -1, has no place in the history)
                    self.cursor, self.since = self.history_at + hits, len(new) - hits
            else:
                self.hits += hits
                self.tries += tries
            self.copied, self.from_history = 0, False
        if self.since > window:
            self.cursor = -1
        self.index.extend(new)


LOOKUP_MIN_N = 2
"""Shortest suffix a model-drafted row copies after: single tokens repeat by chance too often."""
