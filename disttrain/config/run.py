"""The run: one frozen, typed object for a resolved config, built once and handed to everything.

`Run.of(plain)` takes the resolved config as plain containers (what `resolve` returns in the parent
and what `config.yaml` holds, read back in each rank) and types every fixed block through its
schema dataclass (`trainer`, `checkpoint`, `amp`, ...), the strategy and launcher blocks through
their registries (each plug-in's own config class), and the world (`nodes`, `nproc_per_node`,
`node_rank`, `master_addr`, `master_port`) as `World`. Checks, launchers, the worker, the loaders
and the tools take a `Run` and read attributes: `run.world.size`, `run.trainer.batch_size`,
`run.launcher.max_restarts`.

The open `_target_` nodes (`model`, `data`, `task`, `optim`, `sched`) stay mappings: they are the
user's classes' arguments, whatever keys those take. `config.yaml` stays plain YAML: `to_dict()`
is that form. A Run never changes; a changed run is a new one (`updated`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from disttrain.config.common import sealed
from disttrain.config.schema import (
    AmpConfig,
    BackendConfig,
    CheckpointConfig,
    Config,
    DebugConfig,
    InitConfig,
    LauncherConfig,
    ObserveConfig,
    PeftConfig,
    PlanConfig,
    ProfilerConfig,
    SweepConfig,
    TrainerConfig,
)
from disttrain.config.typed import own_key, typed
from disttrain.strategies.specs import StrategyConfig


@dataclass(frozen=True)
class World:
    """The processes of a run: `nodes` machines x `nproc_per_node` ranks, this node's rank and the
    rendezvous address of node 0 (their defaults are the schema's: `Run.of` fills them)."""

    nodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def size(self) -> int:
        """Ranks in the whole run."""
        return self.nodes * self.nproc_per_node


@dataclass(frozen=True, eq=False)
class Run(Mapping[str, Any]):
    """A resolved config, typed: see the module's docstring. Also a read-only Mapping of the plain
    config (`run["model"]`, `"init" in run`, `dict(run)`): each value a copy."""

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
    _plain: dict[str, Any] = field(repr=False)  # the YAML form, read-only (a copy: plain dicts)

    def __post_init__(self) -> None:
        for f in fields(self):  # read-only to the leaves: assignment anywhere under a Run raises
            object.__setattr__(self, f.name, sealed(getattr(self, f.name)))

    # The open `_target_` nodes: the user's classes' arguments, read-only.
    @property
    def model(self) -> dict[str, Any]:
        return self["model"]

    @property
    def data(self) -> dict[str, Any]:
        return self["data"]

    @property
    def task(self) -> dict[str, Any]:
        return self["task"]

    @property
    def optim(self) -> dict[str, Any]:
        return self["optim"]

    @property
    def sched(self) -> dict[str, Any]:
        return self["sched"]

    @classmethod
    def of(cls, cfg: Mapping[str, Any] | Run) -> Run:
        """The Run of a resolved config (plain containers: `resolve`'s result, a config.yaml)."""
        if isinstance(cfg, Run):
            return cfg
        from disttrain.launch.specs import LAUNCHERS
        from disttrain.strategies.specs import STRATEGIES

        plain = copy.deepcopy(dict(cfg))
        world = World(
            nodes=int(plain["nodes"]),
            nproc_per_node=int(plain["nproc_per_node"]),
            node_rank=int(own_key(plain, Config, "node_rank")),
            master_addr=str(own_key(plain, Config, "master_addr")),
            master_port=int(own_key(plain, Config, "master_port")),
        )
        return cls(
            world=world,
            backend=typed(BackendConfig, plain["backend"], "backend"),
            strategy=typed(
                STRATEGIES.get(plain["strategy"]["name"]).config_cls, plain["strategy"], "strategy"
            ),
            amp=typed(AmpConfig, plain["amp"], "amp"),
            peft=typed(PeftConfig, plain.get("peft"), "peft"),  # a run dir from before peft: none
            launcher=typed(LAUNCHERS.get(plain["launcher"]["name"]).config, plain["launcher"], "launcher"),
            trainer=typed(TrainerConfig, plain.get("trainer"), "trainer"),
            checkpoint=typed(CheckpointConfig, plain.get("checkpoint"), "checkpoint"),
            init=typed(InitConfig, plain.get("init"), "init"),
            plan=typed(PlanConfig, plain.get("plan"), "plan"),
            observe=typed(ObserveConfig, plain.get("observe"), "observe"),
            debug=typed(DebugConfig, plain.get("debug"), "debug"),
            profiler=typed(ProfilerConfig, plain.get("profiler"), "profiler"),
            sweep=typed(SweepConfig, plain.get("sweep"), "sweep"),
            name=str(own_key(plain, Config, "name")),
            seed=int(own_key(plain, Config, "seed")),
            resume=own_key(plain, Config, "resume"),
            storage_options=dict(own_key(plain, Config, "storage_options") or {}),
            threads_per_rank=own_key(plain, Config, "threads_per_rank"),
            profile=bool(own_key(plain, Config, "profile")),
            _plain=plain,
        )

    def to_dict(self) -> dict[str, Any]:
        """The plain config (what config.yaml holds): a new copy."""
        return copy.deepcopy(self._plain)

    def updated(self, changes: Mapping[str, Any]) -> Run:
        """A new Run: this one's config with `changes` merged in (nested mappings key by key, any
        other value replaced), e.g. `run.updated({"checkpoint": {"dir": None}, "resume": "auto"})`."""
        return Run.of(_merged(self.to_dict(), changes))

    # The plain view, as config.yaml holds it: `run["model"]["_target_"]`. A copy at each read, so
    # nothing changes the run behind its typed blocks; a typed attribute is the way to read those.
    def __getitem__(self, key: str) -> Any:
        return self._plain[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plain)

    def __len__(self) -> int:
        return len(self._plain)


def _merged(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = _merged(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


__all__ = ["Run", "World"]
