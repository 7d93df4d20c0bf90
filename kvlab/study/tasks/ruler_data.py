"""RULER samples from RULER's own generators, cached on disk.

RULER (Hsieh et al. 2024, arXiv:2404.06654) ships its generators as scripts, packaged on
PyPI as `nvidia-long-context-eval` (module `long_context_eval`): data/synthetic/niah.py,
variable_tracking.py and common_words_extraction.py, with the subtask settings in
synthetic.yaml, the prompts in data/synthetic/constants.py and data/template.py, and the
Paul Graham essays in data/synthetic/json/. The package declares heavy dependencies
(nemo-evaluator, openai, tiktoken) that the generators never import; install it with
`pip install --no-deps nvidia-long-context-eval` and then `pip install wonderwords nltk tenacity`.

The scripts parse their arguments and build their tokenizer at import. kvlab executes each
script's module code once in this process (cwe: once per seed, as it shuffles its words at import) (runpy, with its argv set and
sys.path / sys.modules / the global RNGs restored afterwards), then sets the script's
`args` per subtask and calls its `generate_input_output`. Two departures, both for short
lengths and for reproducibility:

- Length fitting: RULER grows the essay haystack in 500-word steps (tuned for 4K and more;
  at 512 tokens it would leave no haystack at all) and the noise of vt in steps of 10
  sentences. Here the haystack / noise / word-list size is the largest that fits, found by
  bisection, so a prompt holds `length - tokens_to_generate` tokens or a few less (as in
  RULER, `length` counts the generated tokens).
- Sentences are split by nltk's untrained Punkt tokenizer instead of `sent_tokenize`, whose
  trained parameters are a download: samples are then the same on every machine.

Samples are cached as JSON lines under `$KVLAB_CACHE/ruler` (else ~/.cache/kvlab/ruler),
one file per subtask x length, named by a hash of everything that shapes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import runpy
import sys
import tempfile
from pathlib import Path
from typing import Any

SHIM_VERSION = 2          # bump when the way samples are made here changes
PACKAGE = "nvidia-long-context-eval"
INSTALL = f"pip install --no-deps {PACKAGE} && pip install wonderwords nltk tenacity"
SCRIPTS = {"niah": "niah", "variable_tracking": "variable_tracking", "common_words_extraction": "common_words_extraction"}
SEEDED_AT_IMPORT = ("common_words_extraction",)  # shuffles its word list by the seed at import
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."  # niah.py's 'repeat'


class RulerUnavailable(ImportError):
    """RULER's generators are not installed; the message says how to install them."""


def package_dir() -> Path:
    try:
        import long_context_eval
    except ImportError:
        raise RulerUnavailable(f"RULER's generators are not installed: {INSTALL}") from None
    return Path(long_context_eval.__file__).parent


def package_version() -> str:
    from importlib.metadata import version

    return version(PACKAGE)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab")) / "ruler"


def subtask_config(name: str, model_template: str = "base") -> dict:
    """RULER's settings of subtask `name`: {task, args, template, tokens_to_generate}, as prepare.py builds them."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS
    from long_context_eval.data.template import Templates

    custom = yaml.safe_load((package_dir() / "synthetic.yaml").read_text())
    if name not in custom:
        raise ValueError(f"RULER has no subtask {name!r}; its subtasks: {list(custom)}")
    config = dict(custom[name])
    base = TASKS[config["task"]]
    template = Templates[model_template].format(task_template=base["template"]) + base.get("answer_prefix", "")
    return {"task": config["task"], "args": dict(config["args"]), "template": template,
            "tokens_to_generate": base["tokens_to_generate"]}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else str(getattr(tokenizer, "name_or_path", type(tokenizer)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _isolated(argv: list[str], paths: list[str]):
    """Run a script's module code without leaving its argv, sys.path entries, modules or RNG state behind."""
    import numpy as np

    saved = list(sys.path), sys.argv, set(sys.modules), random.getstate(), np.random.get_state()
    sys.path[:0], sys.argv = paths, argv
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        sys.path[:], sys.argv = saved[0], saved[1]
        for name in ("constants", "tokenizer", "template"):  # the scripts' sibling imports by bare name
            if name not in saved[2]:
                sys.modules.pop(name, None)
        random.setstate(saved[3])
        np.random.set_state(saved[4])


