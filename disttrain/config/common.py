"""Leaf helpers of the config schemas, the checks and the strategy specs (no disttrain imports
but the error type).

Kept apart so that `config/schema.py`, `preflight/checks.py` and `strategies/specs/` can all use them
without importing one another: the help-carrying dataclass field, `Choice` and `Switch`, and the
world shape (a refused `Switch` value raises `errors.ConfigError`, imported where it is raised).
"""

from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import FrozenInstanceError, field, fields, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import MISSING

if TYPE_CHECKING:
    from disttrain.config.run import Run


def help_field(
    text: str, default: Any = MISSING, factory: Any = None, choices: Any = None, at_least: float | None = None
) -> Any:
    """A dataclass field with a one-line help text (shown by `disttrain config --help`); `choices`:
    the `Switch` whose members a field takes (`--help` lists them); `at_least`: the smallest number
    it holds (null passes), checked as a Run types it (`config.typed.typed`)."""
    metadata = {"help": text, "choices": choices, "at_least": at_least}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


READ_ONLY = "a Run is read-only: run.updated({...}) makes a changed one"


class Block:
    """Base of every schema block a Run holds: assignable while OmegaConf builds it, read-only
    once the Run seals it (`sealed`), so `run.trainer.batch_size = 999` fails instead of drifting
    from `run.to_dict()`. (OmegaConf refuses to merge into `frozen=True` dataclasses.)"""

    def __setattr__(self, name: str, value: Any) -> None:
        self._open(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._open(name)
        object.__delattr__(self, name)

    def _open(self, name: str) -> None:
        if self.__dict__.get("_sealed"):
            raise FrozenInstanceError(f"cannot assign {type(self).__name__}.{name}: {READ_ONLY}")


K = TypeVar("K", bound="Keyed")


class Keyed(Block):
    """A Block built from a plain node's keys as they are (`Optim.of(node)`), not through OmegaConf:
    each field the node's key (`target`: its `_target_`), else the field's default (None for a
    required one: its check says so); a `kwargs` field holds the node's other keys as written (bar
    `_partial_`): the target's own arguments. The fields' checks run in `__post_init__`."""

    @classmethod
    def of(cls: type[K], node: Any, **given: Any) -> K:  # a Mapping, or already one of `cls`
        if isinstance(node, cls):
            return node
        own = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        read = {"_target_" if n == "target" else n: n for n in own if n not in given and n != "kwargs"}
        values = {read[k]: v for k, v in node.items() if k in read}
        for name, f in own.items():
            if name not in values and f.default_factory is NO_DEFAULT and f.default in (NO_DEFAULT, MISSING):
                values[name] = None
        if "kwargs" in own:  # the node's keys of the fields are theirs: `_target_`, not `target`,
            # which is a task's own argument (lm's `task.target=labels`)
            skip = {"_target_" if n == "target" else n for n in own} | (
                {"_partial_"} if "target" in own else set()
            )
            values["kwargs"] = {k: v for k, v in node.items() if k not in skip}
        return cls(**values, **given)


def _refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(f"cannot change a {type(self).__name__}: {READ_ONLY}")


class FrozenDict(dict[str, Any]):
    """A mapping under a Run: reads as a dict, refuses every change; a copy is a plain dict."""

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> Any:
        return (FrozenDict, (dict(self),))

    def __deepcopy__(self, memo: Any) -> dict[str, Any]:
        import copy

        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class FrozenList(list[Any]):
    """A list under a Run: reads as a list, refuses every change; a copy is a plain list."""

    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = _refuse
    clear = pop = remove = reverse = sort = _refuse

    def __reduce__(self) -> Any:
        return (FrozenList, (list(self),))

    def __deepcopy__(self, memo: Any) -> list[Any]:
        import copy

        return [copy.deepcopy(v, memo) for v in self]


def sealed(value: Any) -> Any:
    """`value` read-only to its leaves: a Block's fields sealed, then the Block; dicts and lists
    as FrozenDict and FrozenList (new ones; the Block is sealed in place)."""
    if isinstance(value, Block):
        for f in fields(value):  # type: ignore[arg-type]
            object.__setattr__(value, f.name, sealed(getattr(value, f.name)))
        object.__setattr__(value, "_sealed", True)
    elif is_dataclass(value) and not isinstance(value, type) and not value.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{type(value).__name__} under a Run must derive from config.common.Block")
    elif isinstance(value, dict):
        return FrozenDict({k: sealed(v) for k, v in value.items()})
    elif isinstance(value, list):
        return FrozenList(sealed(v) for v in value)
    return value


class Choice(str, Enum):
    """A closed choice of the schema (`trainer.detect_anomaly: AnomalyMode`): OmegaConf refuses any
    other value when the config is composed, `--help` lists the members, and a member reads, compares
    and prints as its value (`mode == "skip"`, f"{mode}" -> "skip"). Member names are the values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls, key: str, value: Any) -> Any:
        """`value` (a boolean, a member's name or value) as a member; a ConfigError naming `key`."""
        if isinstance(value, cls):
            return value
        name = str(value).lower() if isinstance(value, bool) else value
        found = cls.__members__.get(name) if isinstance(name, str) else None
        if found is None:
            from disttrain.config.errors import ConfigError, choice_help

            choices = ", ".join(m.value for m in cls)
            raise ConfigError(key, value, f"one of {choices}", f"{key}: {choice_help(key)}.")
        return found


class Switch(Choice):
    """A closed choice that is also on or off, so YAML's booleans keep working (`trainer.compile: true`):
    `false` is its off member (falsy: `if trainer.compile:`), `true` an on member or an alias of one.

    OmegaConf refuses a boolean for an enum field and a member for a `bool | str` one, so the schema
    field is typed `Any` and the dataclass turns what it holds into a member in `__post_init__`
    (`Choice.of`: anything else is a ConfigError there)."""

    def __bool__(self) -> bool:
        return self.value != "false"


class ComputeDtype(Choice):
    """A floating-point dtype by name: amp.dtype, strategy.param_dtype/reduce_dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def world_shape(run: Run) -> str:
    """The world size with where it comes from, for error messages."""
    world = run.world
    return f"nodes x nproc_per_node = {world.nodes} x {world.nproc_per_node} = {world.size}"
