"""`disttrain train`: compose and check every job, claim its run dir, freeze, launch, summarise.

argv -> compose + checks (every job, before anything is written) -> run dir claimed -> each job
runs (`_run_job`: one run, or each job of a basic sweep, without `@hydra.main`; a sweeper or
launcher plugin, or Hydra callbacks: under `@hydra.main`, `_hydra_task`) -> frozen config.yaml ->
launcher -> one worker per rank -> summary.
`resume` and `rerun` train through `freeze_and_launch`.

No module state: the checked jobs and the command line travel as arguments (`Jobs`), also into
the task `@hydra.main` runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.commands.config import compose_checked as _compose_checked
from disttrain.commands.hydra_app import parse_args as _hydra_args

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.sweepdir import SweepRecord


def freeze_and_launch(run: Run, run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Write the frozen run dir for the checked `run`, launch its ranks (or submit its job), wait;
    the run's summary, or None when a scheduler trains it or it wrote none."""
    from disttrain.rundir import command_line

    return _freeze_and_launch(run, run_dir, overrides, command_line())


@dataclass
class Jobs:
    """What `train` checked before anything was written, handed to whatever runs the jobs.

    `checked`: each job's run (keyed by its overrides), resolved and with its `_target_` nodes
    settled (config/clean.py), so a job runs exactly what was checked; `composed`: the same
    compositions with Hydra's node (run and sweep dirs, job settings); `command`: the user's
    command line for command.txt (with the run or sweep dir this command claimed)."""

    config_dir: str | None
    config_name: str
    checked: dict[tuple[str, ...], Run] = field(default_factory=dict)
    composed: dict[tuple[str, ...], Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    multirun: bool = False


def _shell_completion(request: str) -> int:
    """`train -sc install=bash` / `--shell-completion query=zsh`: disttrain's script, not Hydra's
    (whose script calls `disttrain -sc` and parses the line with `train` in it)."""
    from disttrain.commands.completion import SCRIPTS, cmd_complete, cmd_completion

    action, _, shell = request.partition("=")
    shell = shell or "bash"
    if action == "query":
        return cmd_complete([shell])
    if action == "uninstall":
        sys.stdout.write("complete -r disttrain\n")
        return 0
    return cmd_completion([shell if shell in SCRIPTS else ""])


def environment_overrides(overrides: list[str], environ: Mapping[str, str]) -> list[str] | None:
    """Where a scheduler or agent started this process (the launcher whose `detect` holds:
    `disttrain.launch.specs.detected`): `overrides` plus the node settings it gives a node's
    launcher (an srun step: node_rank, master_addr; a Kubeflow pod: nodes, node_rank, ...); None
    when this process is a rank someone else started (RANK and WORLD_SIZE, and no node's launcher).
    """
    from disttrain.launch.specs import detected

    spec = detected(environ)
    node = spec.node_settings(overrides, environ) if spec else None
    if node is None and "RANK" in environ and "WORLD_SIZE" in environ:
        return None
    return overrides if node is None else node


def cmd_train(rest: list[str], prerendered_ok: bool = True) -> int:
    if prerendered_ok:  # `train --help`: the built-in configs' page, without importing Hydra
        from disttrain.commands.train_help import prerendered

        ready = prerendered(rest)
        if ready is not None:
            sys.stdout.write(ready)
            return 0
    args = _hydra_args(rest)
    if not sys.stderr.isatty():
        # No colour codes in a file or pipe: the libraries a sweep brings (optuna's colorlog handler)
        # honour NO_COLOR (no-color.org), as rich does; a terminal keeps its colours.
        os.environ.setdefault("NO_COLOR", "1")
    if args.shell_completion:
        return _shell_completion(" ".join(args.overrides))
    # A rank torchrun (or srun, or a pod) started trains as one; a node's launcher inside an srun step
    # or a Kubeflow pod (PyTorchJob's RANK is its node's) takes node_rank, master_addr, ... from there.
    node = environment_overrides(args.overrides, os.environ)
    if node is None:
        return _train_as_launched_rank(args)
    rest, args.overrides = [*rest, *node[len(args.overrides) :]], node
    jobs = Jobs(args.config_dir, args.config_name or "config", multirun=bool(args.multirun))
    if args.help:  # usage, the groups and their options, then every key once, with its help
        from disttrain.commands.train_help import page

        sys.stdout.write(page(args.overrides, args.config_dir, args.config_name or "config"))
        return 0
    if args.hydra_help or args.info:
        return _run_hydra_app(rest, jobs)
    # Check every job before anything is written: nothing half-written on bad input.
    from disttrain.config import expand_sweep
    from disttrain.rundir import program

    # A sweeper plugin's syntax (Optuna's interval(...)) expands only inside the plugin: then the
    # base job is checked here and every job again as the plugin launches it (_hydra_task).
    for job in expand_sweep(args.overrides) if args.multirun else [args.overrides]:
        run, jobs.composed[tuple(job)] = _compose_checked(job, args, runtime=not args.cfg)
        jobs.checked[tuple(job)] = run
    if args.cfg:
        if (
            (args.cfg == "job" or (args.cfg == "hydra" and args.resolve))
            and not args.multirun
            and not args.package
        ):
            return _print_cfg(args, jobs)
        return _run_hydra_app(rest, jobs)  # Hydra prints what it composes
    if args.multirun:
        first = next(iter(jobs.composed.values()))
        basic = _basic_sweep(first, args.overrides)
        if basic:  # before the sweep dir is claimed: nothing written on a refusal
            check_sweep(jobs, _sweep_dir_of(first))
        sweep_dir, claimed = _own_sweep_dir(args, first)
        rest = [*rest, *claimed]
        jobs.command = [*program(), "train", *rest]
        if basic:
            return _run_sweep(jobs, sweep_dir)
        return _run_hydra_app(rest, jobs)
    extra = _multinode_run_dir(run, args.overrides)
    command = [*rest, *extra]  # every node derives the same dir: part of the command
    full = jobs.composed[tuple(args.overrides)]
    run_dir = _own_run_dir(run, args, [*args.overrides, *extra], command, full)
    jobs.command = [*program(), "train", *command]
    if not full.hydra.callbacks:
        return _run_job(run, run_dir, task_overrides(args.overrides), full.hydra.job, jobs.command)
    return _run_hydra_app([*command, f"hydra.run.dir={_hydra_quote(str(run_dir))}"], jobs)


def _basic_sweep(full: Any, overrides: list[str]) -> bool:
    """`-m` that Hydra's own sweeper and launcher would run one job after the other, in this process,
    with nothing of the user's around the jobs (no callbacks, no `hydra.sweeper.params` in a config,
    no sweeper plugin's syntax): `_run_sweep` runs it. Anything else runs under `@hydra.main`."""
    from disttrain.config.compose import plugin_sweep
    from disttrain.config.hydra_private import BASIC_LAUNCHER, BASIC_SWEEPER

    hydra = full.hydra
    return (
        hydra.sweeper.get("_target_") == BASIC_SWEEPER
        and hydra.launcher.get("_target_") == BASIC_LAUNCHER
        and not hydra.callbacks
        and not hydra.sweeper.get("params")
        and not plugin_sweep(overrides)
    )


def check_sweep(jobs: Jobs, sweep_dir: Path) -> None:
    """A basic sweep's jobs, checked together before anything is written: one `sweep` block for all
    (it configures the sweep, not a job) and, where a cluster launcher submits the sweep, one launcher, every job's folder inside the
    sweep folder, and what the launcher's sweep submission needs of them (one job array's head)."""
    from disttrain.config.errors import ConfigError
    from disttrain.launch.registry import launcher_for

    runs = list(jobs.checked.values())
    first, dirs = runs[0], []
    # A launcher that submits the whole sweep (a Slurm job array, Kubernetes Jobs) takes every job;
    # jobs run here in turn may each have their own (torchrun for one, spawn for the next).
    submitted = any(launcher_for(run).sweeps for run in runs)
    for num, (run, full) in enumerate(zip(runs, jobs.composed.values(), strict=True)):
        shared = [("launcher.name", run.launcher.name, first.launcher.name)] if submitted else []
        shared += [
            (f"sweep.{f.name}", getattr(run.sweep, f.name), getattr(first.sweep, f.name))
            for f in fields(run.sweep)
        ]
        for key, mine, theirs in shared:
            if mine != theirs:
                raise ConfigError(
                    key,
                    mine,
                    f"one value for every job of a sweep (job 0 has {theirs})",
                    f"job {num} differs: the sweep's jobs share their launcher and sweep.* settings; "
                    "sweep those in separate sweeps.",
                )
        job_dir = _sweep_job_dir(full, sweep_dir, num, create=False)
        if sweep_dir not in job_dir.parents:
            raise ConfigError(
                "hydra.sweep.subdir",
                str(full.hydra.sweep.subdir),
                "a folder inside hydra.sweep.dir",
                f"job {num}'s folder would be {job_dir}; the sweep records its jobs by their folders in it.",
            )
        dirs.append(job_dir)
    launcher_for(first).check_sweep(runs, dirs)


def _run_sweep(jobs: Jobs, sweep_dir: Path) -> int:
    """A basic sweep: every checked job in `sweep_dir/<hydra.sweep.subdir>` (the job's number by
    default), recorded in `sweep_dir/sweep.json` first (`disttrain.sweepdir`). A launcher with a
    sweep submission of its own (Slurm's job array, Kubernetes Jobs) gets every frozen job at once;
    otherwise each runs in turn, as Hydra's BasicLauncher runs them, but without `@hydra.main`,
    which would compose each job twice more (~0.2 CPU-s a job) only to hand it what `train` already
    checked. A failed job does not stop the others unless `sweep.stop_on_failure`; the sweep ends
    with a table of every job's state and the first failed job's exit status."""
    from disttrain import sweepdir
    from disttrain.launch.registry import launcher_for

    first = next(iter(jobs.checked.values()))
    todo = []
    for num, (key, run) in enumerate(jobs.checked.items()):
        full = jobs.composed[key]
        todo.append(
            (num, run, _sweep_job_dir(full, sweep_dir, num), task_overrides(list(key)), full.hydra.job)
        )
    record = sweepdir.SweepRecord(
        first.launcher.name,
        first.sweep.max_parallel,
        [sweepdir.SweepJob(num, str(d.relative_to(sweep_dir)), o) for num, _, d, o, _ in todo],
        jobs.command,
    )
    record.save(sweep_dir)
    sys.stderr.write(f"disttrain: launching {len(todo)} jobs in {sweep_dir}\n")
    launcher = launcher_for(first)
    if launcher.sweeps:
        frozen = []
        for num, run, run_dir, overrides, _ in todo:
            sys.stderr.write(f"disttrain: \t#{num} : {' '.join(overrides)}\n")
            frozen.append((num, freeze_job(run, run_dir, overrides, jobs.command), run_dir))
        launcher.submit_sweep(frozen, sweep_dir, first.sweep.max_parallel, recorder(record, sweep_dir))
        return 0
    failed: dict[int, int] = {}
    for num, run, run_dir, overrides, job in todo:
        sys.stderr.write(f"disttrain: \t#{num} : {' '.join(overrides)}\n")
        rc = _run_job(run, run_dir, overrides, job, jobs.command)
        if rc:
            failed[num] = rc
            if first.sweep.stop_on_failure:
                break
    return _sweep_table(record, sweep_dir, failed, ran=num + 1)


def recorder(record: SweepRecord, sweep_dir: Path) -> Callable[[int, str], None]:
    """`submitted(num, scheduler id)` for a launcher's sweep submission: into sweep.json at once."""

    def submitted(num: int, scheduler_id: str) -> None:
        record.job(num).submitted.append(scheduler_id)
        record.save(sweep_dir)

    return submitted


def _sweep_table(record: SweepRecord, sweep_dir: Path, failed: dict[int, int], ran: int) -> int:
    """The end of a local sweep: every job's state (status.json; a job that failed before its ranks
    started: its exit status; one a stopped sweep never reached: not run) on stdout, the counts on
    stderr; the exit status of the first failed job (0: none failed)."""
    from disttrain import sweepdir

    known: dict[int, tuple[str, str]] = {}
    for job in record.jobs:
        if job.num >= ran:
            known[job.num] = ("not run", "")
        elif job.num in failed and sweepdir.state_of_files(record.run_dir(sweep_dir, job)) is None:
            known[job.num] = ("failed", f"exit {failed[job.num]}")
    states = sweepdir.job_states(record, sweep_dir, known)
    sys.stdout.write(sweepdir.table(record, states))
    sys.stderr.write(f"disttrain: sweep {sweep_dir}: {sweepdir.counts(states.values())}\n")
    return next(iter(failed.values()), 0)


def _sweep_job_dir(full: Any, sweep_dir: Path, num: int, create: bool = True) -> Path:
    """Job `num`'s folder: `hydra.sweep.subdir` evaluated as Hydra's launcher evaluates it (with
    `hydra.job.num` and `hydra.job.id` set, and the `${hydra:...}` resolver on this job's config)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    with read_write(full.hydra), open_dict(full.hydra):
        full.hydra.job.num = num
        full.hydra.job.id = num
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(full)
    try:
        job_dir = Path(os.path.normpath(sweep_dir / str(OmegaConf.select(full, "hydra.sweep.subdir"))))
    finally:
        hydra_config.cfg = saved
    if create:
        job_dir.mkdir(parents=True, exist_ok=True)
    return job_dir


@contextmanager
def _job_context(run_dir: Path, job: Any) -> Iterator[None]:
    """What Hydra's job runner does around a job, undone after it: `hydra.job.env_set` in the
    environment, `hydra.job.chdir` into the run dir."""
    saved_env = {str(k): os.environ.get(str(k)) for k in job.env_set}
    cwd = os.getcwd()
    os.environ.update({str(k): str(v) for k, v in job.env_set.items()})
    if job.chdir:
        os.chdir(run_dir)
    try:
        yield
    finally:
        os.chdir(cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_job(run: Run, run_dir: Path, overrides: list[str], job: Any, command: list[str]) -> int:
    """One checked job (a run, or a basic sweep's job) trains without `@hydra.main`, which would
    compose the config again (~0.4 CPU-s before every run) only to hand the job a run dir and
    overrides this command already holds. What Hydra's job runner would do for it is done here
    (`_job_context`)."""
    with _job_context(run_dir, job):
        return run_guarded(run, run_dir, overrides, command)


def run_guarded(run: Run, run_dir: Path, overrides: list[str], command: list[str]) -> int:
    """Freeze and launch one checked job; its exit status, so that a sweep goes on after it: a
    ConfigError is one paragraph, exit 2; a failed launch its own status (its error already said);
    any other error that escapes the job is reported as Hydra reports it (overrides, traceback),
    exit 1."""
    import traceback

    from disttrain.config.errors import ConfigError

    try:
        _freeze_and_launch(run, run_dir, overrides, command)
    except ConfigError as exc:  # a refusal (a sweep job's checkpoint.dir): a paragraph, as train's
        sys.stderr.write(f"disttrain: {exc}\n")
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:
        sys.stderr.write(f"Error executing job with overrides: {overrides}\n{traceback.format_exc()}")
        return 1
    return 0


def task_overrides(overrides: list[str]) -> list[str]:
    """The job's own overrides, as Hydra's `hydra.overrides.task` lists them: without the `hydra.*`
    keys and `hydra/...` groups (those configure Hydra, not the job)."""

    def key(override: str) -> str:
        return override.lstrip("~+").split("=", 1)[0].split("@", 1)[0]

    return [o for o in overrides if not (key(o) == "hydra" or key(o).startswith(("hydra.", "hydra/")))]


def _own_run_dir(run: Run, args: Any, overrides: list[str], command: list[str], full: Any) -> Path:
    """This invocation's run dir, created before the job runs (Hydra would reuse any).

    The default `runs/NAME/TIMESTAMP` is claimed exclusively (a taken one gets a -1 suffix); a
    `hydra.run.dir=PATH` the user chose is continued only with the same config (see rundir.reuse).
    Both are checked to be writable first: one paragraph instead of a traceback after the freeze.
    `full` is the checks' composition; composed again only when the command added a key."""
    from disttrain import rundir
    from disttrain.config import compose
    from disttrain.launch.registry import launcher_for

    if overrides != list(args.overrides):  # the multi-node run dir every node derives
        full = compose(overrides, args.config_dir, args.config_name or "config", with_hydra=True)
    run_dir = Path(str(full.hydra.run.dir)).absolute()
    rundir.check_path(run_dir)
    launcher_for(run).check_command(run_dir, [*rundir.program(), "train", *command])
    created = not run_dir.exists()
    if any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides):
        claimed = rundir.reuse(run_dir, run, shared=run.world.nodes > 1)  # the nodes share one dir
    else:
        claimed, created = rundir.claim(run_dir), True
    _own_checkpoints_or_leave(run, claimed, created)
    from disttrain.timing import mark

    mark("run_dir")
    return claimed


def _own_checkpoints_or_leave(run: Run, run_dir: Path, created: bool) -> None:
    """The checkpoint folder's lock and owner, taken with the run dir's and before the job: a
    refusal is one paragraph (exit 2), and a run dir this command created goes again (review
    2026-11-28-reliability D14: a Hydra traceback, exit 1, an empty run dir left)."""
    from disttrain import owner
    from disttrain.config.errors import ConfigError

    try:
        own_checkpoint_dir(run, run_dir)
    except ConfigError:
        if created:
            owner.release(run_dir)
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # empty but for the lock file just removed
        raise


def _own_sweep_dir(args: Any, first: Any) -> tuple[Path, list[str]]:
    """`-m`: the sweep's folder (`runs/NAME/multirun_TIMESTAMP`, from the first job's composition
    `first`) claimed exclusively, as a run dir; with the override that names it to Hydra."""
    from disttrain import rundir

    sweep_dir = _sweep_dir_of(first)
    if any(o.lstrip("+").startswith("hydra.sweep.dir=") for o in args.overrides):
        return sweep_dir, []  # the user's own folder: its job subdirs are theirs to reuse
    sweep_dir = rundir.claim(sweep_dir)
    return sweep_dir, [f"hydra.sweep.dir={_hydra_quote(str(sweep_dir))}"]


def _sweep_dir_of(full: Any) -> Path:
    """`hydra.sweep.dir` of a composition, absolute and normalised (job folders are kept relative to it)."""
    return Path(os.path.normpath(Path(str(full.hydra.sweep.dir)).absolute()))


def _hydra_quote(value: str) -> str:
    """A Hydra override value that stays one string (a path may hold blanks, commas, brackets)."""
    return "'" + value.replace("'", "\\'") + "'"


def _multinode_run_dir(run: Run, overrides: list[str]) -> list[str]:
    """Several nodes (by hand): a run dir name every node derives alike, unless hydra.run.dir is set."""
    from disttrain.launch.multinode import run_dir_name
    from disttrain.launch.registry import launcher_for
    from disttrain.launch.specs import detected
    from disttrain.preflight.launch_checks import rehearsal_warning

    spec = detected(os.environ)
    if spec is not None:
        spec.check_node_env(run)  # inside an srun step: SLURM_NNODES / SLURM_NTASKS against nodes
    if run.world.nodes == 1 or launcher_for(run).scheduler:  # the scheduler names the nodes' run dirs
        return []
    warning = rehearsal_warning(run)
    if warning:
        sys.stderr.write(f"disttrain: warning: {warning}\n")
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        return []
    return [f"hydra.run.dir={run_dir_name(run)}"]


def _run_hydra_app(rest: list[str], jobs: Jobs) -> int:
    """`rest` under `@hydra.main`: help, `--cfg`/`--info` prints, and the jobs `train` does not run
    itself (a sweeper or launcher plugin's, or any with Hydra callbacks), each through `_hydra_task`
    with `jobs`."""
    from disttrain.commands.hydra_app import run_main
    from disttrain.config import config_dir
    from disttrain.config.schema import register

    register()

    def task(cfg: Any) -> Any:
        return _hydra_task(jobs)

    run_main(task, str(config_dir()), jobs.config_name, rest)
    return 0


def _hydra_task(jobs: Jobs) -> dict[str, Any] | float | None:
    """Runs once per job that `@hydra.main` runs, in the parent: freeze the checked config, launch,
    summarise. A job that a sweeper plugin chose (Optuna) is composed, settled and checked now."""
    from hydra.core.hydra_config import HydraConfig

    from disttrain.config import resolve
    from disttrain.config.errors import ConfigError
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_runtime, check_static

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).resolve()
    overrides = list(hc.overrides.task)
    plugin = "BasicSweeper" not in str(hc.sweeper.get("_target_", "BasicSweeper"))
    # One run is the job `train` checked (hc.overrides.task shows `${...}` values resolved,
    # `model.in_features=64`, so its key may miss).
    checked = next(iter(jobs.checked.values())) if not jobs.multirun else jobs.checked.get(tuple(overrides))
    if checked is None:
        from disttrain.config import compose

        try:
            checked = Run.of(resolve(compose(overrides, jobs.config_dir, jobs.config_name), overrides))
            check_static(checked)
            check_runtime(checked)
        except ConfigError as exc:
            sys.stderr.write(f"disttrain: {exc}\n")
            raise SystemExit(2) from None
    summary = _freeze_and_launch(checked, run_dir, overrides, jobs.command)
    if plugin and summary is not None:
        return _objective(summary)
    return summary


