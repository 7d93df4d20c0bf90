"""The tiers an engine's `offload` option names, built from `offload_args`.

    offload: host        pages evicted from the prefix cache go to host memory (`memory` bytes)
    offload: disk        ... to page files in a folder (`disk_memory` bytes, `path`; a temporary folder if unset)
    offload: host_disk   host first; the host tier's victims spill to disk
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvlab.cache.tiers.disk import DiskTier
from kvlab.cache.tiers.store import HostTier
from kvlab.cache.tiers.tier import Tier

OFFLOADS = {"host": ("host",), "disk": ("disk",), "host_disk": ("host", "disk")}


@dataclass
class OffloadArgs:
    """`engine.offload_args`: the tiers' byte budgets and where the disk tier's files go."""

    memory: int | str = "1GiB"  # host tier budget (bytes, or a string with KiB / MiB / GiB)
    disk_memory: int | str = "4GiB"  # disk tier budget
    path: str | None = None  # disk tier folder (None: a fresh temporary folder, removed at close)
    clean_stale: bool = False  # remove page files a killed run left in `path` (else such a folder is refused)
    async_reads: bool = True  # disk reads on a worker thread (a request waits for its pages, others run)
    async_writes: bool = True  # disk writes behind, on a second worker thread (a demotion costs a row copy)

    def __post_init__(self) -> None:
        from kvlab.engine_config import parse_bytes

        self.memory, self.disk_memory = parse_bytes(self.memory), parse_bytes(self.disk_memory)
        for name in ("memory", "disk_memory"):
            if getattr(self, name) <= 0:
                raise ValueError(f"offload_args.{name} must be positive, got {getattr(self, name)}")


def offload_problem(offload: str | None, args: dict) -> str | None:
    """Why (`offload`, `offload_args`) cannot be built, or None."""
    if offload is None:
        return None
    if offload not in OFFLOADS:
        return f"offload must be None or one of {', '.join(OFFLOADS)}, got {offload!r}"
    known = [f.name for f in fields(OffloadArgs)]
    unknown = sorted(set(args) - set(known))
    if unknown:
        return f"no parameter(s) {', '.join(unknown)}; the tiers' parameters are: {', '.join(known)}"
    try:
        OffloadArgs(**args)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def make_tiers(offload: str, args: dict, page_nbytes: int, pin: bool) -> list[Tier]:
    """The tiers of `offload`, fastest first, each holding its budget's worth of pages."""
    a = OffloadArgs(**args)
    tiers: list[Tier] = []
    for kind in OFFLOADS[offload]:
        if kind == "host":
            tiers.append(HostTier(a.memory // page_nbytes, page_nbytes, pin=pin))
        else:
            tiers.append(DiskTier(a.disk_memory // page_nbytes, page_nbytes, a.path, a.clean_stale, a.async_reads,
                                   a.async_writes))
    return tiers
