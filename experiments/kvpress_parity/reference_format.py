"""How reference_smollm2.json stores kept-token sets (standard library only).

Both sides of the parity harness import this file: the kvpress side (inside its own
virtualenv) to write the sets, a kvlab-side comparison to read them. It imports
neither torch, kvpress nor kvlab.

A kept set over a prompt of n tokens is a bitmask of n bits, bit i set when token i
is still in the cache after compression; bits are packed little-endian within each
byte (bit i lives in byte i // 8 at bit i % 8) and the bytes are base64-encoded.
"""

import base64
import json
from pathlib import Path

REFERENCE = Path(__file__).with_name("reference_smollm2.json")


def encode_kept(kept: list[int], n: int) -> str:
    """Kept token positions (any order, no repeats) -> base64 bitmask over n positions."""
    mask = bytearray((n + 7) // 8)
    for i in kept:
        if not 0 <= i < n:
            raise ValueError(f"kept position {i} outside a prompt of {n} tokens")
        mask[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(mask)).decode("ascii")


def decode_kept(mask: str, n: int) -> list[int]:
    """base64 bitmask over n positions -> sorted kept token positions."""
    raw = base64.b64decode(mask)
    if len(raw) != (n + 7) // 8:
        raise ValueError(f"mask of {len(raw)} bytes does not cover a prompt of {n} tokens")
    return [i for i in range(n) if raw[i // 8] >> (i % 8) & 1]


def load_reference(path: Path = REFERENCE) -> dict:
    """The reference file with every run's `kept` decoded to [layer][kv_head] -> sorted positions."""
    ref = json.loads(path.read_text())
    for run in ref["runs"]:
        n = len(ref["prompts"][run["prompt"]]["token_ids"])
        run["kept"] = [[decode_kept(m, n) for m in layer] for layer in run["kept"]]
    return ref
