"""The disk tier: one file per page in a folder, each one row of bytes (kvlab.cache.tiers.rows), written with one
`write` and read back with one `readinto` into a row buffer.

A page file is exactly `row_bytes` long: a missing, shorter or longer file is found out when it is read (`load`
raises TierReadError, a read ahead reports the error from `poll`) and the page is recomputed instead.

Reads ahead (`start_read`) run on one worker thread (`async_reads`, the default; file reads release the GIL) into a
fresh row buffer each, handed back on `poll`; the step never reads a page whose read has not finished (the
scheduler waits for it, kvlab.engine.scheduler). With `async_reads=False` a read ahead is made at once.

The folder holds a marker with the owning process id. A folder with page files from a process that is no
longer running (a killed run) is refused with a clear message, or cleaned when `clean_stale` is set; one in
use by a live process is always refused. `close` (and the engine's `close`, and interpreter exit through a
finalizer) removes every page file, the marker, and the folder when the tier made it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Hashable

import torch

from kvlab.cache.tiers.tier import Fill, Tier, TierReadError

MARKER = "kvlab-tier.pid"
SUFFIX = ".page"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_folder(path: str | None, clean_stale: bool) -> tuple[Path, bool]:
    """(the tier's folder, whether this tier made it): a fresh temporary one when `path` is None."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="kvlab-tier-")), True
    folder = Path(path)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    marker, pages = folder / MARKER, list(folder.glob("*" + SUFFIX))
    owner = int(marker.read_text() or 0) if marker.exists() else None
    if owner is not None and owner != os.getpid() and _alive(owner):
        raise RuntimeError(f"disk tier folder {folder} is in use by process {owner}; give offload_args.path another folder")
    if pages or owner is not None:
        if not clean_stale:
            raise RuntimeError(f"disk tier folder {folder} holds {len(pages)} page file(s) of an earlier run "
                               f"(process {owner}, no longer running); remove them or set offload_args.clean_stale=true")
        warnings.warn(f"disk tier: removing {len(pages)} stale page file(s) from {folder}", RuntimeWarning, stacklevel=3)
        for page in pages:
            page.unlink()
    marker.write_text(str(os.getpid()))
    return folder, made


def _cleanup(folder: Path, made: bool) -> None:
    for page in folder.glob("*" + SUFFIX):
        page.unlink(missing_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    if made:
        shutil.rmtree(folder, ignore_errors=True)


def read_row(file: Path, row_bytes: int) -> tuple[torch.Tensor, float]:
    """One page file into a fresh [1, row_bytes] buffer (one `readinto`), and the seconds it took; TierReadError
    if it is not whole."""
    started = time.perf_counter()
    buf = torch.empty((1, row_bytes), dtype=torch.uint8)
    try:
        with open(file, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            n = f.readinto(memoryview(buf.numpy()).cast("B")) if size == row_bytes else -1
    except OSError as exc:
        raise TierReadError(f"disk tier page file {file} could not be read: {exc}") from exc
    if n != row_bytes:
        raise TierReadError(f"disk tier page file {file} is truncated or resized ({size} bytes, a page is {row_bytes})")
    return buf, time.perf_counter() - started


class DiskTier(Tier):
    """Page files of exactly `row_bytes` bytes in `folder`, at most `capacity` of them; reads ahead on a worker."""

    kind = "disk"

    def __init__(self, capacity: int, row_bytes: int, path: str | None = None, clean_stale: bool = False,
                 async_reads: bool = True):
        super().__init__(capacity, row_bytes)
        self.folder, made = claim_folder(path, clean_stale)
        self.files: dict[Hashable, Path] = {}
        self.staged: dict[Hashable, torch.Tensor] = {}  # read ahead, in memory: [1, row_bytes]
        self.reading: dict[Hashable, Future] = {}  # reads in flight
        self.done: list[tuple[Hashable, str | None]] = []  # finished reads not yet polled
        self.read_s: dict[Hashable, float] = {}  # seconds each finished read took
        self.async_reads = async_reads
        self.worker: ThreadPoolExecutor | None = None
        self._buf = torch.empty((1, row_bytes), dtype=torch.uint8)  # the staging row of `put`
        self._next = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, made)

    def put(self, key: Hashable, write: Fill) -> None:
        if len(self.files) >= self.capacity and key not in self.files:
            raise RuntimeError(f"disk tier full ({self.capacity} pages): the placement must make room first")
        self._next += 1
        file = self.folder / f"{self._next}{SUFFIX}"
        write(self._buf)
        with open(file, "wb", buffering=0) as f:  # through the OS page cache (no fsync: the tier is a cache, not a log)
            f.write(memoryview(self._buf.numpy()).cast("B"))
        self.drop(key)
        self.files[key] = file

    def readable(self, key: Hashable) -> bool:
        file = self.files.get(key)
        return key in self.staged or (file is not None and file.is_file() and file.stat().st_size == self.row_bytes)

    def load(self, key: Hashable, read: Fill) -> None:
        if key in self.reading:  # finish the read ahead first
            wait([self.reading[key]])
            self._collect()
        if key in self.staged:
            buf = self.staged.pop(key)
        else:
            buf, self.read_s[key] = read_row(self.files[key], self.row_bytes)
        read(buf)
        self.files.pop(key).unlink(missing_ok=True)

    def drop(self, key: Hashable) -> None:
        fut = self.reading.pop(key, None)
        if fut is not None:
            fut.cancel()  # a read already running finishes into a buffer nobody keeps
        self.staged.pop(key, None)
        self.read_s.pop(key, None)
        self.done = [(k, e) for k, e in self.done if k != key]
        file = self.files.pop(key, None)
        if file is not None:
            file.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.files)

    # -- reading ahead -----------------------------------------------------------
    def ready(self, key: Hashable) -> bool:
        return key in self.staged

    def start_read(self, key: Hashable) -> None:
        if key in self.staged or key in self.reading or any(k == key for k, _ in self.done):
            return
        if not self.async_reads:
            try:
                self.staged[key], self.read_s[key] = read_row(self.files[key], self.row_bytes)
                self.done.append((key, None))
            except TierReadError as exc:
                self.done.append((key, str(exc)))
            return
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-disk-tier")
        self.reading[key] = self.worker.submit(read_row, self.files[key], self.row_bytes)

    def _collect(self) -> None:
        for key, fut in list(self.reading.items()):
            if fut.done():
                del self.reading[key]
                exc = fut.exception()
                if exc is None:
                    self.staged[key], self.read_s[key] = fut.result()
                self.done.append((key, None if exc is None else str(exc)))

    def read_seconds(self, keys: list[Hashable]) -> float:
        return sum(self.read_s.pop(key, 0.0) for key in keys)

    def poll(self) -> list[tuple[Hashable, str | None]]:
        self._collect()
        done, self.done = self.done, []
        return done

    def wait(self) -> None:
        if self.reading and not self.done:
            wait(list(self.reading.values()), return_when=FIRST_COMPLETED)

    @property
    def in_flight(self) -> int:
        return len(self.reading) + len(self.done)

    def close(self) -> None:
        for fut in self.reading.values():
            fut.cancel()
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        self.reading.clear()
        self.staged.clear()
        self.read_s.clear()
        self.done = []
        self.files.clear()
        self._finalizer()
