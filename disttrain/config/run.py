"""The run: one frozen, typed object for a resolved config, built once and handed to everything.

`Run.of(plain)` takes the resolved config as plain containers (what `resolve` returns in the parent
and what `config.yaml` holds, read back in each rank) and types every fixed block through its
schema dataclass (`trainer`, `checkpoint`, `amp`, ...), the strategy and launcher blocks through
their registries (each plug-in's own config class), and the world (`nodes`, `nproc_per_node`,
`node_rank`, `master_addr`, `master_port`) as `World`. Checks, launchers, the worker, the loaders
and the tools take a `Run` and read attributes: `run.world.size`, `run.trainer.batch_size`,
`run.launcher.max_restarts`.

`optim`, `sched`, `data` and `task` are typed too (`Optim`, `Sched`, `Data`, `TaskTarget`: the
keys disttrain reads, checked beside their fields, and the target's own `kwargs`). `model` stays a
mapping: the user's class's arguments, whatever keys those take. Nothing under a Run can be
assigned (`config.common.Block`, `sealed`). `config.yaml` stays plain YAML: `to_dict()` is that
form. A changed run is a new one (`updated`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from disttrain.config.common import Block, Keyed, sealed
from disttrain.config.errors import ConfigError
from disttrain.config.schema import (
    AmpConfig,
    BackendConfig,
    CheckpointConfig,
    Config,
    Data,
    DebugConfig,
    InitConfig,
    LauncherConfig,
    ObserveConfig,
    Optim,
    PeftConfig,
    PlanConfig,
    ProfilerConfig,
    Sched,
    SweepConfig,
    TaskTarget,
    TrainerConfig,
)
from disttrain.config.typed import typed
from disttrain.strategies.specs import StrategyConfig


@dataclass
class World(Keyed):
    """The processes of a run: `nodes` machines x `nproc_per_node` ranks, this node's rank and the
    rendezvous address of node 0 (`World.of(plain)`: their keys in the plain config, checked here;
    the defaults are the schema's)."""

    nodes: int
    nproc_per_node: int
    node_rank: int = Config.node_rank
    master_addr: str = Config.master_addr
    master_port: int = Config.master_port

    @property
    def size(self) -> int:
        """Ranks in the whole run."""
        return self.nodes * self.nproc_per_node

    def __post_init__(self) -> None:
        nodes = self.nodes
        for key, value, hint in (
            ("nodes", nodes, "use nodes=1 for a single machine."),
            ("nproc_per_node", self.nproc_per_node, "one rank per GPU; on CPU 2 is a good start."),
        ):
            if value is None or value < 1:
                raise ConfigError(key, value, "a number >= 1", hint)
        if not 0 <= self.node_rank < nodes:
            raise ConfigError(
                "node_rank", self.node_rank, f"0..{nodes - 1} (nodes={nodes})", "number nodes from 0."
            )
        for key in ("nodes", "nproc_per_node", "node_rank", "master_port"):
            setattr(self, key, int(getattr(self, key)))
        self.master_addr = str(self.master_addr)


NAME = re.compile(r"[A-Za-z0-9._-]+")


def check_name(cfg: Mapping[str, Any]) -> None:
    """`name` becomes a path component (runs/NAME/...), the Slurm job name and the rendezvous id:
    no separators, no `..`, nothing a shell or sbatch would split or run."""
    name = cfg.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name) or set(name) == {"."}:
        raise ConfigError(
            "name",
            repr(name) if isinstance(name, str) and not NAME.fullmatch(name) else name,
            "letters, digits and . _ - (not only dots)",
            "e.g. name=lr-sweep_3; the run dir is runs/NAME/TIMESTAMP (set hydra.run.dir for another place).",
        )


