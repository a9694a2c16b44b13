"""`disttrain <command>`: subcommands over one Hydra app. No heavy imports at module top (fast --help).

argv -> cli -> config (compose, check) -> run dir (frozen) -> launch -> worker per rank
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from disttrain.commands import COMMANDS as TARGETS
from disttrain.commands import USER_CODE_COMMANDS

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
  sweep    status|resume SWEEP_DIR: each job of a `train -m` sweep and its state (from the scheduler
           where there is one); resume submits again only the failed and cancelled jobs
  export   RUN_DIR --out model.pt|model.safetensors: the consolidated model for plain PyTorch
  eval     RUN_DIR|CHECKPOINT [key=value ...] [--out FILE]: val metrics of a checkpoint, any world
           size or strategy, on the run's or another validation set (data.val=FILE); never trains
  predict  RUN_DIR|CHECKPOINT --out FILE.jsonl|.pt|.npy: the model's outputs, one row per sample
  env      environment report: versions, GPUs, backends, network, variables, known traps
  bench    `bench comm`: collective benchmark + correctness check on the configured ranks
  plan     per-rank memory of ddp/zero/fsdp/hsdp/tp/pipeline layouts; which fit; a recommendation
           (--simulate: the configured strategy's real setup for sampled ranks on a fake world;
            --load-at OVERRIDES: its checkpoint's DCP load planned at another layout)
  runs     table of the runs under DIR (default ./runs): status, step, loss, best val
  show     one run: config diff against defaults, final metrics, checkpoints, how to reproduce it
  compare  two or more runs side by side: config diff and final metrics (--plot FILE: curves)
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


def _lazy(target: str) -> Callable[[list[str]], int]:
    """The command at "module:function", imported only when it runs (fast --help)."""

    def command(rest: list[str]) -> int:
        import importlib

        module, _, name = target.partition(":")
        result: int = getattr(importlib.import_module(module), name)(rest)
        return result

    return command


COMMANDS: dict[str, Callable[[list[str]], int]] = {name: _lazy(target) for name, target in TARGETS.items()}


def add_cwd_to_path() -> None:
    """Append (never prepend) the cwd: a `yaml.py` or `torch.py` lying in a shared folder must not
    shadow a dependency, while the user's own packages stay importable."""
    import os

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


# Commands that train: they announce their start-up phases on stderr (disttrain.observe.phases).
TRAINING_COMMANDS = ("train", "resume", "rerun")
# Commands that start ranks (launch.launch), or run as a rank torchrun started (`train`).
LAUNCHING_COMMANDS = (*TRAINING_COMMANDS, "eval", "predict")
# Flags with which `train` prints instead of training (help, --cfg, --info, shell completion).
PRINTING_FLAGS = frozenset(
    ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
)


def announces_phases(argv: list[str]) -> bool:
    """A command that trains, in the launcher (not a rank torchrun started), and not printing."""
    import os

    launched_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    return argv[0] in TRAINING_COMMANDS and not launched_rank and not PRINTING_FLAGS.intersection(argv)


def main(argv: list[str] | None = None) -> int:
    """The `disttrain` program (argv None: sys.argv, and the process ends here) or one command in
    this process (a test, a notebook: `main(["train", ...])` returns its exit code)."""
    if argv is not None:
        import time

        return _main(argv, entered=time.time())  # Enter is this call, not this process's start
    if sys.argv[1:2] and sys.argv[1] in LAUNCHING_COMMANDS:
        from disttrain.procs import startup_without_collector

        # until the launch (launch.launch, or a rank torchrun started: commands.launched); the
        # other commands never turn it back on, and some of them (plan --simulate, export) are
        # long enough to make garbage that only a collection frees
        startup_without_collector()
    try:
        rc = _main(sys.argv[1:])
    except SystemExit as exc:  # a launch failure's exit status (disttrain.commands.train)
        if "torch" not in sys.modules:
            raise
        rc = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            sys.stderr.write(f"{exc.code}\n")
    if "torch" in sys.modules:
        exit_now(rc)
    return rc


def exit_now(rc: int) -> None:
    """End the program without tearing its interpreter down: what Python's exit does first is done
    (its threads are joined, its exit handlers run: logging's flush, the fork server's stop, the
    user's own), the standard streams are flushed, then `os._exit`.

    With torch imported, Python's finalization (every module's teardown, the collection of the
    objects torch holds) takes 0.3-0.6 s on an idle machine and 6-8 s on a loaded one, all of it
    after `done:` is printed, with nothing left to do. `atexit._run_exitfuncs` (CPython's own
    call at exit, undocumented) is the one way to run the exit handlers without the rest."""
    import atexit
    import contextlib
    import os
    import threading

    for thread in threading.enumerate():  # as Python's exit: a non-daemon thread finishes first
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing to say
            stream.flush()
    os._exit(rc)


def _main(argv: list[str], entered: float | None = None) -> int:
    """One command; `entered`: when it was asked for (None: the Enter time this process was handed,
    else its start)."""
    from disttrain.timing import mark

    mark("cli")
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    if "--version" in argv:  # any command: disttrain's version (Hydra's parser would print Hydra's)
        from disttrain import __version__

        sys.stdout.write(f"disttrain {__version__}\n")
        return 0
    if argv[0] == "__complete":  # the completion scripts' query (see disttrain.commands.completion)
        from disttrain.commands.completion import cmd_complete

        return cmd_complete(argv[1:])
    command = COMMANDS.get(argv[0])
    if command is None:
        sys.stderr.write(
            f"disttrain: unknown command {argv[0]!r}. Allowed: {', '.join(COMMANDS)}. "
            "HINT: run `disttrain --help`.\n"
        )
        return 2
    from disttrain.observe import phases

    try:
        if announces_phases(argv):
            phases.begin("compose", entered)  # the first line, before Hydra or torch is imported
        if argv[0] in USER_CODE_COMMANDS:
            add_cwd_to_path()
        return _checked(command, argv[1:])
    except KeyboardInterrupt:
        return interrupted(phases.abort())
    finally:
        phases.abort()
        if "disttrain.owner" in sys.modules:  # the run dir / checkpoint dir locks this command took
            sys.modules["disttrain.owner"].release_all()


def _checked(command: Callable[[list[str]], int], rest: list[str]) -> int:
    """`command`, with a config mistake as one paragraph and exit 2."""
    from disttrain.config.errors import ConfigError
    from disttrain.observe import phases

    try:
        return command(rest)
    except ConfigError as exc:
        phases.abort()
        sys.stderr.write(f"disttrain: {exc}\n")
        return 2


def interrupted(during: str | None) -> int:
    """Ctrl-C in the launcher: one line, exit 130 (128 + SIGINT), whatever it interrupted."""
    sys.stderr.write(f"disttrain: interrupted (SIGINT){f' during {during}' if during else ''}\n")
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
