"""A run record (run.jsonl) that is not one is refused by name: `kvlab-report` and `load_runs` name the
file and the line, and exit non-zero, instead of a KeyError, a silently dropped column or an ignored line
(issue 21, item 11)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvlab.study.analysis import load_runs
from kvlab.study.experiment import RecordError, find_finished, read_record
from kvlab.study.loggers import LocalLogger
from kvlab.study.report import cli

CONFIG = {"model": {"name": "m"}, "policy": {"name": "full"}, "task": {"_target_": "kvlab.study.tasks.agreement.Agreement"}}


def write_run(folder: Path, metrics: dict | None = None) -> Path:
    log = LocalLogger()
    log.start(folder, "study/job", CONFIG, {"config_hash": "abc"})
    log.log_metrics(metrics or {"agreement/greedy_match": 0.5, "agreement/kl": 0.1})
    log.finish("finished", {"run/elapsed_s": 1.0})
    return folder / "run.jsonl"


def lines(path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def refused(sweep: Path) -> str:
    """kvlab-report on `sweep` must exit with a message (status 1); the message."""
    with pytest.raises(SystemExit) as exit_:
        cli([str(sweep), "--out", str(sweep / "out"), "--wandb", "off"])
    assert isinstance(exit_.value.code, str), exit_.value.code
    return exit_.value.code


def test_a_sound_record_reports(tmp_path):
    write_run(tmp_path / "a")
    report = cli([str(tmp_path), "--out", str(tmp_path / "out"), "--wandb", "off"])
    assert report.board["greedy match"].tolist() == [0.5]


def test_a_record_without_its_start_line_is_named(tmp_path):
    path = write_run(tmp_path / "a")
    path.write_text("".join(lines(path)[1:]))
    message = refused(tmp_path)
    assert f"{path}:1:" in message and "start line" in message


def test_a_metric_that_is_not_a_number_is_named(tmp_path):
    path = write_run(tmp_path / "a", {"agreement/greedy_match": "oops", "agreement/kl": 0.1})
    message = refused(tmp_path)
    assert f"{path}:2:" in message and "'agreement/greedy_match' is 'oops', not a number" in message
    with pytest.raises(RecordError, match="not a number"):
        load_runs(tmp_path)  # the notebook's reader refuses it too


def test_an_appended_garbage_line_is_named(tmp_path):
    path = write_run(tmp_path / "a")
    with path.open("a") as f:
        f.write("garbage\n")
    message = refused(tmp_path)
    assert f"{path}:4:" in message and "not a JSON line" in message and "garbage" in message
    path.write_text("".join(lines(path)[:-1]) + json.dumps({"note": 1}) + "\n")  # JSON, but not an event
    assert f"{path}:4:" in refused(tmp_path)


def test_a_last_line_cut_by_a_crash_is_left_out_with_a_warning(tmp_path, caplog):
    path = write_run(tmp_path / "a")
    with path.open("a") as f:
        f.write('{"event": "metrics", "metr')  # no newline: the write was cut
    with caplog.at_level(logging.WARNING, logger="kvlab"):
        events = read_record(path)
    assert events["finish"]["status"] == "finished" and f"{path}:4" in caplog.text


def test_a_sweep_rerun_treats_a_broken_record_as_not_finished(tmp_path, caplog):
    path = write_run(tmp_path / "a")
    assert find_finished(tmp_path, "abc") == tmp_path / "a"
    with path.open("a") as f:
        f.write("garbage\n")
    with caplog.at_level(logging.WARNING, logger="kvlab"):
        assert find_finished(tmp_path, "abc") is None  # the job runs again (and rewrites its record)
    assert f"{path}:4" in caplog.text
