"""Helpers for the integration tests: real `disttrain` processes, bounded by timeouts, no orphans.

Every command runs in its own session (process group) and carries a unique tag in its environment,
so that a hang, a timeout or an interrupted test kills the CLI *and* every rank it started (torchrun
puts each rank in a session of its own, out of reach of `killpg`), never leaving a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# `disttrain ARGS...` in this process (the unit tests' runner, tests/shared_support.py): the commands
# that start no rank, and runs whose ranks fork from this worker's fork server (run_cli, run_sweep).
from shared_support import disttrain_in_process as cli_in_process

from disttrain.procs import live_processes

# The console script installed next to this interpreter (the real entry point users run).
CLI = (
    shutil.which("disttrain", path=str(Path(sys.executable).parent))
    or shutil.which("disttrain")
    or "disttrain"
)

# Every run: no progress bar, a fixed thread count (2 ranks x 1 thread on the 2-core CI machine).
FAST = ("trainer.progress=false", "threads_per_rank=1")

# On a CUDA machine `backend=auto` becomes nccl (one rank per GPU): the suite's runs stay on gloo
# CPU ranks, as on CI, unless the test is marked `gpu` (tests/integration/test_gpu.py) or picks a
# backend itself. Set per test by the autouse fixture below.
_GPU_TEST = [False]


@pytest.fixture(autouse=True)
def _gpu_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    _GPU_TEST[0] = request.node.get_closest_marker("gpu") is not None
    yield
    _GPU_TEST[0] = False


def pinned_backend(*overrides: str) -> tuple[str, ...]:
    """("backend=gloo",) for a CLI run of this test, or () in a `gpu` test or when `overrides`
    choose the backend."""
    chosen = any(o.lstrip("+~").partition("=")[0] in ("backend", "backend.name") for o in overrides)
    return () if _GPU_TEST[0] or chosen else ("backend=gloo",)


# A short synthetic run: a few optimizer steps, every one logged, one validation at the end.
QUICK = ("data=synthetic", "trainer.max_steps=6", "trainer.log_every=1")

# Variables that would make the CLI believe it is already a launched rank.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)

DEFAULT_TIMEOUT = 120.0  # one run takes ~8 s on 2 cores; a hang fails instead of blocking CI


# Every process a test command starts inherits this variable with the command's own value.
_TAG = "DISTTRAIN_TEST_TAG"
_TAGS: dict[int, str] = {}  # command pid (= its process group) -> its tag


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without launcher variables, plus a fresh tag for orphan hunting."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(PYTHONUNBUFFERED="1", COLUMNS="200", **extra)
    env[_TAG] = uuid.uuid4().hex
    return env


def _environ_tag(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{_TAG}=".encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode()
    return None


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the command led by `pgid`, read from /proc: its process group,
    plus every process carrying its tag (a torchrun rank runs in a session of its own)."""
    tag = _TAGS.get(pgid) or _environ_tag(pgid)
    if tag:
        _TAGS[pgid] = tag
    procs = live_processes()
    members = {p.pid for p in procs if p.pgrp == pgid or (tag and _environ_tag(p.pid) == tag)}
    # and their descendants: a rank in a session of its own whose title (setproctitle) took over
    # the memory its environment was in, so that /proc/PID/environ no longer shows the tag
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in members:
                members.add(child)
                stack.append(child)
    return sorted(members)