@dataclass(frozen=True, eq=False)
class Run:
    """A resolved config, typed and checked: see the module's docstring."""

    world: World
    backend: BackendConfig
    strategy: StrategyConfig  # the registered strategy's own config class
    amp: AmpConfig
    peft: PeftConfig
    launcher: LauncherConfig  # the registered launcher's own config class
    trainer: TrainerConfig
    checkpoint: CheckpointConfig
    init: InitConfig
    plan: PlanConfig
    observe: ObserveConfig
    debug: DebugConfig
    profiler: ProfilerConfig
    sweep: SweepConfig
    name: str
    seed: int
    resume: str | None
    storage_options: dict[str, Any]
    threads_per_rank: int | None
    profile: bool
    optim: Optim
    sched: Sched
    data: Data
    task: TaskTarget | None  # None: a minimal Run without the node (a test's, a meta.json's)
    _plain: dict[str, Any] = field(repr=False)  # the YAML form, read-only (a copy: plain dicts)

    def __post_init__(self) -> None:
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            hint = "leave it null."
            raise ConfigError(
                "threads_per_rank", self.threads_per_rank, "null (cores / local ranks) or >= 1", hint
            )
        for f in fields(self):  # read-only to the leaves: assignment anywhere under a Run raises
            object.__setattr__(self, f.name, sealed(getattr(self, f.name)))

    @property
    def model(self) -> Any:
        """The open `model` node: the user's class's arguments, read-only (None where absent)."""
        return self._plain.get("model")

    @classmethod
    def of(cls, cfg: Mapping[str, Any] | Run) -> Run:
        """The Run of a resolved config (plain containers: `resolve`'s result, a config.yaml),
        checked as it is typed: the world (`World.of`), the strategy's and launcher's names and
        keys, and every block against its schema (a hand-edited config.yaml meets the closed
        choices here: the ConfigError naming the key)."""
        if isinstance(cfg, Run):
            return cfg
        from disttrain.launch.specs import LAUNCHERS
        from disttrain.strategies.specs import of as strategy_of

        plain = copy.deepcopy(dict(cfg))
        check_name(plain)
        world = World.of(plain)
        strategy = strategy_of(plain)[1]  # an unknown strategy.name, or keys of another strategy
        launcher: LauncherConfig = typed(
            LAUNCHERS.get(plain["launcher"]["name"]).config, plain["launcher"], "launcher"
        )

        def top(key: str) -> Any:  # a run dir frozen before the key existed: the schema's default
            return plain[key] if key in plain else getattr(Config, key, None)

        return cls(
            world=world,
            strategy=strategy,
            launcher=launcher,
            # every other schema block through its dataclass (absent in a run dir from before it: its defaults)
            **{k: typed(t, plain.get(k), k) for k, t in get_type_hints(cls).items() if _schema_block(t)},
            name=str(top("name")),
            seed=int(top("seed")),
            resume=top("resume"),
            storage_options=dict(top("storage_options") or {}),
            threads_per_rank=top("threads_per_rank"),
            profile=bool(top("profile")),
            optim=Optim.of(plain["optim"]),
            sched=Sched.of(plain["sched"]),
            data=Data.of(plain.get("data", {})),
            task=TaskTarget.of(plain["task"]) if "task" in plain else None,
            _plain=plain,
        )

    def to_dict(self) -> dict[str, Any]:
        """The plain config (what config.yaml holds): a new copy."""
        return copy.deepcopy(self._plain)

    def updated(self, changes: Mapping[str, Any]) -> Run:
        """A new Run: this one's config with `changes` merged in (nested mappings key by key, any
        other value replaced), e.g. `run.updated({"checkpoint": {"dir": None}, "resume": "auto"})`."""
        return Run.of(_merged(self.to_dict(), changes))


def _schema_block(t: Any) -> bool:
    """A Run field typed by OmegaConf through its own schema class (not a registry's or `Keyed.of`'s)."""
    return (
        isinstance(t, type)
        and issubclass(t, Block)
        and not issubclass(t, (Keyed, StrategyConfig, LauncherConfig))
    )


def _merged(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = _merged(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


__all__ = ["Run", "World"]
