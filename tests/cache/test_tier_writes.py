"""Writes behind on the disk tier (kvlab/cache/tiers/disk.py, docs/design.md "Tiers below the pool").

A demotion hands its file write to a worker: the page is in the tier at once (counted, findable, ready), a hit
on it before the write lands is served from the row the write holds, bit for bit; a page loaded or dropped while
its write is in flight leaves no file; a failed write is recomputed with a warning; `close` with writes in
flight removes every file. Writes are held in flight here by a gate on the worker's write (no timing).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvlab.cache.tiers.disk as disk
from kvlab import LLM
from kvlab.cache.tiers.disk import DiskTier

ROW = 256


@pytest.fixture
def gate(monkeypatch):
    """Writes on the worker wait until `gate.set()` (at most 10 s: a test that forgets cannot hang)."""
    opened, opened.entered = threading.Event(), threading.Event()  # entered: a write is running, held
    real = disk.write_row

    def gated(file, buf):
        opened.entered.set()
        opened.wait(10)
        real(file, buf)

    monkeypatch.setattr(disk, "write_row", gated)
    yield opened
    opened.set()


def row(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_page_being_written_is_held_ready_and_read_from_its_row(tmp_path, gate):
    tier = DiskTier(4, ROW, str(tmp_path / "t"))
    want = row(1)
    tier.put("a", lambda r: r.copy_(want))
    assert len(tier) == 1 and "a" in tier.writing and not list(tier.folder.glob("*.page"))  # not on disk yet
    assert tier.ready("a")  # a hit does not wait for the write
    got = torch.empty_like(want)
    tier.load("a", got.copy_)
    assert torch.equal(got, want) and len(tier) == 0
    gate.set()
    tier.flush()
    tier.writer.shutdown(wait=True)  # the removal queued behind the write has run
    assert not list(tier.folder.glob("*.page"))  # loaded while in flight: no file left behind
    tier.close()


def test_a_page_dropped_while_its_write_is_in_flight_leaves_no_file(tmp_path, gate):
    tier = DiskTier(4, ROW, str(tmp_path / "t"))
    for i, key in enumerate("abcd"):
        tier.put(key, lambda r, i=i: r.copy_(row(i)))
    assert gate.entered.wait(10)  # a's write is running: it cannot be cancelled, its file goes after it
    tier.drop("a")
    tier.drop("b")  # b's write has not started: cancelled
    tier.put("c", lambda r: r.copy_(row(9)))  # put again: the first write of c is superseded
    gate.set()
    tier.flush()
    tier.writer.shutdown(wait=True)
    assert sorted(tier.files) == ["c", "d"] and len(list(tier.folder.glob("*.page"))) == 2
    got = torch.empty((1, ROW), dtype=torch.uint8)
    tier.start_read("c")
    while not tier.ready("c"):
        tier.wait()
        tier.poll()
    tier.load("c", got.copy_)
    assert torch.equal(got, row(9))  # the file holds the latest write
    tier.close()


@pytest.mark.parametrize("made", [True, False])
def test_close_with_writes_in_flight_removes_every_file(tmp_path, gate, made):
    folder = tmp_path / "t"
    if not made:
        folder.mkdir()  # the user's folder: emptied, kept
    tier = DiskTier(8, ROW, str(folder))
    for i in range(6):
        tier.put(i, lambda r, i=i: r.copy_(row(i)))
    threading.Timer(0.2, gate.set).start()  # the write already running finishes during close
    tier.close()
    time.sleep(0.3)  # a write that outlived close would have landed by now
    assert not folder.exists() if made else not list(folder.iterdir())


def test_writes_in_flight_are_bounded(tmp_path, gate):
    tier = DiskTier(8, ROW, str(tmp_path / "t"), max_pending_bytes=3 * ROW)
    for i in range(3):
        tier.put(i, lambda r, i=i: r.copy_(row(i)))
    assert len(tier.writing) == 3
    threading.Timer(0.2, gate.set).start()
    tier.put(3, lambda r: r.copy_(row(3)))  # waits for the oldest write
    assert len(tier.writing) <= 3
    tier.close()


def test_a_failed_write_is_recomputed_with_a_warning(monkeypatch):
    from returning_turn import ENGINE, OTHER, PARAMS, reference, returning_turn

    want = reference()

    def full_disk(file, buf):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "write_row", full_disk)
    llm = LLM("random:llama-tiny", offload="disk", **ENGINE)
    second = returning_turn(llm)
    tier = llm.engine.kv.tiers[0]
    tier.flush()
    assert tier.write_errors > 0 and len(tier) > 0  # held in the records, nothing on disk
    with pytest.warns(RuntimeWarning, match="recomputed"):
        got = [o.token_ids for o in llm.generate([second, OTHER], PARAMS)]
    assert got == want
    assert llm.stats()["tier_failed_reads"] > 0
    llm.close()


def test_a_restored_page_file_is_removed_behind_not_on_the_step(tmp_path, gate):
    """A synced file's removal frees its blocks (milliseconds a page on this disk): a restore hands it to the
    writer worker, so the step's thread does not wait for it; it is gone once the worker has run."""
    tier = DiskTier(4, ROW, str(tmp_path / "t"))
    tier.put("a", lambda r: r.copy_(row(1)))
    tier.put("b", lambda r: r.copy_(row(2)))
    gate.set()
    tier.flush()
    gate.clear()
    tier.put("c", lambda r: r.copy_(row(3)))  # holds the worker: anything queued behind it waits
    assert gate.entered.wait(10)
    got = torch.empty((1, ROW), dtype=torch.uint8)
    tier.load("a", got.copy_)  # read now, inside the caller
    tier.drop("b")
    assert torch.equal(got, row(1)) and sorted(tier.files) == ["c"]
    assert len(list(tier.folder.glob("*.page"))) == 2  # a's and b's files still there: removed behind
    gate.set()
    tier.flush()
    tier.writer.shutdown(wait=True)
    assert len(list(tier.folder.glob("*.page"))) == 1  # only c's
    tier.close()


