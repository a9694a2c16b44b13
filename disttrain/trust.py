"""Run dirs made by others are data: their config's `_target_`s run only with the user's consent.

`rerun`, `resume` and `export` build a run dir's frozen config.yaml, and every `_target_` in it is
imported and called. Hydra's blocklist stops `os.system` but not `sympy.sympify` (it `eval`s a
string; sympy ships with torch) nor `builtins.open(mode="w")`, so a config.yaml from someone else
is code. The rule:

- a run dir this user created is trusted: `freeze` signs its config.yaml with an HMAC under a key
  only this user can read (`~/.config/disttrain/run-key`, 0600, made on first use), and the file
  is owned by this user. A config.yaml changed by anyone else (a copy edited by hand included)
  no longer matches its signature;
- any other run dir is built only if every `_target_` in it is one of disttrain's or torch's own
  classes (`disttrain.`, `torch.nn.`, `torch.optim.`), or with an explicit `--trust`;
- otherwise one paragraph lists what it would import, and nothing is built.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError

SIGNATURE = ".signature"
# Prefixes of `_target_`s that are disttrain's or torch's own classes and functions: the built-in
# options' targets. Nothing under them evaluates a string or writes a path the config names.
BUILTIN = ("disttrain.", "torch.nn.", "torch.optim.")
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


def foreign_targets(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, t) for k, t in targets(cfg) if not t.startswith(BUILTIN)]


def take_trust_flag(args: list[str]) -> tuple[list[str], bool]:
    """`args` without `--trust`, and whether it was there."""
    kept = [a for a in args if a != TRUST_FLAG]
    return kept, len(kept) != len(args)


def check_trusted(run_dir: Path, cfg: dict[str, Any], trusted: bool) -> None:
    """Refuse, before anything is built, a run dir made by someone else whose config imports code."""
    if trusted or made_by_me(run_dir):
        return
    foreign = foreign_targets(cfg)
    if not foreign:
        return
    listing = ", ".join(f"{k}={t}" for k, t in foreign[:6]) + (
        f" and {len(foreign) - 6} more" if len(foreign) > 6 else ""
    )
    raise ConfigError(
        "RUN_DIR",
        str(run_dir),
        "a run dir you created with disttrain, or one whose config.yaml builds only disttrain's "
        f"and torch's own classes ({', '.join(p + '*' for p in BUILTIN)})",
        f"it was made by someone else, or its config.yaml changed since disttrain wrote it, and building "
        f"it would import and call {listing}. Read {run_dir / 'config.yaml'}; if you trust that code, "
        f"repeat the command with {TRUST_FLAG}.",
    )
