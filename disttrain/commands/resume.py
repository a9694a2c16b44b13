"""`disttrain resume RUN_DIR [key=value ...]`: continue a run in its own run dir.

resume reuses the run dir's frozen config.yaml (overrides change single keys: a new world size,
more steps) and continues from its latest whole checkpoint, in the same run dir.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config.run import Run

RESUME_USAGE = """\
usage: disttrain resume RUN_DIR [key=value ...] [--trust]

Continue the run in RUN_DIR from its latest whole checkpoint, with its saved config.yaml.
Overrides change single keys, typed as `disttrain train` types them, e.g. `nproc_per_node=1`
(the checkpoint reshards) or `trainer.max_steps=2000`; `strategy=fsdp` switches a group's option
(not model, data or experiment); `+key=value` adds a key under a `_target_` (model, optim, data).
config.yaml changes only after every check passed; command.txt keeps the first command and
commands.txt lists every command that ran in the run dir. A run dir someone else made (or whose
config.yaml changed since disttrain wrote it) is built only if its `_target_`s are disttrain's and
torch's own, or with --trust: its config is code.
"""


def run_dir_arg(arg: str, usage: str) -> Path:
    """RUN_DIR from the command line: a folder holding config.yaml, else a ConfigError."""
    run_dir = Path(arg).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("RUN_DIR", arg, "a run directory holding config.yaml", usage.splitlines()[0])
    return run_dir


# Groups whose option may change on resume (`strategy=fsdp`: the checkpoint reshards). The model,
# the data and an experiment define what the checkpoint holds: they stay.
SWITCHABLE = ("backend", "strategy", "amp", "optim", "sched", "launcher", "checkpoint")
FIXED = ("model", "data", "experiment", "peft")


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The saved config with `key=value`, `+key=value`, `~key` applied through the typed schema,
    exactly as `disttrain train` types them: `seed=abc` or `trainer.batch_size=[1,2]` is a config
    error here, not a value frozen into the run. Returns the resolved config (nothing written)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    from disttrain.config import resolve
    from disttrain.config.compose import typed_add_error
    from disttrain.config.errors import translated

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError("override", " ".join(overrides), "key=value", str(exc).splitlines()[0]) from None
    typed = _typed(cfg)
    for o in parsed:
        key, value = o.key_or_group, None if o.is_delete() else o.value()
        group_word = "." not in key and isinstance(cfg.get(key), dict) and not isinstance(value, dict)
        if group_word or key in FIXED:
            _switch_group(typed, key, value, o.input_line or f"{key}={value}")
            continue
        with translated(overrides):
            if o.is_delete():
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(typed, parent) if parent else typed
                if not OmegaConf.is_dict(node) or leaf not in node:
                    _unknown(typed, key, None)
                if OmegaConf.is_dict(node) and "_target_" not in node and leaf in node:
                    raise ConfigError(
                        f"~{key}",
                        "",
                        "~KEY only for keys added under a _target_ (model, optim, data)",
                        f"{parent or 'the top level'} is a typed block: set {key}=VALUE instead.",
                    )
                with open_dict(node):
                    del node[leaf]
            elif o.is_add():
                error = typed_add_error(typed, key, value)
                if error is not None:
                    raise error
                with open_dict(typed):
                    OmegaConf.update(typed, key, value, merge=True, force_add=True)
            else:
                if OmegaConf.select(typed, key, default=_ABSENT) is _ABSENT:
                    _unknown(typed, key, value)
                OmegaConf.update(typed, key, value, merge=True)
    return resolve(typed, overrides)


_ABSENT = object()


def _unknown(typed: Any, key: str, value: Any) -> None:
    """A key the saved config does not have: name its siblings and the closest spelling."""
    import difflib

    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(typed, parent, default=None) if parent else typed
    if not OmegaConf.is_dict(node):
        raise ConfigError(key, value, "a key of the saved config", "see config.yaml in RUN_DIR.")
    keys = [str(k) for k in node]
    close = difflib.get_close_matches(leaf, keys, n=1)
    raise ConfigError(
        key,
        value,
        f"a key of the saved {parent or 'config'}: {', '.join(keys)}",
        f"did you mean {parent + '.' if parent else ''}{close[0]}?"
        if close
        else "see config.yaml in RUN_DIR.",
    )


def _typed(cfg: dict[str, Any]) -> Any:
    """The saved (resolved) config inside the structured schema: every group typed by the schema
    of its option (found by the option's `name`, or `_target_`), as composition types it."""
    from omegaconf import OmegaConf

    from disttrain.config.errors import translate
    from disttrain.config.schema import Config, register

    register()
    schema = OmegaConf.structured(Config)
    for group, values in cfg.items():
        node = _option_schema(group, values)
        if node is not None:
            schema[group] = node
    try:
        return OmegaConf.merge(schema, cfg)
    except Exception as exc:
        err = translate(exc, [])
        if err is None:
            raise
        raise ConfigError(
            "RUN_DIR", "config.yaml", "a config the schema accepts", f"the saved config does not load: {err}"
        ) from None


def _option_schema(group: str, values: Any) -> Any:
    """The stored schema (`strategy/base_ddp`) whose name or _target_ matches the saved group."""
    from hydra.core.config_store import ConfigStore

    if not isinstance(values, dict):
        return None
    cs = ConfigStore.instance()
    try:
        options = cs.list(group)
    except (OSError, ValueError):
        return None
    for option in options:
        node = cs.load(f"{group}/{option}").node
        for field in ("name", "_target_"):
            if field in node and field in values and node[field] == values[field]:
                return node
    return None


def _switch_group(typed: Any, group: str, option: Any, line: str) -> None:
    """`strategy=fsdp` on resume: that option's values replace the saved group (the checkpoint
    reshards); the model, data and experiment stay what the checkpoint was trained with."""
    from omegaconf import OmegaConf

    from disttrain.config import compose

    saved: Any = typed.get(group)
    if group not in SWITCHABLE or not isinstance(option, str):
        block = OmegaConf.is_dict(saved) and len(saved) > 0
        if group in FIXED:
            hint = f"a resumed run keeps the {group} its checkpoints hold; train a new run with {group}={option}."
        elif block:
            hint = f"{group} is a block of settings: change one key, e.g. {group}.{next(iter(saved))}=VALUE."
        else:
            hint = "see config.yaml in RUN_DIR."
        allowed = (
            f"{group}.KEY=VALUE for single keys of the saved {group}"
            if block
            else "a key of the saved config"
        )
        raise ConfigError(group, option, allowed, hint)
    option_cfg = compose([line])[group]  # the option's own values and schema, as `train` composes it
    node = _option_schema(group, {k: option_cfg[k] for k in ("name", "_target_") if k in option_cfg})
    values = OmegaConf.to_container(option_cfg, resolve=False, enum_to_str=True)  # ${amp.dtype}: saved
    typed[group] = OmegaConf.merge(node, values) if node is not None else values


# Files the launcher and rank 0 append to (O_NOFOLLOW: a link planted there fails, after training).
APPENDED = ("commands.txt", "metrics.jsonl")


def check_run_files(run_dir: Path) -> None:
    """The run dir's own files that a resume appends to or reads back are what disttrain wrote: not
    symbolic links (never written through; the open fails) and a trackers.json mapping (the rank
    would raise on it). One ConfigError before anything starts, instead of a rank's traceback."""
    import json

    from disttrain.rundir import RunDir

    links = [n for n in APPENDED if (run_dir / n).is_symlink()]
    links += [f"logs/{p.name}" for p in sorted(RunDir(run_dir).logs.glob("*.log")) if p.is_symlink()]
    if links:
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            "a run dir whose commands.txt, metrics.jsonl and logs/*.log are regular files",
            f"{links[0]} is a symbolic link (to {os.readlink(run_dir / links[0])}): disttrain appends to "
            f"these files and never through a link planted there; remove it (rm {run_dir / links[0]}).",
        )
    trackers = RunDir(run_dir).trackers
    if trackers.is_file():
        try:
            data = json.loads(trackers.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            data = exc
        if not isinstance(data, dict):
            raise ConfigError(
                "RUN_DIR",
                str(run_dir),
                "a run dir whose trackers.json is the JSON object disttrain wrote ({sink: tracker run})",
                f"trackers.json holds {type(data).__name__ if not isinstance(data, Exception) else 'no JSON'}:"
                f" it was edited or damaged; remove it (rm {trackers}) and the resumed run starts new "
                "tracker runs (MLflow, W&B) instead of continuing the old ones.",
            )


def cmd_resume(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(RESUME_USAGE)
        return 0 if rest else 2
    from disttrain.commands.train import freeze_and_launch
    from disttrain.trust import take_trust_flag

    rest, trusted = take_trust_flag(rest)
    run_dir = run_dir_arg(rest[0] if rest else "", RESUME_USAGE)
    overrides = rest[1:]
    run = checked_resume(run_dir, overrides, trusted)
    freeze_and_launch(run, run_dir, [*saved_overrides(run_dir), *overrides])  # only now: the checks passed
    return 0


def checked_resume(run_dir: Path, overrides: list[str], trusted: bool) -> Run:
    """The run that continues in `run_dir` with `overrides`, after every check (`resume` and `sweep
    resume`): the run dir held by this command and not running elsewhere, its files disttrain's,
    its config this user's or built only from disttrain's and torch's own `_target_`s (or
    `trusted`), the config with the overrides checked like `train`'s. Nothing written."""
    from disttrain.config.run import Run
    from disttrain.launch.registry import launcher_for
    from disttrain.owner import hold
    from disttrain.preflight.checks import check_runtime, check_static
    from disttrain.rundir import command_line, read_config, refuse_if_running, refuse_planted_links
    from disttrain.trust import check_trusted

    hold(run_dir, run_dir, "RUN_DIR", "run dir")  # held until the command ends: one launcher per run dir
    refuse_if_running(run_dir, "RUN_DIR")  # another host's launcher (status.json: running)
    saved_cfg = read_config(run_dir)
    check_run_files(run_dir)
    check_trusted(run_dir, saved_cfg, trusted, launches=overrides, writes=True)  # someone else's: --trust
    cfg = apply_overrides(saved_cfg, overrides)
    refuse_planted_links(run_dir, "RUN_DIR", cfg)  # keep-N inside a linked folder deletes another run's
    run = Run.of(cfg)
    if not any(o.lstrip("+").startswith("resume=") for o in overrides):
        run = run.updated({"resume": "auto"})
    check_static(run)
    check_runtime(run, launched=saved_cfg)  # what its launch warned about is not repeated
    launcher_for(run).check_command(run_dir, command_line())
    return run


def saved_overrides(run_dir: Path) -> list[str]:
    """The overrides the run was trained with (overrides.yaml), to freeze again with a resume's."""
    import yaml

    path = run_dir / "overrides.yaml"
    saved = yaml.safe_load(path.read_text()) if path.exists() else []
    return [str(o) for o in saved] if isinstance(saved, list) else []
