"""torchrun (torch.distributed.run / elastic): one agent per node starts `nproc_per_node` ranks."""

from __future__ import annotations

import json
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from disttrain.launch.errors import LaunchError, exit_code_message, last_error_line


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


def launch_torchrun(cfg: dict[str, Any], run_dir: Path, entry: str = "disttrain.worker") -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = ["-u", "-m", entry, str(run_dir)]
    try:
        elastic_launch(launch_config(cfg, run_dir), sys.executable)(*args)
    except ChildFailedError as exc:
        # The first failure, but a rank that only saw its peer die is never the cause (timestamps
        # have one-second resolution, so a tie is common).
        rank, failure = min(
            exc.failures.items(),
            key=lambda kv: (_is_secondary(_failure_message(kv[1])), kv[1].timestamp, kv[0]),
        )
        raise LaunchError(rank, _failure_message(failure), run_dir) from None
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        raise LaunchError(
            None,
            f"stopped by {name}: the ranks saved a checkpoint (when configured); "
            f"continue with `disttrain resume {run_dir}`",
            run_dir,
            exit_code=128 + int(exc.sigval),
        ) from None


def _is_secondary(message: str) -> bool:
    return any(
        m in message for m in ("a peer rank died", "Connection closed by peer", "Connection reset by peer")
    )


def _failure_message(failure: Any) -> str:
    """The exception recorded by the failing rank's @record error file, else its exit code."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
        message = data.get("message", {})
        if isinstance(message, dict):
            return last_error_line(message.get("message", "")) or str(message)
        return last_error_line(str(message))
    except (OSError, ValueError, TypeError):
        return exit_code_message(failure.exitcode)
