"""User-facing config errors: one paragraph naming the key, the bad value, what is allowed, a hint."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


class ConfigError(ValueError):
    """A mistake in the user's config. The CLI prints it without a traceback and exits with 2."""

    def __init__(self, key: str, value: Any, allowed: str, hint: str) -> None:
        self.key, self.value, self.allowed, self.hint = key, value, allowed, hint
        super().__init__(f"config error: {key}={_show(value)} is not valid. Allowed: {allowed}. HINT: {hint}")


def _show(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) and value == "" else str(value)


def one_of(values: Iterable[Any]) -> str:
    return "one of " + ", ".join(str(v) for v in values)


def check_divides(key: str, value: int, world: int, shape: str, hint: str) -> None:
    """`value` must split the world size evenly (mesh dimensions): else name the divisors."""
    if value < 1 or world % value:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ConfigError(key, value, f"a divisor of the world size {world} ({shape}): {divisors}", hint)


def _fields(object_type: Any) -> list[str]:
    if object_type is not None and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    return []


def choice_help(key: str) -> str:
    """The schema's help text of a closed choice (`trainer.detect_anomaly`), found by walking the
    top-level schema; a group's block (data, optim) by its base class. Empty if none is found."""
    import typing

    from disttrain.config.schema import Config, DataConfig, OptimConfig

    bases: dict[str, Any] = {"data": DataConfig, "optim": OptimConfig}  # open groups: their bases
    parts = key.split(".")
    if parts[0] in ("strategy", "data") and len(parts) == 2:  # the plug-ins' own config classes
        from disttrain.config.schema import plugin_registries

        for spec in plugin_registries()[parts[0]].all():
            found = {f.name: f for f in dataclasses.fields(spec.config)}.get(parts[1])
            if found is not None and found.metadata.get("help"):
                return str(found.metadata["help"])
    node: Any = Config
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return ""
        if i == len(parts) - 1:
            return str(fields[part].metadata.get("help", ""))
        node = bases.get(part) if node is Config and part in bases else typing.get_type_hints(node).get(part)
    return ""


def _has_target(object_type: Any) -> bool:
    return (
        object_type is not None
        and dataclasses.is_dataclass(object_type)
        and any(f.name == "_target_" for f in dataclasses.fields(object_type))
    )


