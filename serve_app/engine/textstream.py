"""Incremental detokenization with stop strings, for streaming.

Text is released only when it is final: a trailing partial UTF-8 character (decoded as U+FFFD) or a
tail that could still grow into a stop string is held back until the next tokens settle it.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # the stop string stays at the end of the text
        self.skip_special = skip_special  # special tokens left out of the text
        self.ids: list[int] = []
        self.text = ""  # decoded text of ids, truncated at a stop string once one is seen
        self.sent = 0  # characters of text already released
        self.stopped = False

    def resume(self, ids: list[int], sent_chars: int) -> None:
        """Continue a stream another engine started: `ids` generated there, of whose text the client
        already has `sent_chars` characters (text held back there is released from here)."""
        self.ids = list(ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        self.sent = min(sent_chars, len(self.text))

    def push(self, ids: list[int]) -> str:
        """Add generated ids; return newly final text. Sets `stopped` when a stop string appears."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        if self.stop:
            # A stop string can only newly appear in the part not already released.
            hits = [(i, -len(s)) for s in self.stop if (i := text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
            if hits:
                at, neg = min(hits)  # the first; of two starting there, the longer
                text = text[: at - neg if self.include_stop else at]
                self.stopped = True
        self.text = text
        end = len(text) if self.stopped else self._safe_end(text)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def flush(self) -> str:
        """Release everything held back (the request is finishing)."""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:
            # Hold back the longest tail that is a proper prefix of a stop string.
            for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                if text.endswith(s[:n], 0, end):
                    hold = max(hold, n)
                    break
        return max(end - hold, self.sent)
