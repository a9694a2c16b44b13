"""Run dirs made by others are data: their config's `_target_`s run only with the user's consent.

`rerun`, `resume` and `export` build a run dir's frozen config.yaml, and every `_target_` in it is
imported and called. Hydra's blocklist stops `os.system` but not `sympy.sympify` (it `eval`s a
string; sympy ships with torch) nor `builtins.open(mode="w")`, so a config.yaml from someone else
is code. The rule:

- a run dir this user created is trusted: `freeze` signs its config.yaml with an HMAC under a key
  only this user can read (`~/.config/disttrain/run-key`, 0600, made on first use), and the file
  is owned by this user. A config.yaml changed by anyone else (a copy edited by hand included)
  no longer matches its signature;
- any other run dir is built only if every `_target_` in it names one of disttrain's or torch's own
  callables (`builtin_object`), and it names no program to run (`PROGRAMS`: `launcher.kubectl`,
  `launcher.image`, slurm's `launcher.extra`, k8s's `launcher.env`) that the command line does not
  set, and it holds no `${...}` interpolation (config.yaml is frozen resolved;
  `${oc.create:{_target_: ...}}` becomes a `_target_` node only when resolved, after the check),
  or with an explicit `--trust`;
- otherwise one paragraph lists what it would import or run, and nothing is built.

The check is on the *object* a target names, not its text (review 2026-11-28-reliability D1):
Hydra walks attributes, so `torch.nn.init.torch.load` is `torch.load` and
`disttrain.safefile.write_text_atomic` writes any path. A dotted path may pass only modules of its
own name (no `torch.nn.init.torch`), no private name (`_`: no `__globals__`, no `disttrain.__main__`),
and must end at an nn.Module class defined under torch.nn or disttrain, a torch.optim optimizer or
scheduler class, a disttrain Task class, a loss function of torch.nn.functional, or one of
disttrain's own builders (`BUILDERS`).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import inspect
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError

SIGNATURE = ".signature"
# The packages whose callables a foreign run dir may name (each one still checked: builtin_object).
BUILTIN = ("disttrain.", "torch.nn.", "torch.optim.")
# disttrain's own functions that built-in options build: the data sets and the GPT tensor-parallel
# plan. They read the files their config names; none evaluates a string or writes a file.
BUILDERS = frozenset(
    {
        "disttrain.data.digits.load_digits",
        "disttrain.data.synthetic.make_synthetic",
        "disttrain.data.text.load_text",
        "disttrain.data.files.load_files",
        "disttrain.data.tokens.load_tokens",
        "disttrain.data.hf.load_hf",
        "disttrain.data.mix.load_mix",
        "disttrain.models.gpt.gpt_tp_plan",
    }
)
TASK = "disttrain.tasks.builtin.Task"  # the base class of disttrain's tasks
# Keys whose value is a program disttrain runs (or has a cluster run), with their schema default: a
# foreign run dir keeps the default or the value the user's command line gives (review D2). Slurm's
# `extra` lines are sbatch options (`#SBATCH --export=ALL,BASH_ENV=x.sh` makes the job's bash source
# x.sh; `--output=FILE` overwrites FILE) and k8s's `env` is the pods' environment (LD_PRELOAD,
# PYTHONPATH): either runs code of the config's choosing as the user.
PROGRAMS: dict[str, Any] = {
    "launcher.kubectl": "kubectl",
    "launcher.image": None,
    "launcher.extra": [],
    "launcher.env": {},
}
# Folders a resumed run writes and prunes: a foreign run dir's are inside it or given on the command
# line (a copy whose checkpoint.dir named one of this user's folders had resume delete its `.tmp-*`
# entries and the step_* folders of a checkpoint dir without owner.json).
FOLDERS = ("checkpoint.dir",)
TRUST_FLAG = "--trust"


def key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "disttrain" / "run-key"


def user_key(create: bool) -> bytes | None:
    """This user's signing key (32 random bytes); made (0600, in a 0700 folder) when `create`."""
    path = key_path()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:  # another disttrain made it first
        return path.read_bytes()
    except OSError:  # a read-only home: runs go unsigned (--trust for their own code targets)
        return None
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _digest(key: bytes, config: bytes) -> str:
    return hmac.new(key, config, hashlib.sha256).hexdigest()


def sign(run_dir: Path) -> None:
    """Sign the run dir's config.yaml as written by this user (after every freeze)."""
    from disttrain.safefile import write_atomic

    key = user_key(create=True)
    if key is not None:
        config = (run_dir / "config.yaml").read_bytes()
        write_atomic(run_dir / SIGNATURE, _digest(key, config).encode() + b"\n")


def made_by_me(run_dir: Path) -> bool:
    """config.yaml is this user's file and matches the signature made with this user's key."""
    key = user_key(create=False)
    config = run_dir / "config.yaml"
    try:
        if key is None or config.stat().st_uid != os.getuid():
            return False
        saved = (run_dir / SIGNATURE).read_text(encoding="ascii").strip()
        return hmac.compare_digest(saved, _digest(key, config.read_bytes()))
    except (OSError, ValueError):
        return False