def _objective(summary: dict[str, Any]) -> float:
    """What a sweeper plugin (Optuna) minimises: the final val/loss, else the last train loss."""
    for key in ("val/loss", "train/loss"):
        if isinstance(summary.get(key), int | float):
            return float(summary[key])
    return float("nan")


def _freeze_and_launch(
    run: Run, run_dir: Path, overrides: list[str], command: list[str]
) -> dict[str, Any] | None:
    from disttrain.launch import LaunchError, launch, submit
    from disttrain.rundir import run_status
    from disttrain.timing import mark

    mark("hydra_task")
    run = freeze_job(run, run_dir, overrides, command)
    if submit(run, run_dir, command):
        return None  # a scheduler's nodes train (sbatch, a Kubeflow job); status.json is theirs
    try:
        with run_status(run_dir):  # status.json: running -> finished / failed / interrupted
            launch(run, run_dir)
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    from disttrain.observe.summary import print_done

    return print_done(run_dir)


def freeze_job(run: Run, run_dir: Path, overrides: list[str], command: list[str]) -> Run:
    """The run dir frozen for the checked `run` (its checkpoint folder owned, its batch shape kept
    at another world size): what every launcher then launches or submits."""
    from disttrain.preflight import hf_base
    from disttrain.rundir import freeze

    own_checkpoint_dir(run, run_dir)
    run, reshaped = same_global_batch(run, run_dir)
    if reshaped:  # frozen as the ranks will train it: config.yaml and the checkpoints agree
        sys.stderr.write(f"disttrain: resuming at another world size: {reshaped}\n")
    freeze(run_dir, run, overrides, command)
    hf_base.record(run_dir, run.model)  # from_pretrained's config.json: export rebuilds from this copy
    return run


