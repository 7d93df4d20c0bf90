"""The disk tier: one file per page in a folder, written with numpy `tofile`, read back through a memory map.

A page's parts are laid end to end as raw bytes (each part's dtype and shape are the pool's, known from
the tensors it is loaded into), so a page file is exactly `page_nbytes` long: a missing or shorter file is
unreadable (`readable` is False, `load` raises TierReadError) and the page is recomputed instead.

The folder holds a marker with the owning process id. A folder with page files from a process that is no
longer running (a killed run) is refused with a clear message, or cleaned when `clean_stale` is set; one in
use by a live process is always refused. `close` (and the engine's `close`, and interpreter exit through a
finalizer) removes every page file, the marker, and the folder when the tier made it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Hashable

import numpy as np
import torch

from kvlab.cache.tiers.tier import Tier, TierReadError

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


class DiskTier(Tier):
    """Page files of exactly `page_nbytes` bytes in `folder`, at most `capacity` of them."""

    kind = "disk"

    def __init__(self, capacity: int, page_nbytes: int, path: str | None = None, clean_stale: bool = False):
        super().__init__(capacity, page_nbytes)
        self.folder, made = claim_folder(path, clean_stale)
        self.files: dict[Hashable, Path] = {}
        self._next = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, made)

    def put(self, key: Hashable, parts: list[torch.Tensor]) -> None:
        if len(self.files) >= self.capacity and key not in self.files:
            raise RuntimeError(f"disk tier full ({self.capacity} pages): the placement must make room first")
        self._next += 1
        file = self.folder / f"{self._next}{SUFFIX}"
        raw = torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in parts])  # [page_nbytes]
        raw.numpy().tofile(file)  # through the OS page cache (no msync per page: the tier is a cache, not a log)
        self.drop(key)
        self.files[key] = file

    def readable(self, key: Hashable) -> bool:
        file = self.files.get(key)
        return file is not None and file.is_file() and file.stat().st_size == self.page_nbytes

    def load(self, key: Hashable, into: list[torch.Tensor]) -> None:
        if not self.readable(key):
            raise TierReadError(f"disk tier page file {self.files.get(key)} is missing or truncated")
        file = self.files.pop(key)
        raw = torch.from_numpy(np.memmap(file, dtype=np.uint8, mode="r").copy())  # [page_nbytes]
        offset = 0
        for dst in into:
            n = dst.numel() * dst.element_size()
            dst.copy_(raw[offset:offset + n].clone().view(dst.dtype).view(dst.shape))  # clone: aligned for the view
            offset += n
        file.unlink(missing_ok=True)

    def drop(self, key: Hashable) -> None:
        file = self.files.pop(key, None)
        if file is not None:
            file.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.files)

    def close(self) -> None:
        self.files.clear()
        self._finalizer()
