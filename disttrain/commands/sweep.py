"""`disttrain sweep status DIR` and `disttrain sweep resume DIR`: a `train -m` sweep after the fact.

Both read the sweep folder's record (`disttrain.sweepdir`: data, checked field by field, never run).
status asks the sweep's scheduler for each job's state (Slurm: squeue, then sacct; Kubernetes:
kubectl) and falls back on each run dir's status.json. resume submits again only the jobs that
failed or were cancelled, each into its own folder under its own job number, where the run
continues from its latest checkpoint (resume=auto); each job's config.yaml is built under the same
trust rule as `disttrain resume` (someone else's: only disttrain's and torch's own `_target_`s, or
--trust), and a job script is written anew from it, never read back.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.sweepdir import SweepRecord

SWEEP_USAGE = """\
usage: disttrain sweep status SWEEP_DIR
       disttrain sweep resume SWEEP_DIR [--trust]

status: each job of a `disttrain train -m` sweep (runs/NAME/multirun_DATE) with its state, from the
scheduler where there is one (Slurm's squeue or sacct, Kubernetes), else from its run dir.
resume: submit again only the failed and cancelled jobs, each under its own job number into its
own folder, where it continues from its latest checkpoint; the other jobs are left alone. A job
whose run dir someone else made is built only if its `_target_`s are disttrain's and torch's own,
or with --trust (its config is code).
"""

QUERY_TIMEOUT_S = 60.0  # one squeue/sacct/kubectl call


def cmd_sweep(rest: list[str]) -> int:
    from disttrain.trust import take_trust_flag

    rest, trusted = take_trust_flag(rest)
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(SWEEP_USAGE)
        return 0 if rest else 2
    if rest[0] not in ("status", "resume") or len(rest) != 2 or (trusted and rest[0] != "resume"):
        raise ConfigError(
            "sweep",
            " ".join(rest),
            "status SWEEP_DIR, or resume SWEEP_DIR [--trust]",
            SWEEP_USAGE.splitlines()[0],
        )
    from disttrain import sweepdir

    sweep_dir = Path(rest[1]).absolute()
    record = sweepdir.load(sweep_dir)
    states = job_states(record, sweep_dir)
    if rest[0] == "status":
        sys.stdout.write(sweepdir.table(record, states))
        sys.stderr.write(f"disttrain: sweep {sweep_dir}: {sweepdir.counts(states.values())}\n")
        return 0
    return _resume(record, sweep_dir, states, trusted)


def job_states(record: SweepRecord, sweep_dir: Path) -> dict[int, tuple[str, str]]:
    """Each job's (state, what says so): its scheduler's word, else its run dir's."""
    from disttrain import sweepdir
    from disttrain.launch.registry import LAUNCHERS

    ids = {job.num: job.submitted[-1] for job in record.jobs if job.submitted}
    scheduler = LAUNCHERS.get(record.launcher).load().sweep_states(ids, QUERY_TIMEOUT_S) if ids else {}
    return sweepdir.job_states(record, sweep_dir, scheduler)


def _resume(record: SweepRecord, sweep_dir: Path, states: dict[int, tuple[str, str]], trusted: bool) -> int:
    """Check every failed or cancelled job first (nothing written on a refusal), then run them again
    (resume=auto) in their folders under their own job numbers, as `train -m` runs a sweep
    (`run_sweep_jobs`; a failed job does not stop the others)."""
    from disttrain import sweepdir
    from disttrain.commands.resume import checked_resume, saved_overrides
    from disttrain.commands.train import SweepTask, run_sweep_jobs
    from disttrain.launch.registry import launcher_for
    from disttrain.rundir import command_line

    again = [job for job in record.jobs if states[job.num][0] in sweepdir.RERUN]
    if not again:
        sys.stdout.write(sweepdir.table(record, states))
        sys.stderr.write(f"disttrain: nothing to resume in {sweep_dir}: no job failed or was cancelled\n")
        return 0
    dirs = [record.run_dir(sweep_dir, job) for job in again]
    runs = [checked_resume(run_dir, [], trusted) for run_dir in dirs]
    launcher = launcher_for(runs[0])
    if launcher.sweeps:
        launcher.check_sweep(runs, dirs)
    if any(run.launcher.name != record.launcher for run in runs):
        raise ConfigError(
            "launcher.name",
            next(run.launcher.name for run in runs if run.launcher.name != record.launcher),
            f"{record.launcher}, the launcher the sweep was started with ({sweepdir.RECORD})",
            "a job's config.yaml was changed since; resume that run on its own (`disttrain resume RUN_DIR`).",
        )
    command = command_line()
    sys.stderr.write(f"disttrain: resuming {len(again)} of {len(record.jobs)} jobs in {sweep_dir}\n")
    todo = [
        SweepTask(job.num, run, run_dir, saved_overrides(run_dir))
        for job, run, run_dir in zip(again, runs, dirs, strict=True)
    ]
    return run_sweep_jobs(record, sweep_dir, todo, command, stop_on_failure=False)
