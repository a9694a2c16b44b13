"""Build objects from `_target_` specs, forgiving about keys the target does not take.

A user swaps `model._target_=mylab.nets.Net` while the mlp keys are still in the node; rather than
fail inside a rank, keys the target's signature does not accept are dropped with a warning, and a
missing required argument, an import error or a ValueError the target raises becomes a ConfigError in
the parent.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from disttrain.config.errors import ConfigError

log = logging.getLogger("disttrain")


def locate(target: Any, key: str) -> Any:
    from hydra._internal.utils import _locate

    if not isinstance(target, str) or not target:
        raise ConfigError(key, target, "a dotted path to a class or function", f"e.g. {key}=mylab.nets.Net.")
    try:
        return _locate(target)
    except Exception as exc:
        raise ConfigError(
            key,
            target,
            "an importable class or function",
            f"check the spelling; your own package must be importable from the current directory "
            f"(it is put on sys.path in the parent and every rank). Import said: {str(exc).splitlines()[0]}",
        ) from None


def build(spec: Any, key: str, **extra: Any) -> Any:
    """Instantiate `spec` (a dict with `_target_`); `key` names it in messages (e.g. 'model')."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(key, spec, "a node with _target_", f"set {key}._target_=package.module.Class.")
    fn = locate(spec["_target_"], f"{key}._target_")
    params = {k: v for k, v in spec.items() if not k.startswith("_")}
    params.update(extra)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        dropped = sorted(k for k in params if k not in sig.parameters)
        if dropped:
            log.warning(
                "%s: %s does not accept %s; ignoring %s",
                key,
                spec["_target_"],
                ", ".join(dropped),
                ", ".join(f"{key}.{k}" for k in dropped),
            )
        params = {k: v for k, v in params.items() if k in sig.parameters}
        required = (
            []
            if spec.get("_partial_")
            else [
                n
                for n, p in sig.parameters.items()
                if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and n not in params
            ]
        )
        if required:
            raise ConfigError(
                f"{key}.{required[0]}",
                "(missing)",
                f"a value for every required argument of {spec['_target_']}",
                " ".join(f"+{key}.{n}=VALUE" for n in required) + " on the command line.",
            )
    node = {
        "_target_": spec["_target_"],
        **{k: v for k, v in spec.items() if k.startswith("_") and k != "_target_"},
    }
    try:
        return instantiate({**node, **params}, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, ValueError):  # the target rejected a value: the user's mistake, not a bug
            said = str(cause).splitlines()[0] if str(cause) else "(no message)"
            raise ConfigError(
                key,
                spec["_target_"],
                f"arguments that {spec['_target_']} accepts",
                f"it raised ValueError: {said}",
            ) from None
        raise
