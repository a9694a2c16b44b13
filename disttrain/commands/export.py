"""`disttrain export RUN_DIR --out FILE`: the newest whole checkpoint's model as one state dict.

It loads the checkpoint into the plain, unwrapped model (no process group, no strategy), so the file
loads with plain PyTorch. `--format hf` writes a Hugging Face model's `save_pretrained` folder
(config.json + model.safetensors) that `from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.commands.resume import run_dir_arg

if TYPE_CHECKING:
    import torch
from disttrain.config.errors import ConfigError

EXPORT_USAGE = """\
usage: disttrain export RUN_DIR|CHECKPOINT_DIR [--out model.pt|model.safetensors|DIR] [--format pt|safetensors|hf]
       [--config RUN_DIR/config.yaml] [--ema] [--merge] [--trust]

Write the newest whole checkpoint's model as one consolidated state dict that plain PyTorch loads
into the unwrapped model: torch.load(path, weights_only=True), or safetensors.torch.load_model(model,
path) (tied weights are stored once; the header's "disttrain.model" holds the model config as JSON).
--format hf (a Hugging Face model): --out is a folder written by save_pretrained, config included,
that AutoModel*.from_pretrained(DIR) loads. The format defaults to --out's suffix (pt without one).
A checkpoint folder outside its run dir (checkpoint.dir elsewhere) takes the run's config by
--config RUN_DIR/config.yaml; no config.yaml is ever looked for in the folders above it.
--ema writes the moving average of the weights (trainer.ema) instead of the trained weights.
A peft=lora run: --format hf writes PEFT's adapter folder (PeftModel.from_pretrained(base, DIR) loads
it); --merge writes the base with the adapters merged in (any format: a plain model's state dict).
"""
FORMATS = ("pt", "safetensors", "hf")


def cmd_export(rest: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain export", usage=EXPORT_USAGE)
    parser.add_argument("location")
    parser.add_argument("--out", default=None)
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (trainer.ema)")
    parser.add_argument("--trust", action="store_true", help="build a run dir someone else made")
    parser.add_argument("--merge", action="store_true", help="peft=lora: the adapters merged into the base")
    parser.add_argument("--format", default=None)
    parser.add_argument("--config", default=None, help="the run's config.yaml, for checkpoints elsewhere")
    args = parser.parse_args(rest)
    fmt = args.format or ("safetensors" if str(args.out or "").endswith(".safetensors") else "pt")
    if fmt not in FORMATS:
        raise ConfigError(
            "--format", fmt, " | ".join(FORMATS), "e.g. --format hf --out DIR for from_pretrained."
        )
    location = Path(args.location).resolve()
    if not location.is_dir():
        raise ConfigError(
            "RUN_DIR", args.location, "an existing run dir or checkpoint folder", EXPORT_USAGE.splitlines()[0]
        )
    if args.config:  # checkpoints kept outside their run dir: the user names the run's config
        config = Path(args.config).resolve()
        if config.name != "config.yaml" or not config.is_file():
            raise ConfigError(
                "--config",
                args.config,
                "a run dir's config.yaml",
                "e.g. --config runs/NAME/DATE/config.yaml.",
            )
        run_dir = config.parent
    else:
        run_dir = owning_run_dir(location, args.location)
    run_dir = run_dir_arg(str(run_dir), EXPORT_USAGE)
    if not args.out:
        from disttrain.rundir import refuse_planted_links

        refuse_planted_links(run_dir, "RUN_DIR")  # export/... must land in this run dir
    if fmt == "hf":
        out = Path(args.out) if args.out else run_dir / "export" / "hf"
        check_out_dir(out, "--out" if args.out else "RUN_DIR")
    else:
        out = Path(args.out) if args.out else run_dir / "export" / f"model.{'pt' if fmt == 'pt' else fmt}"
        check_out(out, "--out" if args.out else "RUN_DIR")
    from disttrain.rundir import read_config
    from disttrain.trust import check_trusted

    saved = read_config(run_dir)
    check_trusted(run_dir, saved, args.trust)  # its model _target_ is code
    from disttrain.config.run import Run

    lora = Run.of(saved).peft.name == "lora"  # a run dir from before peft: none
    if args.merge and not lora:
        raise ConfigError(
            "--merge",
            True,
            "a run trained with peft=lora",
            "the run trained every parameter: its export is the whole model already; drop --merge.",
        )
    if lora and fmt != "hf" and not args.merge:
        raise ConfigError(
            "--format",
            fmt,
            "hf (PEFT's adapter folder) or --merge (the base with the adapters merged in) for a peft=lora run",
            "its checkpoints hold the adapters alone: `--format hf --out DIR` for PeftModel.from_pretrained, "
            "or add --merge for a plain model.",
        )
    if lora:
        return export_adapted(run_dir, location, out, fmt, ema=args.ema, merge=args.merge)
    return export(run_dir, location, out, fmt, ema=args.ema)


def owning_run_dir(location: Path, given: str) -> Path:
    """The run dir whose config.yaml describes the checkpoints at `location`: the location itself,
    or, for `<run dir>/checkpoints` and `<run dir>/checkpoints/step_N`, the run dir above it.

    Never a config.yaml further up: a folder of checkpoints elsewhere (`checkpoint.dir` on a shared
    file system) would otherwise take any parent's config.yaml, up to `/`, and build its
    `_target_`s as the model (someone else's file run as code).
    """
    candidates = [location]
    if location.name == "checkpoints":
        candidates.append(location.parent)
    elif location.parent.name == "checkpoints":
        candidates.append(location.parent.parent)
    for run_dir in candidates:
        if (run_dir / "config.yaml").is_file():
            return run_dir
    raise ConfigError(  # name what the user gave, not a folder it looked in
        "RUN_DIR",
        given,
        "a run dir (it holds config.yaml), its checkpoints/ folder or a checkpoint folder in it",
        "for checkpoints kept elsewhere (checkpoint.dir), export the run dir that wrote them "
        "(disttrain export RUN_DIR: the newest checkpoint of its checkpoint.dir), or name its config: "
        "disttrain export CHECKPOINT --config RUN_DIR/config.yaml.",
    )


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


def check_out_dir(out: Path, key: str) -> None:
    """A save_pretrained target: a new or empty folder (stale shards of another model would load
    beside the new ones), under a folder we may write. A link there (to a folder, dangling) is
    refused before anything loads: the final rename would fail on it (or write through it)."""
    if out.is_symlink():
        raise ConfigError(
            key,
            str(out),
            "a new or empty folder for --format hf, not a symbolic link",
            f"{out} is a link to {os.readlink(out)}; name the folder itself, or a new path.",
        )
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            key, str(out), "a new or empty folder for --format hf", "name a new folder, or empty this one."
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(
            key, str(out), "a folder path for --format hf", f"e.g. --out {out.with_suffix('')}-hf"
        )
    check_out(out / "model.safetensors", key)


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created there: a real probe (root passes os.access on /proc, which
    still refuses new files), removed at once."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".disttrain-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def export(run_dir: Path, location: Path, out: Path, fmt: str = "pt", ema: bool = False) -> int:
    import resource

    import torch

    from disttrain import checkpoint
    from disttrain.config.run import Run
    from disttrain.models import build_model
    from disttrain.observe.log import setup_logging
    from disttrain.rundir import read_config

    run = Run.of(read_config(run_dir))  # a run dir frozen before a key: the schema's default
    if location == run_dir:  # the run's checkpoint.dir, which may lie outside the run dir
        from disttrain.shared_dir import checkpoint_dir

        location = checkpoint_dir(run, run_dir)
    setup_logging(None, 0, to_console=True)
    from disttrain.preflight import hf_base

    model = hf_base.build(run_dir, run.model)  # from_pretrained: the base config the run trained with
    if model is None:
        with torch.device("cpu"):
            model = build_model(run.model)
    if fmt == "hf":
        check_hf_model(model, run.model)
    # What built the weights: `_target_` and its arguments, so the file says which class loads it.
    metadata = {"disttrain.model": json.dumps(run.model, sort_keys=True), "format": "pt"}
    verify = run.checkpoint.verify
    if ema:
        metadata["disttrain.weights"] = "ema"
    try:
        with named_load_errors(location):
            if fmt == "hf":
                source = checkpoint.load_model(location, model, verify, ema)
                save_pretrained(model, out)
            else:
                source = checkpoint.export_model(location, out, model, verify, metadata, ema=ema)
    except Exception as exc:  # a ConfigError of named_load_errors comes back as it is
        raise disk_full(exc, out, model) from None
    n = sum(v.numel() for v in model.state_dict().values())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    what = f"{source.name}'s EMA weights" if ema else source.name
    sys.stdout.write(f"exported {what} ({n} values) -> {out} (peak RSS {peak_mb:.0f} MB)\n")
    return 0


def export_adapted(run_dir: Path, location: Path, out: Path, fmt: str, ema: bool, merge: bool) -> int:
    """A peft=lora run: the base rebuilt as the ranks built it (the model factory after the seed,
    then init.path), checked against the run's record of it (its hash), the adapters on it and the
    checkpoint's adapters loaded; then PEFT's adapter folder, or the merged model."""
    import resource

    from disttrain import checkpoint
    from disttrain.checkpoint import init_from
    from disttrain.config.run import Run
    from disttrain.models import adapters, build_model
    from disttrain.observe.log import setup_logging
    from disttrain.rng import seed_everything
    from disttrain.rundir import read_config

    run = Run.of(read_config(run_dir))
    if location == run_dir:
        from disttrain.shared_dir import checkpoint_dir

        location = checkpoint_dir(run, run_dir)
    setup_logging(None, 0, to_console=True)
    seed_everything(run.seed)
    base = build_model(run.model)
    init_from.apply(run.init, base, True)
    problem = adapters.keep_base(run_dir / adapters.BASE_RECORD, adapters.base_record(run, base), write=False)
    if problem:
        raise ConfigError(
            "RUN_DIR", str(run_dir), "a peft=lora run whose base is as it trained on it", problem
        )
    model = adapters.apply(run.peft, base, announce=False)
    with named_load_errors(location):
        source = checkpoint.load_model(location, model, run.checkpoint.verify, ema, trainable_only=True)
    written = adapters.merged(model) if merge else model
    if fmt == "hf" and merge:
        check_hf_model(written, run.model)
    try:
        if fmt == "hf":
            save_pretrained(written, out)
        else:
            checkpoint.write_model(
                written, out, source, {"disttrain.model": json.dumps(run.model, sort_keys=True)}
            )
    except Exception as exc:
        raise disk_full(exc, out, written) from None
    trainable, total = adapters.counts(model)
    what = ("the merged model" if merge else "the adapters") + (" (EMA weights)" if ema else "")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write(
        f"exported {source.name}'s {what} ({trainable} adapter parameters of {total}) -> {out} "
        f"(peak RSS {peak_mb:.0f} MB)\n"
    )
    return 0


@contextlib.contextmanager
def named_load_errors(location: Path) -> Iterator[None]:
    """A checkpoint that cannot give what export asks as one paragraph: --ema of a run without
    an EMA, or no committed checkpoint at `location`."""
    from disttrain import checkpoint

    try:
        yield
    except checkpoint.NoEMA as exc:
        raise ConfigError(
            "--ema", True, "a checkpoint of a run trained with trainer.ema.decay set", f"{exc}; drop --ema."
        ) from None
    except FileNotFoundError as exc:
        raise ConfigError(
            "RUN_DIR", str(location), "a run dir with a committed checkpoint", str(exc)
        ) from None


def disk_full(exc: Exception, out: Path, model: torch.nn.Module) -> Exception:
    """A write that failed on a full disk (or quota) as one paragraph naming the folder and the
    space free; any other exception as it is. The temporary file or folder is gone by now."""
    from disttrain.checkpoint.manager import free_bytes, out_of_room

    if not out_of_room(exc):
        return exc
    folder = out if out.is_dir() else out.parent
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return ConfigError(
        "--out",
        str(out),
        "a path on a disk with room for the export",
        f"{folder} is full: {free_bytes(folder)} free, the export needs ~{need / 2**20:.1f} MB (the model's "
        "tensors); nothing was left there. Free space there or choose another --out.",
    )


def check_hf_model(model: object, model_cfg: dict[str, object]) -> None:
    """--format hf needs a transformers PreTrainedModel (save_pretrained and a config)."""
    hf = sys.modules.get("transformers")  # a transformers model imported it: no import for the rest
    if hf is None or not isinstance(model, hf.PreTrainedModel):
        cls = f"{type(model).__module__}.{type(model).__qualname__}"
        raise ConfigError(
            "--format",
            "hf",
            "pt or safetensors for this run's model",
            f"the run's model ({cls}, model._target_={model_cfg.get('_target_')}) is not a Hugging Face "
            "transformers PreTrainedModel, so it has no save_pretrained folder; use --format safetensors "
            "(or pt) and load the file into the model with safetensors.torch.load_model.",
        )


def save_pretrained(model: object, out: Path) -> None:
    """`save_pretrained` into a temporary folder beside `out`, then renamed into place: an
    interrupted export leaves no half-written folder under the name."""
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)  # type: ignore[attr-defined]
        if out.is_dir():
            out.rmdir()  # empty (check_out_dir)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
