"""`disttrain train`: compose and check every job, claim its run dir, freeze, launch, summarise.

argv -> compose + checks (every job, before anything is written) -> run dir claimed -> the job runs
(one run: `_run_job`, directly; a sweep: each job under `@hydra.main`, `_hydra_task`) -> frozen
config.yaml -> launcher -> one worker per rank -> summary.
`resume` and `rerun` train through `freeze_and_launch`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disttrain.commands.config import COMPOSED as _COMPOSED
from disttrain.commands.config import compose_checked as _compose_checked
from disttrain.commands.config import key_help as _key_help
from disttrain.commands.hydra_app import parse_args as _hydra_args


def freeze_and_launch(cfg: dict[str, Any], run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Write the frozen run dir for the checked `cfg`, launch its ranks (or submit its job), wait;
    the run's summary, or None when a scheduler trains it or it wrote none."""
    return _freeze_and_launch(cfg, run_dir, overrides)


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


def cmd_train(rest: list[str]) -> int:
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
    command = rest
    if not (args.help or args.hydra_help or args.info or args.shell_completion):
        if not args.cfg:
            _say_checking()
        # Check every job before Hydra creates a single run dir: nothing half-written on bad input.
        from disttrain.config import expand_sweep

        # A sweeper plugin's syntax (Optuna's interval(...)) expands only inside the plugin: then the
        # base job is checked here and every job again as the plugin launches it (_hydra_task).
        for job in expand_sweep(args.overrides) if args.multirun else [args.overrides]:
            cfg = _compose_checked(job, args, runtime=not args.cfg)
            _CHECKED[tuple(job)] = cfg
        _CHECKED_FROM[:] = [args.config_dir, args.config_name or "config"]
        if (
            (args.cfg == "job" or (args.cfg == "hydra" and args.resolve))
            and not args.multirun
            and not args.package
        ):
            return _print_cfg(args)
        if args.multirun and not args.cfg:
            rest = [*rest, *_own_sweep_dir(args, expand_sweep(args.overrides)[0])]
        if not args.multirun and not args.cfg:
            extra = _multinode_run_dir(cfg, args.overrides)
            command = [*rest, *extra]  # every node derives the same dir: part of the command
            run_dir = _own_run_dir(cfg, args, [*args.overrides, *extra], command)
            composed = _COMPOSED[tuple(args.overrides)]
            if not args.help and not composed.hydra.callbacks:
                from disttrain.rundir import program

                _COMMAND[:] = [*program(), "train", *command]
                return _run_job(cfg, run_dir, task_overrides(args.overrides), composed.hydra.job)
            rest = [*command, f"hydra.run.dir={_hydra_quote(str(run_dir))}"]
            _KNOWN_MODE[:] = [composed.hydra.mode]
    if args.help:  # Hydra's help (the groups and their options), then every key once, with its help
        try:
            _run_hydra_app(rest, args.config_name or "config", command)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        return _key_help(args, footer="\nUse --hydra-help to view Hydra specific help\n")
    return _run_hydra_app(rest, args.config_name or "config", command)


def _say_checking() -> None:
    """One line on a terminal's stderr as soon as the command is parsed: composition, the checks and
    torch's import take seconds before the first log line, a blank screen after Enter (docs-as-written
    review 3.10). Not on a pipe or file: stdout carries only the result, stderr the logs."""
    isatty = getattr(sys.stderr, "isatty", None)
    if isatty is not None and isatty():
        sys.stderr.write("disttrain: checking the config ...\n")
        sys.stderr.flush()


def _run_job(cfg: dict[str, Any], run_dir: Path, overrides: list[str], job: Any) -> int:
    """One run (no sweep, no Hydra callbacks): the checked job trains without `@hydra.main`, which
    would compose the config a second time (~0.4 CPU-s before every run) only to hand the job a
    run dir and overrides this command already holds. What Hydra's job runner would do for it is
    done here: `hydra.job.env_set` into the environment, `hydra.job.chdir` into the run dir. An
    error that escapes the job is reported as Hydra reports it (overrides, traceback), exit 1."""
    import os
    import traceback

    os.environ.update({str(k): str(v) for k, v in job.env_set.items()})
    if job.chdir:
        os.chdir(run_dir)
    try:
        _freeze_and_launch(cfg, run_dir, overrides)
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


