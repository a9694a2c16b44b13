"""Leaf helpers of the config schemas, the checks and the strategy specs (no disttrain imports
but the error type).

Kept apart so that `config/schema.py`, `preflight/checks.py` and `strategies/specs/` can all use them
without importing one another: the help-carrying dataclass field, `Choice` and `Switch`, and the
world shape (a refused `Switch` value raises `errors.ConfigError`, imported where it is raised).
"""

from __future__ import annotations

from dataclasses import field
from enum import Enum
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

if TYPE_CHECKING:
    from disttrain.config.run import Run


def help_field(text: str, default: Any = MISSING, factory: Any = None, choices: Any = None) -> Any:
    """A dataclass field with a one-line help text (shown by `disttrain config --help`); `choices`:
    the `Switch` whose members a field takes (`--help` lists them)."""
    metadata = {"help": text} if choices is None else {"help": text, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class Choice(str, Enum):
    """A closed choice of the schema (`trainer.detect_anomaly: AnomalyMode`): OmegaConf refuses any
    other value when the config is composed, `--help` lists the members, and a member reads, compares
    and prints as its value (`mode == "skip"`, f"{mode}" -> "skip"). Member names are the values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Switch(Choice):
    """A closed choice that is also on or off, so YAML's booleans keep working (`trainer.compile: true`):
    `false` is its off member (falsy: `if trainer.compile:`), `true` an on member or an alias of one.

    OmegaConf refuses a boolean for an enum field and a member for a `bool | str` one, so the schema
    field is typed `Any` and the dataclass turns what it holds into a member in `__post_init__`
    (`Switch.of`: anything else is a ConfigError there)."""

    def __bool__(self) -> bool:
        return self.value != "false"

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


class ComputeDtype(Choice):
    """A floating-point dtype by name: amp.dtype, strategy.param_dtype/reduce_dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def world_shape(run: Run) -> str:
    """The world size with where it comes from, for error messages."""
    world = run.world
    return f"nodes x nproc_per_node = {world.nodes} x {world.nproc_per_node} = {world.size}"
