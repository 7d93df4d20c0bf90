"""Local records (read back by kvlab.study.analysis), W&B offline runs and their fallbacks."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest

from kvlab.study.analysis import load_runs
from kvlab.study.experiment import read_record
from kvlab.study.loggers import LocalLogger, Loggers, RunLogger
from kvlab.study.loggers.wandb_run import WandbLogger

CONFIG = {"name": "t", "seed": 3, "engine": {"block_size": 8, "allocator": "paged"}, "policy": {"name": "full"}}
META = {"config_hash": "abc", "git_commit": "deadbeef", "versions": {"torch": "x"}}


def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    return fig


def log_one_run(logger: RunLogger, run_dir):
    logger.start(run_dir, "t/run", CONFIG, META)
    logger.log_metrics({"agreement/kl": 0.25, "workload/tokens_per_s": 10.0})
    logger.log_table("cells", pd.DataFrame({"depth": [0.0, 1.0], "accuracy": [1.0, 0.5], "note": ["a", None]}))
    logger.log_figure("plot", figure())
    logger.finish("finished", {"agreement/kl": 0.25, "workload/tokens_per_s": 10.0})


def test_local_record_round_trip(tmp_path):
    log_one_run(LocalLogger(), tmp_path / "run")
    record = read_record(tmp_path / "run" / "run.jsonl")
    assert record["start"]["config"] == CONFIG and record["finish"]["status"] == "finished"
    assert (tmp_path / "run" / "tables" / "cells.parquet").exists()
    assert (tmp_path / "run" / "figures" / "plot.png").exists()
    runs = load_runs(tmp_path)
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["engine.block_size"] == 8 and row["policy.name"] == "full" and row["agreement/kl"] == 0.25
    assert row["meta.git_commit"] == "deadbeef" and row["status"] == "finished" and row["source"] == "local"


def test_offline_wandb_files_are_not_parsed_by_hand(tmp_path):
    """W&B's own files are read through the W&B API only; local analysis reads the local records
    that every kvlab run writes (kvlab.study.experiment always adds a LocalLogger)."""
    log_one_run(WandbLogger(mode="offline", project="kvlab-test"), tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert load_runs(tmp_path).empty


def test_local_and_wandb_records_of_one_run_make_one_row(tmp_path):
    log_one_run(Loggers([LocalLogger(), WandbLogger(mode="offline", project="kvlab-test")]), tmp_path / "run")
    runs = load_runs(tmp_path)
    assert len(runs) == 1 and runs.iloc[0]["source"] == "local"


def test_unreachable_wandb_server_falls_back_to_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    logger = WandbLogger(mode="online", project="kvlab-test", init_timeout_s=5)
    with pytest.warns(RuntimeWarning, match="unreachable; logging this run offline"):
        logger.start(tmp_path, "t", CONFIG, META)
    assert logger.run is not None and logger.run.settings.mode == "offline"
    logger.finish("finished", {"x": 1.0})
    assert list((tmp_path / "wandb").glob("offline-run-*"))


class Broken(RunLogger):
    def start(self, run_dir, name, config, meta):
        pass

    def log_metrics(self, metrics, step=None):
        raise ConnectionError("server went away")

    def log_table(self, name, table):
        raise AssertionError("a disabled logger was called")

    log_figure = log_table

    def finish(self, status, summary, error=None):
        self.finished = status


def test_a_failing_logger_warns_and_never_kills_the_run(tmp_path):
    broken = Broken()
    loggers = Loggers([broken, LocalLogger()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_one_run(loggers, tmp_path)
    assert any("server went away" in str(w.message) for w in caught)
    assert broken.finished == "failed"  # closed when dropped
    assert read_record(tmp_path / "run.jsonl")["finish"]["status"] == "finished"
