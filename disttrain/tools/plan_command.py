"""`disttrain plan`: the command. It composes and checks the config, then runs the planner's shape
arithmetic (tools/planner.py), and with `--simulate` the rehearsal on a fake world
(tools/simulate.py, and tools/simulate_load.py for `--load-at`), and prints the result.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from disttrain.tools.planner import plan, render

if TYPE_CHECKING:
    from disttrain.config.run import Run


def cmd_plan(rest: list[str]) -> int:
    """`disttrain plan [--json] [--simulate] [overrides]`: memory per rank for each layout, and a
    recommendation; --simulate rehearses the configured strategy's real setup on a fake world."""
    p = argparse.ArgumentParser(prog="disttrain plan", description=cmd_plan.__doc__)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="run the configured strategy's real setup (device mesh, fully_shard, parallelize_module, "
        "pipeline split) for sampled ranks of nodes x nproc_per_node (<= 1024) on torch's fake process "
        "group with a meta-device model; report each rank's shards against the plan, the collectives of "
        "one step (FakeTensorMode), and every failure by rank and key (exit 2). plan.gpu_mem_gb is the "
        "simulated device's memory",
    )
    p.add_argument(
        "--no-step", action="store_true", help="with --simulate: skip the one-step collective count"
    )
    p.add_argument(
        "--load-at",
        default=None,
        metavar="OVERRIDES",
        help="with --simulate: plan DCP's load, at the layout these overrides make (quoted, e.g. "
        "'nproc_per_node=4 strategy=fsdp'), of a checkpoint the configured layout saves; report each "
        "sampled loading rank's bytes and the saved ranks' files it reads, and name every tensor that "
        "would not load (exit 2)",
    )
    p.add_argument("--config-dir", default=None, help="your own config folder, as for train")
    p.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. model.hidden=[4096,4096] plan.gpu_mem_gb=40"
    )
    args = p.parse_intermixed_args(rest)
    from disttrain.config import ConfigError, compose, resolve
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_static

    if args.load_at is not None and not args.simulate:  # a usage mistake: said before composing
        raise ConfigError(
            "--load-at",
            args.load_at,
            "--load-at with --simulate",
            "add --simulate (the load is planned on its ranks)",
        )
    run = Run.of(resolve(compose(args.overrides, args.config_dir), args.overrides))
    check_static(run)
    target = load_layout(args) if args.load_at is not None else None
    result = plan(run)
    if args.simulate:
        from disttrain.tools import simulate

        result["simulate"] = simulate.simulate(run, result, step=not args.no_step, load_at=target)
    if args.json:
        from disttrain.tools.render import print_json

        print_json(result)
    elif args.simulate:
        simulate.render(result["simulate"])
    else:
        render(result)
    return 0


def load_layout(args: argparse.Namespace) -> Run:
    """The config of `--load-at`'s layout: the saved run's overrides, then its own (checked alike)."""
    import shlex

    from disttrain.config import ConfigError, compose, resolve
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_static
    from disttrain.tools.simulate_load import target_overrides

    extra = shlex.split(args.load_at)
    if not extra:
        raise ConfigError(
            "--load-at", args.load_at, "overrides of the loading layout", "e.g. --load-at 'nproc_per_node=4'"
        )
    overrides = target_overrides(args.overrides, extra)
    target = Run.of(resolve(compose(overrides, args.config_dir), overrides))
    check_static(target)
    return target
