"""`disttrain rerun RUN_DIR [key=value ...] [--run-dir NEW]`: the same run again, into a new run dir.

It starts from RUN_DIR's frozen config.yaml (resolved once when the run began: no re-composition,
no today's defaults), so on the same hardware, thread count and code the losses and weights are
bitwise equal. Overrides change single keys as with `disttrain resume`. It warns when the code
differs from the run's: another git SHA than git.json's, or uncommitted changes (git.diff holds the
run's own uncommitted changes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config.run import Run

RERUN_USAGE = """\
usage: disttrain rerun RUN_DIR [key=value ...] [--run-dir NEW] [--trust]

Run RUN_DIR's frozen config.yaml again into a new run dir (default: RUN_DIR-rerun-DATE_TIME):
bitwise equal on the same hardware and thread count. Overrides change single keys
(`trainer.max_steps=100`, `seed=1`); group options cannot change (the config is resolved).
A run dir someone else made is built only if its `_target_`s are disttrain's and torch's own, or
with --trust (its config is code).
"""


def code_warnings(run_dir: Path, cwd: Path) -> list[str]:
    """Why this checkout may not reproduce RUN_DIR: another SHA, or a dirty tree (now or then)."""
    import json

    from disttrain.rundir import git_state

    try:
        then: dict[str, Any] = json.loads((run_dir / "git.json").read_text())
    except (OSError, ValueError):
        return [f"{run_dir}/git.json is missing: the code the run used is unknown"]
    now = git_state(cwd)
    out = []
    if then.get("sha") and now.get("sha") != then["sha"]:
        out.append(
            f"the current git SHA {now.get('sha') or '(no git repo)'} differs from the run's {then['sha']}: "
            f"`git checkout {then['sha']}` for the same code"
        )
    if now.get("dirty"):
        out.append("the working tree has uncommitted changes: the rerun may differ")
    if then.get("dirty"):
        out.append(f"the run itself had uncommitted changes (saved in {run_dir / 'git.diff'})")
    return out


def parse(rest: list[str]) -> tuple[Path, list[str], Path]:
    from disttrain.commands.resume import run_dir_arg

    new: str | None = None
    args: list[str] = []
    it = iter(rest)
    for tok in it:
        if tok == "--run-dir":
            new = next(it, None)
            if new is None:
                raise ConfigError("--run-dir", None, "a folder for the new run", RERUN_USAGE.splitlines()[0])
        elif tok.startswith("--run-dir="):
            new = tok.partition("=")[2]
        else:
            args.append(tok)
    if not args:
        raise ConfigError("RUN_DIR", None, "a run directory holding config.yaml", RERUN_USAGE.splitlines()[0])
    run_dir = run_dir_arg(args[0], RERUN_USAGE)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    target = Path(new).resolve() if new else run_dir.with_name(f"{run_dir.name}-rerun-{stamp}")
    if (target / "config.yaml").exists() or target == run_dir:
        raise ConfigError(
            "--run-dir", str(target), "a new folder (not a run dir already)", "pick another --run-dir."
        )
    return run_dir, args[1:], target


def own_checkpoints(run: Run, target: Path, overrides: list[str]) -> tuple[Run, str]:
    """A rerun starts fresh in checkpoints of its own: the original's `checkpoint.dir` (kept in its
    frozen config with resume=auto) would be resumed, continued and pruned. One node: the new run
    dir's checkpoints/; several nodes (which need a shared folder): a sibling of the original's.
    An explicit `checkpoint.dir=` override wins. Returns the run to train and a note for the console."""
    original = run.checkpoint.dir
    if not original or any(o.lstrip("+").startswith("checkpoint.dir=") for o in overrides):
        return run, ""
    from disttrain.shared_dir import checkpoint_dir

    shared = run.world.nodes != 1  # a sibling in the same store for a URL (s3://b/run -> s3://b/<new>)
    own = str(checkpoint_dir(run, target).parent / target.name) if shared else None
    where = own or f"{target}/checkpoints"
    return run.updated(
        {"checkpoint": {"dir": own}}
    ), f" (checkpoints: {where}; the original's {original} stays as it is)"


def cmd_rerun(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(RERUN_USAGE)
        return 0 if rest else 2
    import yaml

    from disttrain.commands.resume import apply_overrides
    from disttrain.commands.train import freeze_and_launch
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_runtime, check_static
    from disttrain.rundir import read_config
    from disttrain.trust import check_trusted, take_trust_flag

    rest, trusted = take_trust_flag(rest)
    run_dir, overrides, target = parse(rest)
    saved_cfg = read_config(run_dir)
    check_trusted(run_dir, saved_cfg, trusted, launches=overrides)  # someone else's code: --trust
    run, note = own_checkpoints(Run.of(apply_overrides(saved_cfg, overrides)), target, overrides)
    check_static(run)
    check_runtime(run, launched=saved_cfg)  # what its launch warned about is not repeated
    for warning in code_warnings(run_dir, Path.cwd()):
        sys.stderr.write(f"disttrain rerun: warning: {warning}\n")
    saved = (
        yaml.safe_load((run_dir / "overrides.yaml").read_text())
        if (run_dir / "overrides.yaml").exists()
        else []
    )
    sys.stderr.write(f"disttrain rerun: {run_dir} -> {target}{note}\n")
    from disttrain.owner import hold

    hold(target, target, "--run-dir", "run dir")  # two reruns into one folder: the second is refused
    freeze_and_launch(run, target, [*(saved or []), *overrides])
    return 0
