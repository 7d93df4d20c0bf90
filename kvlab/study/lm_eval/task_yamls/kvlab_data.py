"""The `custom_dataset` / `process_results` functions the kvlab task YAMLs name (`!function kvlab_data.<name>`).

lm-eval imports this file by path and calls a dataset function with the task's `dataset_kwargs` and the
run's metadata (lm-eval merges `--model_args` into it: `pretrained` names the model whose tokenizer sizes
the NIAH prompts; `data_dir` overrides the shared data folder). Each returns a DatasetDict with a `test`
split read from a JSONL file built under kvlab.study.lm_eval.local_data.cache_dir().
"""

from __future__ import annotations

import hashlib
import json

from lm_eval.tasks.wikitext.preprocess_wikitext import process_results as wikitext_process_results
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

from kvlab.study.lm_eval import local_data

__all__ = ["wikitext_detokenizer", "wikitext_process_results"]  # lm-eval's own, for kvlab_wikitext2.yaml


def _name(stem: str, params: dict) -> str:
    return f"{stem}-{hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]}"


def wikitext2(data_dir=None, **_):
    """WikiText-2 test, one row per article ({"page"}), for loglikelihood_rolling."""
    rows = [{"page": page} for page in local_data.wikitext2_documents(data_dir)]
    return local_data.load_jsonl(local_data.write_jsonl("wikitext2_documents", rows))


def lambada_wikitext(num_docs=500, min_words=40, max_words=120, sample_seed=1234, data_dir=None, **_):
    """LAMBADA-style passages from WikiText-2 test ({"text", "article"}): predict the last word."""
    params = {"num_docs": num_docs, "min_words": min_words, "max_words": max_words, "seed": sample_seed}
    rows = local_data.lambada_rows(local_data.wikitext2_documents(data_dir), **params)
    return local_data.load_jsonl(local_data.write_jsonl(_name("lambada_wikitext", params), rows))


def niah(variants=("needle", "passkey", "multikey"), context_lengths=(256, 512), depths=(0.0, 0.5, 1.0),
         samples_per_cell=2, num_keys=4, sample_seed=0, pretrained=None, tokenizer=None, model=None,
         data_dir=None, **_):
    """kvlab's needle-in-a-haystack prompts, sized in the tokens of the model under test."""
    from kvlab.study.tasks.data import corpus_tokens

    name = tokenizer or pretrained or model
    if not name:
        raise ValueError("kvlab_niah sizes its prompts in the tokens of the model under test: give the model as "
                         "`pretrained` in --model_args (lm-eval passes it on) or --metadata '{\"tokenizer\": ...}'")
    tok = local_data.model_tokenizer(name)
    params = {"variants": list(variants), "context_lengths": list(context_lengths), "depths": list(depths),
              "samples_per_cell": samples_per_cell, "num_keys": num_keys, "seed": sample_seed}
    rows = local_data.niah_rows(tok, corpus_tokens(local_data.ESSAYS, data_dir, tok), **params)
    return local_data.load_jsonl(local_data.write_jsonl(_name(f"niah-{str(name).replace('/', '_')}", params), rows))


def niah_process_results(doc, results):
    """Correct when the generation contains the needle's value (kvlab.study.tasks.niah's rule)."""
    return {"acc": float(doc["answer"] in results[0])}


def ruler(subtasks=("niah_single_1", "niah_multikey_1", "niah_multivalue", "vt", "cwe"), lengths=(1024,),
          num_samples=4, model_template="base", sample_seed=0, pretrained=None, tokenizer=None, model=None, **_):
    """RULER's samples from its own generators (kvlab.study.tasks.ruler, the `nvidia-long-context-eval`
    package), sized in the tokens of the model under test; one row per sample with its subtask, RULER's
    task family (which metric scores it), the length and the expected outputs."""
    from kvlab.study.tasks.ruler import Ruler

    name = tokenizer or pretrained or model
    if not name:
        raise ValueError("kvlab_ruler sizes its samples in the tokens of the model under test: give the model as "
                         "`pretrained` in --model_args (lm-eval passes it on) or --metadata '{\"tokenizer\": ...}'")
    task = Ruler(subtasks=list(subtasks), lengths=list(lengths), num_samples=num_samples,
                 model_template=model_template, cache_dir=str(local_data.cache_dir() / "ruler"))
    rows = [{key: row[key] for key in ("subtask", "task", "length", "index", "input", "outputs")}
            for row in task.samples(local_data.model_tokenizer(name), seed=sample_seed)]
    params = {"subtasks": list(subtasks), "lengths": list(lengths), "num_samples": num_samples,
              "template": model_template, "seed": sample_seed}
    return local_data.load_jsonl(local_data.write_jsonl(_name(f"ruler-{str(name).replace('/', '_')}", params), rows))


def ruler_process_results(doc, results):
    """RULER's per-sample score (string_match_all or _part, by the subtask's family), in [0, 1]."""
    from kvlab.study.tasks.ruler import score

    return {"score": score(results[0], list(doc["outputs"]), doc["task"])}
