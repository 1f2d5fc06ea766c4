"""Streaming text: incremental detokenisation that holds back partial UTF-8 and any tail that may
still become a stop string. Pure; the tokenizer is passed in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Feed generated token ids; get the text that is safe to show."""

    def __init__(self, tokenizer: Decoder | None, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    def _decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """Adds tokens; returns (how many of them to keep, text to emit).

        When a stop string completes, only the tokens up to the one that completed it are kept,
        the text ends before the stop string, and `stopped` is set.
        """
        if self.stopped:
            return 0, ""
        start = len(self._token_ids)
        self._token_ids.extend(token_ids)
        text = self._decode(self._token_ids)
        cut = self._first_stop(text)
        if cut is None:
            safe = self._safe_end(text)
            piece, self._emitted = text[self._emitted:safe], max(self._emitted, safe)
            return len(token_ids), piece
        self.stopped = True
        keep = len(token_ids)
        for count in range(1, len(token_ids) + 1):  # the token that completed the stop string
            if self._first_stop(self._decode(self._token_ids[: start + count])) is not None:
                keep = count
                break
        del self._token_ids[start + keep:]
        piece = text[self._emitted:cut]
        self._emitted = cut
        return keep, piece

    def flush(self) -> str:
        """At the end: everything held back (a dangling stop-string prefix is real text)."""
        if self.stopped:
            return ""
        text = self._decode(self._token_ids)
        piece, self._emitted = text[self._emitted:], len(text)
        return piece

    def _first_stop(self, text: str) -> int | None:
        # Searching the whole text keeps this simple; generations here are short enough.
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self._emitted and text[end - 1] == REPLACEMENT:
            end -= 1
        hold = 0  # the longest tail that is a proper prefix of some stop string
        for stop in self._stop:
            for length in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:length], 0, end):
                    hold = max(hold, length)
                    break
        return max(end - hold, self._emitted)
