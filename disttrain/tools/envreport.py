"""What this process runs on: versions, devices, backends, network, the variables that steer them,
and warnings for known traps. `disttrain env` prints it; every run dir keeps it as env.json.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

from disttrain.tools.traps import check_traps, network_interfaces, shm_bytes

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


def cmd_env(rest: list[str]) -> int:
    """`disttrain env [--json]`: the environment report with warnings for known traps."""
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain env", description=cmd_env.__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(rest)
    report = collect_env(in_rank=False)
    if args.json:
        from disttrain.tools.render import print_json

        print_json(report)
    else:
        render_env(report)
    return 0


def render_env(report: dict[str, Any]) -> None:
    from disttrain.tools.render import console, human_bytes, table

    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GiB)" for g in report["gpus"]) or "none"
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["backends"].items())
    rows = [
        ("python", report["python"]),
        ("platform", report["platform"]),
        ("cores", f"{report['cpu_affinity']} usable of {report['cpu_count']}"),
        ("torch", report["torch"]),
        ("cuda / cudnn / nccl", f"{report['cuda']} / {report['cudnn']} / {report['nccl']}"),
        ("gpus", gpus),
        ("backends", backends),
        ("/dev/shm", human_bytes(report.get("shm_bytes"))),
        *((p, v or "-") for p, v in report["packages"].items()),
    ]
    out = console()
    out.print(table("environment", ["item", "value"], rows))
    nets = [(i["name"], i["ipv4"] or "-", i["state"] or "-") for i in report["interfaces"]]
    out.print(table("network interfaces", ["name", "ipv4", "state"], nets))
    variables = sorted(report["variables"].items()) or [("(none set)", "")]
    out.print(
        table(
            "variables (MASTER_*, NCCL_*, GLOO_*, SLURM_*, OMP_NUM_THREADS, ...)",
            ["name", "value"],
            variables,
        )
    )
    if report["warnings"]:
        for w in report["warnings"]:
            out.print(f"[yellow]warning:[/yellow] {w}", markup=True)
    else:
        out.print("no known traps found")