def _own_run_dir(cfg: dict[str, Any], args: Any, overrides: list[str], command: list[str]) -> Path:
    """This invocation's run dir, created before Hydra runs the job (Hydra would reuse any).

    The default `runs/NAME/TIMESTAMP` is claimed exclusively (a taken one gets a -1 suffix); a
    `hydra.run.dir=PATH` the user chose is continued only with the same config (see rundir.reuse).
    Both are checked to be writable first: one paragraph instead of a traceback after the freeze."""
    from disttrain import rundir
    from disttrain.config import compose
    from disttrain.launch.registry import launcher_for

    full = _COMPOSED.get(tuple(overrides))  # the checks' composition, unless the command added a key
    if full is None:
        full = compose(overrides, args.config_dir, args.config_name or "config", with_hydra=True)
    run_dir = Path(str(full.hydra.run.dir)).absolute()
    rundir.check_path(run_dir)
    launcher_for(cfg).check_command(run_dir, [*rundir.program(), "train", *command])
    if any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides):
        return rundir.reuse(run_dir, cfg, shared=cfg["nodes"] > 1)  # the nodes share one dir
    claimed = rundir.claim(run_dir)
    from disttrain.timing import mark

    mark("run_dir")
    return claimed


def _own_sweep_dir(args: Any, first_job: list[str]) -> list[str]:
    """`-m`: the sweep's folder (`runs/NAME/multirun_TIMESTAMP`) claimed exclusively, as a run dir."""
    from disttrain import rundir
    from disttrain.config import compose

    if any(o.lstrip("+").startswith("hydra.sweep.dir=") for o in args.overrides):
        return []  # the user's own folder: its job subdirs are theirs to reuse
    full = compose(first_job, args.config_dir, args.config_name or "config", with_hydra=True)
    sweep_dir = rundir.claim(Path(str(full.hydra.sweep.dir)).absolute())
    return [f"hydra.sweep.dir={_hydra_quote(str(sweep_dir))}"]


def _hydra_quote(value: str) -> str:
    """A Hydra override value that stays one string (a path may hold blanks, commas, brackets)."""
    return "'" + value.replace("'", "\\'") + "'"


def _multinode_run_dir(cfg: dict[str, Any], overrides: list[str]) -> list[str]:
    """Several nodes (by hand): a run dir name every node derives alike, unless hydra.run.dir is set."""
    from disttrain.launch.multinode import run_dir_name
    from disttrain.launch.registry import launcher_for
    from disttrain.launch.specs import detected
    from disttrain.preflight.launch_checks import rehearsal_warning

    spec = detected(os.environ)
    if spec is not None:
        spec.check_node_env(cfg)  # inside an srun step: SLURM_NNODES / SLURM_NTASKS against nodes
    if cfg["nodes"] == 1 or launcher_for(cfg).scheduler:  # the scheduler names the nodes' run dirs
        return []
    warning = rehearsal_warning(cfg)
    if warning:
        sys.stderr.write(f"disttrain: warning: {warning}\n")
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        return []
    return [f"hydra.run.dir={run_dir_name(cfg)}"]


# The user's command line for command.txt: Hydra must see sys.argv without the `train` subcommand.
_COMMAND: list[str] = []

# The checked config of each job (keyed by its overrides), with its `_target_` nodes settled
# (config/clean.py): the job runs exactly what was checked, not Hydra's unsettled composition.
_CHECKED: dict[tuple[str, ...], dict[str, Any]] = {}
_CHECKED_FROM: list[Any] = [None, "config"]  # --config-dir, --config-name of those checks
_KNOWN_MODE: list[Any] = []  # a single run's hydra.mode, from that composition (hydra_app.known_mode)


