"""`disttrain train --help` at once: the page for the built-in configs is rendered ahead of time into
`train_help.txt` (beside this module, shipped in the wheel), and printed from there without importing
Hydra or torch. Rendering it composes the config (~1 CPU-s with Hydra's import), too slow for a help
page (review 2026-11-28-ux #10: Hydra's own `app_help` took 4.5-5.9 CPU-s: no longer used).

The file is used only where it is exactly what rendering would print: `train --help` (or `-h`)
alone, without DISTTRAIN_CONFIG_DIR and without installed plug-ins (entry points of a
`disttrain.*` group, which add options and keys). Otherwise, with overrides (`train --help
model=gpt`) or --config-dir, the page is rendered; so is it when a config or module changed since
the file was written (its fingerprint line), and a unit test fails then:
    python -m disttrain.commands.train_help      # writes it again
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PAGE = Path(__file__).with_name("train_help.txt")
HELP_FLAGS = (["--help"], ["-h"])


def prerendered(rest: list[str]) -> str | None:
    """The page for `train REST`, when REST asks for the built-in configs' help and the file holds it:
    written from the package's sources and configs as they are now (its first line, their
    fingerprint, matches; a tree changed since it was written renders the page instead)."""
    if rest not in HELP_FLAGS or os.environ.get("DISTTRAIN_CONFIG_DIR") or _plugins() or not PAGE.is_file():
        return None
    stamp, _, text = PAGE.read_text(encoding="utf-8").partition("\n")
    return text if stamp == f"fingerprint {fingerprint()}" else None


# What the page is rendered from, besides the config YAML: the schemas and the help code (config/),
# the registered specs, whose config classes hold the strategies', launchers', ... keys and help
SOURCES = ("config/*.py", "*/specs.py", "*/specs/*.py", "commands/train_help.py")


def fingerprint() -> str:
    """A hash of what the page is rendered from: every config YAML and the SOURCES modules, read as
    bytes (a few ms, nothing imported)."""
    import hashlib

    import disttrain
    from disttrain.config.compose import config_dir

    package = Path(disttrain.__file__).parent
    files = [(config_dir(), p) for p in sorted(config_dir().rglob("*.yaml"))]
    files += [(package, p) for pattern in SOURCES for p in sorted(package.glob(pattern))]
    digest = hashlib.blake2b(digest_size=16)
    for root, path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _plugins() -> bool:
    """Whether an installed package declares a disttrain plug-in (strategies, launchers, tasks, ...):
    a `[disttrain.KIND]` section in the entry_points.txt of a distribution on sys.path, the files
    `importlib.metadata.entry_points` reads (read here directly: it takes ~15 ms, where the
    metadata API's scan of every distribution took 0.5 s on a loaded machine)."""
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(folder or ".", name, "entry_points.txt"), encoding="utf-8") as f:
                    if any(line.startswith("[disttrain.") for line in f):
                        return True
            except (OSError, UnicodeDecodeError):
                continue
    return False


USAGE = """\
usage: disttrain train [group=option ...] [key=value ...] [-m] [--cfg job] [--config-dir DIR]

Compose the config from its groups and keys, check it, freeze it into a run dir
(runs/NAME/TIMESTAMP), start the ranks and train.
  -m                  a sweep: key=a,b trains once per value (Optuna: -m hydra/sweeper=optuna)
  --cfg job           print what config.yaml will hold, and stop
  --config-dir DIR    your own groups and options, beside the built-in ones
  --help [CHOICES]    this page; with group=option ... or key=value, for those choices
  --hydra-help        Hydra's own flags
"""
FOOTER = "\nUse --hydra-help to view Hydra specific help\n"


def page(overrides: list[str], user_dir: str | None, config_name: str) -> str:
    """The help page: usage, every config group with its options, then every key of the config the
    overrides compose (key=default, type, help; `config.keyhelp.format_keys`)."""
    from disttrain.config import compose
    from disttrain.config.compose import config_dir
    from disttrain.config.keyhelp import format_keys

    keys = format_keys(
        compose(overrides, user_dir, config_name)
    )  # first: a bad --config-dir is one paragraph
    dirs = [config_dir()]
    if user_dir:  # as compose: a --config-dir holding the primary config replaces the built-in folder
        dirs = (
            [Path(user_dir)]
            if (Path(user_dir) / f"{config_name}.yaml").is_file()
            else [*dirs, Path(user_dir)]
        )
    return (
        f"{USAGE}\n== Configuration groups ==\nCompose your configuration from those groups (group=option)\n\n"
        f"{groups(dirs)}\n{keys}{FOOTER}"
    )


def groups(dirs: list[Path]) -> str:
    """'group: option, option' for every config group in the config folders `dirs` (options are
    their YAML files), without Hydra's own groups and the `base_*` schemas the options extend."""
    found: dict[str, set[str]] = {}
    for root in dirs:
        for path in root.rglob("*.yaml"):
            parts = path.relative_to(root).parts
            group = "/".join(parts[:-1])
            if not group or group == "hydra" or group.startswith("hydra/") or path.stem.startswith("base_"):
                continue
            found.setdefault(group, set()).add(path.stem)
    return "".join(f"{g}: {', '.join(sorted(options))}\n" for g, options in sorted(found.items()))


def render() -> str:
    """The built-in configs' page, as `train --help` renders it (what `prerendered` stands in for)."""
    return page([], None, "config")


def write() -> None:
    """train_help.txt: the fingerprint line, then the page."""
    PAGE.write_text(f"fingerprint {fingerprint()}\n{render()}", encoding="utf-8")


if __name__ == "__main__":
    write()
    sys.stdout.write(f"wrote {PAGE}\n")