class Generators:
    """RULER's generator scripts, loaded on first use, all tokenizing with `tokenizer`."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._scripts: dict[tuple[str, int], dict] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="kvlab-ruler-")
        tokenizer.save_pretrained(self._tmp.name)  # the scripts load their tokenizer from a folder

    def close(self) -> None:
        self._scripts.clear()   # niah.py's namespace holds ~6M key words
        self._tmp.cleanup()

    def script(self, task: str, seed: int) -> dict:
        seed = seed if task in SEEDED_AT_IMPORT else 42  # else the import-time seed is reseeded before use
        if (task, seed) not in self._scripts:
            root = package_dir() / "data"
            path = root / "synthetic" / f"{SCRIPTS[task]}.py"
            argv = [str(path), "--save_dir", self._tmp.name, "--save_name", "x", "--tokenizer_type", "hf",
                    "--tokenizer_path", self._tmp.name, "--max_seq_length", "0", "--tokens_to_generate", "0",
                    "--num_samples", "0", "--random_seed", str(seed)]
            with _isolated(argv, [str(root / "synthetic"), str(root)]):
                ns = runpy.run_path(str(path), run_name=f"kvlab_ruler_{task}")
            ns = ns["generate_input_output"].__globals__  # run_path returns a copy; the functions see these
            if "sent_tokenize" in ns:
                from nltk.tokenize.punkt import PunktSentenceTokenizer

                ns["sent_tokenize"] = PunktSentenceTokenizer().tokenize  # untrained: no download
            self._scripts[(task, seed)] = ns
        return self._scripts[(task, seed)]

    def samples(self, name: str, length: int, num_samples: int, tokens_to_generate: int, seed: int,
                model_template: str = "base") -> list[dict]:
        """`num_samples` of subtask `name`: {index, input, outputs, length}; length = input tokens + tokens_to_generate."""
        import numpy as np

        config = subtask_config(name, model_template)
        ns = self.script(config["task"], seed)
        args = ns["args"]
        for key, value in config["args"].items():
            setattr(args, key, value)
        args.template, args.max_seq_length, args.tokens_to_generate = config["template"], length, tokens_to_generate
        args.random_seed, args.remove_newline_tab = seed, False
        saved = random.getstate(), np.random.get_state()
        random.seed(seed)  # before the maker: variable_tracking draws its one-shot example there
        np.random.seed(seed)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                make, sizes = self._maker(config["task"], ns, length)
                return fit_samples(make, ns["TOKENIZER"], num_samples, length, tokens_to_generate, name, *sizes)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])

    def _maker(self, task: str, ns: dict, length: int):
        """size -> (input text, expected outputs), from the script's generate_input_output, and the sizes allowed."""
        args = ns["args"]
        if task == "niah":
            args.num_needle_k = max(args.num_needle_k, args.num_needle_q)
            ns["haystack"] = niah_haystack(ns, args.type_haystack)
            return ns["generate_input_output"], (1, len(ns["haystack"]) if args.type_haystack == "essay" else None)
        if task == "common_words_extraction":
            return ns["generate_input_output"], (args.num_cw, len(ns["words"]))  # RULER's least: num_cw words
        # variable_tracking: a one-shot example first, as its main() makes it (500 tokens; here at most half
        # the length, so that short lengths keep room for the question), then inserted as its loop does
        def chains(size: int, is_icl: bool):
            # generate_chains appends a fresh name when two collide, which leaves its last chain short and
            # raises IndexError; RULER's own loop never sees it at its sizes. Draw again (the seeded stream
            # moves on, so the retry is as reproducible as the first draw).
            for _ in range(100):
                try:
                    return ns["generate_input_output"](size, args.num_chains, args.num_hops, is_icl=is_icl)
                except IndexError:
                    continue
            raise RuntimeError("RULER variable_tracking: 100 draws in a row had colliding variable names")

        def make_icl(size: int):
            return chains(size, True)

        icl = fit_samples(make_icl, ns["TOKENIZER"], 1, min(500, length // 2), args.tokens_to_generate, "vt example")[0]
        icl_text = icl["input"] + " " + " ".join(icl["outputs"]) + "\n\n"
        head = ns["TASKS"]["variable_tracking"]["template"][:20]

        def make(size: int):
            text, answer = chains(size, False)
            cut = text.index(head)
            return text[:cut] + " " + ns["randomize_icl"](icl_text) + "\n\n" + text[cut:], answer

        return make, (1, None)


def niah_haystack(ns: dict, kind: str):
    """niah.py's module-level `haystack` for `kind` (it builds only the one its argv asked for)."""
    if kind == "essay":
        import re

        essay = json.loads((package_dir() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json").read_text())
        return re.sub(r"\s+", " ", essay["text"]).split(" ")
    if kind == "repeat":
        return NOISE
    if kind == "needle":
        return ns["needle"]
    raise ValueError(f"niah: unknown type_haystack {kind!r}")


def fit_samples(make, tokenizer, num_samples: int, length: int, tokens_to_generate: int, name: str,
                least: int = 1, most: int | None = None) -> list[dict]:
    """The largest size whose prompt + tokens_to_generate fits `length` (bisection), then samples at it,
    each shrunk until it fits (as RULER's loops do)."""
    def count(text: str) -> int:
        return len(tokenizer.text_to_tokens(text))

    lo, hi = least, min(length, most or length)  # every unit (word, sentence, list entry) is at least one token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        text, _ = make(mid)
        lo, hi = (mid, hi) if count(text) + tokens_to_generate <= length else (lo, mid - 1)
    step = max(1, lo // 50)
    out = []
    for index in range(num_samples):
        size = lo
        while True:
            text, answer = make(size)
            total = count(text) + tokens_to_generate
            if total <= length:
                break
            if size == least:
                raise ValueError(f"RULER {name}: length {length} is too short for its smallest prompt "
                                 f"({total - tokens_to_generate} tokens) and {tokens_to_generate} generated "
                                 f"tokens; use a longer length or fewer new tokens")
            size = max(size - step, least)
        out.append({"index": index, "input": text, "outputs": [str(a) for a in answer], "length": total})
    return out


def cached_samples(names: list[str], lengths: list[int], num_samples: int, tokens: dict[str, int], seed: int,
                   tokenizer: Any, cache_dir: Path, model_template: str = "base") -> dict[tuple[str, int], list[dict]]:
    """{(subtask, length): samples}, read from `cache_dir` or generated (and written) there."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    version = package_version()
    out, missing = {}, []
    for name in names:
        for length in lengths:
            key = json.dumps([SHIM_VERSION, version, name, length, num_samples, tokens[name], seed, model_template,
                              fingerprint])
            path = cache_dir / f"{name}-{length}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
            if path.exists():
                out[(name, length)] = [json.loads(line) for line in path.read_text().splitlines()]
            else:
                missing.append((name, length, path))
    if missing:
        generators = Generators(tokenizer)
        try:
            for name, length, path in missing:
                rows = generators.samples(name, length, num_samples, tokens[name], seed, model_template)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                tmp.replace(path)
                out[(name, length)] = rows
        finally:
            generators.close()
    return out
