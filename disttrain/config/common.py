"""Leaf helpers of the config schemas, the checks and the strategy specs (no disttrain imports).

Kept apart so that `config/schema.py`, `preflight/checks.py` and `strategies/specs/` can all use them
without importing one another: the help-carrying dataclass field, `Choice` and the world shape.
"""

from __future__ import annotations

from dataclasses import field
from enum import Enum
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

if TYPE_CHECKING:
    from disttrain.config.run import Run


def help_field(text: str, default: Any = MISSING, factory: Any = None) -> Any:
    """A dataclass field with a one-line help text (shown by `disttrain config --help`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


class Choice(str, Enum):
    """A closed choice of the schema (`trainer.detect_anomaly: AnomalyMode`): OmegaConf refuses any
    other value when the config is composed, `--help` lists the members, and a member reads, compares
    and prints as its value (`mode == "skip"`, f"{mode}" -> "skip"). Member names are the values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ComputeDtype(Choice):
    """A floating-point dtype by name: amp.dtype, strategy.param_dtype/reduce_dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def world_shape(run: Run) -> str:
    """The world size with where it comes from, for error messages."""
    world = run.world
    return f"nodes x nproc_per_node = {world.nodes} x {world.nproc_per_node} = {world.size}"
