"""`disttrain resume RUN_DIR [key=value ...]` and `disttrain export RUN_DIR --out FILE`.

resume reuses the run dir's frozen config.yaml (overrides change single keys: a new world size,
more steps) and continues from its latest whole checkpoint, in the same run dir.
export loads the newest whole checkpoint into the plain, unwrapped model and writes one state dict.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError

RESUME_USAGE = """\
usage: disttrain resume RUN_DIR [key=value ...]

Continue the run in RUN_DIR from its latest whole checkpoint, with its saved config.yaml.
Overrides change single keys, typed as `disttrain train` types them, e.g. `nproc_per_node=1`
(the checkpoint reshards) or `trainer.max_steps=2000`; `strategy=fsdp` switches a group's option
(not model, data or experiment); `+key=value` adds a key under a `_target_` (model, optim, data).
config.yaml changes only after every check passed; command.txt keeps the first command and
commands.txt lists every command that ran in the run dir.
"""

EXPORT_USAGE = """\
usage: disttrain export RUN_DIR|CHECKPOINT_DIR [--out model.pt|model.safetensors]

Write the newest whole checkpoint's model as one consolidated state dict that plain PyTorch loads
into the unwrapped model: torch.load(path, weights_only=True), or safetensors.torch.load_model(model,
path) (tied weights are stored once; the header's "disttrain.model" holds the model config as JSON).
"""


def _run_dir(arg: str, usage: str) -> Path:
    run_dir = Path(arg).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("RUN_DIR", arg, "a run directory holding config.yaml", usage.splitlines()[0])
    return run_dir


# Groups whose option may change on resume (`strategy=fsdp`: the checkpoint reshards). The model,
# the data and an experiment define what the checkpoint holds: they stay.
SWITCHABLE = ("backend", "strategy", "amp", "optim", "sched", "launcher", "checkpoint")
FIXED = ("model", "data", "experiment")


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
    values = OmegaConf.to_container(option_cfg, resolve=False)  # ${amp.dtype}: from the saved config
    typed[group] = OmegaConf.merge(node, values) if node is not None else values


def cmd_resume(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(RESUME_USAGE)
        return 0 if rest else 2
    import yaml

    from disttrain.cli import _freeze_and_launch
    from disttrain.config.validate import check_runtime, check_static
    from disttrain.rundir import command_line, read_config, refuse_if_running

    run_dir = _run_dir(rest[0], RESUME_USAGE)
    refuse_if_running(run_dir, "RUN_DIR")  # two launchers in one run dir write the same checkpoints
    overrides = rest[1:]
    cfg = apply_overrides(read_config(run_dir), overrides)
    if not any(o.lstrip("+").startswith("resume=") for o in overrides):
        cfg["resume"] = "auto"
    check_static(cfg)
    check_runtime(cfg)
    if cfg["launcher"]["name"] == "slurm":
        from disttrain.launch.slurm import check_script_inputs

        check_script_inputs(run_dir, command_line())
    saved = (
        yaml.safe_load((run_dir / "overrides.yaml").read_text())
        if (run_dir / "overrides.yaml").exists()
        else []
    )
    _freeze_and_launch(cfg, run_dir, [*(saved or []), *overrides])  # only now: the checks passed
    return 0


def cmd_export(rest: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain export", usage=EXPORT_USAGE)
    parser.add_argument("location")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(rest)
    location = Path(args.location).resolve()
    if not location.is_dir():
        raise ConfigError(
            "RUN_DIR", args.location, "an existing run dir or checkpoint folder", EXPORT_USAGE.splitlines()[0]
        )
    run_dir = location
    while not (run_dir / "config.yaml").is_file() and run_dir != run_dir.parent:
        run_dir = run_dir.parent  # a checkpoint folder: its run dir holds the config
    if not (run_dir / "config.yaml").is_file():  # name what the user gave, not the root it reached
        raise ConfigError(
            "RUN_DIR",
            args.location,
            "a run dir (it holds config.yaml) or a checkpoint folder inside one",
            EXPORT_USAGE.splitlines()[0],
        )
    run_dir = _run_dir(str(run_dir), EXPORT_USAGE)
    out = Path(args.out) if args.out else run_dir / "export" / "model.pt"
    check_out(out, "--out" if args.out else "RUN_DIR")
    return export(run_dir, location, out)


def check_out(out: Path, key: str) -> None:
    """The export target must be a file path we may write: not a folder, under a writable folder."""

    if out.is_dir():
        raise ConfigError(
            key,
            str(out),
            "a file path ending in .pt or .safetensors",
            f"name a file, e.g. --out {out / 'model.pt'}.",
        )
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folders export would create
    if not parent.is_dir() or not _can_create_in(parent):
        raise ConfigError(
            key,
            str(out),
            "a file path in a folder you can write",
            f"{parent} is {'not a folder' if not parent.is_dir() else 'not writable'}; choose another --out.",
        )


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created there: a real probe (root passes os.access on /proc, which
    still refuses new files), removed at once."""
    import os
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".disttrain-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def export(run_dir: Path, location: Path, out: Path) -> int:
    import json

    import torch

    from disttrain import checkpoint
    from disttrain.models import build_model
    from disttrain.observe.log import setup_logging
    from disttrain.rundir import read_config

    cfg = read_config(run_dir)
    if location == run_dir:  # the run's checkpoint.dir, which may lie outside the run dir
        from disttrain.shared_dir import checkpoint_dir

        location = checkpoint_dir(cfg, run_dir)
    setup_logging(None, 0, to_console=True)
    with torch.device("cpu"):
        model = build_model(cfg["model"])
    # What built the weights: `_target_` and its arguments, so the file says which class loads it.
    metadata = {"disttrain.model": json.dumps(cfg["model"], sort_keys=True), "format": "pt"}
    try:
        source = checkpoint.export_model(
            location, out, model, cfg.get("checkpoint", {}).get("verify", "hash"), metadata
        )
    except FileNotFoundError as exc:
        raise ConfigError(
            "RUN_DIR", str(location), "a run dir with a committed checkpoint", str(exc)
        ) from None
    n = sum(v.numel() for v in model.state_dict().values())
    sys.stdout.write(f"exported {source.name} ({n} values) -> {out}\n")
    return 0