def test_drop_cached_syncs_the_files_and_forgets_reads_taken(tmp_path):
    """`drop_cached` (cold reads: a history written long ago): every write lands, the files are synced and dropped
    from the page cache, a read ahead already taken is forgotten (read again from the file), bytes unchanged."""
    tier = DiskTier(4, ROW, str(tmp_path / "t"))
    for i, key in enumerate("ab"):
        tier.put(key, lambda r, i=i: r.copy_(row(i)))
    assert tier.drop_cached() == 2 and not tier.writing  # every write landed first
    tier.start_read("a")
    while not tier.ready("a"):
        tier.wait()
        tier.poll()
    assert tier.drop_cached(["a", "zz"]) == 1 and not tier.ready("a")  # the read taken is forgotten
    for i, key in enumerate("ab"):
        got = torch.empty((1, ROW), dtype=torch.uint8)
        tier.load(key, got.copy_)
        assert torch.equal(got, row(i))
    tier.close()


@pytest.mark.parametrize("behind", [True, False])
def test_the_work_behind_the_step_is_measured_a_page(monkeypatch, tmp_path, behind):
    """`behind_seconds`: the CPU a page's file write behind and its file's removal take off the step's thread (the
    cost model charges them to a demotion); a write made inline is the step's own `put` and not counted twice.
    Each write here burns 20 ms of CPU on its thread: a lower bound the test imposes, no timing asserted."""
    real = disk.write_row

    def burning(file, buf):
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
        real(file, buf)

    monkeypatch.setattr(disk, "write_row", burning)
    tier = DiskTier(4, ROW, str(tmp_path / "t"), async_writes=behind)
    assert tier.behind_seconds() == 0.0  # nothing seen yet
    for k in range(3):
        tier.put(k, lambda r, k=k: r.copy_(row(k)))
    tier.flush()
    assert (tier.behind_seconds() >= 0.02) == behind
    assert len(tier.write_cpu) == (3 if behind else 0)
    tier.drop(0)
    tier.flush()  # the removal, behind or at once, is timed too
    assert len(tier.remove_cpu) == 1
    tier.close()
