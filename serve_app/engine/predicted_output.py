"""Predicted Outputs: a draft the client gives (OpenAI's `prediction`), kept aligned with the output.

A request that edits a file or rewrites a document knows most of its answer: the original. Its tokens are
a draft that costs no forward, so the engine proposes long runs of them (`EngineConfig.max_predicted_tokens`
per step, far past a draft model's k) and the target verifies them in its one forward as it verifies any
draft: the output is exactly the same as without the prediction (greedy identical, sampling exact with a
one-hot q, seeded text the same), only fewer target steps make it.

`Prediction` follows where the output is in the predicted text. While the output repeats it, the next
predicted tokens are proposed; at the first token that differs (the edit) the alignment is lost, and it is
found again once the output's last tokens occur in the prediction (the longest such suffix; the occurrence
nearest after the last aligned position), as prompt lookup re-aligns on its own context. Pure Python over
token ids; testable without models.
"""

from __future__ import annotations

from bisect import bisect_left

MAX_N = 8
"""Longest output suffix looked up to re-align."""

MIN_N = 2
"""Shortest suffix that re-aligns anywhere in the prediction (one token repeats by chance too often)."""

MIN_WINDOW = 4
"""Fewest predicted tokens a step proposes after a rejection (the window then grows back while they agree)."""

NEAR = 16
"""A single token re-aligns too, where it occurs at most this far past the last aligned position (an
edit that replaced a word: the next word is right there)."""


class PredictedOutput:
    """One request's predicted output and where its output is in it."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.pos: int | None = 0 if self.tokens else None
        """Index of the predicted token expected next; None: lost until a suffix of the output re-aligns."""
        self.last = 0  # where the alignment was last: re-aligning prefers occurrences after it
        self._index: dict[tuple[int, ...], list[int]] | None = None  # built at the first re-alignment
        self.matched = 0  # output tokens that followed the prediction (OpenAI's accepted prediction tokens)
        self.window: int | None = None
        """Most predicted tokens to propose next (None: no limit but the engine's): after a rejection, twice the
        run that was accepted (at least MIN_WINDOW), doubling while whole proposals are accepted. Where the
        answer strays from the prediction, long proposals would pay for verifying tokens that fail."""

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` predicted tokens to draft from here (none while the alignment is lost)."""
        if self.window is not None:
            limit = min(limit, self.window)
        if self.pos is None or limit <= 0:
            return []
        return self.tokens[self.pos : self.pos + limit]

    def settle(self, proposed: int, accepted: int) -> None:
        """A step verified `proposed` of its predicted tokens and accepted `accepted`: size the next window."""
        if accepted >= proposed:
            self.window = None if self.window is None else 2 * self.window
        else:
            self.window = max(MIN_WINDOW, 2 * accepted)

    def advance(self, output: list[int], new: int) -> None:
        """The output grew by its last `new` tokens: follow them through the prediction, re-aligning after
        the first that differs."""
        for t in output[len(output) - new :]:
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == t:
                self.pos += 1
                self.last = self.pos
                self.matched += 1
            else:
                self.pos = None
        if self.pos is None:
            self.pos = self._realign(output)

    @property
    def index(self) -> dict[tuple[int, ...], list[int]]:
        """n-gram (1..MAX_N tokens) of the prediction -> the positions right after it, ascending."""
        if self._index is None:
            self._index = {}
            for e in range(1, len(self.tokens) + 1):
                for n in range(1, min(MAX_N, e) + 1):
                    self._index.setdefault(tuple(self.tokens[e - n : e]), []).append(e)
        return self._index

    def _realign(self, output: list[int]) -> int | None:
        for n in range(min(MAX_N, len(output)), 0, -1):
            at = self.index.get(tuple(output[len(output) - n :]))
            if not at:
                continue
            i = bisect_left(at, self.last)  # nearest occurrence at or after the last aligned position
            e = at[i] if i < len(at) else at[-1]
            if n >= MIN_N or (i < len(at) and e - self.last <= NEAR):
                return e if e < len(self.tokens) else None
        return None

    def usage(self) -> dict:
        """OpenAI's usage.completion_tokens_details counts: predicted tokens the output followed, and those it
        did not (the rest of the prediction)."""
        accepted = min(self.matched, len(self.tokens))
        return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": len(self.tokens) - accepted}
