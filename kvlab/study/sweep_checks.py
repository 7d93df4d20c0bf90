"""Checks a multirun passes before any job starts (called by kvlab.study.sweep_report.SweepReport.on_multirun_start).

    slurm launcher        `sbatch` must be on PATH (jobs are submitted with it)
    ray_cluster launcher  a given address must answer (host:port or ray://host:port: a TCP connection;
                          "auto": a running local cluster, from RAY_ADDRESS or Ray's address file)
    a study (kvlab.study.study) every objective must be a metric the configured task or workload produces

Each failure is a `SweepRefused` naming what is wrong and what to do; Hydra's callback layer swallows
ordinary exceptions as warnings, so it is a SystemExit: the sweep ends with that message and status 1.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

SLURM = "SlurmLauncher"
RAY = ("RayLauncher", "KvlabRayLauncher")


class SweepRefused(SystemExit):
    """A sweep that cannot run: raised before any job starts."""

    def __init__(self, message: str):
        super().__init__(f"sweep refused before any job started: {message}")


def check_sweep(config: DictConfig) -> None:
    """Run every check that applies to this multirun's launcher and study; raise SweepRefused on the first failure."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    cls = target.rsplit(".", 1)[-1]
    if cls == SLURM:
        check_sbatch()
    if cls in RAY:
        address = OmegaConf.select(config, "hydra.launcher.ray.init.address", default=None)
        check_ray_address(address)
    if config.get("study") is not None:
        check_study(config)


def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SweepRefused(
            "hydra/launcher=slurm submits its jobs with `sbatch`, which is not on PATH: run the sweep on a SLURM "
            "login node (or put sbatch on PATH), or use hydra/launcher=submitit_local to run the same submitit "
            "code path on this machine")


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "ray://host:port" -> (host, port); ValueError if it has no port."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray address {address!r} is not host:port, ray://host:port or auto")
    return host, int(port)


def ray_address_file() -> Path:
    """Where a running local Ray cluster writes its address (ray start / ray.init)."""
    return Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


def check_ray_address(address, timeout_s: float = 5.0) -> None:
    if address in (None, "", "local"):
        return  # a local cluster is started for the sweep
    if str(address) == "auto":
        found = os.environ.get("RAY_ADDRESS") or (ray_address_file().read_text().strip()
                                                 if ray_address_file().exists() else "")
        if not found:
            raise SweepRefused(
                "hydra.launcher.ray.init.address=auto but no running Ray cluster was found (no RAY_ADDRESS, no "
                f"{ray_address_file()}): start one with `ray start --head`, give its address, or leave the "
                "address null to start a local cluster for the sweep")
        address = found
    try:
        host, port = split_address(str(address))
    except ValueError as exc:
        raise SweepRefused(str(exc)) from None
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise SweepRefused(
            f"the Ray cluster at {address} does not answer ({host}:{port}: {exc.strerror or exc}); check the "
            "address (`ray status` on the head node), or leave hydra.launcher.ray.init.address null to start a "
            "local cluster for the sweep") from None


def check_study(config: DictConfig) -> None:
    from kvlab.study.study import check_objectives

    plain = OmegaConf.to_container(config, resolve=False)
    plain.pop("hydra", None)
    try:
        check_objectives(plain)
    except (ValueError, TypeError) as exc:
        raise SweepRefused(str(exc)) from None
