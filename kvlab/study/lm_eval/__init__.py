"""kvlab as a backend of EleutherAI's lm-evaluation-harness (`pip install -e .[lm_eval]`).

Importing this package registers the lm-eval model `kvlab` (kvlab.study.lm_eval.model.KvlabLM):

    import kvlab.study.lm_eval, lm_eval
    lm_eval.simple_evaluate(model="kvlab", model_args="pretrained=smollm2-135m,policy=snapkv,compression_ratio=0.5",
                            tasks=["kvlab_lambada_wikitext"], task_manager=lm_eval.tasks.TaskManager(
                                include_path=kvlab.study.lm_eval.TASKS_DIR))

    python -m kvlab.study.lm_eval --model kvlab --model_args pretrained=smollm2-135m,policy=snapkv \
        --tasks kvlab_lambada_wikitext --include_path kvlab/study/lm_eval/task_yamls --limit 20

The offline task YAMLs (WikiText-2 rolling perplexity, a LAMBADA-style last-word task from WikiText in
loglikelihood and generate_until forms, needle in a haystack) are in TASKS_DIR; their data is built
from the shared data folder at run time (kvlab.study.lm_eval.local_data).
"""

from pathlib import Path

from kvlab.study.lm_eval.model import KvlabLM

TASKS_DIR = Path(__file__).parent / "task_yamls"

__all__ = ["KvlabLM", "TASKS_DIR"]
