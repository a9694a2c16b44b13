"""docs/config-reference.md, generated from the schema: every key of every group option with its
type, default and help text (the dataclass field's `help`, as `disttrain config --help` shows it).

`python -m disttrain.tools.configref --write` rewrites the page; `--check` exits 1 when the page on
disk differs (tests/unit/test_tools_configref.py runs the same comparison). No torch import and no
Hydra composition: each option is its schema node from Hydra's ConfigStore with the option's YAML
values merged on top, so the page costs well under a second to build.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from disttrain.config.keyhelp import key_rows

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"
COMMAND = "python -m disttrain.tools.configref --write"
SKIPPED_GROUPS = ("experiment",)  # `# @package _global_` presets of other groups' keys: no schema


class UndescribedKey(ValueError):
    """A schema key without a help text: the page would list it without saying what it does."""


def _options(config_dir: Path) -> dict[str, list[str]]:
    """group -> its option names (the YAML files of config_dir/<group>/)."""
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(config_dir.iterdir())
        if group.is_dir() and group.name not in SKIPPED_GROUPS
    }


def _defaults(config_dir: Path) -> dict[str, str]:
    """group -> the option config.yaml picks."""
    primary = yaml.safe_load((config_dir / "config.yaml").read_text())
    picked: dict[str, str] = {}
    for entry in primary["defaults"]:
        if isinstance(entry, dict):
            (group, option), *_ = entry.items()
            if not group.startswith("override") and option is not None:
                picked[str(group)] = str(option)
    return picked


def _read_option(config_dir: Path, group: str, option: str) -> tuple[str, dict[str, Any], str]:
    """The option's schema node name (`base_fsdp`), its own values (merged over the options it
    extends), and the comment lines that open its file (what the option is)."""
    text = (config_dir / group / f"{option}.yaml").read_text()
    data = yaml.safe_load(text) or {}
    global_package = "@package _global_" in text.split("\n", 1)[0]
    values = data.get(group, {}) if global_package else {k: v for k, v in data.items() if k != "defaults"}
    base, inherited = "", dict[str, Any]()
    for entry in data.get("defaults", []):
        name = entry.split("@")[0] if isinstance(entry, str) else None
        if name is None or name == "_self_":
            continue
        if name.startswith("base_"):
            base = name
        else:  # another option of the same group (checkpoint/async extends default)
            base, inherited, _ = _read_option(config_dir, group, name)
    intro = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            intro.append(line.lstrip("# ").rstrip())
    merged = OmegaConf.to_container(OmegaConf.merge(inherited, values))
    assert isinstance(merged, dict)
    return base, {str(k): v for k, v in merged.items()}, " ".join(intro)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    for key, kind, default, text in rows:
        shown = f"`{_cell(default)}`" if default else ""
        lines.append(f"| `{key}` | {_cell(kind)} | {shown} | {_cell(text)} |")
    return lines


def _described(rows: list[tuple[str, str, str, str]], where: str) -> list[tuple[str, str, str, str]]:
    """The rows, or UndescribedKey naming each key whose schema field has no help text."""
    bare = [r[0] for r in rows if not r[3].strip()]
    if bare:
        raise UndescribedKey(
            f"{where}: no help text for {', '.join(bare)}: give each schema field one "
            "(help_field(text, default) in disttrain/config/common.py), then run " + COMMAND
        )
    return rows


def option_rows(node: DictConfig, values: dict[str, Any], group: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) of one option: its schema node with the option's values on top."""
    merged = OmegaConf.merge(node, values)
    assert isinstance(merged, DictConfig)
    return _described(key_rows(merged, f"{group}."), f"{group} option")


def _top_level(config_dir: Path, groups: dict[str, list[str]]) -> list[tuple[str, str, str, str]]:
    """The keys of the Config dataclass that no group owns, with config.yaml's values."""
    from disttrain.config.schema import Config

    primary = yaml.safe_load((config_dir / "config.yaml").read_text())
    values = {k: v for k, v in primary.items() if k not in ("defaults", "hydra")}
    cfg = OmegaConf.merge(OmegaConf.structured(Config), values)
    assert isinstance(cfg, DictConfig)
    rows = [r for r in key_rows(cfg) if r[0].split(".")[0] not in groups]
    return _described(rows, "top level")


Row = tuple[str, str, str, str]


def _group_section(store: Any, config_dir: Path, group: str, options: list[str]) -> list[str]:
    """One table of the keys every option has (a default per option where they differ), then each
    option's own keys under its heading, with the comment that opens its file."""
    found: dict[str, tuple[str, list[Row]]] = {}
    for option in options:
        base, values, intro = _read_option(config_dir, group, option)
        found[option] = (intro, option_rows(store.load(f"{group}/{base}.yaml").node, values, group))
    first = found[options[0]][1]
    shared = [
        r
        for r in first
        if all(any(o[:2] == r[:2] and o[3] == r[3] for o in rows) for _, rows in found.values())
    ]
    shared_keys = {r[0] for r in shared}
    out: list[str] = []
    if shared:
        table = []
        for key, kind, _, text in shared:
            defaults = {o: next(r[2] for r in found[o][1] if r[0] == key) for o in options}
            if len(set(defaults.values())) == 1:
                table.append((key, kind, defaults[options[0]], text))
            else:
                per = ", ".join(f"{o}: {d or '(empty)'}" for o, d in defaults.items())
                table.append((key, kind, "", f"{text} (default: {per})"))
        out += ["", "Keys of every option:", "", *_table(table)]
    for option in options:
        intro, rows = found[option]
        own = [r for r in rows if r[0] not in shared_keys]
        out += ["", f"### {group}={option}", ""]
        if intro:
            out += [intro, ""]
        out += [*_table(own)] if own else ["No keys beyond the ones above."]
    return out


def render(config_dir: Path | None = None) -> str:
    """The page's text."""
    from hydra.core.config_store import ConfigStore

    from disttrain.config.compose import config_dir as builtin_config_dir
    from disttrain.config.schema import register

    config_dir = config_dir or builtin_config_dir()
    register()
    store = ConfigStore.instance()
    groups, picked = _options(config_dir), _defaults(config_dir)
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from the schema by `{COMMAND}`. Do not edit by hand. -->",
        "",
        "Every config key, with its type, default and what it does.",
        "Set a key on the command line: `trainer.max_steps=100`.",
        "Pick a group's option with `group=option`: `strategy=fsdp`.",
        "`disttrain config --help strategy=fsdp` prints the same table for your choices.",
        "`disttrain config` prints the whole resolved config.",
        "The text comes from the schema's dataclasses and the option files under `configs/`.",
        "A test regenerates this page and fails when it is stale or a key has no description.",
        "",
        "Groups: " + ", ".join(f"[`{g}`](#{g})" for g in groups) + ".",
        "Experiments (`experiment=NAME`) only preset keys listed here.",
        "",
        "## Top level",
        "",
        "The keys no group owns, and the `trainer`, `init`, `plan`, `observe`, `debug` and `profiler` blocks.",
        "",
        *_table(_top_level(config_dir, groups)),
    ]
    for group, options in groups.items():
        out += ["", f"## {group}", ""]
        out.append(f"Options: {', '.join(f'`{o}`' for o in options)}. Default: `{picked.get(group)}`.")
        out += _group_section(store, config_dir, group, options)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttrain.tools.configref", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE.name} is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text)
        return 0
    if args.check:
        if PAGE.read_text() != text:
            sys.stderr.write(f"{PAGE} is stale: run {COMMAND}\n")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
