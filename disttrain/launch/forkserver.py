"""Ranks forked from a warm server: torch is imported once per node, while the parent still checks.

A rank started as `python -m disttrain.worker` spends ~2 CPU-seconds importing torch and disttrain
before it can join its process group; with N ranks per node that is N imports, all after the
parent's pre-launch checks. Python's `forkserver` start method (used by torch.multiprocessing and
torch's elastic agent for function entry points) runs one server process that imports the
modules named in its preload list, then forks every child from that warm state:

- `warm_up()` starts the server right after the static checks passed (a config mistake spawns
  nothing), so its imports run on another core while the parent composes the run dir and takes
  the dry step; by the time the agent starts the ranks they only fork.
- The server imports torch and disttrain's rank modules only: never the user's code (a `_target_`
  module is imported by each rank after the fork, as before) and never CUDA (importing torch does
  not initialise it), so a fork is as clean as a fresh interpreter.
- The server is a helper, not a rank: it holds no state of the run, writes nothing, and exits when
  the launcher does (it watches a pipe the launcher holds). A failed runtime check leaves nothing.
- A forked process inherits the environment of the server, which started before the launcher set
  the ranks' variables (`launch.rank_environment`): `rank_entry` rebuilds exactly the environment a
  `python -m disttrain.worker` child would get (the launcher's, plus the agent's per-rank keys).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from typing import Any

# What the server imports before forking: the rank's whole import graph (torch, the engine, the
# strategies' common modules), not the user's modules.
PRELOAD = ["disttrain.launch.forkserver", "disttrain.worker"]  # this module first: SERVER_ENV

# The server's environment when it imported this module (in a rank: before the agent's keys).
SERVER_ENV = dict(os.environ)

START_METHOD = "forkserver"


def warm_up() -> None:
    """Start this process's fork server with the rank modules preloaded (idempotent, returns at once)."""
    from multiprocessing import forkserver

    from disttrain.launch.environ import patched_environ

    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)
    # The server runs `python -c ...`, which would put the cwd first on sys.path (Python 3.11 does
    # not apply the parent's sys.path to the server): a stray torch.py or yaml.py in the cwd would
    # be imported. PYTHONSAFEPATH keeps it out; each rank gets the launcher's sys.path when forked.
    with patched_environ({"PYTHONSAFEPATH": "1"}):
        forkserver.ensure_running()


def rank_environment(launcher_env: dict[str, str]) -> dict[str, str]:
    """The launcher's environment plus what the agent set for this rank (RANK, MASTER_PORT, ...):
    what a rank started as a subprocess of the launcher would see."""
    agent = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
    return {**launcher_env, **agent}


def rank_entry(entry: str, run_dir: str, launcher_env: dict[str, str]) -> None:
    """A forked rank: the launcher's environment, then `entry.run(run_dir)` as `python -m entry` would.

    Exit codes match `disttrain.dist.rank_main`: a ConfigError is 2 (its paragraph is in the error
    file torchelastic's @record wrote), a signal stop exits as the signal would."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from disttrain.config.errors import ConfigError

    environ = rank_environment(launcher_env)
    os.environ.clear()
    os.environ.update(environ)
    os.environ["DISTTRAIN_RANK_PARENT"] = str(os.getppid())  # the server: PDEATHSIG's parent
    try:
        record(importlib.import_module(entry).run)(run_dir)
    except ConfigError:
        raise SystemExit(2) from None


def launcher_env() -> dict[str, Any]:
    """The environment the ranks get: this process's, as the launcher set it for them."""
    return dict(os.environ)