def targets(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(config key, `_target_`) of every node that Hydra would instantiate."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None:
            yield key or "_target_", str(target)
        for name, value in node.items():
            yield from targets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{key}[{i}]")


def interpolations(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(config key, text) of every string that OmegaConf would resolve. A frozen config.yaml holds
    none (`read_config`); in a foreign one `${oc.create:{_target_: ...}}` (or `oc.decode`) becomes a
    `_target_` node only when the config is resolved, after `targets` looked at it."""
    if isinstance(node, dict):
        for name, value in node.items():
            sub = f"{key}.{name}" if key else str(name)
            if "${" in str(name):
                yield sub, str(name)
            yield from interpolations(value, sub)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from interpolations(value, f"{key}[{i}]")
    elif isinstance(node, str) and "${" in node:
        yield key, node


def walk(target: str) -> Any:
    """The object `target` names, found as Hydra's `_locate` finds it (attribute first, else the
    submodule), or None where the path passes a private name or a module of another name
    (`torch.nn.init.torch`: the module `torch`, re-exported), or names nothing."""
    parts = target.split(".")
    if not parts or not all(p.isidentifier() and not p.startswith("_") for p in parts):
        return None
    try:
        obj: Any = importlib.import_module(parts[0])
        for i in range(1, len(parts)):
            path = ".".join(parts[: i + 1])
            found = getattr(obj, parts[i], None)
            if found is None and inspect.ismodule(obj):
                found = importlib.import_module(path)
            if found is None or (inspect.ismodule(found) and found.__name__ != path):
                return None
            obj = found
    except Exception:  # a path that does not import is not a built-in one
        return None
    return obj


def builtin_object(target: str) -> bool:
    """Whether `target` names one of disttrain's or torch's own callables that builds a model, loss,
    optimizer, scheduler, task or data set from plain values (see the module docstring)."""
    if not target.startswith(BUILTIN):
        return False
    obj = walk(target)
    home = str(getattr(obj, "__module__", None) or "")
    if inspect.isclass(obj):
        import torch
        from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

        if issubclass(obj, torch.nn.Module):
            return home.startswith(("torch.nn.", "disttrain."))
        if issubclass(obj, (torch.optim.Optimizer, LRScheduler, ReduceLROnPlateau)):
            return home.startswith("torch.optim.")
        # a disttrain task (by name: disttrain.tasks is a layer above this module)
        return home.startswith("disttrain.") and any(
            f"{b.__module__}.{b.__qualname__}" == TASK for b in obj.__mro__
        )
    if inspect.isfunction(obj):
        return home == "torch.nn.functional" or f"{home}.{obj.__qualname__}" in BUILDERS
    return False


def foreign_targets(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, target) of every `_target_` that is not one of disttrain's or torch's own callables."""
    return [(k, t) for k, t in targets(cfg) if not builtin_object(t)]


def _value(cfg: dict[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _given(key: str, overrides: Sequence[str]) -> bool:
    """Whether the command line's `overrides` set `key` (`launcher=spawn` sets every launcher key)."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return any(key == g or key.startswith(g + ".") for g in given)


def foreign_programs(cfg: dict[str, Any], overrides: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(key, value) of every program-valued key the config sets to another value than disttrain's
    default, unless the command line's `overrides` set it (the user's own choice)."""
    return [
        (key, str(value))
        for key, default in PROGRAMS.items()
        if not _given(key, overrides) and (value := _value(cfg, key)) is not None and value != default
    ]


def foreign_folders(
    cfg: dict[str, Any], run_dir: Path, overrides: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """(key, value) of every folder key (`FOLDERS`) naming a folder outside `run_dir`, unless the
    command line's `overrides` set it: a resumed run saves there, prunes its `step_*` folders
    (keep-N) and deletes its `.tmp-*` entries."""
    home = run_dir.resolve()
    return [
        (key, str(value))
        for key in FOLDERS
        if not _given(key, overrides)
        and (value := _value(cfg, key)) is not None
        and not Path(os.path.realpath(str(value))).is_relative_to(home)
    ]


def take_trust_flag(args: list[str]) -> tuple[list[str], bool]:
    """`args` without `--trust`, and whether it was there."""
    kept = [a for a in args if a != TRUST_FLAG]
    return kept, len(kept) != len(args)


def check_trusted(
    run_dir: Path,
    cfg: dict[str, Any],
    trusted: bool,
    launches: Sequence[str] | None = None,
    writes: bool = False,
) -> None:
    """Refuse, before anything is built, a run dir made by someone else whose config imports code,
    or, for a command that starts the run's launcher (`launches`: its command line's overrides,
    which may set a program key), names a program to run, or, for one that saves into the run's
    own folders (`writes`: resume), names such a folder outside the run dir."""
    if trusted or made_by_me(run_dir):
        return
    programs = [] if launches is None else foreign_programs(cfg, launches)
    if writes:
        programs += [(k, v) for k, v in foreign_folders(cfg, run_dir, launches or ())]
    foreign = foreign_targets(cfg)
    resolved = list(interpolations(cfg))
    if not foreign and not programs and not resolved:
        return
    listing = ", ".join(f"{k}={t}" for k, t in foreign[:6]) + (
        f" and {len(foreign) - 6} more" if len(foreign) > 6 else ""
    )
    actions = [f"import and call {listing}"] if foreign else []
    actions += [f"{'write into' if k in FOLDERS else 'run'} {k}={v}" for k, v in programs]
    actions += [f"resolve {k}={v}" for k, v in resolved[:3]]
    own = " or ".join(f"{k}=YOURS" for k, _ in programs)
    raise ConfigError(
        "RUN_DIR",
        str(run_dir),
        "a run dir you created with disttrain, or one whose config.yaml builds only disttrain's and "
        "torch's own models, losses, optimizers, schedulers, tasks and data sets (defined in "
        f"{', '.join(p + '*' for p in BUILTIN)}, not what those modules import) and names no program "
        "and holds no ${...} interpolation (nor, for resume, a checkpoint.dir outside it)",
        f"it was made by someone else, or its config.yaml changed since disttrain wrote it, and using "
        f"it would {' and '.join(actions)}. Read {run_dir / 'config.yaml'}; "
        + (f"give your own on the command line ({own}), or " if programs else "")
        + f"if you trust that code, repeat the command with {TRUST_FLAG}.",
    )
