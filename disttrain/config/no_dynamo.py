"""The pre-launch checks without importing torch._dynamo (about as long as importing torch itself).

torch wraps many internals in `torch._disable_dynamo`, which imports torch._dynamo the first time
such a function runs: building an optimizer (`add_param_group`) or a forward on the meta device
does. The parent never compiles anything, so while its checks run `torch._dynamo` is a stand-in
whose `disable(fn)` is `fn`. Anything else asked of the stand-in marks the attempt unreliable: the
checks then run again with the real torch._dynamo, so every error the user sees is torch's own.
Afterwards nothing of the stand-in remains (the wrappers it answered forget their cached answer).

A rank forked from the fork server (launch/forkserver.py) defers the import the same way for its
whole life (`defer_dynamo`), unless something needs the real module: a run that compiles nothing
calls only `disable` (its first optimizer step does), so it never pays the import (~0.5 CPU-s).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
NAME = "torch._dynamo"


class _Standin(types.ModuleType):
    def __init__(self) -> None:
        super().__init__(NAME)
        self.answered: list[Any] = []
        self.asked_more = False

    def disable(self, fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        """torch._dynamo.disable(fn=None, recursive=True, *, reason=None, wrapping=True): `fn`
        itself, or (no fn: `@torch.compiler.disable(reason=...)`) a decorator returning its `fn`."""
        if fn is None:
            return self.disable
        self.answered.append(fn)
        return fn

    def __getattr__(self, name: str) -> Any:
        if name != "__file__":  # inspect.getmodule asks every module for it: no use of dynamo; but
            self.asked_more = True  # `__path__` is an import of a torch._dynamo submodule
        raise AttributeError(f"{NAME}.{name} (deferred during the pre-launch checks)")


def without_dynamo(check: Callable[[], T]) -> T:
    """`check()` with torch._dynamo's import deferred; again with it if the stand-in fell short."""
    import torch  # noqa: F401 (torch itself imports before the stand-in goes in)

    if NAME in sys.modules:  # imported already (an earlier job of a sweep, a test process): free
        return check()
    standin = _Standin()
    sys.modules[NAME] = standin
    try:
        result = check()
    except Exception:
        if not standin.asked_more:
            raise
    else:
        if not standin.asked_more:
            return result
    finally:
        _remove(standin, standin.answered)
    return check()  # the stand-in was asked for more than disable(): the real thing decides


def _remove(standin: types.ModuleType, answered: list[Any]) -> None:
    """No trace of `standin`: out of sys.modules and torch, and the `_disable_dynamo` wrappers it
    answered forget their cached answer (their next call asks whatever torch._dynamo is then)."""
    import torch

    if sys.modules.get(NAME) is standin:
        del sys.modules[NAME]
    if torch.__dict__.get("_dynamo") is standin:
        del torch._dynamo
    for fn in answered:
        fn.__dict__.pop("__dynamo_disable", None)


class _Deferred(types.ModuleType):
    """torch._dynamo in a rank until something needs more than `_disable_dynamo`'s `disable`.

    torch's `_disable_dynamo` wrappers ask `disable(fn, recursive, wrapping=False)` once and cache
    the answer on `fn`; with nothing compiled (the real module is needed to compile anything),
    disabling dynamo for `fn` is `fn` itself. A few questions torch asks on the way to the first
    step have known answers (`_KNOWN`, `graph_break`). Any other request (`torch.compile`, a
    decorator at import, `is_compiling`, a submodule import through `__path__`) imports the real module: the
    cached answers are forgotten (their next call asks the real `disable`), and from then on this
    object forwards every attribute to it, so a reference taken earlier stays right."""

    def __init__(self) -> None:
        super().__init__(NAME)
        self.answered: list[Any] = []
        self.real: types.ModuleType | None = None
        self.lock = threading.RLock()  # an import that comes back here finds the module importing

    def disable(self, fn: Any = None, recursive: bool = True, *args: Any, **kwargs: Any) -> Any:
        if self.real is None and fn is not None and not args and kwargs == {"wrapping": False}:
            self.answered.append(fn)
            return fn
        return self.load().disable(fn, recursive, *args, **kwargs)

    def load(self) -> types.ModuleType:
        """The real torch._dynamo, imported now if it is not yet."""
        with self.lock:
            if self.real is None:
                import importlib

                _remove(self, self.answered)
                self.answered.clear()
                self.real = importlib.import_module(NAME)
        return self.real

    def __getattr__(self, name: str) -> Any:
        if name == "__file__" and self.real is None:  # inspect.getmodule asks every module
            raise AttributeError(f"{NAME}.{name} (deferred)")
        if name in _KNOWN and self.real is None:
            return _Known(self, name)
        if name == "graph_break" and self.real is None:  # optimizer.step: outside a graph, nothing
            return _no_graph_break
        return getattr(self.load(), name)


# What torch asks a rank's torch._dynamo on the way to the first step, answered as the real module
# would while it is not imported (tests/unit/test_no_dynamo.py compares with the real answers):
# init_process_group clears trace_rules' caches (a module never imported has none); DDP's
# constructor asks the optimize_ddp mode (config.optimize_ddp, which nobody could set: its default);
# DCP's get_state_dict asks whether a module is an OptimizedModule (only torch.compile makes one).
class _NoOptimizedModule:
    """torch._dynamo.eval_frame.OptimizedModule before torch._dynamo is imported: nothing is one."""


_KNOWN: dict[str, dict[str, Any]] = {
    "trace_rules": {"clear_lru_cache": lambda: None},
    "utils": {"get_optimize_ddp_mode": lambda: "ddp_optimizer"},
    "eval_frame": {"OptimizedModule": _NoOptimizedModule},
}


def _no_graph_break(msg: str = "") -> None:
    """torch._dynamo.graph_break() where nothing is being compiled: it does nothing."""


class _Known:
    """`torch._dynamo.<sub>` of a `_Deferred`: its known answers; anything else imports the real one."""

    def __init__(self, deferred: _Deferred, sub: str) -> None:
        self._deferred, self._sub = deferred, sub

    def __getattr__(self, name: str) -> Any:
        if self._deferred.real is None and name in _KNOWN[self._sub]:
            return _KNOWN[self._sub][name]
        return getattr(getattr(self._deferred.load(), self._sub), name)


def defer_dynamo() -> None:
    """In a rank: defer torch._dynamo's import until something needs more than `disable` (see
    `_Deferred`). Nothing to do where it is imported already (a fork server that preloaded it)."""
    if NAME not in sys.modules:
        sys.modules[NAME] = _Deferred()