def _run_hydra_app(rest: list[str], config_name: str, command: list[str] | None = None) -> int:
    from disttrain.commands.hydra_app import known_mode, register_help_resolver, run_main
    from disttrain.config import config_dir
    from disttrain.config.schema import register

    register()
    register_help_resolver()  # config.yaml's hydra.help.template lists the groups through it
    known_mode(_KNOWN_MODE)
    from disttrain.rundir import program

    _COMMAND[:] = [*program(), "train", *(rest if command is None else command)]
    run_main(_hydra_task, str(config_dir()), config_name, rest)
    return 0


def _hydra_task(cfg: Any) -> dict[str, Any] | None:
    """Runs once per job in the parent: freeze the resolved config, launch, summarise."""
    from hydra.core.hydra_config import HydraConfig

    from disttrain.config import resolve
    from disttrain.config.errors import ConfigError
    from disttrain.preflight.checks import check_runtime, check_static

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).resolve()
    overrides = list(hc.overrides.task)
    plugin = "BasicSweeper" not in str(hc.sweeper.get("_target_", "BasicSweeper"))
    checked = _CHECKED.get(tuple(overrides))
    if checked is None and str(hc.mode) == "RunMode.RUN" and len(_CHECKED) == 1:
        # One run: the job cmd_train checked (hc.overrides.task shows `${...}` values resolved,
        # `model.in_features=64`, so the key misses; checking it again cost a compose and a dry step).
        checked = next(iter(_CHECKED.values()))
    if checked is None:  # a job a sweeper plugin chose (Optuna): compose, settle and check it now
        from disttrain.config import compose

        try:
            checked = resolve(compose(overrides, *_CHECKED_FROM), overrides)
            check_static(checked)
            check_runtime(checked)
        except ConfigError as exc:
            sys.stderr.write(f"disttrain: {exc}\n")
            raise SystemExit(2) from None
    summary = _freeze_and_launch(checked, run_dir, overrides)
    if plugin and summary is not None:
        return _objective(summary)  # type: ignore[return-value]
    return summary


def _objective(summary: dict[str, Any]) -> float:
    """What a sweeper plugin (Optuna) minimises: the final val/loss, else the last train loss."""
    for key in ("val/loss", "train/loss"):
        if isinstance(summary.get(key), int | float):
            return float(summary[key])
    return float("nan")


