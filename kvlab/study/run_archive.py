"""Run records kept as one compressed archive per study (torch-free).

A committed study keeps its report (Markdown, CSV, JSON, PNG) under `experiments/results/` and the run
folders that back it (each job's `run.jsonl`, tables and Hydra config) in `experiments/results/runs/<study>.tar.gz`,
so the reviewed tree holds no Hydra folder names. `kvlab-report`, `load_runs` and notebooks read an
archive wherever they read a sweep folder:

    python -m kvlab.study.run_archive pack multirun/my_sweep experiments/results/runs/my_sweep.tar.gz
    kvlab-report experiments/results/runs/my_sweep.tar.gz --out experiments/results/my_sweep
"""

from __future__ import annotations

import argparse
import contextlib
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

SUFFIXES = (".tar.gz", ".tgz")


def is_archive(path: str | Path) -> bool:
    return str(path).endswith(SUFFIXES) and Path(path).is_file()


def stem(path: str | Path) -> str:
    """The study's name: `runs/leaderboard.tar.gz` -> `leaderboard`."""
    name = Path(path).name
    return next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)


@contextlib.contextmanager
def opened(source: str | Path) -> Iterator[Path]:
    """A folder of runs: `source` itself, or an archive unpacked into a temporary folder for the block."""
    if not is_archive(source):
        yield Path(source)
        return
    with tempfile.TemporaryDirectory(prefix="kvlab-runs-") as tmp, tarfile.open(source, "r:gz") as tar:
        tar.extractall(tmp, filter="data")  # refuses absolute paths, links out of the folder, devices
        yield Path(tmp) / stem(source)


def pack(folder: str | Path, archive: str | Path) -> Path:
    """Write `folder` (a sweep) into `archive` (.tar.gz) as one top-level folder named after the archive,
    members sorted, owners and times cleared (two packs of the same runs hold the same members)."""
    folder, archive = Path(folder), Path(archive)
    if not folder.is_dir():
        raise FileNotFoundError(f"run_archive: {folder} is not a folder")
    archive.parent.mkdir(parents=True, exist_ok=True)

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=f"{stem(archive)}/{path.relative_to(folder)}", filter=clean)
    return archive


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvlab.study.run_archive", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="a sweep folder -> one .tar.gz")
    pk.add_argument("folder")
    pk.add_argument("archive")
    args = p.parse_args(argv)
    print(f"wrote {pack(args.folder, args.archive)}")


if __name__ == "__main__":
    main()
