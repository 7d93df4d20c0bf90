"""The analysis notebook runs end to end: a small sweep, load_runs, the standard plots — and shows the right tables."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from exp_helpers import REPO, needs_data

pytestmark = pytest.mark.process  # another Python process: in the default suite, out of `make test-unit`


class _Rows(HTMLParser):
    """Body rows of a pandas HTML table: [index cells + value cells] as text."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_body = self._in_cell = False

    def handle_starttag(self, tag, attrs):
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append([])
        elif tag in ("td", "th") and self._in_body:
            self._in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in_cell = False
        elif tag == "tbody":
            self._in_body = False

    def handle_data(self, data):
        if self._in_cell:
            self.rows[-1][-1] += data.strip()


def shown(cell) -> dict:
    """The execute_result of a code cell (what the notebook displays), as {mime: data}."""
    [result] = [o for o in cell.outputs if o.output_type == "execute_result"]
    return result.data


def html_rows(cell) -> list[list[str]]:
    parser = _Rows()
    parser.feed(shown(cell)["text/html"])
    return parser.rows


@needs_data("wikitext-2-raw")
def test_sweep_analysis_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KVLAB_SWEEP_DIR", str(tmp_path / "sweep"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "experiments" / "sweep_analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = {c.source.strip().splitlines()[0]: c for c in nb.cells if c.cell_type == "code" and c.source.strip()}
    assert not [o for c in code.values() for o in c.outputs if o.output_type == "error"]

    # the sweep wrote four jobs (allocator x quant), each with its own run record
    assert len(list((tmp_path / "sweep").rglob("run.jsonl"))) == 4

    # one row per run, sorted by allocator then cache format, every one finished
    runs = html_rows(code["runs = load_runs(SWEEP_DIR)"])
    assert [row[1:4] for row in runs] == [["contiguous", "auto", "finished"], ["contiguous", "bf16", "finished"],
                                          ["paged", "auto", "finished"], ["paged", "bf16", "finished"]]
    greedy_match, kl = [[float(row[i]) for row in runs] for i in (4, 5)]
    assert kl[0] == kl[2] == 0 and kl[1] > 0 and kl[3] > 0  # a full-precision cache is the reference itself
    assert all(0 < g <= 1 for g in greedy_match)

    # the quality table: one row per cache format, KL 0 for auto only; the request table: one row per run
    quality = html_rows(code["quality = runs.groupby(\"quant.name\")[[\"agreement/greedy_match\", "
                             "\"agreement/top1_match\", \"agreement/kl\"]].mean()"])
    assert [row[0] for row in quality] == ["auto", "bf16"]
    assert float(quality[0][3]) == 0 and float(quality[1][3]) > 0
    latency = html_rows(code["requests = load_tables(runs, \"workload_requests\", columns=[\"engine.allocator\", "
                             "\"quant.name\"])"])
    assert len(latency) == 4 and all(float(v) > 0 for row in latency for v in row[-2:])