def same_global_batch(run: Run, run_dir: Path) -> tuple[Run, str | None]:
    """Resumed at another data-parallel size (`disttrain resume RUN nproc_per_node=1`, `train
    resume=PATH` on another world): the run with the batch shape that keeps the checkpoint's global
    batch, and what changed (`run` itself and None: nothing)."""
    from disttrain.checkpoint.geometry import checkpoint_meta, keep_global_batch
    from disttrain.checkpoint.manager import resume_location
    from disttrain.strategies import specs

    return keep_global_batch(run, checkpoint_meta(resume_location(run, run_dir)), specs.dp_degree(run))


def own_checkpoint_dir(run: Run, run_dir: Path) -> None:
    """An explicit `checkpoint.dir`: one launcher at a time (its lock, held until this command
    ends), and never another run's checkpoints unless `resume=` names them. Node 0 speaks for a
    multi-node run (every node shares the folder). A scheduler's job (Slurm, Kubernetes) is not
    checked here: no launcher of it lives in this process, and its requeues reuse one run dir."""
    from disttrain import owner
    from disttrain.config.errors import ConfigError
    from disttrain.launch.registry import launcher_for
    from disttrain.shared_dir import checkpoint_dir

    if not run.checkpoint.dir or run.world.node_rank != 0 or launcher_for(run).scheduler:
        return
    directory = checkpoint_dir(run, run_dir)
    if not isinstance(directory, Path):  # an object store holds no lock: one run a URL is the user's to keep
        return
    owner.hold(directory, run_dir, "checkpoint.dir", "checkpoint folder")
    home = owner.home_run_dir(directory)
    if home is not None and home != run_dir:  # another run's own folder: never while that run lives
        try:
            owner.hold(home, run_dir, "checkpoint.dir", "run dir")
        except ConfigError as exc:
            raise ConfigError(
                "checkpoint.dir",
                str(directory),
                "a checkpoint folder no live run writes",
                f"it is the checkpoints/ folder of the run {home}, and {exc.hint}",
            ) from None
    owner.claim_checkpoints(directory, run_dir, run.resume)


