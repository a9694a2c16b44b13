"""slurm (an sbatch job; srun starts one launcher per node): its config and spec. Inside a job
(SLURM_JOB_ID) the spec is detected; inside an srun step with one task per node, `disttrain train`
takes node_rank and master_addr from SLURM's variables and checks the allocation against `nodes`."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.common import help_field as _h
from disttrain.config.schema import LauncherConfig
from disttrain.launch.specs import LAUNCHERS, Environ, LauncherSpec


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """An sbatch script in the run dir; srun starts one torchrun agent per node."""

    name: str = "slurm"
    partition: str | None = _h("sbatch --partition; null: the cluster's default", None)
    time: str | None = _h("sbatch --time limit, e.g. 04:00:00 or 2-00:00:00; null: partition default", None)
    gpus_per_node: int = _h("sbatch --gpus-per-node; 0: none requested", 0)
    cpus_per_task: int = _h("sbatch --cpus-per-task (one task per node runs every local rank); 0: unset", 0)
    account: str | None = _h("sbatch --account", None)
    qos: str | None = _h("sbatch --qos", None)
    extra: list[str] = _h('more lines for the script head, e.g. "#SBATCH --constraint=a100"', factory=list)
    signal_before_s: int = _h("seconds before the time limit Slurm sends SIGUSR1: checkpoint + requeue", 120)
    dry_run: bool = _h("print the sbatch script (and write it to the run dir) without submitting", False)


def detect(environ: Environ) -> bool:
    return "SLURM_JOB_ID" in environ


SPEC = LAUNCHERS.register(
    LauncherSpec(
        "slurm",
        SlurmLauncherConfig,
        "disttrain.launch.slurm:SlurmLauncher",
        "slurm: submits an sbatch job",
        detect=detect,
        # an srun step's node settings and checks (launch/slurm.py, above this declaration)
        node_overrides="disttrain.launch.slurm:node_overrides",
        check_node="disttrain.launch.slurm:check_allocation",
        started_by="srun",
    )
)
