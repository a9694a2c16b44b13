"""The optional extras (pyproject's `disttrain[...]`) and what in a run needs each, checked before
launch: a tracker, sweeper or fp8 run without its package is one paragraph with the exact install
command, exit 2, before a rank starts or a run dir is written (review 2026-11-28-ux #7: a missing
`wandb` failed after launch and left a failed run dir).

Table-driven: a feature that needs an extra adds a row to `EXTRAS` (the package) and to `NEEDS` (a
config key and when the run uses it) or `OPTIONS` (a config group's option). Presence is found
without importing (`importlib.util.find_spec`): importing wandb alone takes seconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config.run import Run


@dataclass(frozen=True)
class Extra:
    """One optional extra: its name in pyproject, the modules it provides, its pip package."""

    name: str
    modules: tuple[str, ...]
    package: str

    @property
    def install(self) -> str:
        return f"pip install 'disttrain[{self.name}]' (or pip install '{self.package}')"

    def missing(self) -> str | None:
        """The first of its modules that is not installed; None when all are."""
        return next((m for m in self.modules if not _found(m)), None)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a None in sys.modules
        return False


EXTRAS: dict[str, Extra] = {
    e.name: e
    for e in (
        Extra("mlflow", ("mlflow",), "mlflow-skinny>=2.10"),
        Extra("wandb", ("wandb",), "wandb>=0.17"),
        Extra("plot", ("matplotlib",), "matplotlib>=3.7"),
        Extra("optuna", ("hydra_plugins.hydra_optuna_sweeper", "optuna"), "hydra-optuna-sweeper>=1.2"),
        Extra("stream", ("torchdata",), "torchdata>=0.10"),
        Extra("hf", ("datasets",), "datasets>=2.19"),
        Extra("fp8", ("torchao",), "torchao>=0.18"),
        Extra("peft", ("peft",), "peft>=0.17"),
        Extra("s3", ("s3fs",), "s3fs>=2024.6"),
        Extra("gcs", ("gcsfs",), "gcsfs>=2024.6"),
    )
}


def _sinks(*names: str) -> Callable[[Run], bool]:
    """Whether `observe.sinks` lists one of the built-in sinks `names` (by alias or class path)."""

    def uses(run: Run) -> bool:
        for entry in run.observe.sinks:
            target = entry.get("_target_") if isinstance(entry, Mapping) else entry
            name = str(target).rsplit(".", 1)[-1].lower()
            if name in names and (str(target) == name or str(target).startswith("disttrain.observe.sinks.")):
                return True
        return False

    return uses


@dataclass(frozen=True)
class Need:
    """A config `key` whose value `uses(run)` needs the extra `extra`."""

    key: str
    value: str  # as the message shows it
    uses: Callable[[Run], bool]
    extra: str


def locations(run: Run) -> list[tuple[str, Any]]:
    """(key, value) of each config key that may name an object store (s3:// or gs://)."""
    found = [("checkpoint.dir", run.checkpoint.dir), ("init.path", run.init.path), ("resume", run.resume)]
    return found + [(f"data.{k}", run.data.kwargs.get(k)) for k in ("path", "val_path")]


# an object store's URL scheme -> the extra of its fsspec backend
STORES = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}

NEEDS: tuple[Need, ...] = (
    Need("observe.sinks", "mlflow", _sinks("mlflow"), "mlflow"),
    Need("observe.sinks", "wandb", _sinks("wandb"), "wandb"),
    Need("amp", "fp8", lambda run: run.amp.name == "fp8", "fp8"),
    Need("peft", "lora", lambda run: run.peft.name == "lora", "peft"),
)

# A config group's option that only an extra provides: (group, option) -> extra
OPTIONS: dict[tuple[str, str], str] = {("hydra/sweeper", "optuna"): "optuna"}


def missing_extra(key: str, value: Any, extra: str, what: str) -> ConfigError:
    """The one-paragraph refusal of `key`=`value`, whose feature `what` needs the extra `extra`."""
    spec = EXTRAS[extra]
    return ConfigError(
        key,
        value,
        f"{what} only with its package installed ({spec.missing()} is not: it comes with the extra "
        f"disttrain[{extra}])",
        f"install it: {spec.install}. Nothing was started or written.",
    )


def check_run(run: Run) -> None:
    """Every extra the `run` needs is installed (NEEDS, an object store's backend), else a ConfigError naming the key."""
    for need in NEEDS:
        if need.uses(run) and EXTRAS[need.extra].missing():
            raise missing_extra(need.key, need.value, need.extra, f"{need.key}={need.value}")
    for key, value in locations(run):
        scheme, sep, _ = str(value).partition("://")
        if sep and scheme in STORES and EXTRAS[STORES[scheme]].missing():
            raise missing_extra(key, f"{scheme}://...", STORES[scheme], f"{key}={scheme}://...")


def check_options(overrides: list[str]) -> None:
    """A group option on the command line that only an extra provides (`hydra/sweeper=optuna`):
    checked before composition, whose own error would point at a missing YAML file instead."""
    for override in overrides:
        group, _, option = override.lstrip("+").partition("=")
        error = option_error(group, option)
        if error is not None:
            raise error


def option_error(group: str, option: str) -> ConfigError | None:
    """The refusal of `group=option` when an extra provides that option and is missing; else None."""
    extra = OPTIONS.get((group, option))
    if extra is None or not EXTRAS[extra].missing():
        return None
    return missing_extra(group, option, extra, f"{group}={option}")
