"""torchrun (torch.distributed.run / elastic): one agent per node starts `nproc_per_node` ranks."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

from disttrain.launch.errors import LaunchError, last_error_line


def launch_config(cfg: dict[str, Any], run_dir: Path) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    single = cfg["nodes"] == 1
    endpoint = (
        "127.0.0.1:0"
        if single and not cfg["master_port"]
        else f"{cfg['master_addr']}:{cfg['master_port'] or 29500}"
    )
    launcher = cfg["launcher"]
    return LaunchConfig(
        min_nodes=cfg["nodes"],
        max_nodes=cfg["nodes"],
        nproc_per_node=cfg["nproc_per_node"],
        run_id=f"disttrain-{uuid.uuid4().hex[:8]}" if single else f"disttrain-{run_dir.name}",
        role="disttrain",
        rdzv_endpoint=endpoint,
        rdzv_backend="c10d",
        rdzv_configs={"timeout": int(launcher["rdzv_timeout"]), "is_host": cfg["node_rank"] == 0},
        max_restarts=int(launcher["max_restarts"]),
        monitor_interval=float(launcher["monitor_interval"]),
        start_method="spawn",
        local_addr="127.0.0.1" if single else None,
    )


def launch_torchrun(cfg: dict[str, Any], run_dir: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = ["-u", "-m", "disttrain.worker", str(run_dir)]
    try:
        elastic_launch(launch_config(cfg, run_dir), sys.executable)(*args)
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
        raise LaunchError(rank, _failure_message(failure), run_dir) from None


def _failure_message(failure: Any) -> str:
    """The exception recorded by the failing rank's @record error file, else its exit code."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
        message = data.get("message", {})
        if isinstance(message, dict):
            return last_error_line(message.get("message", "")) or str(message)
        return last_error_line(str(message))
    except (OSError, ValueError, TypeError):
        return f"exit code {failure.exitcode} (signal or crash before Python could record an error)"