def _freeze_and_launch(cfg: dict[str, Any], run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    from disttrain.launch import LaunchError, launch, submit
    from disttrain.rundir import command_line, freeze, run_status
    from disttrain.timing import mark

    mark("hydra_task")
    own_checkpoint_dir(cfg, run_dir)
    reshaped = same_global_batch(cfg, run_dir)
    if reshaped:  # frozen as the ranks will train it: config.yaml and the checkpoints agree
        sys.stderr.write(f"disttrain: resuming at another world size: {reshaped}\n")
    freeze(run_dir, cfg, overrides, _COMMAND or command_line())
    if submit(cfg, run_dir, _COMMAND or command_line()):
        return None  # a scheduler's nodes train (sbatch, a Kubeflow job); status.json is theirs
    try:
        with run_status(run_dir):  # status.json: running -> finished / failed / interrupted
            launch(cfg, run_dir)
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    return print_summary(run_dir)


def same_global_batch(cfg: dict[str, Any], run_dir: Path) -> str | None:
    """Resumed at another data-parallel size (`disttrain resume RUN nproc_per_node=1`, `train
    resume=PATH` on another world): the batch shape that keeps the checkpoint's global batch, set in
    `cfg`; what changed, or None."""
    from disttrain.checkpoint.geometry import checkpoint_meta, keep_global_batch
    from disttrain.checkpoint.manager import resume_location
    from disttrain.strategies import specs

    return keep_global_batch(cfg, checkpoint_meta(resume_location(cfg, run_dir)), specs.dp_degree(cfg))


def own_checkpoint_dir(cfg: dict[str, Any], run_dir: Path) -> None:
    """An explicit `checkpoint.dir`: one launcher at a time (its lock, held until this command
    ends), and never another run's checkpoints unless `resume=` names them. Node 0 speaks for a
    multi-node run (every node shares the folder). A scheduler's job (Slurm, Kubernetes) is not
    checked here: no launcher of it lives in this process, and its requeues reuse one run dir."""
    from disttrain import owner
    from disttrain.launch.registry import launcher_for
    from disttrain.shared_dir import checkpoint_dir

    if not cfg["checkpoint"]["dir"] or cfg["node_rank"] != 0 or launcher_for(cfg).scheduler:
        return
    directory = checkpoint_dir(cfg, run_dir)
    owner.hold(directory, run_dir, "checkpoint.dir", "checkpoint folder")
    owner.claim_checkpoints(directory, run_dir, cfg["resume"])


def print_summary(run_dir: Path) -> dict[str, Any] | None:
    import json

    from disttrain.rundir import RunDir

    path = RunDir(run_dir).summary
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    vals = " ".join(f"{k}={s[k]:.4f}" for k in sorted(s) if k.startswith("val/"))
    gpu = s.get("gpu_mem_allocated_peak_gib")  # CUDA runs only: the CPU line stays as it was
    mem = f", peak GPU memory {gpu:.2f} GiB ({s['gpu_mem_reserved_peak_gib']:.2f} reserved)" if gpu else ""
    stopped = f" (stopped early: {s['stop_reason']})" if s.get("early_stopped") else ""
    sys.stdout.write(
        f"done: {s['steps']} steps{stopped}, {vals or 'no validation'}, {s['samples_per_s']:.0f} samples/s, "
        f"{s['train_time_s']:.1f} s training{mem} | run dir: {run_dir}\n"
    )
    return dict(s)


def _train_as_launched_rank(args: Any) -> int:
    """Inside a rank torchrun/Kubeflow/TorchX/srun started: see disttrain.commands.launched."""
    from disttrain.commands.launched import train_as_launched_rank

    return train_as_launched_rank(args)


def _print_cfg(args: Any) -> int:
    """`train --cfg job`: what config.yaml will hold (resolved, `_target_` nodes settled: Hydra would
    print its composition before that, `${...}` and all) and `train --cfg hydra --resolve`: Hydra deletes the job's keys before
    resolving the `hydra` node, so its `${name}` (hydra.run.dir) fails; here it resolves against the
    whole config, as at run time. Values only a running job has (hydra.job.num) stay `???`."""
    from omegaconf import OmegaConf, open_dict

    from disttrain.config import compose

    cfg = compose(
        args.overrides, args.config_dir, args.config_name or "config", with_hydra=args.cfg == "hydra"
    )
    if args.cfg == "job":
        checked = _CHECKED.get(tuple(args.overrides))
        if checked is not None:  # what config.yaml will hold: resolved once, `_target_` nodes settled
            import yaml

            sys.stdout.write(yaml.safe_dump(checked, sort_keys=False))
            return 0
        from disttrain.config.gpus import resolve_nproc

        job = OmegaConf.to_container(cfg, resolve=True)
        resolve_nproc(job)  # type: ignore[arg-type]  # nproc_per_node=auto as the run freezes it
        sys.stdout.write(OmegaConf.to_yaml(job))
        return 0
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # the `${hydra:...}` resolver, as under @hydra.main
    OmegaConf.set_readonly(cfg.hydra, None)  # as Hydra's own --cfg does (compose hands it read-only)
    with open_dict(cfg.hydra):
        for key in ("help", "hydra_help"):  # as Hydra's --cfg hydra: its help templates are not config
            cfg.hydra.pop(key, None)
    OmegaConf.resolve(cfg)
    sys.stdout.write(OmegaConf.to_yaml({"hydra": cfg.hydra}))
    return 0
