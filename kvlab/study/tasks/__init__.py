"""Quality tasks: perplexity, needle in a haystack (RULER-style variants), RULER, agreement with the full cache.

Each is a dataclass built from conf/task/<name>.yaml (`_target_`); `run(llm, ctx)` returns a Result.
"""

from kvlab.study.tasks.base import Result, RunContext, Task

__all__ = ["Result", "RunContext", "Task"]
