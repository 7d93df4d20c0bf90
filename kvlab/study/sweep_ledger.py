"""A sweep's ledger: one JSON line per finished job (<sweep dir>/sweep_jobs.jsonl), written by
`SweepReport` where the job ran and read by the report, the progress line and the Ray launcher."""

from __future__ import annotations

import json
from pathlib import Path

LEDGER = "sweep_jobs.jsonl"
STATUSES = ("finished", "failed", "skipped", "not run")


def ledger_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / LEDGER


def read_ledger(sweep_dir: str | Path) -> list[dict]:
    """The outcomes recorded so far in this sweep, in the order jobs ended."""
    path = ledger_path(sweep_dir)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a killed worker
    return rows