def _kill_group(pgid: int) -> None:
    """SIGKILL the command led by `pgid`: its process group and every tagged process it started."""
    members = _group_members(pgid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for pid in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def start_in_session(cmd: Sequence[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`cmd` started in its own session (its process group is the command's), output piped; its
    tag remembered, so that `_kill_group` finds what it started even after the group is gone."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if _TAG in env:
        _TAGS[proc.pid] = env[_TAG]
    return proc


def run_command(
    cmd: Sequence[str], cwd: Path, timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in its own session; on timeout (or any interruption) kill the whole group.

    After a normal exit, fail if any process of the group (a rank, a torchrun agent) outlived it.
    """
    env = env or clean_env()
    proc = start_in_session(cmd, cwd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} did not finish in {timeout:.0f} s (killed its process group)\n"
            f"--- stdout tail\n{_tail(out)}\n--- stderr tail\n{_tail(err)}"
        )
    except BaseException:  # pytest-timeout, Ctrl-C: never leave ranks behind
        _kill_group(proc.pid)
        proc.wait()
        raise
    deadline = time.monotonic() + 10.0
    while (left := _group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        _kill_group(proc.pid)
        pytest.fail(
            f"processes {left} outlived `{' '.join(cmd)}` (killed them)\n--- stderr tail\n{_tail(err)}"
        )
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def find_run_dirs(root: Path) -> list[Path]:
    """Every run dir under `root` (a folder holding the frozen config.yaml, not Hydra's .hydra/)."""
    return sorted(p.parent for p in root.rglob("config.yaml") if p.parent.name != ".hydra")


def run_disttrain(
    cmd: Sequence[str],
    cwd: Path,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    separate: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`cmd` ([CLI, ARGS...]) in this process (`cli_in_process`: the ranks it starts are real
    processes, forked from this worker's fork server, which every such run shares; ~1 CPU-s a run
    instead of ~5), or with `separate` as the console script in a process of its own, bounded by
    `timeout` (what a test of the CLI's own process needs: its exit, its signals, its children).
    Outside the main thread always the latter: torch's elastic agent sets signal handlers, which
    only the main thread may (a test that runs a sweep in a thread pool gets a process)."""
    import threading

    if separate or threading.current_thread() is not threading.main_thread():
        return run_command(cmd, cwd, timeout, env)
    return cli_in_process(*cmd[1:], cwd=cwd, env=env or clean_env())


def run_cli(
    tmp_path: Path,
    *overrides: str,
    flags: Sequence[str] = (),
    expect_rc: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    separate: bool = False,
) -> tuple[subprocess.CompletedProcess[str], Path | None]:
    """`disttrain train [flags] FAST... overrides...` in `tmp_path`: the process and the run dir it made.

    In this process, or with `separate` in a process of its own (`run_disttrain`). Fails unless the
    exit code is `expect_rc` and at most one new run dir appeared (exactly one on success). The run
    dir is None when none was created.
    """
    before = set(find_run_dirs(tmp_path))
    cmd = [CLI, "train", *flags, *FAST, *pinned_backend(*overrides), *overrides]
    proc = run_disttrain(cmd, tmp_path, timeout, env, separate)
    if proc.returncode != expect_rc:
        pytest.fail(
            f"`{' '.join(cmd)}` exited {proc.returncode}, expected {expect_rc}\n"
            f"--- stdout tail\n{_tail(proc.stdout)}\n--- stderr tail\n{_tail(proc.stderr)}"
        )
    new = [d for d in find_run_dirs(tmp_path) if d not in before]
    assert len(new) <= 1, f"one run created {len(new)} run dirs: {new}"
    if expect_rc == 0:
        assert new, f"a successful run created no run dir under {tmp_path}"
    return proc, (new[0] if new else None)


def train_in_process(run_dir: Path, *overrides: str) -> Path:
    """The 1-process reference of a parity test, in this process: the config `disttrain train FAST...
    overrides...` composes and checks, trained by the rank's own code (worker.train) as rank 0 of
    a world of one (gloo over an in-memory store), one thread as in a CLI rank; `run_dir` gets
    what that rank writes (metrics.jsonl, summary.json, checkpoints). What it saves: the two
    interpreter start-ups (CLI and rank) of a subprocess run that has nothing to prove across
    processes; the runs compared against it stay real multi-process CLI runs."""
    import torch
    import torch.distributed as dist

    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv
    from disttrain.preflight.checks import check_static
    from disttrain.worker import train

    args = [*FAST, *pinned_backend(*overrides), *overrides]
    cfg = resolve(compose(args), args)
    check_static(Run.of(cfg))
    assert cfg["nodes"] * cfg["nproc_per_node"] == 1, "a reference in this process is one rank"
    run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train(Run.of(cfg), DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")), run_dir)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return run_dir


@contextlib.contextmanager
def server_preloading(*modules: str) -> Iterator[None]:
    """This process's fork server (the in-process runs' ranks fork from it) with `modules` imported
    too, until the block ends: for a module whose runs' ranks all import the same library for a
    user's model. transformers (torchao with it) costs each rank ~4 CPU-s after its fork; imported
    once by the server, it costs the ranks nothing. What the ranks run is unchanged (the server
    already preloads torch and disttrain; a module it cannot import it skips). A server already
    running (an earlier module's) is stopped first, this one at the end: later runs of this worker
    get the usual preload. Not for a library that reads the environment at import (`datasets`
    fixes its cache folder then) where a test sets that environment for its runs."""
    from disttrain.launch import forkserver

    forkserver.stop()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(forkserver, "PRELOAD", [*forkserver.PRELOAD, *modules])
        try:
            yield
        finally:
            forkserver.stop()


# What the ranks of a run of a Hugging Face model import (server_preloading).
TRANSFORMERS_MODELS = (
    "transformers.models.auto.modeling_auto",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
)


# ------------------------------------------------------------------------------------ run contents
def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of metrics.jsonl (each line must be valid JSON with a step)."""
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert records, f"{run_dir / 'metrics.jsonl'} is empty"
    assert all(isinstance(r.get("step"), int) for r in records), (
        "every metrics record carries an integer step"
    )
    return records


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "train/loss" in r]


def val_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "val/loss" in r]


def train_losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in train_records(run_dir)]


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The 'model' state dict of checkpoints/final.pt, loaded without running any pickled code."""
    import torch

    state = torch.load(run_dir / "checkpoints" / "final.pt", map_location="cpu", weights_only=True)
    return dict(state["model"])


def read_yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def write_module(root: Path, dotted: str, source: str) -> Path:
    """Write `source` as module `dotted` (e.g. 'mylab.nets') under `root`, with package __init__s."""
    parts = dotted.split(".")
    folder = root.joinpath(*parts[:-1])
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(1, len(parts)):
        init = root.joinpath(*parts[:i], "__init__.py")
        if not init.exists():
            init.write_text("")
    path = folder / f"{parts[-1]}.py"
    path.write_text(source)
    return path


# ------------------------------------------------------------------------------------ shared runs
# One 2-rank torchrun run that several tests compare against (launchers, determinism, launched mode):
# dropout on, so the per-rank RNG streams matter too.
BASELINE = (*QUICK, "seed=5", "model.dropout=0.1")


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`disttrain train launcher=torchrun BASELINE...` in a fresh folder that is a git repo.

    Once per test session, not once per xdist worker (eight modules on four workers read it): the
    first worker to ask runs it under a file lock in the session's shared temp folder and records
    the process; the others wait for that lock and read the record (pytest-xdist's recipe for a
    session fixture). Its readers only read the run dir and write new folders beside it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # popen-gwN/.. : the folder every worker of this session shares
    cwd, record = shared / "baseline", shared / "baseline.json"
    with FileLock(str(shared / "baseline.lock")):
        if record.is_file():
            done = json.loads(record.read_text())
            proc = subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"])
            return proc, Path(done["run_dir"])
        if cwd.exists():  # a worker that failed to make it left a half: start again
            shutil.rmtree(cwd)
        cwd.mkdir()
        init_git_repo(cwd)
        proc, run_dir = run_cli(cwd, "launcher=torchrun", *BASELINE)
        assert run_dir is not None
        done = {"args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr, "run_dir": str(run_dir)}
        record.write_text(json.dumps(done))
    return proc, run_dir


def init_git_repo(path: Path) -> str:
    """Make `path` a git repo with one commit; return the commit's SHA."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
            cwd=path,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip()

    (path / "README").write_text("experiment\n")
    git("init", "-q")
    git("add", "README")
    git("commit", "-q", "-m", "init")
    return git("rev-parse", "HEAD")


@pytest.fixture
def netns_pair() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two network namespaces joined by a veth (tests/integration/netns.py): ((namespace, veth) of
    node 0, (namespace, veth) of node 1); removed afterwards. Skips where they cannot be made."""
    from .netns import namespaces

    with namespaces() as pair:
        yield pair
