"""`LauncherSpec` and the launcher registry: what config, checks and `disttrain train` know of a
launcher before it is imported. Torch-free; one module per built-in launcher beside this one.

A spec names the launcher's typed config (the only home of its defaults, stored in Hydra's ConfigStore
as `launcher/base_<name>`), its `Launcher` class (imported only when it is checked or runs) and how
it recognises the environment its scheduler or agent makes (`detect`, as Lightning's cluster
environments do). A new launcher (PBS, LSF, ...) is a package: one module with its `Launcher`, its
config and its `LAUNCHERS.register(LauncherSpec(...))`, declared in the `disttrain.launchers`
entry-point group, plus one YAML under `launcher/` in a `--config-dir` (`defaults: [base_<name>]`).

Where `disttrain train` runs, `detected(environ)` is the first spec whose `detect` holds: the
plug-ins first (a package knows its cluster), then the built-ins torchrun, slurm, k8s; spawn detects
nothing. The detected spec decides whether this process is already a rank someone else started (RANK
and WORLD_SIZE set: `disttrain.launch.external`), or a node's launcher that takes its node settings
from the environment (`node_overrides`: an srun step, a Kubeflow pod) and checks them (`check_node`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disttrain.config.registry import Registry, Spec, load_target

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.launch.base import Launcher

Environ = Mapping[str, str]


def _never(environ: Environ) -> bool:
    return False


@dataclass(frozen=True)
class LauncherSpec(Spec):
    """What config and checks know of a launcher without importing it: a `Spec` (`target`: its
    `Launcher` class; `help`: one line for `launcher.name`'s allowed values), and:

    detect(environ): this process runs inside the environment the launcher's scheduler or agent
    makes (a Slurm job, a Kubeflow pod, a rank torchrun started).
    node_overrides(overrides, environ): there, `overrides` plus the node settings the environment
    gives a `disttrain train` run once per node (node_rank, master_addr, ...); None where this
    process is no node's launcher (then RANK and WORLD_SIZE, if set, make it a rank).
    check_node(run): a node's launcher there: the environment against the run (`config.run.Run`).
    started_by: what a rank started in this environment records as its launcher (launch.json).
    `node_overrides` and `check_node` are functions or "module:function" paths, imported when
    called (`node_settings`, `check_node_env`): a built-in's implementation lives in `launch/`,
    above this torch-free declaration (tests/unit/test_layers.py).
    """

    detect: Callable[[Environ], bool] = _never
    node_overrides: Callable[[list[str], Environ], list[str] | None] | str | None = None
    check_node: Callable[[Run], None] | str | None = None
    started_by: str = ""  # default: the name
    # Its nodes see a file system of their own (a pod's image), not the submitting machine's: the
    # config's relative paths stay as written, for each node to resolve (config.compose.absolute_paths).
    own_files: bool = False

    def __post_init__(self) -> None:
        self.check_named("launcher")

    def node_settings(self, overrides: list[str], environ: Environ) -> list[str] | None:
        """`node_overrides` here (None: no node settings come from this environment)."""
        found = _function(self.node_overrides)
        return None if found is None else found(overrides, environ)

    def check_node_env(self, run: Run) -> None:
        found = _function(self.check_node)
        if found is not None:
            found(run)

    def load(self) -> Launcher:
        launcher: Launcher = load_target(self.target)()
        return launcher


def _function(ref: Any) -> Any:
    """A function, or the one a "module:function" path names (imported now), or None."""
    return load_target(ref) if isinstance(ref, str) else ref


LAUNCHERS: Registry[LauncherSpec] = Registry(
    "launchers",
    key="launcher.name",
    spec_type=LauncherSpec,
    builtin=(
        "disttrain.launch.specs.torchrun",
        "disttrain.launch.specs.spawn",
        "disttrain.launch.specs.slurm",
        "disttrain.launch.specs.k8s",
    ),
    hint="choose the launcher group option: launcher=slurm, or add launcher/NAME.yaml with a "
    "registered launcher's base_NAME.",
    describe=lambda spec: spec.target,
)
register = LAUNCHERS.register


def detected(environ: Environ) -> LauncherSpec | None:
    """The launcher whose environment this process runs in: the first spec whose `detect` holds,
    plug-ins first, then the built-ins (torchrun, slurm, k8s); None outside every one."""
    specs = LAUNCHERS.all()
    plugins = [s for s in specs if not LAUNCHERS.is_builtin(s.name)]
    for spec in [*plugins, *(s for s in specs if LAUNCHERS.is_builtin(s.name))]:
        if spec.detect(environ):
            return spec
    return None


def started_by(environ: Environ) -> str:
    """Who started this rank, as its environment tells: the detected launcher's `started_by`, or
    `env` (RANK and WORLD_SIZE only, set by hand or by a script)."""
    spec = detected(environ)
    return "env" if spec is None else spec.started_by or spec.name
