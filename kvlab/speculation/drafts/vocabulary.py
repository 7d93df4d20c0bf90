"""Vocabularies as byte strings, and the bridge between a draft's vocabulary and the target's.

The heterogeneous-vocabulary drafts (`slem`, `tli`, `slrs`; Timor et al., ICML 2025,
arXiv:2502.05202) never compare token ids across models, only the text a token stands for. A
`Vocabulary` is that view of a tokenizer: the bytes of every token id (None for special tokens,
which stand for no text) and an `encode(text)` without special tokens. `from_tokenizer` reads it
from a Hugging Face tokenizer (byte-level BPE as in SmolLM2, or SentencePiece-style with `▁` for a
space and `<0xNN>` byte fallback as in Gemma 3); `toy(...)` builds small longest-match tokenizers
over one alphabet for tests of models without a tokenizer (`random:<shape>`), and `load_vocabulary`
resolves the names `toy-a`, `toy-b`, `toy-p` used in draft configs.

`Bridge` pairs a draft vocabulary with the target's: the shared vocabulary (token ids whose bytes
are equal in both; the first id where one vocabulary repeats a string) and the draft's view of a
target context, translated token by token (a shared token to its draft id, any other re-encoded
from its text), as Hugging Face's universal assisted generation does for the tokens it appends.
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Vocabulary:
    token_bytes: list  # [V] bytes of each token id; None for special tokens (no text)
    encode: Callable[[str], list]  # text -> token ids, no special tokens added
    prefix_ids: list = field(default_factory=list)  # ids the tokenizer puts before a text (a BOS), if any
    name: str = ""

    def __post_init__(self) -> None:
        self.ids_of: dict[bytes, int] = {}  # bytes -> the first id standing for them
        for i, b in enumerate(self.token_bytes):
            if b is not None and b not in self.ids_of:
                self.ids_of[b] = i
        self.max_token_bytes = max((len(b) for b in self.ids_of), default=0)

    def __len__(self) -> int:
        return len(self.token_bytes)

    def text_bytes(self, ids) -> bytes:
        """The bytes the tokens stand for (special tokens stand for none)."""
        return b"".join(self.token_bytes[i] or b"" for i in ids if 0 <= i < len(self.token_bytes))

    def encode_bytes(self, data: bytes) -> list:
        """Ids for `data`: `encode` on its text; bytes that are no UTF-8 character (a byte-fallback
        piece) go one by one to single-byte tokens, or are dropped where the vocabulary has none."""
        out, start = [], 0
        while start < len(data):
            text, used = complete_utf8(data[start:])
            if text:
                out += self.encode(text)
                start += used
            else:  # a stray byte
                if data[start:start + 1] in self.ids_of:
                    out.append(self.ids_of[data[start:start + 1]])
                start += 1
        return out


def complete_utf8(data: bytes) -> tuple[str, int]:
    """The longest prefix of `data` that is valid UTF-8, as text, and its length in bytes."""
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as exc:
        good = data[:exc.start]
        return good.decode("utf-8"), len(good)


# -- Hugging Face tokenizers -----------------------------------------------------
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE (GPT-2 style) writes every byte as one printable character: the printable
    Latin-1 bytes as themselves, the others (control bytes, space, ...) as chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def from_tokenizer(tokenizer, name: str = "") -> Vocabulary:
    """The byte view of a Hugging Face tokenizer (byte-level BPE, or `▁` + byte fallback)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = repr(getattr(backend, "decoder", None))
    if "ByteLevel" in decoder:
        table = _byte_level_table()

        def to_bytes(piece: str) -> bytes | None:
            if any(c not in table for c in piece):
                return None
            return bytes(table[c] for c in piece)
    elif "▁" in decoder or "ByteFallback" in decoder:
        def to_bytes(piece: str) -> bytes | None:
            m = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8")
    else:
        raise ValueError(f"tokenizer {name or type(tokenizer).__name__}: kvlab reads the text of tokens from "
                         f"byte-level BPE or SentencePiece-style (`▁`, <0xNN>) tokenizers; its decoder is {decoder}")
    special = set(tokenizer.all_special_ids)
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    token_bytes = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None or (i in added and added[i].special):
            token_bytes.append(None)
        elif i in added:
            token_bytes.append(added[i].content.encode("utf-8"))
        else:
            token_bytes.append(to_bytes(piece) or None)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    prefix = full[:len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []

    def encode(text: str) -> list:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return Vocabulary(token_bytes, encode, prefix, name)


# -- toy tokenizers for tests ------------------------------------------------------
def toy(tokens: list, size: int | None = None, num_special: int = 3, name: str = "toy") -> Vocabulary:
    """A longest-match tokenizer over `tokens` (strings): ids 0 .. num_special-1 are special (no
    text), then the tokens in order; `size` pads with special ids (a model's vocabulary can be
    larger than its tokenizer's). Every single character of the text must be a token."""
    token_bytes = [None] * num_special + [t.encode("utf-8") for t in tokens]
    if size is not None:
        if size < len(token_bytes):
            raise ValueError(f"toy vocabulary {name}: {len(token_bytes)} ids do not fit in {size}")
        token_bytes += [None] * (size - len(token_bytes))
    vocab = Vocabulary(token_bytes, lambda text: [], [], name)
    longest = vocab.max_token_bytes

    def encode(text: str) -> list:
        data, out, pos = text.encode("utf-8"), [], 0
        while pos < len(data):
            for n in range(min(longest, len(data) - pos), 0, -1):
                if data[pos:pos + n] in vocab.ids_of:
                    out.append(vocab.ids_of[data[pos:pos + n]])
                    pos += n
                    break
            else:
                raise ValueError(f"toy vocabulary {name}: no token for {data[pos:pos + 1]!r}")
        return out

    vocab.encode = encode
    return vocab


ALPHABET = "abcdefgh"


def _strings(n: int) -> list:
    """All strings of n letters of ALPHABET, in a fixed pseudo-random order."""
    out = [""]
    for _ in range(n):
        out = [s + c for s in out for c in ALPHABET]
    return sorted(out, key=lambda s: (hash_str(s), s))


def hash_str(s: str) -> int:
    h = 2166136261
    for c in s.encode():
        h = ((h ^ c) * 16777619) % (1 << 32)
    return h


def _toy_named(name: str) -> Vocabulary:
    """The toys for 256-id random models: 3 special ids, then 253 tokens over 8 letters.

    toy-a: the 8 letters, the 64 pairs, 181 triples.
    toy-b: toy-a's letters and pairs at the same ids, toy-a's triples at the same ids in even
           slots and quadruples (which toy-a lacks) in odd slots: about two thirds shared, same ids.
    toy-p: the letters, the pairs and 181 other triples, all in another order: a tokenizer sharing
           a third of toy-a's strings, under different ids."""
    letters, pairs = list(ALPHABET), _strings(2)
    if name == "toy-a":
        return toy(letters + pairs + _strings(3)[:181], 256, name=name)
    if name == "toy-b":
        triples, quads = _strings(3)[:181], _strings(4)
        return toy(letters + pairs + [t if i % 2 == 0 else quads[i] for i, t in enumerate(triples)], 256, name=name)
    if name == "toy-p":
        tokens = letters + pairs + _strings(3)[181:362]
        return toy(sorted(tokens, key=lambda s: hash_str(s + "p")), 256, name=name)
    raise ValueError(f"unknown toy tokenizer {name!r}; known: toy-a, toy-b, toy-p")


def load_vocabulary(spec, name: str = "") -> Vocabulary:
    """A `Vocabulary` from a Hugging Face tokenizer object or a toy name (`toy-a`, `toy-b`, `toy-p`)."""
    if isinstance(spec, Vocabulary):
        return spec
    if isinstance(spec, str):
        return _toy_named(spec)
    return from_tokenizer(spec, name)


@dataclass
class Bridge:
    """A draft vocabulary next to the target's."""

    draft: Vocabulary
    target: Vocabulary

    def __post_init__(self) -> None:
        self.target_of: dict[int, int] = {}  # draft id -> target id of the same bytes (the shared vocabulary)
        for d, b in enumerate(self.draft.token_bytes):
            if b is not None and b in self.target.ids_of and self.draft.ids_of[b] == d:
                self.target_of[d] = self.target.ids_of[b]
        self.draft_of = {t: d for d, t in self.target_of.items()}  # target id -> draft id
        self._contexts: dict[int, tuple[int, list]] = {}  # seq_id -> (target tokens translated, draft ids)

    def to_draft(self, target_ids: list, key: int | None = None) -> list:
        """The draft's ids for a target context, token by token (incremental per `key`: target
        contexts only grow)."""
        done, out = self._contexts.get(key, (0, self.draft.prefix_ids))
        if done > len(target_ids):  # not the context this key translated before
            done, out = 0, self.draft.prefix_ids
        out = list(out)
        for t in target_ids[done:]:
            if t in self.draft_of:
                out.append(self.draft_of[t])
            elif 0 <= t < len(self.target.token_bytes) and self.target.token_bytes[t] is not None:
                out += self.draft.encode_bytes(self.target.token_bytes[t])
        if key is not None:
            self._contexts[key] = (len(target_ids), out)
        return out

    def forget(self, key: int) -> None:
        self._contexts.pop(key, None)

    def num_tracked(self) -> int:
        return len(self._contexts)
