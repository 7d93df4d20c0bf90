"""kvlab-report on a real tiny sweep: the leaderboard table, the Pareto plots, the Markdown and one
self-contained HTML page (parsed: the table's rows, every image inlined, no external URL)."""

from __future__ import annotations

import base64
import subprocess
import sys
import tarfile
from html.parser import HTMLParser

import pandas as pd
import pytest
from exp_helpers import DATA, REPO, kvlab_cmd, run_env

from kvlab.study.analysis import leaderboard, load_runs, markdown_table, pareto_front
from kvlab.study.report import write_report
from kvlab.study.run_archive import pack

# 3 jobs, seconds each: full and two compressing policies at ratio 0.5 on prompts long enough to evict,
# with a shared-prefix workload so the KV-bytes / tokens / tokens/s / TTFT / bytes-freed columns are measured
SWEEP = ["-m", "model=random-llama-tiny", "task=agreement", "task.num_prompts=2", "task.prompt_length=160",
         "task.max_new_tokens=4", "workload=shared-prefix", "workload.num_requests=4", "workload.prefix_length=96",
         "workload.suffix_length=64", "workload.max_tokens=4", "engine.kv_cache_memory=4MiB", "progress=false",
         "logger=none", "policy=full,snapkv,streaming_llm", "policy.compression_ratio=0.5", "policy.when=prefill"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    if not (DATA / "wikitext-2-raw").exists():
        pytest.skip(f"shared data not found at {DATA / 'wikitext-2-raw'} (see ../shared/data/README.md)")
    root = tmp_path_factory.mktemp("report")
    out = subprocess.run(kvlab_cmd(*SWEEP, f"hydra.sweep.dir={root / 'sweep'}"), cwd=root, env=run_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root / "sweep"


class Page(HTMLParser):
    """Collects a page's table cells (per row), <img> sources and every URL-bearing attribute."""

    def __init__(self):
        super().__init__()
        self.rows, self.images, self.urls, self._cell = [], [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(attrs.get("src", ""))
        for key in ("src", "href", "action", "data"):
            if attrs.get(key):
                self.urls.append(attrs[key])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(self._cell.strip())
            self._cell = None


def test_leaderboard_has_kvpress_columns_and_the_costs(sweep):
    board = leaderboard(load_runs(sweep))
    assert list(board[["method", "compression ratio"]].itertuples(index=False, name=None)) == [
        ("full", 0.0), ("snapkv", 0.5), ("streaming_llm", 0.5)]
    assert list(board.columns[:4]) == ["dataset", "model", "method", "compression ratio"]
    assert (board["dataset"] == "agreement (wikitext-2-raw)").all() and (board["model"] == "random:llama-tiny").all()
    full, snap, stream = board.to_dict("records")
    assert full["greedy match"] == 1.0 and full["KL to full cache"] == 0.0
    assert snap["KL to full cache"] > 0 and stream["KL to full cache"] > 0  # half the prompt evicted
    held = "KV MiB held (mean)"
    assert snap[held] < full[held] and stream[held] < full[held]  # evicted pages went back to the pool
    assert snap["KV MiB freed"] > 0 and stream["KV MiB freed"] > 0
    tokens = "KV tokens held (mean)"
    assert snap[tokens] < full[tokens] and stream[tokens] < full[tokens]
    assert not [c for c in board.columns if "page" in c or "block" in c]  # a page's size depends on the grouping
    assert (board["tokens/s"] > 0).all() and (board["TTFT median (s)"] > 0).all()


def test_kvlab_report_writes_table_plots_and_a_self_contained_page(sweep, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvlab.study.report", str(sweep), "--out", str(tmp_path)],
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    board = pd.read_csv(tmp_path / "leaderboard.csv")
    assert list(board["method"]) == ["full", "snapkv", "streaming_llm"]
    md = (tmp_path / "leaderboard.md").read_text()
    assert f"Command: `kvlab-report {sweep} --out {tmp_path}`" in md
    assert md.count("\n| agreement (wikitext-2-raw) | random:llama-tiny |") == 3
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["pareto_kv_bytes.png", "pareto_throughput.png"]
    assert all(f"]({name})" in md for name in pngs)
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    page = Page()
    page.feed((tmp_path / "leaderboard.html").read_text())
    header, *rows = page.rows
    assert header[:4] == ["dataset", "model", "method", "compression ratio"] and "KV MiB held (mean)" in header
    assert [row[header.index("method")] for row in rows] == ["full", "snapkv", "streaming_llm"]
    assert len(page.images) == 2
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    assert not [u for u in page.urls if not u.startswith("data:")]  # nothing to fetch: opens offline
    assert "http://" not in (tmp_path / "leaderboard.html").read_text().replace("http://www.w3.org", "")


def test_kvlab_report_refuses_a_folder_without_runs_and_an_unknown_quality(sweep, tmp_path):
    empty = subprocess.run([sys.executable, "-m", "kvlab.study.report", str(tmp_path)], env=run_env(),
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode != 0 and f"no finished run under {tmp_path}" in empty.stderr
    bad = subprocess.run([sys.executable, "-m", "kvlab.study.report", str(sweep), "--out", str(tmp_path),
                          "--quality", "accuracy"], env=run_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--quality 'accuracy' is not a leaderboard column" in bad.stderr
    assert "greedy match" in bad.stderr


def test_a_sweep_packed_into_an_archive_reads_and_reports_as_its_folder(sweep, tmp_path):
    archive = pack(sweep, tmp_path / "runs" / "tiny_sweep.tar.gz")
    members = tarfile.open(archive).getnames()
    assert members and all(m.startswith("tiny_sweep/") for m in members)
    folder, packed = load_runs(sweep), load_runs(archive)
    assert len(packed) == len(folder) == 3
    assert all(d.startswith(f"{archive}:") for d in packed["run_dir"])
    pd.testing.assert_frame_equal(packed.drop(columns="run_dir"), folder.drop(columns="run_dir"))
    report = write_report(archive, command="kvlab-report archive")
    assert report.files["csv"] == tmp_path / "runs" / "tiny_sweep" / "leaderboard.csv"  # beside the archive
    pd.testing.assert_frame_equal(pd.read_csv(report.files["csv"]), leaderboard(folder).reset_index(drop=True),
                                  check_dtype=False)


def test_committed_results_hold_reports_not_run_folders_or_generated_pages():
    """experiments/results/ is reviewed in diffs: run records go into runs/<study>.tar.gz, HTML is generated."""
    tracked = subprocess.run(["git", "ls-files", "experiments/results"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0 or not tracked.stdout:
        pytest.skip("not a git checkout")
    paths = tracked.stdout.split()
    assert not [p for p in paths if p.endswith(".html")]
    assert not [p for p in paths if p.endswith("run.jsonl") or "/.hydra/" in p]  # a sweep folder committed as is
    assert max(len(p) for p in paths) <= 100, max(paths, key=len)


def test_pareto_front_keeps_the_undominated_rows():
    df = pd.DataFrame({"cost": [1.0, 2.0, 3.0, 2.0, None], "quality": [0.5, 0.9, 0.9, 0.4, 1.0]})
    # (1, .5) cheapest; (2, .9) best per cost; (3, .9) dominated by (2, .9); (2, .4) by (1, .5); None: not measured
    assert list(pareto_front(df, "cost", "quality")) == [True, True, False, False, False]
    assert list(pareto_front(df, "cost", "quality", x_better="max")) == [False, False, True, False, False]


def test_repeated_runs_of_a_cell_give_their_median():
    """Timing repeats (the leaderboard's throughput sweep rerun with another seed) land in one row as the
    median, so one slow run on a noisy machine does not move the cell; other cells stay apart."""
    runs = pd.DataFrame({"policy.name": ["snapkv"] * 3 + ["full"], "model.name": ["m"] * 4,
                         "policy.compression_ratio": [0.5, 0.5, 0.5, 0.0], "seed": [0, 1, 2, 0],
                         "workload/tokens_per_s": [5.0, 6.0, 60.0, 7.0],
                         "workload/kv_bytes_mean": [2.0**20] * 3 + [2.0**21]})
    board = leaderboard(runs)
    assert list(board["method"]) == ["full", "snapkv"]
    assert board["tokens/s"].tolist() == [7.0, 6.0]        # the mean would be 23.7
    assert board["KV MiB held (mean)"].tolist() == [2.0, 1.0]


def test_markdown_table_formats_and_escapes():
    text = markdown_table(pd.DataFrame({"a": ["x|y", None], "b": [1.234567, float("nan")]}))
    assert text.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 1.235 |", "|  |  |"]


def test_kvlab_report_logs_a_wandb_table(sweep, tmp_path):
    import json

    out = subprocess.run([sys.executable, "-m", "kvlab.study.report", str(sweep), "--out", str(tmp_path), "--wandb", "on"],
                         env=run_env(WANDB_MODE="offline"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "logged the leaderboard to W&B (offline)" in out.stdout
    [table] = tmp_path.glob("wandb/offline-run-*/files/media/table/leaderboard_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:3] == ["dataset", "model", "method"]
    assert [row[2] for row in data["data"]] == ["full", "snapkv", "streaming_llm"]
    assert len(list(tmp_path.glob("wandb/offline-run-*/files/media/images/pareto/*.png"))) == 2


def test_wandb_is_on_when_the_sweeps_runs_logged_to_it():
    from kvlab.study.report import wandb_target

    logged = pd.DataFrame({"logger._target_": ["kvlab.study.loggers.wandb_run.WandbLogger"], "logger.project": ["p"],
                           "logger.entity": [None], "logger.group": ["smoke"], "logger.mode": ["offline"]})
    assert wandb_target(logged) == {"project": "p", "entity": None, "group": "smoke", "mode": "offline"}
    assert wandb_target(logged.assign(**{"logger.mode": "disabled"})) is None
    assert wandb_target(pd.DataFrame({"logger": [None]})) is None  # logger=none


def test_a_study_of_one_sweep_per_task_merges_into_one_row_per_policy_and_ratio(tmp_path):
    """experiments/leaderboard.sh runs one sweep per task into one folder; the report puts each task's columns
    side by side for a (method, ratio), plots each score against the costs, and refuses to merge cells that
    two datasets measured twice."""
    from kvlab.study.analysis import merge_tasks
    from kvlab.study.report import write_report

    cells = [("agreement (wikitext-2-raw)", "greedy match", 0.5), ("perplexity (wikitext-2-raw)", "perplexity", 20.0),
             ("ruler", "RULER score", 0.25), ("none", "KV MiB held (mean)", 90.0), ("none", "tokens/s", 5.0)]
    rows = []
    for method, ratio, shift in (("full", 0.0, 0.0), ("snapkv", 0.5, 1.0)):
        for dataset, column, value in cells:
            rows.append({"dataset": dataset, "model": "m", "method": method, "compression ratio": ratio,
                         column: value - shift if column != "perplexity" else value + shift})
    board = pd.DataFrame(rows).groupby(["dataset", "model", "method", "compression ratio"], sort=False).first().reset_index()
    merged = merge_tasks(board)
    assert list(merged["method"]) == ["full", "snapkv"]
    assert merged.loc[1, ["greedy match", "perplexity", "RULER score", "KV MiB held (mean)", "tokens/s"]].tolist() == \
        [-0.5, 21.0, -0.75, 89.0, 4.0]
    twice = pd.concat([board, board.iloc[[0]].assign(dataset="agreement (other)")])
    assert merge_tasks(twice) is None                   # two datasets measured greedy match: no merge
    assert merge_tasks(board[board["dataset"] == "ruler"]) is None  # one dataset: nothing to merge
    # the real report: a sweep of a task and a workload-only sweep into one folder
    if not (DATA / "wikitext-2-raw").exists():
        pytest.skip(f"shared data not found at {DATA / 'wikitext-2-raw'} (see ../shared/data/README.md)")
    sweep = tmp_path / "study"
    common = ["-m", "model=random-llama-tiny", "engine.kv_cache_memory=4MiB", "progress=false", "logger=none",
              "policy=full,snapkv", "policy.compression_ratio=0.5", "policy.when=prefill", f"hydra.sweep.dir={sweep}"]
    for extra in (["task=perplexity", "task.context_lengths=[64]", "task.num_windows=2", "workload=none"],
                  ["task=none", "workload=shared-prefix", "workload.num_requests=2", "workload.prefix_length=48",
                   "workload.suffix_length=32", "workload.max_tokens=2"]):
        out = subprocess.run(kvlab_cmd(*common, *extra), cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = write_report(sweep, tmp_path / "out")
    assert list(report.merged["method"]) == ["full", "snapkv"] and report.merged["perplexity"].notna().all()
    assert report.merged["tokens/s"].notna().all()
    assert (tmp_path / "out" / "pareto_kv_bytes_perplexity.png").exists()
    assert "One row per policy and ratio" in (tmp_path / "out" / "leaderboard.md").read_text()


def test_a_mixed_studys_unset_wandb_settings_read_back_as_none():
    """A W&B sweep beside logger=none sweeps in one folder (experiments/lm_eval_leaderboard.sh with THROUGHPUT=1):
    the runs' table reads the W&B runs' unset entity back as NaN, which wandb.init refused (issue 26)."""
    from kvlab.study.report import wandb_target

    runs = pd.DataFrame([{"logger": None},  # an lm-eval job, logger=none: no logger.* keys at all
                         {"logger._target_": "kvlab.study.loggers.wandb_run.WandbLogger", "logger.project": "kvlab",
                          "logger.entity": None, "logger.group": "study", "logger.mode": "offline"}])
    assert runs["logger.entity"].isna().all()  # NaN, not None, once a run lacks the key
    assert wandb_target(runs) == {"project": "kvlab", "entity": None, "group": "study", "mode": "offline"}
    assert wandb_target(runs.drop(columns=["logger.group", "logger.project"]))["group"] is None


@pytest.mark.heavy  # ~15 s on quiet cores, 90 s at load 12; the fast test above guards the same NaN
def test_kvlab_report_logs_an_offline_table_for_a_study_mixing_wandb_and_no_logger(sweep, tmp_path):
    """The tiny sweep (logger=none) plus one random:llama-tiny job that logged to W&B offline, in one folder:
    `kvlab-report` (W&B on automatically, the study's entity unset) writes its files and the offline table."""
    import json
    import shutil

    study = tmp_path / "study"
    shutil.copytree(sweep, study)
    out = subprocess.run(kvlab_cmd("-m", "model=random-llama-tiny", "task=none", "workload=shared-prefix",
                                   "workload.num_requests=2", "workload.prefix_length=48", "workload.suffix_length=32",
                                   "workload.max_tokens=2", "engine.kv_cache_memory=4MiB", "progress=false",
                                   "logger=wandb", "logger.mode=offline", "policy=full", f"hydra.sweep.dir={study}"),
                         cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = tmp_path / "report"
    out = subprocess.run([sys.executable, "-m", "kvlab.study.report", str(study), "--out", str(report)],
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "logged the leaderboard to W&B (offline)" in out.stdout
    assert {"leaderboard.md", "leaderboard.csv", "leaderboard.html"} <= {p.name for p in report.iterdir()}
    [table] = report.glob("wandb/offline-run-*/files/media/table/leaderboard_*.table.json")
    assert "none" in [row[0] for row in json.loads(table.read_text())["data"]]  # the W&B job's row (dataset none)


def lm_eval_run(tasks: tuple, limit: float, method: str, ratio: float, **metrics: float) -> dict:
    """A finished lm-eval run's row as load_runs gives it (task=lm_eval, one task list and limit)."""
    return {"status": "finished", "policy.name": method, "model.name": "m", "policy.compression_ratio": ratio,
            "task._target_": "kvlab.study.tasks.lm_eval.LmEval", "task.tasks": tasks, "task.limit": limit,
            **{f"lm_eval/{k.replace('__', '/')}": v for k, v in metrics.items()}}


def test_lm_eval_sweeps_of_different_task_lists_merge_per_policy_and_ratio():
    """Each TASKS value of experiments/lm_eval_leaderboard.sh is a job set of its own (task.tasks is in the config
    hash); the leaderboard puts their columns in one row per (policy, ratio), each column from its own run."""
    runs = pd.DataFrame([
        lm_eval_run(("kvlab_niah",), 10, "full", 0.0, kvlab_niah__acc=1.0),
        lm_eval_run(("kvlab_niah",), 10, "snapkv", 0.5, kvlab_niah__acc=0.2),
        lm_eval_run(("kvlab_ruler",), 5, "full", 0.0, kvlab_ruler__score=0.9),
        lm_eval_run(("kvlab_ruler",), 5, "snapkv", 0.5, kvlab_ruler__score=0.4),
        lm_eval_run(("kvlab_wikitext2",), 3, "snapkv", 0.5, kvlab_wikitext2__word_perplexity=40.0)])
    board = leaderboard(runs)
    assert list(board["method"]) == ["full", "snapkv"]
    assert board[["lm-eval kvlab_niah/acc", "lm-eval kvlab_ruler/score"]].values.tolist() == [[1.0, 0.9], [0.2, 0.4]]
    assert board["lm-eval kvlab_wikitext2/word_perplexity"].tolist()[1] == 40.0


def test_one_column_measured_under_two_task_settings_is_refused():
    """Two samples of one task in one study (kvlab_niah on 10 and on 100 documents) have no single value: the
    leaderboard names the cell instead of reporting their median; repeats of one setting still give a median."""
    runs = pd.DataFrame([lm_eval_run(("kvlab_niah",), 10, "snapkv", 0.5, kvlab_niah__acc=0.2),
                         lm_eval_run(("kvlab_niah",), 100, "snapkv", 0.5, kvlab_niah__acc=0.6)])
    with pytest.raises(ValueError, match="kvlab_niah/acc.*snapkv.*different task settings"):
        leaderboard(runs)
    repeats = pd.concat([runs.iloc[[0]]] * 3, ignore_index=True)
    repeats["lm_eval/kvlab_niah/acc"] = [0.2, 0.3, 0.9]
    assert leaderboard(repeats)["lm-eval kvlab_niah/acc"].tolist() == [0.3]
