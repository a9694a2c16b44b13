"""One registry shape for every kind of plug-in: strategies, launchers, tasks, built-in models and data,
and the tensor-parallel plans of model classes (`disttrain.models.parallel.TP_PLANS`).

A registry holds torch-free specs by name. Its built-ins are the specs its built-in modules register
when imported (lazily, at the first use); a package of yours adds more through the entry-point group
`disttrain.<kind>` (`disttrain.strategies`, `disttrain.launchers`, `disttrain.tasks`,
`disttrain.models`, `disttrain.data`, `disttrain.tp_plans`): the entry point names a module that
registers its specs when imported, or a spec (or a list of specs). A test or notebook may also call `register` before the
config is composed.

    register(spec, replace=False)  a second spec under a taken name is refused (naming both)
    get(name)                      the spec, or the one-paragraph ConfigError naming the config key
    all(), names()                 built-ins first, then plug-ins, each in registration order
    discover(), rediscover()       import the built-ins and the installed entry points (once / again)
    unregister(name)               tests

Leaf module: it imports nothing of disttrain but `config.errors`; specs' targets load lazily.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from disttrain.config.errors import ConfigError, one_of

if TYPE_CHECKING:
    from disttrain.config.run import Run

GROUP_PREFIX = "disttrain."


class Named(Protocol):
    @property
    def name(self) -> str: ...


SpecT = TypeVar("SpecT", bound=Named)


class Registry(Generic[SpecT]):
    """The specs of one plug-in kind. `key` is the config key a name is chosen by (`launcher.name`),
    named by `get`'s error; `hint` ends that error; `spec_type` filters what an entry point yields."""

    def __init__(
        self,
        kind: str,
        *,
        key: str,
        spec_type: type,
        builtin: tuple[str, ...],
        hint: str,
        describe: Callable[[Any], str] = repr,
    ) -> None:
        self.kind, self.key, self.spec_type, self.hint = kind, key, spec_type, hint
        self.group = GROUP_PREFIX + kind  # the entry-point group
        self._builtin_modules = builtin
        self._describe = describe  # what a duplicate's error says of each spec (its target)
        self._specs: dict[str, SpecT] = {}
        self._builtin: set[str] = set()
        self._loaded = {"builtin": False, "plugins": False}

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._specs)})"

    def register(self, spec: SpecT, replace: bool = False) -> SpecT:
        """Add `spec` (idempotent for the same object); a different spec under a taken name is an
        error unless `replace`. Returns the spec (`SPEC = REGISTRY.register(...)`)."""
        if not isinstance(spec, self.spec_type):
            raise TypeError(f"{self.kind}: {spec!r} is not a {self.spec_type.__name__}")
        known = self._specs.get(spec.name)
        if known is not None and known is not spec and not replace:
            raise ValueError(
                f"a {self.kind[:-1] if self.kind.endswith('s') else self.kind} named {spec.name!r} is "
                f"already registered ({self._describe(known)}); refusing {self._describe(spec)}. "
                "HINT: choose another name, or register(spec, replace=True) to replace it on purpose."
            )
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove a spec (tests that register one of their own)."""
        self._specs.pop(name, None)
        self._builtin.discard(name)

    def load_builtin(self) -> None:
        """Import the built-in modules (once); what they register counts as built-in."""
        if self._loaded["builtin"]:
            return
        self._loaded["builtin"] = True
        for module in self._builtin_modules:
            importlib.import_module(module)
        for module in self._builtin_modules:  # the specs the built-in modules hold at their top level
            held = {id(v) for v in vars(sys.modules[module]).values() if isinstance(v, self.spec_type)}
            self._builtin |= {name for name, spec in self._specs.items() if id(spec) in held}

    def discover(self) -> None:
        """The built-ins, then every installed entry point of `disttrain.<kind>` (each once)."""
        self.load_builtin()
        if self._loaded["plugins"]:
            return
        self._loaded["plugins"] = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=self.group):
            try:
                found = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"entry point {self.group}:{ep.name}",
                    ep.value,
                    f"an importable module or {self.spec_type.__name__}",
                    f"importing it failed ({type(exc).__name__}: {exc}); fix or uninstall the package "
                    f"that declares it ({getattr(ep.dist, 'name', '?')}).",
                ) from None
            for spec in found if isinstance(found, list | tuple) else [found]:
                if isinstance(spec, self.spec_type):
                    self.register(spec)  # type: ignore[arg-type]

    def rediscover(self) -> None:
        """Scan the entry points again (after installing a plug-in in this process: tests)."""
        self._loaded["plugins"] = False
        self.discover()

    def all(self) -> list[SpecT]:
        """Every spec: the built-ins first, then the plug-ins, each in registration order."""
        self.discover()
        order = list(self._specs)
        return sorted(self._specs.values(), key=lambda s: (s.name not in self._builtin, order.index(s.name)))

    def names(self) -> list[str]:
        return [s.name for s in self.all()]

    def is_builtin(self, name: str) -> bool:
        self.load_builtin()
        return name in self._builtin

    def get(self, name: str) -> SpecT:
        """The spec called `name`, or a ConfigError naming `key`, the value and the known names."""
        self.load_builtin()
        if name not in self._specs:
            self.discover()
        if name not in self._specs:
            raise ConfigError(self.key, name, one_of(self.names()), self.hint)
        return self._specs[name]


def load_target(target: str) -> Any:
    """`package.module:Name` or `package.module.Name`: the object (imports its module)."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Spec:
    """The fields every plug-in kind's spec names alike: `name` (its group option, stored as
    `base_<name>`), `config` (its typed config: the only home of its defaults), `target` (what it
    builds: "module:Name" or a dotted path, imported only when used) and one line of `help`."""

    name: str
    config: type
    target: str
    help: str = ""

    def typed(self, node: Any) -> Any:
        """A resolved node of this kind as its config class."""
        from disttrain.config.typed import typed

        return typed(self.config, node)

    def load(self) -> Any:
        """The target (imports its module)."""
        return load_target(self.target)

    def check_named(self, kind: str) -> None:
        """A spec chosen by `<kind>.name`: its config's `name` defaults to the spec's name, and its
        target is a "module:Class" path."""
        default = {f.name: f.default for f in dataclasses.fields(self.config)}.get("name")
        if default != self.name:
            raise ValueError(
                f"{kind} spec {self.name!r}: {self.config.__name__}.name defaults to {default!r}"
            )
        if ":" not in self.target:
            raise ValueError(f"{kind} spec {self.name!r}: target {self.target!r} is not 'module:Class'")