def _train_as_launched_rank(args: Any) -> int:
    """Inside a rank torchrun/Kubeflow/TorchX/srun started: see disttrain.commands.launched."""
    from disttrain.commands.launched import train_as_launched_rank

    return train_as_launched_rank(args)


def _print_cfg(args: Any, jobs: Jobs) -> int:
    """`train --cfg job`: what config.yaml will hold (resolved, `_target_` nodes settled: Hydra would
    print its composition before that, `${...}` and all) and `train --cfg hydra --resolve`: Hydra deletes the job's keys before
    resolving the `hydra` node, so its `${name}` (hydra.run.dir) fails; here it resolves against the
    whole config, as at run time. Values only a running job has (hydra.job.num) stay `???`."""
    from omegaconf import OmegaConf, open_dict

    if args.cfg == "job":  # what config.yaml will hold: resolved once, `_target_` nodes settled
        import yaml

        sys.stdout.write(yaml.safe_dump(jobs.checked[tuple(args.overrides)].to_dict(), sort_keys=False))
        return 0
    from hydra.core.hydra_config import HydraConfig

    cfg = jobs.composed[tuple(args.overrides)]
    HydraConfig.instance().set_config(cfg)  # the `${hydra:...}` resolver, as under @hydra.main
    OmegaConf.set_readonly(cfg.hydra, None)  # as Hydra's own --cfg does (compose hands it read-only)
    with open_dict(cfg.hydra):
        for key in ("help", "hydra_help"):  # as Hydra's --cfg hydra: its help templates are not config
            cfg.hydra.pop(key, None)
    OmegaConf.resolve(cfg)
    sys.stdout.write(OmegaConf.to_yaml({"hydra": cfg.hydra}))
    return 0
