"""`disttrain <command>`: subcommands over one Hydra app. No heavy imports at module top (fast --help).

argv -> cli -> config (compose, check) -> run dir (frozen) -> launch -> worker per rank
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

USAGE = """\
usage: disttrain <command> [flags] [key=value ...]

Config-driven distributed PyTorch training: Hydra config groups, checked before launch, frozen
into a run directory, ranks started by torchrun or mp.spawn.

commands:
  train    compose + check the config, freeze it into a run dir, launch the ranks, train.
           Takes every @hydra.main flag: -m (multirun), --cfg job, --config-dir DIR, --help, ...
  config   print the resolved config after the same checks (fast: no torch import)
  resume   RUN_DIR [key=value ...]: continue a run from its latest checkpoint with its saved config
  rerun    RUN_DIR [key=value ...] [--run-dir NEW]: the same run again from its frozen config.yaml
  export   RUN_DIR --out model.pt|model.safetensors: the consolidated model for plain PyTorch
  env      environment report: versions, GPUs, backends, network, variables, known traps
  bench    `bench comm`: collective benchmark + correctness check on the configured ranks
  plan     per-rank memory of ddp/zero/fsdp/hsdp/tp/pipeline layouts; which fit; a recommendation
  runs     table of the runs under DIR (default ./runs): status, step, loss, best val
  show     one run: config diff against defaults, final metrics, checkpoints, how to reproduce it
  compare  two runs side by side: config diff and metric diff
           (env, bench, plan, runs, show and compare take --json for scripts)
  completion  bash|zsh: the shell completion script (eval "$(disttrain completion bash)")

examples:
  disttrain train                                   # MLP on digits, 2 CPU ranks, DDP over gloo
  disttrain train strategy=single nproc_per_node=1 optim.lr=1e-2 trainer.max_epochs=3
  disttrain train -m optim.lr=1e-3,1e-2             # two runs, each fully launched
  disttrain train --config-dir ./configs experiment=paper
  disttrain config data=synthetic model.hidden=[256,256]
  torchrun --nproc-per-node 2 -m disttrain train    # runs as the ranks torchrun started

`disttrain train --help` lists every config group and its options.
"""


def _hydra_args(rest: list[str]) -> Any:
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(rest)


def _compose_checked(overrides: list[str], args: Any, runtime: bool) -> dict[str, Any]:
    """Compose (once: Hydra's own node is kept for the run dir, see _own_run_dir), resolve, check."""
    from disttrain.config import compose, resolve
    from disttrain.config.validate import check_runtime, check_static
    from disttrain.timing import mark

    full = compose(overrides, args.config_dir, args.config_name or "config", with_hydra=True)
    _COMPOSED[tuple(overrides)] = full
    cfg = resolve(full, overrides)
    check_static(cfg)
    mark("static_checks")
    if runtime:
        check_runtime(cfg)
        mark("runtime_checks")
    return cfg


def cmd_config(rest: list[str]) -> int:
    """Print the resolved config (the same composition and static checks as `train`)."""
    import yaml

    args = _hydra_args(rest)
    if args.help:
        sys.stdout.write("usage: disttrain config [--config-dir DIR] [key=value ...]\n\n")
        return _key_help(args)
    cfg = _compose_checked(args.overrides, args, runtime=False)
    sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))
    return 0


def _key_help(args: Any) -> int:
    """Each key's type, default (given the overrides' group choices) and the schema's help text."""
    from disttrain.config import compose
    from disttrain.config.keyhelp import format_keys

    sys.stdout.write(format_keys(compose(args.overrides, args.config_dir, args.config_name or "config")))
    return 0