@dataclass(frozen=True)
class TargetSpec(Spec):
    """A built-in task, model or data set (its config's `_target_` default is `target`), with
    optional pre-launch checks of its own keys: `check_static(run, typed)` with the run
    (`disttrain.config.run.Run`) and its node as the config class."""

    check_static: Callable[[Run, Any], None] | None = None


def check_chosen(registry: Registry[TargetSpec], run: Run, key: str) -> None:
    """The pre-launch checks of each spec of `registry` whose target the run's `key` node builds
    (its `_target_`; a data node's is its train split's), given that node as the spec's config."""
    node = run.to_dict().get(key)  # an open `_target_` node (task, model, data)
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    if target is None and isinstance(node.get("train"), dict):
        target = node["train"].get("_target_")
    for spec in registry.all():
        if spec.check_static is not None and spec.target == target:
            spec.check_static(run, spec.typed(node))


def config_nodes(registry: Registry[Any]) -> dict[str, type]:
    """ConfigStore node name -> config class: `base_<name>` for every spec of `registry`."""
    return {f"base_{spec.name}": spec.config for spec in registry.all()}


def target_registry(kind: str, *, key: str, module: str, hint: str) -> Registry[TargetSpec]:
    """The registry of a `_target_` group (tasks, models, data) whose built-ins are `module`'s."""
    return Registry(kind, key=key, spec_type=TargetSpec, builtin=(module,), hint=hint, describe=_target)


def _target(spec: TargetSpec) -> str:
    return spec.target
