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
    finally:
        if "disttrain.owner" in sys.modules:  # the run dir / checkpoint dir locks this command took
            sys.modules["disttrain.owner"].release_all()


if __name__ == "__main__":
    raise SystemExit(main())
