"""The local record of a run, written into its Hydra output folder whatever else happens.

    run.jsonl          one JSON object a line: start (config, meta), metrics, table, figure, finish
    tables/<name>.parquet
    figures/<name>.png

Lines are flushed as they are written, so a crash leaves what was logged so far.
kvlab.study.analysis.load_runs reads these folders back.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from kvlab.study.loggers.base import RunLogger

RECORD = "run.jsonl"


def write_report(out: str | Path, text: str, payload: dict) -> tuple[Path, Path]:
    """A benchmark's results: `<out>.md` (the table) and `<out>.json` (the figures, JSON-safe)."""
    md, js = Path(f"{out}.md"), Path(f"{out}.json")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    js.write_text(json.dumps(to_json(payload), indent=2))
    return md, js


def to_json(value: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class LocalLogger(RunLogger):
    def __init__(self) -> None:
        self.dir: Path | None = None
        self._file = None

    def _write(self, event: str, **fields) -> None:
        self._file.write(json.dumps(to_json({"event": event, "time": time.time(), **fields})) + "\n")
        self._file.flush()

    def start(self, run_dir, name, config, meta):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = (self.dir / RECORD).open("w")
        self._write("start", name=name, config=config, meta=meta)

    def log_metrics(self, metrics, step=None):
        self._write("metrics", step=step, metrics=metrics)

    def log_table(self, name, table):
        path = self.dir / "tables" / f"{name}.parquet"
        path.parent.mkdir(exist_ok=True)
        try:
            table.to_parquet(path, index=False)
        except Exception:  # mixed-type object columns: store them as text
            table.astype({c: str for c in table.columns if table[c].dtype == object}).to_parquet(path, index=False)
        self._write("table", name=name, path=str(path.relative_to(self.dir)), rows=len(table))

    def log_figure(self, name, figure):
        path = self.dir / "figures" / f"{name}.png"
        path.parent.mkdir(exist_ok=True)
        figure.savefig(path, dpi=100, bbox_inches="tight")
        self._write("figure", name=name, path=str(path.relative_to(self.dir)))

    def finish(self, status, summary, error=None):
        if self._file is None:
            return
        self._write("finish", status=status, summary=summary, error=error)
        self._file.close()
        self._file = None
