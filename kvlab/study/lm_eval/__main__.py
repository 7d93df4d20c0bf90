"""`python -m kvlab.study.lm_eval <lm-eval's own arguments>`: lm-eval's command line with the `kvlab` model registered.

    python -m kvlab.study.lm_eval --model kvlab --model_args pretrained=smollm2-135m,policy=snapkv,compression_ratio=0.5 \
        --tasks kvlab_wikitext2 --limit 4 --batch_size 64 --output_path out/

kvlab's offline tasks (kvlab.study.lm_eval.TASKS_DIR) are found beside lm-eval's own and any `--include_path`
(lm-eval's command line takes one folder; the wrapper adds kvlab's to the task index it builds).
"""

from __future__ import annotations

import sys


def with_kvlab_tasks(include_path) -> list:
    """`include_path` (None, a folder or a list of them) with kvlab's task folder first."""
    import kvlab.study.lm_eval

    paths = [] if include_path is None else [include_path] if isinstance(include_path, (str, bytes)) or \
        not hasattr(include_path, "__iter__") else list(include_path)
    return [str(kvlab.study.lm_eval.TASKS_DIR), *paths]


def main(argv: list[str] | None = None) -> None:
    import lm_eval.tasks

    import kvlab.study.lm_eval  # noqa: F401  (registers the `kvlab` model)
    from lm_eval.__main__ import cli_evaluate

    base = lm_eval.tasks.TaskManager

    class TaskManager(base):  # the command line builds its index through lm_eval.tasks.TaskManager
        def __init__(self, *args, include_path=None, **kwargs):
            super().__init__(*args, include_path=with_kvlab_tasks(include_path), **kwargs)

    lm_eval.tasks.TaskManager = TaskManager
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        lm_eval.tasks.TaskManager = base


if __name__ == "__main__":
    main()
