"""What this process runs on: versions, devices, backends, and the variables that steer them."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

PREFIXES = ("MASTER_", "NCCL_", "GLOO_", "SLURM_", "TORCHELASTIC_", "CUDA_VISIBLE")
EXACT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> dict[str, Any]:
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
    }
