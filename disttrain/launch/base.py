"""The one interface every launcher has: its own checks, an optional hand-off to a scheduler, `launch`.

A launcher is chosen by `launcher.name` through the registry (`disttrain.launch.registry`); nothing
else compares launcher names. Torch-free at import: checks run in `disttrain config` too.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from disttrain.config.run import Run


class Launcher(Protocol):
    """How the ranks of one run start. Subclass it: the defaults suit a launcher that starts its
    ranks on this machine (torchrun, spawn); a scheduler's launcher (slurm, k8s) overrides `submit`."""

    # True: a scheduler starts the nodes (sbatch, a Kubeflow job): it owns their node ranks, the
    # run dir each node derives and the rendezvous port, so none of them is chosen or probed here.
    scheduler: ClassVar[bool] = False
    # True: `submit_sweep` hands a `-m` sweep's jobs to the scheduler together (a job array).
    sweeps: ClassVar[bool] = False

    def check_static(self, run: Run) -> None:
        """Checks of the resolved config that need no machine; raise ConfigError."""

    def check_runtime(self, run: Run) -> None:
        """Checks of this machine before anything is written (a program on PATH); raise ConfigError."""

    def check_command(self, run_dir: Path, command: list[str]) -> None:
        """The run dir and command line it would write somewhere (a job script), checked before the
        run dir is claimed; raise ConfigError."""

    def prestart(self, run: Run) -> None:
        """Called once the static checks passed, before the runtime checks (model build, dry step):
        start what makes the ranks' start-up cheaper, e.g. a warm fork server. It must start no
        rank and write nothing (a failed runtime check follows); what it starts must end with this
        process."""

    def submit(self, run: Run, run_dir: Path, command: list[str]) -> bool:
        """Hand the frozen run to a scheduler. True: it did, the scheduler's nodes train and
        status.json is theirs; False: `launch` starts the ranks here."""
        return False

    def check_sweep(self, runs: Sequence[Run], run_dirs: Sequence[Path]) -> None:
        """The checked jobs of one `-m` sweep (their run dirs' would-be paths), before anything is
        written: what a sweep submission needs of them together (one job array's shared head);
        raise ConfigError."""

    def submit_sweep(
        self,
        jobs: Sequence[tuple[int, Run, Path]],
        sweep_dir: Path,
        max_parallel: int,
        submitted: Callable[[int, str], None],
    ) -> None:
        """Only where `sweeps`: hand the frozen jobs `(number, run, run dir)` of a sweep to the
        scheduler together (a Slurm job array, Kubernetes Jobs), at most `max_parallel` running at
        once (0: no cap), calling `submitted(number, scheduler id)` for each job handed over.
        Elsewhere `train` runs (or submits) the jobs one after another."""
        raise NotImplementedError(f"{type(self).__name__} has no sweep submission (sweeps=False)")

    def sweep_states(self, ids: Mapping[int, str], timeout: float) -> dict[int, tuple[str, str]]:
        """The scheduler's word on each job of a sweep, by job number, from its current id in `ids`:
        (a `disttrain.sweepdir.STATES` state, the scheduler's own name for it). Jobs it knows
        nothing about are left out (their run dirs' status.json speaks for them)."""
        return {}

    @abstractmethod
    def launch(self, run: Run, run_dir: Path, entry: str) -> None:
        """Start this node's ranks running `entry` (`python -m entry RUN_DIR`) and wait for them;
        raise LaunchError naming the first failure. Every launcher implements it (a subclass that
        does not cannot be instantiated)."""
