"""Build objects from `_target_` specs, strictly: every key written for a target must be one of its
arguments.

A key the target does not take is a ConfigError naming it, with a "did you mean" from difflib. The
keys of nested `_target_` nodes (nanoGPT's `model.config._target_=model.GPTConfig`) are checked the
same way, all before anything is built. A target taking `**kwargs` is checked where its signature
allows: a key close to one of its named parameters is a typo; any other key passes through
unchecked (logged at debug level). A missing required argument, an import error and a ValueError or
argument TypeError the target raises become ConfigErrors as well: in the parent, before launch.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from disttrain.config.errors import ConfigError

log = logging.getLogger("disttrain")

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def locate(target: Any, key: str) -> Any:
    """The object `target` names (imported as Hydra's instantiate would), to read its signature.

    Builds nothing: `build` instantiates through `hydra.utils.instantiate`, which also applies
    Hydra's target restrictions (its blocklist)."""
    from hydra.utils import get_object

    if not isinstance(target, str) or not target:
        raise ConfigError(key, target, "a dotted path to a class or function", f"e.g. {key}=mylab.nets.Net.")
    try:
        with _quiet("hydra.utils"):  # get_object logs an ERROR line before raising: ours is the message
            return get_object(target)
    except Exception as exc:
        said, close = why_not_importable(target)
        raise ConfigError(
            key,
            target,
            "an importable class or function",
            f"Python says {said or _first_line(exc)}. "
            + (f"Did you mean {key}={close[0]}{_others(close[1:])}? " if close else "")
            + "Your own package must be importable from the current directory (it is put on sys.path in "
            "the parent and every rank).",
        ) from None


def _others(close: list[str]) -> str:
    return f" (or {', '.join(close)})" if close else ""


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def why_not_importable(target: str) -> tuple[str, list[str]]:
    """Why the dotted path `target` does not import, as Python itself says it (`module 'torch.optim'
    has no attribute 'Adamw'`, `No module named 'mylab'`, or the error a module raised while it was
    imported), and the closest names to the missing part among what its parent holds (difflib;
    a different case counts as close: `AdamW` for `Adamw`), as full dotted paths.

    Hydra's `get_object` tries the whole path as a module first and reports that attempt's
    `No module named 'torch.optim.Adamw'`: the real reason (no such attribute) is lost."""
    import importlib
    import pkgutil

    parts = target.split(".")
    try:
        obj: Any = importlib.import_module(parts[0])
    except ModuleNotFoundError as exc:
        if exc.name != parts[0]:
            return f"importing {parts[0]} raised {_first_line(exc)}", []  # a module it imports is missing
        top = [m.name for m in pkgutil.iter_modules()]
        return f"ModuleNotFoundError: No module named {parts[0]!r}", _close(parts, 0, top)
    except Exception as exc:  # the user's module itself fails (SyntaxError, its own ImportError)
        return f"importing {parts[0]} raised {_first_line(exc)}", []
    for i in range(1, len(parts)):
        where, name = ".".join(parts[:i]), ".".join(parts[: i + 1])
        if not hasattr(obj, parts[i]) and inspect.ismodule(obj) and hasattr(obj, "__path__"):
            try:  # a submodule not imported yet
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name != name:
                    return f"importing {name} raised {_first_line(exc)}", []
            except Exception as exc:
                return f"importing {name} raised {_first_line(exc)}", []
        if not hasattr(obj, parts[i]):
            kind = f"module {where!r}" if inspect.ismodule(obj) else f"{where} ({type(obj).__name__})"
            names = [n for n in dir(obj) if not n.startswith("_")]
            if i == len(parts) - 1:  # the target itself: a class or function, never a module
                names = [n for n in names if _buildable(obj, n)]
            elif inspect.ismodule(obj) and hasattr(obj, "__path__"):  # a package: its submodules too
                names += [m.name for m in pkgutil.iter_modules(obj.__path__) if not m.name.startswith("_")]
            return f"AttributeError: {kind} has no attribute {parts[i]!r}", _close(parts, i, names)
        obj = getattr(obj, parts[i])
    return "", []


def _buildable(obj: Any, name: str) -> bool:
    try:
        value = getattr(obj, name)
    except Exception:
        return False
    return callable(value) and not inspect.ismodule(value)


def _close(parts: list[str], i: int, names: list[str]) -> list[str]:
    """Up to three dotted paths: `parts` with part `i` replaced by one of `names` close to it (the
    same word in another case or with other underscores first, then difflib's closest)."""

    def norm(n: str) -> str:  # AdamW, adamw, fully_shard, FullyShard: the same word
        return n.lower().replace("_", "")

    name, unique = parts[i], sorted(set(names))
    by_norm: dict[str, list[str]] = {}
    for n in unique:
        by_norm.setdefault(norm(n), []).append(n)
    same = [n for n in by_norm.get(norm(name), []) if n != name]
    near = difflib.get_close_matches(norm(name), list(by_norm), n=3, cutoff=0.75)
    close = same + [n for key in near for n in by_norm[key] if n not in same]
    return [".".join([*parts[:i], n, *parts[i + 1 :]]) for n in close[:3]]


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """`logger`'s records dropped for the duration (a filter, so its handlers stay as configured)."""
    log_ = logging.getLogger(logger)
    drop = logging.Filter(name="\0")  # matches no record name: every record is filtered out
    log_.addFilter(drop)
    try:
        yield
    finally:
        log_.removeFilter(drop)


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _nested(value: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, node) of every `_target_` node inside `value`, as Hydra would instantiate them."""
    if isinstance(value, dict):
        if "_target_" in value:
            yield path, value
            return
        for k, v in value.items():
            yield from _nested(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nested(v, f"{path}.{i}")


def check(spec: Any, key: str, extra: Iterable[str] = (), supplied: int = 0) -> None:
    """Check the keys of `spec` and of its nested `_target_` nodes against the targets' signatures.

    `extra` names arguments the caller passes itself; `supplied` counts leading positional ones it
    passes to the partial later (an optimizer's params, a scheduler's optimizer): not the user's to
    set. Builds nothing (imports the targets).
    """
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(key, spec, "a node with _target_", f"set {key}._target_=package.module.Class.")
    target = spec["_target_"]
    fn = locate(target, f"{key}._target_")
    if spec.get("_recursive_", True):
        for name, value in spec.items():
            if name != "_target_":
                for path, node in _nested(value, f"{key}.{name}" if name != "_args_" else key):
                    check(node, path)
    sig = _signature(fn)
    if sig is None:
        log.debug("%s: %s has no signature to check its arguments against", key, target)
        return
    later = [n for n, p in sig.parameters.items() if p.kind in _POSITIONAL][:supplied]
    named = [n for n, p in sig.parameters.items() if p.kind in _NAMED and n not in later]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    given = {k for k in spec if not k.startswith("_")} | set(extra)
    for name in (k for k in spec if not k.startswith("_")):
        if name in named:
            continue
        close = difflib.get_close_matches(name, [n for n in named if n not in given], n=1)
        if takes_kwargs and not close:
            log.debug("%s.%s: %s takes **kwargs; the key is passed on unchecked", key, name, target)
            continue
        raise ConfigError(
            f"{key}.{name}",
            spec[name],
            f"the arguments of {target}: {', '.join(named) or 'none by name'}",
            (
                f"did you mean {key}.{close[0]}?"
                if close
                else f"remove {key}.{name}, or check {target}'s signature."
            )
            + (
                " (It takes **kwargs, but a key this close to a named argument is taken for a typo.)"
                if takes_kwargs
                else ""
            ),
        )
    if spec.get("_partial_"):
        return
    covered = [n for n, p in sig.parameters.items() if p.kind in _POSITIONAL][: len(spec.get("_args_") or [])]
    missing = [
        n
        for n, p in sig.parameters.items()
        if p.default is p.empty and p.kind in _NAMED and n not in given and n not in covered
    ]
    if missing:
        raise ConfigError(
            f"{key}.{missing[0]}",
            "(missing)",
            f"a value for every required argument of {target}",
            "set " + " ".join(f"{key}.{n}=VALUE" for n in missing) + " on the command line "
            f"(or the key{'s' if len(missing) > 1 else ''} under {key} in your YAML).",
        )


def build(
    spec: Any,
    key: str,
    on_error: Callable[[BaseException], ConfigError | None] | None = None,
    supplied: int = 0,
    **extra: Any,
) -> Any:
    """Instantiate `spec` (a dict with `_target_`); `key` names it in messages (e.g. 'model').

    `on_error` may turn an exception the target raised into a ConfigError (e.g. a bad data file);
    `supplied`: see `check`.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check(spec, key, extra, supplied)
    try:
        return instantiate({**copy.deepcopy(spec), **extra}, _convert_="all")  # plain: see typed.py
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        err = on_error(cause) if on_error is not None and cause is not None else None
        if err is not None:
            raise err from None
        where = _where(exc, key)
        if cause is None:  # Hydra refused the node itself (its target blocklist): nothing was called
            raise _refused(exc, spec, where, key) from None
        said = str(cause).splitlines()[0] if str(cause) else "(no message)"
        if isinstance(cause, ValueError):  # the target rejected a value: the user's mistake, not a bug
            raise ConfigError(
                where,
                _target_at(spec, where, key),
                f"arguments that {_target_at(spec, where, key)} accepts",
                f"it raised ValueError: {said}",
            ) from None
        argument = re.search(
            r"unexpected keyword argument '(\w+)'|required (?:\w+ )?arguments?: '(\w+)'", said
        )
        if isinstance(cause, TypeError) and argument is not None:
            name = argument.group(1) or argument.group(2)
            raise ConfigError(
                f"{where}.{name}",
                "(missing)" if argument.group(2) else _value_at(spec, where, key, name),
                f"the arguments {_target_at(spec, where, key)} accepts",
                f"it raised TypeError: {said}",
            ) from None
        if isinstance(cause, TypeError):  # any other call mistake the target reports (e.g. **kwargs on)
            raise ConfigError(
                where,
                _target_at(spec, where, key),
                f"arguments that {_target_at(spec, where, key)} accepts",
                f"it raised TypeError: {said}",
            ) from None
        raise


def _refused(exc: BaseException, spec: dict[str, Any], where: str, key: str) -> ConfigError:
    """Hydra's own refusal of a node as one paragraph: its message without the full_key line."""
    said = " ".join(
        line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("full_key:")
    )
    target = _target_at(spec, where, key)
    if "blocklisted" in said:
        return ConfigError(
            f"{where}._target_",
            target,
            "a class or function Hydra builds from config (its blocklist refuses file and process "
            "operations such as os.remove, shutil.rmtree, os.kill)",
            f"point {where}._target_ at your own class or function. Hydra said: {said}",
        )
    return ConfigError(where, target, "a node Hydra can instantiate", f"Hydra said: {said}")


def _where(exc: BaseException, key: str) -> str:
    """The config key of the nested node whose target failed (Hydra names it as full_key)."""
    found = re.search(r"full_key: (\S+)", str(exc))
    return f"{key}.{found.group(1)}" if found else key


def _node_at(spec: dict[str, Any], where: str, key: str) -> Any:
    node: Any = spec
    for part in where[len(key) :].split(".")[1:]:
        node = node[int(part)] if isinstance(node, list) else node.get(part, {})
    return node


def _target_at(spec: dict[str, Any], where: str, key: str) -> Any:
    node = _node_at(spec, where, key)
    return node.get("_target_", spec["_target_"]) if isinstance(node, dict) else spec["_target_"]


def _value_at(spec: dict[str, Any], where: str, key: str, name: str) -> Any:
    node = _node_at(spec, where, key)
    return node.get(name, "?") if isinstance(node, dict) else "?"
