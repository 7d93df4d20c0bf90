"""Stop strings: a request finishes when its detokenised output contains one (vLLM's `stop`).

Each sequence with stop strings owns a `StopStrings`: an incremental detokeniser over its output
tokens (the classic prefix/read-offset scheme of vLLM's slow path and Hugging Face TGI: every new
token decodes a window of the few tokens before it, so the cost per token stays bounded) and the
search for the stop strings in the text each token adds. A stop string may span several tokens,
and the token that completes it may carry text after it. Torch-free.

    stops = StopStrings(tokenizer.decode, ("\\n\\n", "Question:"))
    for token in generated:
        if stops.append(token):           # the token completed a match
            stops.matched, stops.text     # "\\n\\n", the output text cut before it
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder yields for the incomplete UTF-8 of a character split over tokens


class IncrementalDetokenizer:
    """Output tokens in, the text they decode to out, a few tokens at a time.

    `decode(ids) -> str` decodes a list of ids (e.g. `lambda ids: tok.decode(ids, skip_special_tokens=True)`).
    Text is released once it no longer ends in U+FFFD, so a character whose bytes span tokens appears
    whole, with the token that completes it. `text` equals `decode(all tokens)` for prefix-stable
    decoders (byte-level BPE, SentencePiece), minus a trailing incomplete character.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # token_ids[_prefix:_read] decoded to the text released last (the window's context)
        self._read = 0  # tokens whose text is released

    def append(self, token: int) -> int:
        """Add one token; the number of characters it released (0 while a character is incomplete)."""
        self.token_ids.append(token)
        before = self.decode(self.token_ids[self._prefix:self._read])
        after = self.decode(self.token_ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return 0
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.token_ids)
        return len(after) - len(before)


class StopStrings:
    """The stop strings of one sequence, matched on its detokenised output.

    After `append` returns True: `matched` is the stop string found (of several completed by one token,
    the one that starts first in the text) and `text` the output cut before it, or just after it with
    `include` (vLLM's include_stop_str_in_output). The tokens are not cut: the token that completed
    the match is the sequence's last (as vLLM keeps it).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], include: bool = False):
        if not stop or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop = tuple(stop)
        self.include = include
        self.matched: str | None = None
        self.text: str | None = None  # the output text once matched

    def prime(self, token_ids: Sequence[int]) -> None:
        """Output tokens generated before this matcher existed (a fork): decoded, never searched."""
        for token in token_ids:
            self.detokenizer.append(token)

    def append(self, token: int) -> bool:
        """Add one generated token; True if it completed a stop string (then `matched` and `text` are set)."""
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched: the sequence has finished")
        new = self.detokenizer.append(token)
        if not new:
            return False
        found = find_stop(self.detokenizer.text, new, self.stop)
        if found is None:
            return False
        self.matched, index = found
        end = index + len(self.matched) if self.include else index
        self.text = self.detokenizer.text[:end]
        return True


def find_stop(text: str, new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """(stop string, its index in `text`) of the earliest stop string that ends in the last `new_chars`
    characters of `text` (only those can complete a match not found before), else None."""
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_chars - len(s) + 1)
        index = text.find(s, start)
        if index != -1 and (best is None or index < best[1]):
            best = (s, index)
    return best