def _shell_completion(request: str) -> int:
    """`train -sc install=bash` / `--shell-completion query=zsh`: disttrain's script, not Hydra's
    (whose script calls `disttrain -sc` and parses the line with `train` in it)."""
    from disttrain.completion import SCRIPTS, cmd_complete, cmd_completion

    action, _, shell = request.partition("=")
    shell = shell or "bash"
    if action == "query":
        return cmd_complete([shell])
    if action == "uninstall":
        sys.stdout.write("complete -r disttrain\n")
        return 0
    return cmd_completion([shell if shell in SCRIPTS else ""])


def cmd_train(rest: list[str]) -> int:
    from disttrain.launch import launched_externally
    from disttrain.launch.kubeflow_env import kubeflow_node_env, node_overrides
    from disttrain.launch.slurm import allocation_overrides

    args = _hydra_args(rest)
    if args.shell_completion:
        return _shell_completion(" ".join(args.overrides))
    # A Kubeflow pod running `disttrain train` is a node launcher (PyTorchJob's RANK is its node rank).
    if launched_externally() and kubeflow_node_env() is None:
        return _train_as_launched_rank(args)
    # inside a Kubeflow pod or an srun step: node_rank, master_addr (and port) from their variables
    slurm = allocation_overrides(node_overrides(args.overrides))
    rest, args.overrides = [*rest, *slurm[len(args.overrides) :]], slurm
    command = rest
    if not (args.help or args.hydra_help or args.info or args.shell_completion):
        # Check every job before Hydra creates a single run dir: nothing half-written on bad input.
        from disttrain.config import expand_sweep

        # A sweeper plugin's syntax (Optuna's interval(...)) expands only inside the plugin: then the
        # base job is checked here and every job again as the plugin launches it (_hydra_task).
        for job in expand_sweep(args.overrides) if args.multirun else [args.overrides]:
            cfg = _compose_checked(job, args, runtime=not args.cfg)
            _CHECKED[tuple(job)] = cfg
        _CHECKED_FROM[:] = [args.config_dir, args.config_name or "config"]
        if args.cfg == "job" and not args.multirun and not args.package:
            # Hydra would print its own composition, before the `_target_` nodes are settled.
            from omegaconf import OmegaConf

            from disttrain.config import compose

            job_cfg = compose(args.overrides, args.config_dir, args.config_name or "config")
            sys.stdout.write(OmegaConf.to_yaml(job_cfg, resolve=args.resolve))
            return 0
        if args.multirun and not args.cfg:
            rest = [*rest, *_own_sweep_dir(args, expand_sweep(args.overrides)[0])]
        if not args.multirun and not args.cfg:
            extra = _multinode_run_dir(cfg, args.overrides)
            command = [*rest, *extra]  # every node derives the same dir: part of the command
            run_dir = _own_run_dir(cfg, args, [*args.overrides, *extra], command)
            rest = [*command, f"hydra.run.dir={_hydra_quote(str(run_dir))}"]
            _KNOWN_MODE[:] = [_COMPOSED[tuple(args.overrides)].hydra.mode]
    if args.help:  # Hydra's help (groups, options, the config), then every key's type and help text
        try:
            _run_hydra_app(rest, args.config_name or "config", command)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        return _key_help(args)
    return _run_hydra_app(rest, args.config_name or "config", command)


def _own_run_dir(cfg: dict[str, Any], args: Any, overrides: list[str], command: list[str]) -> Path:
    """This invocation's run dir, created before Hydra runs the job (Hydra would reuse any).

    The default `runs/NAME/TIMESTAMP` is claimed exclusively (a taken one gets a -1 suffix); a
    `hydra.run.dir=PATH` the user chose is continued only with the same config (see rundir.reuse).
    Both are checked to be writable first: one paragraph instead of a traceback after the freeze."""
    from disttrain import rundir
    from disttrain.config import compose

    full = _COMPOSED.get(tuple(overrides))  # the checks' composition, unless the command added a key
    if full is None:
        full = compose(overrides, args.config_dir, args.config_name or "config", with_hydra=True)
    run_dir = Path(str(full.hydra.run.dir)).absolute()
    rundir.check_path(run_dir)
    if cfg["launcher"]["name"] == "slurm":
        from disttrain.launch.slurm import check_script_inputs

        check_script_inputs(run_dir, [Path(sys.argv[0]).name, "train", *command])
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
    from disttrain.config.launch_checks import rehearsal_warning
    from disttrain.launch.multinode import run_dir_name
    from disttrain.launch.slurm import check_allocation

    check_allocation(cfg)  # inside srun: SLURM_NNODES / SLURM_NTASKS against nodes
    if cfg["nodes"] == 1 or cfg["launcher"]["name"] in ("slurm", "k8s"):
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
_COMPOSED: dict[tuple[str, ...], Any] = {}  # each job's composition with its `hydra` node (run dir)
_KNOWN_MODE: list[Any] = []  # a single run's hydra.mode, from that composition (see _known_mode)


