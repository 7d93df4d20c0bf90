"""Data of the offline lm-eval tasks (kvlab/study/lm_eval/task_yamls), built at run time from the shared data folder.

lm-eval's own tasks download from the hub; these are built from what `kvlab.study.tasks.data` finds locally
(WikiText-2 raw test, the Paul Graham essays), written as JSONL under the cache folder
(`$KVLAB_CACHE/lm_eval`, default ~/.cache/kvlab/lm_eval) and read back through `datasets`' `json`
builder, so each task's data is also a plain file a user can read or point another task at:

- `wikitext2_documents`: WikiText-2 test split into its articles, as lm-eval's `wikitext` task reads
  EleutherAI/wikitext_document_level (one `page` per article, raw text);
- `lambada_rows`: a LAMBADA-style last-word set: passages of whole sentences from WikiText-2 articles
  (detokenised as lm-eval's wikitext task does) that end in an alphabetic word; the model predicts that
  word. Unlike LAMBADA (Paperno et al. 2016) no human filtered them for needing broad context;
- `niah_rows`: needle-in-a-haystack prompts from kvlab's own generator (kvlab.study.tasks.niah.build_prompt),
  sized in the model's tokens and decoded to text.
"""

from __future__ import annotations

import json
import os
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

WIKITEXT = "wikitext-2-raw/wiki.test.raw"
ESSAYS = "paul-graham-essays"
ARTICLE = re.compile(r"^ = [^=].* = $")  # a top-level heading: " = Robert Boulter = "
WORD = re.compile(r"^[A-Za-z]{3,}$")  # a last word worth predicting


def cache_dir() -> Path:
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab")) / "lm_eval"


def wikitext2_documents(data_dir: str | Path | None = None, source: str = WIKITEXT) -> list[str]:
    """The articles of a WikiText raw file, each from its heading to the next one (raw, tokenised text)."""
    from kvlab.study.tasks.data import data_path

    lines = data_path(source, data_dir).read_text(encoding="utf-8").splitlines(keepends=True)
    docs: list[list[str]] = []
    for line in lines:
        if ARTICLE.match(line.rstrip("\n")) or not docs:
            docs.append([])
        docs[-1].append(line)
    return ["".join(doc).strip() + "\n" for doc in docs if "".join(doc).strip()]


def lambada_rows(pages: list[str], num_docs: int, min_words: int, max_words: int, seed: int) -> list[dict]:
    """Up to `num_docs` passages {"text", "article"} of `min_words`..`max_words` words ending a sentence
    on an alphabetic word, at most one per paragraph, paragraphs chosen at random (seeded)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    candidates = []
    for a, page in enumerate(pages):
        for paragraph in page.split("\n"):
            if paragraph.strip() and not paragraph.strip().startswith("="):
                text = passage(wikitext_detokenizer({"page": paragraph.strip()}), min_words, max_words)
                if text:
                    candidates.append({"text": text, "article": a})
    random.Random(seed).shuffle(candidates)
    return candidates[:num_docs]


def passage(paragraph: str, min_words: int, max_words: int) -> str | None:
    """The longest run of whole sentences from the paragraph's start within max_words words whose last
    sentence ends in an alphabetic word (its full stop dropped); None if shorter than min_words."""
    best = None
    words: list[str] = []
    for sentence in re.split(r"(?<=\.) ", paragraph):
        words += sentence.split()
        if len(words) > max_words:
            break
        last = words[-1].rstrip(".") if words else ""
        if len(words) >= min_words and words[-1].endswith(".") and WORD.match(last):
            best = " ".join(words[:-1] + [last])
    return best


def niah_rows(tokenizer: Any, haystack: list[int], variants: list[str], context_lengths: list[int],
              depths: list[float], samples_per_cell: int, num_keys: int, seed: int) -> list[dict]:
    """kvlab's NIAH prompts ({"input", "answer", "variant", "context_length", "depth"}) as text."""
    from kvlab.study.tasks.niah import NeedleInAHaystack

    task = NeedleInAHaystack(variants=list(variants), context_lengths=list(context_lengths), depths=list(depths),
                             samples_per_cell=samples_per_cell, num_keys=num_keys)
    rows = []
    for row in task.samples(tokenizer, haystack, seed):
        rows.append({"input": tokenizer.decode(row["prompt_token_ids"], skip_special_tokens=True),
                     "answer": row["answer"], "variant": row["variant"],
                     "context_length": row["context_length"], "depth": row["depth"]})
    return rows


def write_jsonl(name: str, rows: list[dict], folder: Path | None = None) -> Path:
    """rows -> <cache>/<name>.jsonl (rewritten only when the content changed); its path."""
    path = (folder or cache_dir()) / f"{name}.jsonl"
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def load_jsonl(path: Path):
    """A DatasetDict with one `test` split read by `datasets`' json builder (as `dataset_path: json` does)."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(path)})


@lru_cache(maxsize=8)
def model_tokenizer(name: str):
    """The tokenizer of a kvlab model name (packaged, folder, .gguf), without loading weights; a
    ByteTokenizer for random:<shape> models (as the engine encodes text for them). Loaded once per name in a
    process: every build of a task's data asks again (each simple_evaluate, each job of a sweep), and Gemma 3's
    33 MB tokenizer.json took 17 s to load on the loaded two cores (the tokenizer is only read)."""
    from kvlab.study.tasks.data import ByteTokenizer

    if str(name).startswith("random:"):
        from kvlab.models import RANDOM_SHAPES

        return ByteTokenizer(RANDOM_SHAPES[str(name).split(":", 1)[1]]["vocab_size"])
    from transformers import AutoTokenizer

    from kvlab.models import resolve

    folder = resolve(str(name))
    return AutoTokenizer.from_pretrained(str(folder) if folder is not None else str(name))
