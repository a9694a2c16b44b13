"""Launchers are plug-ins: a toy launcher added as one module + one spec + one YAML is picked up by
the schema (compose), the checks and `launch`; no launcher name is compared outside the registry."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit_support import checked, checked_run, write_module

import disttrain
from disttrain.config import ConfigError
from disttrain.config.run import Run
from disttrain.launch import launch, submit
from disttrain.launch.registry import LAUNCHERS, launcher_for, launcher_names

TOY = """
from dataclasses import dataclass
from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.config.schema import LauncherConfig
from disttrain.launch.base import Launcher
from disttrain.launch.registry import LauncherSpec, register_launcher


@dataclass
class ToyLauncherConfig(LauncherConfig):
    name: str = "toy"
    greeting: str = "hello"


class ToyLauncher(Launcher):
    def check_static(self, run):
        if not run.launcher.greeting:  # run.launcher: this launcher's own config class
            raise ConfigError("launcher.greeting", "", "a word", "say hello.")

    def launch(self, run, run_dir, entry):
        (Path(run_dir) / "toy.txt").write_text(f"{run.launcher.greeting} {entry} {run.world.nproc_per_node}")


register_launcher(LauncherSpec("toy", ToyLauncherConfig, "toylaunch:ToyLauncher", "toy: a test's launcher"))
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The toy launcher's module on sys.path and registered; its YAML in a --config-dir."""
    (tmp_path / "code").mkdir()
    write_module(tmp_path / "code", "toylaunch", TOY)
    (tmp_path / "configs" / "launcher").mkdir(parents=True)
    (tmp_path / "configs" / "launcher" / "toy.yaml").write_text(
        "defaults:\n  - base_toy\n\nmax_restarts: 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    import toylaunch  # noqa: F401  (registering is importing its module)

    try:
        yield str(tmp_path / "configs")
    finally:
        LAUNCHERS.unregister("toy")
        sys.modules.pop("toylaunch", None)


def test_a_toy_launcher_is_composed_checked_and_dispatched(toy: str, tmp_path: Path) -> None:
    assert "toy" in launcher_names()
    run = checked_run(["launcher=toy", "launcher.greeting=hi"], config_dir=toy)
    plain = run.to_dict()["launcher"]
    assert plain == {**plain, "name": "toy", "greeting": "hi"}
    assert type(run.launcher).__name__ == "ToyLauncherConfig"
    assert run.launcher.greeting == "hi" and run.launcher.rdzv_timeout == 900.0
    with pytest.raises(ConfigError) as err:
        checked(["launcher=toy", "launcher.greeting="], config_dir=toy)
    assert err.value.key == "launcher.greeting"
    with pytest.raises(ConfigError) as err:  # the schema is the toy's: a typo fails at compose
        checked(["launcher=toy", "launcher.greting=hi"], config_dir=toy)
    assert err.value.key == "launcher.greting"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert submit(run, run_dir, ["disttrain", "train"]) is False  # no scheduler: launch here
    launch(run, run_dir, entry="some.entry")
    assert (run_dir / "toy.txt").read_text() == "hi some.entry 2"


def test_launcher_name_lists_registered_launchers(toy: str) -> None:
    with pytest.raises(ConfigError) as err:
        checked(["launcher.name=nope"], config_dir=toy)
    assert err.value.key == "launcher.name" and "toy" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "scheduler"),
    [((), False), (("launcher=spawn",), False), (("launcher=slurm",), True), (("launcher=k8s",), True)],
)
def test_builtin_launchers_come_from_the_registry(overrides: tuple[str, ...], scheduler: bool) -> None:
    from disttrain.config import compose, resolve

    run = Run.of(resolve(compose(list(overrides)), list(overrides)))
    launcher = launcher_for(run)
    assert type(launcher).__name__.lower().startswith(run.launcher.name)
    assert launcher.scheduler is scheduler


def test_no_launcher_name_is_compared_outside_the_registry() -> None:
    """`cfg["launcher"]["name"] == "slurm"` and the like: the choice belongs to the registry."""
    root = Path(disttrain.__file__).parent
    compare = re.compile(
        r"""\[["']launcher["']\]\[["']name["']\]\s*(==|!=|in\b)|\blauncher_name\(\)\s*==\s*"""
    )
    names = "|".join(launcher_names())
    literal = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = []
    for path in root.rglob("*.py"):
        if path.parent.name == "launch" and path.name == "registry.py":
            continue  # the registry
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line) or literal.search(line):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
