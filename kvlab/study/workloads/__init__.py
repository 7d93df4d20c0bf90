"""Serving workloads: Azure trace replay, synthetic shared-prefix and multi-turn.

Each is a dataclass built from conf/workload/<name>.yaml (`_target_`); `run(llm, ctx)` replays
its requests through `llm.engine` and returns throughput, TTFT / TPOT, KV usage and waste.
"""

from kvlab.study.workloads.azure import load_azure_trace
from kvlab.study.workloads.replay import Request, replay

__all__ = ["Request", "load_azure_trace", "replay"]
