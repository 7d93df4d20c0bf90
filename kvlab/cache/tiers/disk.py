"""The disk tier: one file per page in a folder, each one row of bytes (kvlab.cache.tiers.rows), written with one
`write` and read back with one `readinto` into a row buffer.

A page file is exactly `row_bytes` long: a missing, shorter or longer file is found out when it is read (`load`
raises TierReadError, a read ahead reports the error from `poll`) and the page is recomputed instead.

Reads ahead (`start_read`) run on one worker thread (`async_reads`, the default; file reads release the GIL) into a
fresh row buffer each, handed back on `poll`; the step never reads a page whose read has not finished (the
scheduler waits for it, kvlab.engine.scheduler). With `async_reads=False` a read ahead is made at once.

Writes are write-behind (`async_writes`, the default): `put` copies the page into a fresh row buffer on the step's
thread (the pool page is reused at once) and hands the file write to a second worker thread, so a demotion costs
the returning request one row copy, not a file write. A page being written is in the tier ("in flight"): it is
counted, findable and *ready* - a hit on it is served from the row buffer the write still holds, which is the
page's bytes (nothing writes into it once filled), so a hit never waits for a write. A `load` or `drop` of such a
page cancels its write if it has not started, else queues the file's removal behind it on the same worker (one
worker, first in first out: the removal runs after the write). Finished writes let go of their buffers when the
tier next looks (`poll`, `put`); a page file no longer wanted (restored, dropped) is removed on the same worker
too, so a restore does not wait for the file system to free its blocks. At most `max_pending_bytes` of buffers
are held (a `put` beyond that waits for the oldest write). A write that failed (a full disk) leaves no file: the
page's later read fails and it is recomputed with a warning, as for a file deleted after its write. With `async_writes=False` a `put` writes at
once. `flush()` waits for every write in flight. `drop_cached()` makes the next reads cold: every write
finished, the page files synced to the device and dropped from the OS page cache (`posix_fadvise` DONTNEED), the
reads ahead already taken forgotten: what a restore meets when its history was written long ago.

The folder holds a marker with the owning process id. A folder with page files from a process that is no
longer running (a killed run) is refused with a clear message, or cleaned when `clean_stale` is set; one in
use by a live process is always refused. `close` (and the engine's `close`, and interpreter exit through a
finalizer) removes every page file, the marker, and the folder when the tier made it.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
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


def write_row(file: Path, buf: torch.Tensor) -> None:
    """One row into `file` with one `write`, through the OS page cache (no fsync: the tier is a cache, not a log);
    a partial file is removed if the write fails."""
    try:
        with open(file, "wb", buffering=0) as f:
            f.write(memoryview(buf.numpy()).cast("B"))
    except BaseException:
        file.unlink(missing_ok=True)
        raise


def _on_thread(fn, sink: deque, *args, **kwargs):
    """`fn(*args, **kwargs)` with the CPU seconds it took on this thread (user and system) appended to `sink`."""
    started = time.thread_time()
    try:
        return fn(*args, **kwargs)
    finally:
        sink.append(time.thread_time() - started)


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


def _read_until(file: Path, row_bytes: int) -> tuple[torch.Tensor, float]:
    """`read_row` on the worker: the row and the moment (perf_counter, one clock for every thread) it was read."""
    buf, _ = read_row(file, row_bytes)
    return buf, time.perf_counter()


class DiskTier(Tier):
    """Page files of exactly `row_bytes` bytes in `folder`, at most `capacity` of them; reads ahead on a worker."""

    kind = "disk"

    def __init__(self, capacity: int, row_bytes: int, path: str | None = None, clean_stale: bool = False,
                 async_reads: bool = True, async_writes: bool = True, max_pending_bytes: int = 64 << 20):
        super().__init__(capacity, row_bytes)
        self.folder, made = claim_folder(path, clean_stale)
        self.files: dict[Hashable, Path] = {}
        self.staged: dict[Hashable, torch.Tensor] = {}  # read ahead, in memory: [1, row_bytes]
        self.reading: dict[Hashable, Future] = {}  # reads in flight
        self.started: dict[Hashable, float] = {}  # when each read in flight was started (perf_counter)
        self.done: list[tuple[Hashable, str | None]] = []  # finished reads not yet polled
        self.read_s: dict[Hashable, tuple[float, float]] = {}  # finished reads ahead: (started, finished)
        self.writing: dict[Hashable, tuple[Future, torch.Tensor]] = {}  # writes in flight: the write, its row
        self.async_reads, self.async_writes = async_reads, async_writes
        self.max_pending = max(1, max_pending_bytes // max(row_bytes, 1))  # rows of writes in flight at most
        self.worker: ThreadPoolExecutor | None = None  # reads
        self.writer: ThreadPoolExecutor | None = None  # writes, and the removal of files whose write was in flight
        self.write_errors = 0  # writes that failed (their pages are recomputed when read)
        self.write_cpu: deque = deque(maxlen=64)  # CPU seconds of the last writes behind, on the writer thread
        self.remove_cpu: deque = deque(maxlen=64)  # ... of the last page files' removals (wherever they ran)
        self._buf = torch.empty((1, row_bytes), dtype=torch.uint8)  # the staging row of a synchronous `put`
        self._next = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, made)

    def put(self, key: Hashable, write: Fill) -> None:
        if len(self.files) >= self.capacity and key not in self.files:
            raise RuntimeError(f"disk tier full ({self.capacity} pages): the placement must make room first")
        self._next += 1
        file = self.folder / f"{self._next}{SUFFIX}"
        if not self.async_writes:
            write(self._buf)
            write_row(file, self._buf)
            self.drop(key)
            self.files[key] = file
            return
        buf = torch.empty((1, self.row_bytes), dtype=torch.uint8)
        write(buf)
        self._reap()
        while len(self.writing) >= self.max_pending:  # bounded memory: wait for the oldest write
            wait([next(iter(self.writing.values()))[0]])
            self._reap()
        self.drop(key)
        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-disk-tier-write")
        self.writing[key] = (self.writer.submit(_on_thread, write_row, self.write_cpu, file, buf), buf)
        self.files[key] = file

    def _reap(self) -> None:
        """Let go of the rows of finished writes (a failed one leaves no file: its page is recomputed when read)."""
        for key, (fut, _) in list(self.writing.items()):
            if fut.done():
                del self.writing[key]
                if fut.exception() is not None:
                    self.write_errors += 1

    def flush(self) -> None:
        """Wait until every write in flight is on disk (or failed), and every removal queued behind is done."""
        if self.writing:
            wait([fut for fut, _ in self.writing.values()])
        if self.writer is not None:
            self.writer.submit(int).result()  # one worker, in order: what was queued before it has run
        self._reap()

    def behind_seconds(self) -> float:
        """CPU seconds the tier spends on a page off the step's thread: the median of its last file writes behind
        (0 when it writes inline: the step's `put` holds the write) plus the median of its last file removals
        (behind, or at once where `drop` is not timed by the caller). On cores with none free, as on a shared
        machine, the step loses this time too; a removal of a file synced to the device frees its blocks (ms)."""
        def med(values) -> float:
            v = sorted(values)
            return v[len(v) // 2] if v else 0.0
        return (med(self.write_cpu) if self.async_writes else 0.0) + med(self.remove_cpu)

    def drop_cached(self, keys: list[Hashable] | None = None) -> int:
        """Make the next reads of `keys` (default: every page) cold reads from the device: their writes finished,
        the files synced and dropped from the OS page cache, reads ahead already in memory forgotten (read again
        when next needed). How many files were dropped; 0 where the OS cannot (no `posix_fadvise`)."""
        self.flush()
        keys = list(self.files) if keys is None else [k for k in keys if k in self.files]
        unpolled = set(self.reading) | {k for k, _ in self.done}  # their reads stay as they are
        keys = [k for k in keys if k not in unpolled]
        for key in keys:
            self.staged.pop(key, None)
            self.read_s.pop(key, None)
        if not hasattr(os, "posix_fadvise"):
            return 0
        for key in keys:
            fd = os.open(self.files[key], os.O_RDONLY)
            try:
                os.fdatasync(fd)  # a dirty page is not dropped: written back first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return len(keys)

    def _forget_write(self, key: Hashable) -> None:
        """`key`'s write in flight is no longer wanted: cancelled, or its file removed once it is written."""
        fut, _ = self.writing.pop(key)
        file = self.files.get(key)
        if not fut.cancel() and file is not None:  # runs after the write (one worker, in order)
            self.writer.submit(_on_thread, file.unlink, self.remove_cpu, missing_ok=True)
        if file is not None:
            del self.files[key]

    def load(self, key: Hashable, read: Fill) -> None:
        if key in self.writing:  # still being written: its row is in memory
            read(self.writing[key][1])
            self._forget_write(key)
            self.staged.pop(key, None)
            return
        if key in self.reading:  # finish the read ahead first
            wait([self.reading[key]])
            self._collect()
        if key in self.staged:
            buf = self.staged.pop(key)
        else:  # a read now, inside the caller's timing
            buf, _ = read_row(self.files[key], self.row_bytes)
        read(buf)
        self._remove(self.files.pop(key))

    def _remove(self, file: Path) -> None:
        """Remove a page file no longer wanted: behind, on the writer worker, when the tier writes behind (a file
        written long ago is synced to the device, and its removal frees its blocks: ~4 ms measured here, which a
        restore would otherwise pay inline), else at once."""
        if not self.async_writes:
            _on_thread(file.unlink, self.remove_cpu, missing_ok=True)
            return
        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-disk-tier-write")
        try:
            self.writer.submit(_on_thread, file.unlink, self.remove_cpu, missing_ok=True)
        except RuntimeError:  # the worker was shut down: at once
            file.unlink(missing_ok=True)

    def drop(self, key: Hashable) -> None:
        fut = self.reading.pop(key, None)
        if fut is not None:
            fut.cancel()  # a read already running finishes into a buffer nobody keeps
        self.started.pop(key, None)
        self.staged.pop(key, None)
        self.read_s.pop(key, None)
        self.done = [(k, e) for k, e in self.done if k != key]
        if key in self.writing:
            self._forget_write(key)
        file = self.files.pop(key, None)
        if file is not None:
            self._remove(file)

    def __len__(self) -> int:
        return len(self.files)

    # -- reading ahead -----------------------------------------------------------
    def ready(self, key: Hashable) -> bool:
        if key in self.writing and key not in self.staged:  # a hit on a page being written: its row stays in
            self.staged[key] = self.writing[key][1]  # memory until loaded, even once the write has finished
        return key in self.staged

    def start_read(self, key: Hashable) -> None:
        if key in self.staged or key in self.reading or key in self.writing or any(k == key for k, _ in self.done):
            return
        started = time.perf_counter()
        if not self.async_reads:
            try:
                self.staged[key], _ = read_row(self.files[key], self.row_bytes)
                self.read_s[key] = (started, time.perf_counter())
                self.done.append((key, None))
            except TierReadError as exc:
                self.done.append((key, str(exc)))
            return
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-disk-tier")
        self.started[key] = started
        self.reading[key] = self.worker.submit(_read_until, self.files[key], self.row_bytes)

    def _collect(self) -> None:
        for key, fut in list(self.reading.items()):
            if fut.done():
                del self.reading[key]
                started = self.started.pop(key, 0.0)
                exc = fut.exception()
                if exc is None:
                    self.staged[key], finished = fut.result()
                    self.read_s[key] = (started, finished)
                self.done.append((key, None if exc is None else str(exc)))

    def read_seconds(self, keys: list[Hashable]) -> float:
        """Wall seconds the reads ahead of `keys` took: from the first one's start to the last one's end on the
        worker (the round trip and the queue included), forgotten once told."""
        spans = [self.read_s.pop(key) for key in keys if key in self.read_s]
        return max(e for _, e in spans) - min(b for b, _ in spans) if spans else 0.0

    def poll(self) -> list[tuple[Hashable, str | None]]:
        self._collect()
        self._reap()
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
        for fut, _ in self.writing.values():
            fut.cancel()
        for pool in (self.worker, self.writer):
            if pool is not None:
                pool.shutdown(wait=True)  # a write already running finishes; _cleanup then removes its file
        self.worker = self.writer = None
        self.writing.clear()
        self.started.clear()
        self.reading.clear()
        self.staged.clear()
        self.read_s.clear()
        self.done = []
        self.files.clear()
        self._finalizer()
