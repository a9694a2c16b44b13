"""What the unit and the integration tests share: `disttrain ARGS...` run in the test process (the
one in-process CLI runner), the tiny configurations both suites train, and the checks of a claim
both suites make (one on one rank in-process, one across ranks).

pytest puts tests/ on sys.path (its default "prepend" import mode adds the folder of tests/conftest.py,
and tests/ is the root of the tests/integration package), so both suites import this module as
`shared_support` (tests/unit/unit_support.py and tests/integration/conftest.py re-export the runner).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

# Variables that would make the CLI believe it is already a launched rank, or move its configs.
SCRUB = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DISTTRAIN_CONFIG_DIR",
)  # fmt: skip

# A GPT small enough for a CPU test: one block, width 32, on the shipped text, 32-token context.
TINY_GPT = (
    "model=gpt",
    "data=text",
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "data.block_size=32",
)


# peft=lora's tiny GPT-2 (save_pretrained, then init.path): at width 384 and rank 2 the adapters are
# 0.7 % of the weights (DCP adds ~1.5 KB a tensor and the RNG file 15 KB, which a model this small
# notices), so "a checkpoint under 5 % of the weights" means something.
LORA_GPT2 = {"vocab_size": 256, "n_positions": 64, "n_embd": 384, "n_layer": 2, "n_head": 2}
LORA_RANK = 2


def lora_gpt2_run(tiny: Path) -> tuple[str, ...]:
    """The overrides of a peft=lora run of the GPT-2 saved at `tiny` (a few cheap steps)."""
    return (
        "data=text",
        "task=model_loss",
        "task.call={input_ids: x, labels: x}",
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"model.pretrained_model_name_or_path={tiny}",
        f"init.path={tiny}",
        "peft=lora",
        f"peft.rank={LORA_RANK}",
        "trainer.batch_size=2",
        "trainer.val_batches=1",
        "sched=constant",
        "optim.lr=0.01",
    )


def lora_params() -> int:
    """LoRA parameters of LORA_GPT2 on c_attn, c_proj (attention and MLP) and c_fc: r x (in + out)."""
    d = LORA_GPT2["n_embd"]
    return LORA_GPT2["n_layer"] * LORA_RANK * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))


def said(stderr: str) -> list[str]:
    """The lines of a command's stderr without its start-up phase lines (disttrain.observe.phases):
    what it said beyond its progress."""
    from disttrain.observe.phases import PHASE_LINE

    return [line for line in stderr.strip().splitlines() if not PHASE_LINE.match(line)]


def check_one_fp16_overflow(records: list[dict[str, Any]]) -> None:
    """The logged steps of an fp16 run whose step 3 overflows on every rank (FaultMLP
    inf_grad_at=3): GradScaler's initial scale until then, halved once, that one step skipped, and
    the loss still falls. (Plain asserts with their values: pytest rewrites only test modules.)"""
    scales = [r["amp/scale"] for r in records]
    skipped = [r["amp/skipped_steps"] for r in records]
    assert scales[1] == 65536.0 and scales[2] == 32768.0 and scales[-1] == 32768.0, scales
    assert skipped[1] == 0 and skipped[2:] == [1.0] * (len(records) - 2), skipped
    assert records[-1]["train/loss"] < records[0]["train/loss"], [r["train/loss"] for r in records]


def disttrain_in_process(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`disttrain ARGS...` as `disttrain.cli.main` in this process, in `cwd`: what the console script
    runs, minus an interpreter start-up and a torch import per call, and for a multi-rank run minus
    the fork server's start (~3 CPU-s): this process's server, started by its first run, serves
    every later one, as it serves every job of a sweep (launch/forkserver.py).

    The exit code is main()'s return value or SystemExit code; stdout/stderr are what it and the
    ranks it started wrote (fd-level: the ranks write to their launcher's descriptors); an exception
    escaping main() is the traceback a user would see, so it fails the test. The environment is
    scrubbed as for the console script (`env`: this environment instead, scrubbed too), and the cwd,
    sys.path, os.environ and what a launcher or a rank changes for its process (threads, logging,
    excepthook, signal handlers, RNGs) are restored afterwards; modules imported from `cwd` (the
    user's code of this call) are unloaded, so the next call imports its own. A rank still alive
    when the call returns (or that an exception, a pytest timeout, left behind) is killed, and
    the former fails the test, as `run_command` fails a process that outlived its run.
    """
    from disttrain.cli import main

    saved_cwd, saved_path, saved_env = os.getcwd(), list(sys.path), dict(os.environ)
    saved_process = _process_state()
    # A package of the same name that an earlier test imported from its own folder (`mylab`) would
    # be found in sys.modules instead of this cwd's: set it aside for the call, put it back after.
    local = _top_level_names(Path(cwd))
    shadowed = {
        name: sys.modules.pop(name)
        for name in list(sys.modules)
        if name.partition(".")[0] in local and _stale(sys.modules[name])
    }
    saved_modules = set(sys.modules)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for key in SCRUB:
        os.environ.pop(key, None)
    # The console script's sys.path has no '' (the cwd): only the CLI itself may add the cwd.
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
    os.chdir(cwd)
    try:
        with _captured_fds() as (out, err):
            try:
                rc = main(list(args))
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        _kill_ranks(wait=0.0)
        raise
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        root = str(Path(cwd).resolve())
        for name in set(sys.modules) - saved_modules:
            if any(place.startswith(root) for place in _places(sys.modules[name])):
                del sys.modules[name]
        sys.modules.update(shadowed)
        _restore_process_state(saved_process)
    left = _kill_ranks(wait=10.0)
    assert not left, f"ranks {left} outlived `disttrain {' '.join(args)}` (killed them)\n{err.text[-3000:]}"
    return subprocess.CompletedProcess(["disttrain", *args], rc, out.text, err.text)


