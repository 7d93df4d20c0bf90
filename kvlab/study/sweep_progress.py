"""Progress of a sweep whose jobs run elsewhere (joblib workers, submitit / SLURM, Ray): a line each time
the counts change, read from the sweep folder every `sweep_progress_s` seconds:

    sweep multirun/study progress: 2 finished, 1 failed, 0 skipped; 1 running (4 started)

Ended jobs come from the ledger (kvlab.study.sweep_report); a job is running while its run record
(run.jsonl) has a start line and no finish line and the ledger has no row for it. A job whose worker
was killed stays "running" here until its launcher records it as failed (the Ray launcher does;
under SLURM, the job's end is what submitit reports). Started in the sweep's process by
SweepReport.on_multirun_start for every launcher but the basic one (whose jobs print as they go).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvlab.study.loggers.local import RECORD


def count_jobs(sweep_dir: Path) -> dict[str, int]:
    """{finished, failed, skipped, not run, running, started} of a sweep folder now."""
    from kvlab.study.sweep_ledger import STATUSES, read_ledger

    rows = read_ledger(sweep_dir)
    counts = {status: sum(row.get("status") == status for row in rows) for status in STATUSES}
    ended = {str(Path(row.get("dir", ""))) for row in rows}
    running = started = 0
    for record in Path(sweep_dir).rglob(RECORD):
        started += 1
        if str(record.parent) in ended:
            continue
        if not has_finish(record):
            running += 1
    counts.update(running=running, started=started)
    return counts


def has_finish(record: Path) -> bool:
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return False
    for line in reversed(lines[-3:]):
        try:
            if json.loads(line).get("event") == "finish":
                return True
        except json.JSONDecodeError:
            continue
    return False


def progress_line(sweep_dir: Path, counts: dict[str, int]) -> str:
    line = (f"sweep {sweep_dir} progress: {counts['finished']} finished, {counts['failed']} failed, "
            f"{counts['skipped']} skipped; {counts['running']} running")
    if counts.get("not run"):
        line += f"; {counts['not run']} not run (fail_fast)"
    return line


class SweepProgress:
    """A daemon thread printing `progress_line` whenever the counts change (and once when stopped)."""

    def __init__(self, sweep_dir: Path, interval_s: float):
        self.sweep_dir, self.interval_s = Path(sweep_dir), interval_s
        self._stop = threading.Event()
        self._last: str | None = None
        self._thread = threading.Thread(target=self._loop, name="kvlab-sweep-progress", daemon=True)

    def start(self) -> "SweepProgress":
        self._thread.start()
        return self

    def poll(self) -> str | None:
        """Print the progress line if it changed; return it (None when unchanged)."""
        line = progress_line(self.sweep_dir, count_jobs(self.sweep_dir))
        if line == self._last:
            return None
        self._last = line
        print(line, flush=True)
        return line

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # a half-written file: try again next time
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
