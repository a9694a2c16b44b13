"""procs.py, the /proc reader: what `rank_pids`, `launcher_alive` and the integration
harness (its process-group sweep) see of a process, on real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from disttrain.procs import live_processes, proc_stat, rank_pids

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc"),
    pytest.mark.timeout(60),
]

# A child that names itself argv[1] (prctl PR_SET_NAME, as a rank does), says so, then waits.
NAMED = textwrap.dedent(
    """
    import ctypes, sys, time
    ctypes.CDLL("libc.so.6").prctl(15, ctypes.c_char_p(sys.argv[1].encode()), 0, 0, 0)
    print("named", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def named() -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    """Start children named as asked; kill and reap them afterwards."""
    children: list[subprocess.Popen[str]] = []

    def start(name: str) -> subprocess.Popen[str]:
        child = subprocess.Popen([sys.executable, "-c", NAMED, name], stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "named\n"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_proc_stat_of_this_process() -> None:
    me = proc_stat(os.getpid())
    assert me is not None
    assert (me.pid, me.ppid, me.pgrp, me.state) == (os.getpid(), os.getppid(), os.getpgrp(), "R")
    assert me.pid in {p.pid for p in live_processes()}


def test_a_name_with_parentheses_and_spaces_is_read_whole(
    named: Callable[[str], subprocess.Popen[str]],
) -> None:
    child = named("x) (y) z")
    stat = proc_stat(child.pid)
    assert stat is not None
    assert (stat.comm, stat.ppid, stat.pgrp) == ("x) (y) z", os.getpid(), os.getpgrp())


def test_a_zombie_or_a_reaped_process_is_not_live() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while proc_stat(child.pid) is not None and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.02)
    assert proc_stat(child.pid) is None and child.pid not in {p.pid for p in live_processes()}
    child.wait()
    assert proc_stat(child.pid) is None


def test_rank_pids_finds_the_ranks_below_a_launcher_by_their_names(
    named: Callable[[str], subprocess.Popen[str]],
) -> None:
    r0, r1 = named("disttrain r0"), named("disttrain r1")
    named("disttrain rx")  # not a rank number
    assert rank_pids(os.getpid()) == {0: r0.pid, 1: r1.pid}
    assert rank_pids(r0.pid) == {}


# A rank with a forked child (as a DataLoader worker with multiprocessing_context=fork): both carry
# the rank's name and title; the child says its pid once it is there, then both wait.
FORKING_RANK = textwrap.dedent(
    """
    import os, sys, time
    import setproctitle
    setproctitle.setproctitle(f"disttrain rank 1/2 {sys.argv[1]}")
    setproctitle.setthreadtitle("disttrain r1")
    if os.fork() == 0:
        print(os.getpid(), flush=True)
    time.sleep(60)
    """
)


def test_a_ranks_forked_worker_is_not_taken_for_the_rank(tmp_path: Path) -> None:
    """A DataLoader worker forked from rank 1 keeps its name and title: `rank_pids` returned the
    worker (listed after the rank), so a test's SIGKILL of "rank 1" killed a worker; `live_ranks`
    (`disttrain show`) listed it as a second rank 1."""
    from disttrain.procs import live_ranks, proc_stat

    rank = subprocess.Popen(
        [sys.executable, "-c", FORKING_RANK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert rank.stdout is not None
    worker = int(rank.stdout.readline())
    try:
        stat = proc_stat(worker)
        assert stat is not None and (stat.comm, stat.ppid) == ("disttrain r1", rank.pid)
        assert rank_pids(os.getpid()) == {1: rank.pid}
        assert live_ranks(tmp_path) == [{"rank": 1, "world": 2, "pid": rank.pid}]
    finally:
        os.kill(worker, 9)
        rank.kill()
        rank.wait()


# Calls into torch.cuda that read how torch was built, not the driver: `_is_compiled` is
# `hasattr(torch._C, "_cuda_getDeviceCount")` (torch._dynamo.device_interface asks it at import).
NOT_PROBES = ("torch/cuda/__init__.py:_is_compiled ",)


@pytest.mark.timeout(300)
def test_the_servers_preloads_never_probe_cuda() -> None:
    """Review GPU #14: the fork server's imports (the same for ddp and fsdp: torch._dynamo too) call
    no torch.cuda/torch.accelerator function and no torch._C cuda/accelerator builtin, and leave CUDA
    uninitialised, so a rank forked from it can still initialise CUDA. In a fresh interpreter
    (tests/unit/cuda_probe.py: a profile hook from before `import torch`); with the CUDA build of
    torch (triton imported too) by scripts/check_forkserver_cuda.sh."""
    import json
    from pathlib import Path

    probe = Path(__file__).with_name("cuda_probe.py")
    # ~5 CPU-s (a profile hook on every call of `import torch`), 19 s wall at load 10: 4 CI workers
    # on 2 cores took over 50 s
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["strategy"] for r in results] == ["ddp", "fsdp"]
    assert results[0]["modules"] == results[1]["modules"] and "torch._dynamo" in results[0]["modules"]
    for r in results:
        probes = [p for p in r["probes"] if not p.startswith(NOT_PROBES)]
        assert probes == [] and r["cuda_initialized"] is False, r


def _rank_entry_in_a_child(tmp_path: Path, probe: str, collector_off: bool = False) -> int:
    """rank_entry("probe", tmp_path) in a child forked from this process (not a process-group leader,
    as a rank forked by the server), `probe`'s source as the module's; with `collector_off` the
    child first turns the collector off, as the server's first preload does. Its pid, once it exited 0."""
    from disttrain.launch.forkserver import LauncherStdio, rank_entry
    from disttrain.procs import startup_without_collector

    (tmp_path / "probe.py").write_text(probe)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            sys.path.insert(0, str(tmp_path))
            if collector_off:
                startup_without_collector()
            rank_entry("probe", str(tmp_path), dict(os.environ), LauncherStdio())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return pid


def test_a_forked_rank_leads_a_session_of_its_own(tmp_path: Path) -> None:
    """Issue 34: torchrun starts each rank in a new session; a rank forked into its launcher's
    session shared one autogroup's CPU share with every other rank of the node (on a loaded
    machine 15-20 % fewer tokens/s than nanoGPT's loop under torchrun)."""
    pid = _rank_entry_in_a_child(
        tmp_path,
        "import os\nfrom pathlib import Path\n\n"
        "def run(run_dir):\n"
        "    Path(run_dir, 'ids').write_text(f'{os.getsid(0)} {os.getpgid(0)} {os.getpid()}')\n",
    )
    sid, pgid, rank = (int(x) for x in (tmp_path / "ids").read_text().split())
    assert sid == pgid == rank == pid
    assert os.getsid(0) != pid


def test_a_forked_rank_collects_garbage_with_the_servers_objects_frozen(tmp_path: Path) -> None:
    """The fork server imports torch and the rank modules with the garbage collector off (1.1 CPU-s
    of full collections over its growing heap, on the way to the first step), and a rank forked
    from it inherits that: rank_entry turns it on again, with the server's objects frozen (never
    scanned, their pages never touched). A rank left without a collector would leak every cycle its
    training makes."""
    _rank_entry_in_a_child(
        tmp_path,
        "import gc\nfrom pathlib import Path\n\n"
        "def run(run_dir):\n"
        "    Path(run_dir, 'gc').write_text(f'{gc.isenabled()} {gc.get_freeze_count()}')\n",
        collector_off=True,
    )
    enabled, frozen = (tmp_path / "gc").read_text().split()
    assert enabled == "True" and int(frozen) > 10_000, (enabled, frozen)  # torch's objects at least