def _kill_ranks(wait: float) -> dict[int, int]:
    """SIGKILL the ranks below this process still alive after `wait` seconds; {rank: pid} of those."""
    import time

    from disttrain.procs import rank_pids

    deadline = time.monotonic() + wait
    while (left := rank_pids(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


class _Captured:
    text = ""


@contextlib.contextmanager
def _captured_fds() -> Any:
    """What the call writes to stdout and stderr, from Python (sys.stdout, sys.stderr) and from the
    processes it starts: the ranks of a multi-rank run fork from the fork server and write to the
    descriptors their launcher (this process) has (launch/forkserver.py LauncherStdio), so fds 1
    and 2 point at a file of this call's while it runs, and the Python streams write through to
    them (one order for both)."""
    import tempfile

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    results = (_Captured(), _Captured())
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = (os.dup(1), os.dup(2))
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            # Never closed: a logging handler made during the call (a rank's console handler, a
            # library's own) keeps its stream and may write to it later, as to a StringIO; it then
            # writes to whatever fds 1 and 2 are by then (closefd=False: the fds stay this process's).
            text_out, text_err = (
                io.TextIOWrapper(
                    open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115 (see above)
                    encoding="utf-8",
                    errors="replace",
                    write_through=True,
                )
                for fd in (1, 2)
            )
            with contextlib.redirect_stdout(text_out), contextlib.redirect_stderr(text_err):
                yield results
            text_out.flush()
            text_err.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for file, result in ((out, results[0]), (err, results[1])):
                file.seek(0)
                result.text = file.read().decode("utf-8", errors="replace")


# SIGQUIT too: torch's elastic agent (a launcher in this process) sets it with TERM, INT and HUP
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _process_state() -> dict[str, Any]:
    """What a one-rank `train` run in this process changes for the process: the rank's thread
    count, logging set-up, the excepthook `init_process_group` installs, signal handlers, RNGs."""
    import logging
    import random

    import numpy as np
    import torch

    root = logging.getLogger()
    return {
        "threads": torch.get_num_threads(),
        "handlers": list(root.handlers),
        "level": root.level,
        "excepthook": sys.excepthook,
        "signals": {sig: signal.getsignal(sig) for sig in _SIGNALS},
        "rng": (random.getstate(), np.random.get_state(), torch.random.get_rng_state()),
    }


def _restore_process_state(saved: dict[str, Any]) -> None:
    import logging
    import random

    import numpy as np
    import torch

    torch.set_num_threads(saved["threads"])
    root = logging.getLogger()
    root.handlers[:] = saved["handlers"]
    root.setLevel(saved["level"])
    sys.excepthook = saved["excepthook"]
    for sig, handler in saved["signals"].items():
        if handler is not None:  # None: a handler not set from Python, which Python cannot put back
            signal.signal(sig, handler)
    random.setstate(saved["rng"][0])
    np.random.set_state(saved["rng"][1])
    torch.random.set_rng_state(saved["rng"][2])


def _top_level_names(cwd: Path) -> set[str]:
    """The modules and packages that `import NAME` would find in `cwd`."""
    return {p.stem for p in cwd.glob("*.py")} | {
        p.name for p in cwd.iterdir() if (p / "__init__.py").is_file()
    }


def _places(module: Any) -> list[str]:
    """Where a module was loaded from: its file and, for a package, its folders."""
    path = getattr(module, "__path__", None)
    folders = list(path) if isinstance(path, (list, tuple)) or type(path).__name__ == "_NamespacePath" else []
    return [str(p) for p in (getattr(module, "__file__", None), *folders) if isinstance(p, (str, Path))]


def _stale(module: Any) -> bool:
    """True for a module loaded from a folder that is no longer on sys.path (an earlier test's
    tmp_path); the installed packages (`yaml`, `torch`) never are."""
    places = _places(module)
    roots = [str(Path(p).resolve()) for p in sys.path if p]
    return bool(places) and not any(str(Path(p).resolve()).startswith(r) for p in places for r in roots)
