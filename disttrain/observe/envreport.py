"""What this process runs on: versions, devices, backends, network, the variables that steer them,
and warnings for known traps. Every run dir keeps it as env.json (`report_env`, rank 0);
`disttrain env` (tools/envreport.py) prints it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from disttrain.traps import check_traps, network_interfaces, shm_bytes

PREFIXES = ("MASTER_", "NCCL_", "GLOO_", "SLURM_", "TORCHELASTIC_", "CUDA_VISIBLE")
EXACT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect_env(in_rank: bool = True) -> dict[str, Any]:
    """The report, with `warnings` for known traps (`in_rank`: called inside a launched rank)."""
    report = _collect()
    report["warnings"] = check_traps(report, dict(os.environ), in_rank=in_rank)
    return report


def _collect() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    gpus = (
        [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
        if cuda
        else []
    )
    nccl = None
    if cuda and dist.is_nccl_available():
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "gpus": gpus,
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "packages": {
            p: _version(p) for p in ("disttrain", "hydra-core", "omegaconf", "numpy", "rich", "tensorboard")
        },
        "variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIXES) or k in EXACT},
        "interfaces": network_interfaces(),
        "shm_bytes": shm_bytes(),
    }


def report_env(run_dir: Path, env: Any, threads: int) -> None:
    """RUN_DIR/env.json on rank 0: the report, every rank's host, the world; a restart only appends
    to it (the machine was reported already). Every rank calls it (the host names are gathered)."""
    import time

    import torch.distributed as dist

    from disttrain.dist import hostname
    from disttrain.rundir import RunDir, write_json

    hosts: list[Any] = [hostname()]
    if dist.is_initialized() and env.world_size > 1:
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, hostname())
    if not env.is_zero:
        return
    path = RunDir(run_dir).env
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and path.is_file():  # a restart: the machine was reported; be quick
        report = json.loads(path.read_text())
        report.setdefault("restarts", []).append({"attempt": restart, "time": time.time()})
        write_json(path, report)
        return
    report = collect_env()
    report.update(
        backend=env.backend,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        threads_per_rank=threads,
        hosts=hosts,
        device=str(env.device),
        started=time.time(),
    )
    write_json(path, report)
