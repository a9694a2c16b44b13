"""The pre-launch checks without importing torch._dynamo (about as long as importing torch itself).

torch wraps many internals in `torch._disable_dynamo`, which imports torch._dynamo the first time
such a function runs: building an optimizer (`add_param_group`) or a forward on the meta device
does. The parent never compiles anything, so while its checks run `torch._dynamo` is a stand-in
whose `disable(fn)` is `fn`. Anything else asked of the stand-in marks the attempt unreliable: the
checks then run again with the real torch._dynamo, so every error the user sees is torch's own.
Afterwards nothing of the stand-in remains (the wrappers it answered forget their cached answer).
"""

from __future__ import annotations

import sys
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
    import torch

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
        if sys.modules.get(NAME) is standin:
            del sys.modules[NAME]
        if torch.__dict__.get("_dynamo") is standin:
            del torch._dynamo
        for fn in standin.answered:
            fn.__dict__.pop("__dynamo_disable", None)
    return check()  # the stand-in was asked for more than disable(): the real thing decides
