"""`python SCRIPT ARGS...` as a child of a fork server that imported torch once.

Tests whose point is several real processes (ranks that get signals, a store host that is
SIGKILLed) need processes, not fresh interpreters: a forked child is a process of its own (its own
pid, sockets, signal handlers, exit status), minus the ~2.5 CPU-s torch import of each interpreter.
The fork server is a clean process (not a fork of pytest): it only imported torch and
torch.distributed, and each child runs its script as `__main__` as `python SCRIPT` would.

Only stdlib imports here: each child imports this module to find `_main`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def start(script: Path, args: list[str], env: dict[str, str], out: Path, err: Path) -> Any:
    """Start `python script *args` with environment `env`, stdout to `out` and stderr to `err`;
    return its multiprocessing Process (pid, exitcode: negative for a signal, kill())."""
    proc = _context().Process(target=_main, args=(str(script), args, env, str(out), str(err)), daemon=False)
    proc.start()
    return proc


def _main(script: str, args: list[str], env: dict[str, str], out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):  # the C++ side's output (gloo, c10d) too
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if env.get("OMP_NUM_THREADS"):  # torch was imported before the variable was set: apply it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    exec(compile(Path(script).read_text(), script, "exec"), {"__name__": "__main__", "__file__": script})