def _run_hydra_app(rest: list[str], config_name: str, command: list[str] | None = None) -> int:
    import hydra

    from disttrain.config import config_dir
    from disttrain.config.schema import register

    register()
    if {"--help", "-h"} & set(rest):
        _hide_schemas_in_help()
    _known_mode()
    from disttrain.rundir import program

    argv0 = sys.argv[0]
    _COMMAND[:] = [*program(), "train", *(rest if command is None else command)]
    sys.argv = [argv0, *rest]
    try:
        hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(_hydra_task)()
    finally:
        sys.argv = [argv0, "train", *rest]
    return 0


def _known_mode() -> None:
    """@hydra.main composes the whole config one extra time only to read `hydra.mode` (Hydra.get_mode,
    ~0.2 s before every run); a single run's checks composed the same config and overrides already."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode
    if getattr(original, "_disttrain", False):
        return

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        if _KNOWN_MODE:
            return _KNOWN_MODE.pop()
        return original(self, config_name, overrides)

    get_mode._disttrain = True  # type: ignore[attr-defined]
    Hydra.get_mode = get_mode  # type: ignore[method-assign]


def _hide_schemas_in_help() -> None:
    """`--help` lists each group's options; the `base_*` schemas the YAML options extend (Hydra's
    extend-a-schema pattern) are not choices, so they are left out of that list."""
    from hydra._internal.hydra import Hydra

    original = Hydra.format_config_groups
    if getattr(original, "_disttrain", False):
        return

    def format_config_groups(self: Hydra, predicate: Callable[[str], bool], compact: bool = True) -> str:
        lines = []
        for line in original(self, predicate, compact).splitlines():
            head, sep, items = line.partition(": ")
            if sep and compact:
                line = head + sep + ", ".join(o for o in items.split(", ") if not o.startswith("base_"))
            if not line.strip().startswith("base_"):
                lines.append(line)
        return "".join(f"{line}\n" for line in lines)

    format_config_groups._disttrain = True  # type: ignore[attr-defined]
    Hydra.format_config_groups = format_config_groups  # type: ignore[method-assign]


def _hydra_task(cfg: Any) -> dict[str, Any] | None:
    """Runs once per job in the parent: freeze the resolved config, launch, summarise."""
    from hydra.core.hydra_config import HydraConfig

    from disttrain.config import resolve
    from disttrain.config.errors import ConfigError
    from disttrain.config.validate import check_runtime, check_static

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).resolve()
    overrides = list(hc.overrides.task)
    plugin = "BasicSweeper" not in str(hc.sweeper.get("_target_", "BasicSweeper"))
    checked = _CHECKED.get(tuple(overrides))
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
    from disttrain.launch import LaunchError, launch
    from disttrain.rundir import command_line, freeze, run_status
    from disttrain.timing import mark

    mark("hydra_task")
    freeze(run_dir, cfg, overrides, _COMMAND or command_line())
    mark("frozen")
    if cfg["launcher"]["name"] == "slurm":
        from disttrain.launch.slurm import submit

        submit(cfg, run_dir, _COMMAND or command_line())  # the job's nodes train; status.json is theirs
        return None
    if cfg["launcher"]["name"] == "k8s":
        from disttrain.launch import k8s

        if not k8s.in_pod():
            k8s.submit(cfg, run_dir)  # the job's pods train, each into its own <run_root>/<job>
            return None
        k8s.check_pod(cfg)
    try:
        with run_status(run_dir):  # status.json: running -> finished / failed / interrupted
            launch(cfg, run_dir)
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    return _print_summary(run_dir)


def _print_summary(run_dir: Path) -> dict[str, Any] | None:
    import json

    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    vals = " ".join(f"{k}={s[k]:.4f}" for k in sorted(s) if k.startswith("val/"))
    sys.stdout.write(
        f"done: {s['steps']} steps, {vals or 'no validation'}, {s['samples_per_s']:.0f} samples/s, "
        f"{s['train_time_s']:.1f} s training | run dir: {run_dir}\n"
    )
    return dict(s)


def _train_as_launched_rank(args: Any) -> int:
    """Inside a rank torchrun/Kubeflow/TorchX/srun started: see disttrain.launch.external."""
    from disttrain.launch.external import train_as_launched_rank

    return train_as_launched_rank(args)


def _tool(target: str) -> Callable[[list[str]], int]:
    """A command implemented in disttrain.tools, imported only when it runs (fast --help)."""

    def command(rest: list[str]) -> int:
        import importlib

        module, _, name = target.partition(":")
        result: int = getattr(importlib.import_module(f"disttrain.tools.{module}"), name)(rest)
        return result

    return command


def _command(target: str) -> Callable[[list[str]], int]:
    """A command implemented in another module, imported only when it runs (fast --help)."""

    def command(rest: list[str]) -> int:
        import importlib

        module, _, name = target.partition(":")
        result: int = getattr(importlib.import_module(module), name)(rest)
        return result

    return command


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "config": cmd_config,
    "resume": _command("disttrain.resume:cmd_resume"),
    "rerun": _command("disttrain.rerun:cmd_rerun"),
    "export": _command("disttrain.resume:cmd_export"),
    "env": _tool("envreport:cmd_env"),
    "bench": _tool("benchcmd:cmd_bench"),
    "plan": _tool("planner:cmd_plan"),
    "runs": _tool("runs:cmd_runs"),
    "show": _tool("runs:cmd_show"),
    "compare": _tool("runs:cmd_compare"),
    "completion": _command("disttrain.completion:cmd_completion"),
}


# Commands that build the user's `_target_`s (`_target_: mylab.nets.Net` from the working directory).
# The read-only ones (config, runs, show, compare, env, plan) never import from the cwd.
USER_CODE_COMMANDS = ("train", "resume", "export", "bench")


def add_cwd_to_path() -> None:
    """Append (never prepend) the cwd: a `yaml.py` or `torch.py` lying in a shared folder must not
    shadow a dependency, while the user's own packages stay importable."""
    import os

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def main(argv: list[str] | None = None) -> int:
    from disttrain.timing import mark

    mark("cli")
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    if "--version" in argv:  # any command: disttrain's version (Hydra's parser would print Hydra's)
        from disttrain import __version__

        sys.stdout.write(f"disttrain {__version__}\n")
        return 0
    if argv[0] == "__complete":  # the completion scripts' query (see disttrain.completion)
        from disttrain.completion import cmd_complete

        return cmd_complete(argv[1:])
    command = COMMANDS.get(argv[0])
    if command is None:
        sys.stderr.write(
            f"disttrain: unknown command {argv[0]!r}. Allowed: {', '.join(COMMANDS)}. "
            "HINT: run `disttrain --help`.\n"
        )
        return 2
    if argv[0] in USER_CODE_COMMANDS:
        add_cwd_to_path()
    from disttrain.config.errors import ConfigError

    try:
        return command(argv[1:])
    except ConfigError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("disttrain: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
