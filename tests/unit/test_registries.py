"""One registry shape for every plug-in kind (strategies, launchers, tasks, models, data), and a toy
launcher and a toy task that are one module + one YAML each, installed by an entry point, picked up
by config composition, the checks, `train --help` and (the launcher) environment detection.
All in-process: no `disttrain train` subprocess."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from dataclasses import field, make_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from unit_support import checked

from disttrain.config.errors import ConfigError
from disttrain.config.registry import Registry, TargetSpec
from disttrain.config.run import Run
from disttrain.config.schema import DataConfig, LauncherConfig, TaskConfig
from disttrain.data.specs import DATA
from disttrain.launch.specs import LAUNCHERS, LauncherSpec, detected, started_by
from disttrain.models.parallel import TP_PLANS, TPPlanSpec
from disttrain.models.specs import MODELS
from disttrain.strategies.specs import STRATEGIES, StrategyConfig
from disttrain.strategies.specs.data_parallel import DDP
from disttrain.tasks.specs import TASKS


def _config(base: type, name: str, **defaults: Any) -> type:
    extra = [(k, type(v), field(default=v)) for k, v in defaults.items()]
    return make_dataclass(f"Cfg_{name}", [("name", str, field(default=name)), *extra], bases=(base,))


# One spec factory per kind: name -> a spec of that kind that no built-in holds.
KINDS: dict[str, tuple[Registry[Any], Callable[[str], Any]]] = {
    "strategies": (
        STRATEGIES,
        lambda n: replace(DDP, name=n, config=_config(StrategyConfig, n), target=f"{n}_mod:Strategy"),
    ),
    "launchers": (
        LAUNCHERS,
        lambda n: LauncherSpec(n, _config(LauncherConfig, n), f"{n}_mod:Launcher", "a toy"),
    ),
    "tasks": (
        TASKS,
        lambda n: TargetSpec(n, make_dataclass(n, [], bases=(TaskConfig,)), f"{n}_mod.Task", "a toy"),
    ),
    "models": (MODELS, lambda n: TargetSpec(n, make_dataclass(n, []), f"{n}_mod.Net", "a toy")),
    "data": (DATA, lambda n: TargetSpec(n, _config(DataConfig, n), f"{n}_mod.load", "a toy")),
    "tp_plans": (TP_PLANS, lambda n: TPPlanSpec(f"{n}", f"{n}_mod:plan", "a toy")),
}


def install(site: Path, dist: str, groups: dict[str, str], modules: dict[str, str]) -> None:
    """A package as pip installs it: its modules and a `*.dist-info` with entry_points.txt."""
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n{line}\n" for g, line in groups.items()))


@pytest.fixture
def cleanup() -> Iterator[list[tuple[Registry[Any], str]]]:
    added: list[tuple[Registry[Any], str]] = []
    try:
        yield added
    finally:
        for registry, name in added:
            registry.unregister(name)
            sys.modules.pop(f"plug_{registry.kind}", None)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_registry_keeps_the_contract(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[Any]
) -> None:
    registry, make = KINDS[kind]
    builtins = registry.names()
    assert builtins and all(registry.is_builtin(n) for n in builtins)
    assert registry.group == f"disttrain.{kind}"
    # register: the same object twice is fine, another spec under a taken name is refused naming both
    spec = make("toy_one")
    cleanup.append((registry, "toy_one"))
    assert registry.register(spec) is spec and registry.register(spec) is spec
    other = make("toy_one")
    with pytest.raises(ValueError, match=r"toy_one.*already registered.*toy_one_mod.*refusing"):
        registry.register(other)
    assert registry.get("toy_one") is spec
    assert registry.register(other, replace=True) is other and registry.get("toy_one") is other
    with pytest.raises(ValueError, match="already registered"):  # a built-in is not replaced by accident
        registry.register(make(builtins[0]))
    # get: an unknown name is the one-paragraph ConfigError naming the config key and the known names
    with pytest.raises(ConfigError) as err:
        registry.get("nope")
    assert err.value.key == registry.key and err.value.value == "nope"
    assert all(n in err.value.allowed for n in [*builtins, "toy_one"]) and err.value.hint
    # discover: an installed package's entry point (a module that registers, or a spec object)
    site = tmp_path / "site"
    site.mkdir()
    module = f"plug_{kind}"
    install(
        site,
        f"plug-{kind}",
        {registry.group: f"toy_two = {module}\ntoy_three = {module}:THREE"},
        {
            module: f"from test_registries import KINDS\nREG, make = KINDS[{kind!r}]\nREG.register(make('toy_two'))\n"
            "THREE = make('toy_three')\n"
        },
    )
    monkeypatch.syspath_prepend(str(site))
    cleanup.extend([(registry, "toy_two"), (registry, "toy_three")])
    assert "toy_two" not in registry.names()  # entry points are read once, at the first use ...
    registry.rediscover()  # ... or again (what a fresh process does)
    names = registry.names()
    # all(): built-ins first, in their order, then the plug-ins in registration order
    assert names == [*builtins, "toy_one", "toy_two", "toy_three"]
    assert not registry.is_builtin("toy_two") and registry.get("toy_three").name == "toy_three"


# ------------------------------------------------------------------------- a toy launcher and task
TOY_LAUNCHER = '''
"""A PBS-like launcher as a package: its Launcher, config, detection and spec in one module."""
from dataclasses import dataclass
from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.config.schema import LauncherConfig
from disttrain.launch.base import Launcher
from disttrain.launch.specs import LAUNCHERS, LauncherSpec


@dataclass
class ToyLauncherConfig(LauncherConfig):
    name: str = "toy"
    queue: str = "batch"


class ToyLauncher(Launcher):
    def check_static(self, run):  # run.launcher: this launcher's own config class
        if not run.launcher.queue:
            raise ConfigError("launcher.queue", "", "a queue name", "launcher.queue=batch.")

    def launch(self, run, run_dir, entry):
        (Path(run_dir) / "toy.txt").write_text(run.launcher.queue)


def node_overrides(overrides, environ):
    return [*overrides, f"node_rank={environ['TOY_NODE']}"] if "TOY_NODE" in environ else None


SPEC = LAUNCHERS.register(
    LauncherSpec("toy", ToyLauncherConfig, "toylaunch:ToyLauncher", "toy: a test's scheduler",
                 detect=lambda environ: "TOY_JOB_ID" in environ, node_overrides=node_overrides)
)
'''

TOY_TASK = '''
"""A task as a package: the Task subclass, its config, its checks and its spec in one module."""
from dataclasses import dataclass

from disttrain.config.errors import ConfigError
from disttrain.config.registry import TargetSpec
from disttrain.config.schema import TaskConfig
from disttrain.tasks import Classification
from disttrain.tasks.specs import TASKS


class WeightedClassification(Classification):
    def __init__(self, weight=1.0, **kwargs):
        super().__init__(**kwargs)
        self.weight = weight

    def loss(self, output, target):
        return self.weight * super().loss(output, target)


@dataclass
class ToyTaskConfig(TaskConfig):
    _target_: str = "toytask.WeightedClassification"
    weight: float = 1.0


def check(run, task):
    if task.weight <= 0:
        raise ConfigError("task.weight", task.weight, "a number > 0", "task.weight=1 leaves the loss as is.")


SPEC = TASKS.register(TargetSpec("toy", ToyTaskConfig, ToyTaskConfig._target_, "a weighted loss", check))
'''


@pytest.fixture
def toys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """toylab installed (two modules, two entry points) and a config dir with one YAML for each."""
    site, conf = tmp_path / "site", tmp_path / "conf"
    site.mkdir()
    install(
        site,
        "toylab",
        {LAUNCHERS.group: "toy = toylaunch", TASKS.group: "toy = toytask"},
        {"toylaunch": TOY_LAUNCHER, "toytask": TOY_TASK},
    )
    (conf / "launcher").mkdir(parents=True)
    (conf / "launcher" / "toy.yaml").write_text("defaults:\n  - base_toy\n")
    (conf / "task").mkdir()
    (conf / "task" / "toy.yaml").write_text("# @package _global_\ndefaults:\n  - base_toy@task\n  - _self_\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        LAUNCHERS.rediscover()  # what a fresh `disttrain` process does at its first registry use
        TASKS.rediscover()
        yield str(conf)
    finally:
        LAUNCHERS.unregister("toy")
        TASKS.unregister("toy")
        for module in ("toylaunch", "toytask"):
            sys.modules.pop(module, None)  # not monkeypatch.delitem: its undo would bring it back


def test_a_toy_launcher_and_task_are_composed_and_checked(toys: str, tmp_path: Path) -> None:
    from disttrain.launch import launch
    from disttrain.tasks import build_task

    cfg = checked(["launcher=toy", "task=toy", "task.weight=2"], config_dir=toys)
    assert cfg["launcher"]["name"] == "toy" and cfg["launcher"]["queue"] == "batch"
    assert cfg["task"] == {"_target_": "toytask.WeightedClassification", "weight": 2.0}
    assert type(build_task(cfg["task"])).__name__ == "WeightedClassification"
    for bad, key in (
        ("task.weight=0", "task.weight"),  # the task spec's own check
        ("task.weight=heavy", "task.weight"),  # its schema's type
        ("launcher.queue=", "launcher.queue"),  # the launcher's own check
        ("launcher.qeue=x", "launcher.qeue"),  # its schema: a typo fails at compose
    ):
        with pytest.raises(ConfigError) as err:
            checked(["launcher=toy", "task=toy", bad], config_dir=toys)
        assert err.value.key == key, bad
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch(Run.of({**cfg, "nproc_per_node": 2}), run_dir)
    assert (run_dir / "toy.txt").read_text() == "batch"


def test_train_help_lists_the_toys_and_their_keys(toys: str) -> None:
    from disttrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--config-dir", toys, "launcher=toy", "task=toy", "--help"]) == 0
    text = out.getvalue()
    options = dict(line.split(": ", 1) for line in text.split("== Configuration groups ==")[1].split("==")[0].splitlines() if ": " in line)  # fmt: skip
    assert options["launcher"] == "k8s, slurm, spawn, torchrun, toy", text
    assert options["task"] == "classification, lm, model_loss, regression, toy", text
    assert any(line.startswith("launcher.queue") for line in text.splitlines())
    assert any(line.startswith("task.weight") for line in text.splitlines())


def test_the_toy_launcher_detects_its_environment_before_the_built_ins(toys: str) -> None:
    from disttrain.commands.train import environment_overrides

    slurm_step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1"}
    assert getattr(detected(slurm_step), "name", None) == "slurm"
    assert environment_overrides(["seed=1"], slurm_step) == ["seed=1", "node_rank=1"]
    toy_job = {**slurm_step, "TOY_JOB_ID": "42", "TOY_NODE": "3"}  # a plug-in's scheduler on top
    assert getattr(detected(toy_job), "name", None) == "toy"
    assert environment_overrides(["seed=1"], toy_job) == ["seed=1", "node_rank=3"]
    # a rank the toy scheduler started itself (RANK, WORLD_SIZE, no node settings) trains as one
    rank = {"TOY_JOB_ID": "42", "RANK": "1", "WORLD_SIZE": "2"}
    assert environment_overrides([], rank) is None and started_by(rank) == "toy"
    assert detected({}) is None and started_by({"RANK": "0", "WORLD_SIZE": "1"}) == "env"


@pytest.mark.parametrize(
    ("registry", "key", "overrides"),
    [(MODELS, "model.in_features", ["model=mlp"]), (DATA, "data.size", ["data=synthetic"])],
    ids=["model", "data"],
)
def test_a_model_or_data_spec_checks_its_own_keys_when_the_run_builds_it(
    registry: Registry[TargetSpec], key: str, overrides: list[str]
) -> None:
    """A registered model's or data set's `check_static` runs with the pre-launch checks, given its
    node typed, for the spec whose target the run builds (a data node's: its train split's), and
    for no other."""
    builtin = registry.get(overrides[0].partition("=")[2])
    seen: list[Any] = []

    def refuse(run: Run, node: Any) -> None:
        seen.append(node)
        raise ConfigError(key, "x", "what the plug-in allows", "the plug-in's own hint.")

    probe = replace(builtin, name="probe", check_static=refuse)
    registry.register(probe)
    try:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            checked(overrides)
        assert len(seen) == 1 and isinstance(seen[0], builtin.config), seen
        other = "model=gpt" if registry is MODELS else "data=digits"
        checked([other])  # a run that builds another target never calls it
        assert len(seen) == 1
    finally:
        registry.unregister("probe")
