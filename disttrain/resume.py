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
Overrides change single keys, e.g. `nproc_per_node=1` (the checkpoint reshards) or
`trainer.max_steps=2000`; `+key=value` adds a key, `~key` removes one.
"""

EXPORT_USAGE = """\
usage: disttrain export RUN_DIR|CHECKPOINT_DIR [--out model.pt|model.safetensors]

Write the newest whole checkpoint's model as one consolidated state dict that plain PyTorch loads
into the unwrapped model: torch.load(path, weights_only=True) or safetensors.torch.load_file(path).
"""


def _run_dir(arg: str, usage: str) -> Path:
    run_dir = Path(arg).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("RUN_DIR", arg, "a run directory holding config.yaml", usage.splitlines()[0])
    return run_dir


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `key=value`, add `+key=value`, delete `~key` on a resolved config (Hydra's grammar)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError("override", " ".join(overrides), "key=value", str(exc).splitlines()[0]) from None
    for o in parsed:
        key = o.key_or_group
        *parents, leaf = key.split(".")
        node: Any = cfg
        for part in parents:
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(
                    key, o.input_line, "a key of the saved config", "see config.yaml in RUN_DIR."
                )
            node = node[part]
        if o.is_delete():
            node.pop(leaf, None)
            continue
        if not o.is_add() and (not isinstance(node, dict) or leaf not in node):
            allowed = ", ".join(node) if isinstance(node, dict) else "none"
            raise ConfigError(
                key,
                o.value(),
                f"a key of the saved config ({allowed})",
                f"write +{key}=VALUE to add a key; group options (strategy=fsdp) cannot change on resume.",
            )
        node[leaf] = o.value()
    return cfg


def cmd_resume(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(RESUME_USAGE)
        return 0 if rest else 2
    import yaml

    from disttrain.cli import _freeze_and_launch
    from disttrain.config.validate import check_runtime, check_static
    from disttrain.rundir import read_config

    run_dir = _run_dir(rest[0], RESUME_USAGE)
    overrides = rest[1:]
    cfg = apply_overrides(read_config(run_dir), overrides)
    if not any(o.lstrip("+").startswith("resume=") for o in overrides):
        cfg["resume"] = "auto"
    check_static(cfg)
    check_runtime(cfg)
    saved = (
        yaml.safe_load((run_dir / "overrides.yaml").read_text())
        if (run_dir / "overrides.yaml").exists()
        else []
    )
    _freeze_and_launch(cfg, run_dir, [*(saved or []), *overrides])
    return 0


def cmd_export(rest: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain export", usage=EXPORT_USAGE)
    parser.add_argument("location")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(rest)
    location = Path(args.location).resolve()
    run_dir = location
    while not (run_dir / "config.yaml").is_file() and run_dir != run_dir.parent:
        run_dir = run_dir.parent  # a checkpoint folder: its run dir holds the config
    run_dir = _run_dir(str(run_dir), EXPORT_USAGE)
    out = Path(args.out) if args.out else run_dir / "export" / "model.pt"
    return export(run_dir, location, out)


def export(run_dir: Path, location: Path, out: Path) -> int:
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
    try:
        source = checkpoint.export_model(
            location, out, model, cfg.get("checkpoint", {}).get("verify", "hash")
        )
    except FileNotFoundError as exc:
        raise ConfigError(
            "RUN_DIR", str(location), "a run dir with a committed checkpoint", str(exc)
        ) from None
    n = sum(v.numel() for v in model.state_dict().values())
    sys.stdout.write(f"exported {source.name} ({n} values) -> {out}\n")
    return 0
