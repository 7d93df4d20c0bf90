"""The analysis notebook runs end to end: a small sweep, load_runs, the standard plots."""

from __future__ import annotations

import os

from exp_helpers import REPO, needs_data


@needs_data("wikitext-2-raw")
def test_sweep_analysis_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KVLAB_SWEEP_DIR", str(tmp_path / "sweep"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "experiments" / "sweep_analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert (tmp_path / "sweep").is_dir()
    assert os.listdir(tmp_path / "sweep")