def unknown_key_hint(full_key: str, allowed: list[str], target: bool) -> str:
    """The closest key; `+KEY` only under a `_target_` node, whose extra keys reach the user's class.
    A typed block (trainer, launcher, ...) reads only its schema's keys: `+` there would be ignored."""

    parent, _, leaf = full_key.rpartition(".")
    close = difflib.get_close_matches(leaf, allowed, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else "check the spelling. "
    if target:
        return hint + f"To pass a key your own _target_ class takes, write +{full_key}=VALUE."
    return (
        hint + f"{parent or 'the top level'} is a typed block: it has no other keys, and +KEY cannot add one."
    )


def _override_value(key: str, overrides: list[str]) -> str:
    for ov in overrides:
        name, _, value = ov.lstrip("+~").partition("=")
        if name == key:
            return value
    return "?"


@contextmanager
def translated(overrides: list[str]) -> Iterator[None]:
    """Hydra/OmegaConf errors of the user's config inside become one-paragraph ConfigErrors."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        err = translate(exc, overrides)
        if err is None:
            raise
        raise err from None


def translate(exc: BaseException, overrides: list[str]) -> ConfigError | None:
    """Turn a Hydra/OmegaConf composition error into a ConfigError, or None if it is not one."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    cause = exc.__cause__ or exc
    text = f"{exc}\n{cause}"
    full_key = getattr(cause, "full_key", None) or _search(r"full_key: (\S+)", text)

    if isinstance(exc, MissingConfigException):
        missing = (
            _search(r"Could not find '([^']+)'", text) or _search(r"primary config '([^']+)'", text) or "?"
        )
        group, _, option = missing.rpartition("/")
        options = [o for o in (exc.options or []) if not o.startswith("base_")]
        from disttrain.config.extras import option_error

        extra = option_error(group, option)  # an option a missing extra provides (chosen in a YAML)
        if extra is not None:
            return extra
        if group:
            return ConfigError(
                group,
                option,
                one_of(options) if options else "no options found",
                f"pick one of the listed options, or add {missing}.yaml to your own folder "
                "and pass it with --config-dir DIR.",
            )
        return ConfigError(
            "--config-name",
            missing,
            "a config file on the search path",
            "check --config-name (default: config).",
        )
    sweep = _search(r"Ambiguous value for argument '([^']+)'", text)
    if sweep is not None:  # `key=a,b` without -m
        key, _, value = sweep.partition("=")
        return ConfigError(
            key,
            value,
            "one value (a comma list is a sweep, which needs -m)",
            f"sweep with `disttrain train -m {sweep}`; a list is {key}=[{value}], a string {key}='{value}'.",
        )
    taken = _search(r"An item is already at '([^']+)'", text) or _search(
        r"Multiple values for ([\w/.@-]+)\.", text
    )
    if taken is not None:  # `+key=...` for a key (or group) the config already has
        return ConfigError(
            f"+{taken}",
            _override_value(taken, overrides),
            f"{taken}=VALUE (it already has a value)",
            f"drop the +: write {taken}={_override_value(taken, overrides)}.",
        )
    if isinstance(exc, OverrideParseException):
        return ConfigError(
            "override",
            getattr(exc, "override", "?"),
            "key=value, +new.key=value, ~key, or a sweep a,b with -m",
            f"the override could not be parsed ({str(exc).splitlines()[0]}).",
        )
    unknown = _search(r"Key '([^']+)' not in '([^']+)'", text)
    if unknown is not None and full_key == "data.task":  # the key before the task group existed
        return ConfigError(
            "data.task",
            _override_value(full_key, overrides),
            "the task group: task=classification, regression, lm or model_loss, or task._target_=yours",
            "data.task became its own config group (it owns batch -> loss and metrics): write "
            f"task={_override_value(full_key, overrides).strip(chr(39))} instead of data.task=...; "
            "task=regression also makes the built-in data sets' targets float.",
        )
    if unknown is not None and full_key:
        parent = full_key.rpartition(".")[0] or "the top level"
        object_type = getattr(cause, "object_type", None)
        allowed = _fields(object_type)
        return ConfigError(
            full_key,
            _override_value(full_key, overrides),
            f"the keys of {parent}: " + (", ".join(allowed) if allowed else "see `disttrain config`"),
            unknown_key_hint(full_key, allowed, _has_target(object_type) or not allowed),
        )
    converted = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", text)
    if converted is not None and full_key:
        return ConfigError(
            full_key,
            converted.group(1),
            f"a value of type {converted.group(3).lower()}",
            f"write {full_key}=<{converted.group(3).lower()}>; lists as [a,b], null for none.",
        )
    if isinstance(cause, MissingMandatoryValue) or "Missing mandatory value" in text:
        return ConfigError(
            full_key or "?",
            "???",
            "a value (this key has no default)",
            f"set it on the command line: {full_key}=VALUE.",
        )
    if "Interpolation" in type(cause).__name__ or "interpolation" in text.lower():
        return ConfigError(
            full_key or "?",
            "${...}",
            "an interpolation that resolves",
            f"the interpolation failed: {str(cause).splitlines()[0]}",
        )
    choice = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", text)
    if choice is not None and full_key:  # a closed choice (config.common.Choice): the schema's members
        return ConfigError(
            full_key,
            choice[1],
            one_of(m.strip() for m in choice[2].split(",")),
            f"{choice_help(full_key) or 'pick one of them'}.",
        )
    if isinstance(cause, OmegaConfBaseException) and full_key:
        # Any other schema violation (null for a non-optional field, a scalar for a list, deleting a
        # schema key): still the user's mistake, so the same one-paragraph message, no traceback.
        first = str(cause).splitlines()[0]
        expected = (
            "a non-null value"
            if "is not Optional" in first
            else "a list, written [a,b]"
            if "is not a ListConfig" in first
            else "a value of the type its schema declares"
        )
        return ConfigError(
            full_key,
            _override_value(full_key, overrides),
            expected,
            f"OmegaConf said: {first.rstrip('.')}. See the current value with `disttrain config`.",
        )
    return None


def _search(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None
