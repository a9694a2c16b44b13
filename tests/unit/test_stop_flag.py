"""StopFlag: the ranks agree on one step to stop after, even once the rendezvous store is gone (D19).

Two real gloo ranks in lock-step (one all-reduce per step, like DDP) around a store that a third
process hosts, as torchrun's agent does. The tests kill that process (SIGKILL: the store dies with
it) and send the ranks SIGTERM at different moments, so that one rank waits at a step boundary
while the other is blocked inside the next step's all-reduce: a second all-reduce on the default
group could never be matched there; the stop group's can.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.forkserver
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forked
import pytest


@pytest.fixture(scope="module", autouse=True)
def _stop_the_fork_server() -> Iterator[None]:
    """Stop and reap the fork server after this module: no process outlives it, and the CPU time
    of its children (reaped by it) is counted as this process's children's, as for Popen."""
    yield
    multiprocessing.forkserver._forkserver._stop()  # the stdlib's own way to stop it (its tests use it)


pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="signals and socket wakeups as on Linux"),
    pytest.mark.timeout(180),
]

STORE = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    print(store.port, flush=True)
    time.sleep(600)
    """
)

RANK = textwrap.dedent(
    """
    import json, signal, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    from disttrain.engine.signals import StopFlag, StopUnagreed

    port, rank, out, delay = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    step, result = 0, {"rank": rank}
    try:
        with StopFlag(lambda: step, timeout_s=20.0) as stop:
            while step < 100000:
                one = torch.ones(1)
                dist.all_reduce(one)  # the step's collective (DDP's gradient all-reduce)
                time.sleep(delay)
                step += 1
                (out / f"step{rank}").write_text(str(step))
                if stop.should_stop(step):
                    break
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a peer's stop came first: ours lands later
        result.update(stopped=step, signal=stop.agreed)
        state = torch.tensor([float(step)])
        dist.all_reduce(state)  # the save's collectives still work without the store
        dist.barrier()
        result["sum"] = state.item()
    except StopUnagreed as exc:
        result.update(unagreed=str(exc), step=step)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    """
)


def _start(tmp_path: Path, local_world: int) -> tuple[Any, list[Any]]:
    """The store host and the two ranks: processes forked from a server that imported torch once."""
    (tmp_path / "store.py").write_text(STORE)
    (tmp_path / "rank.py").write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.update(LOCAL_WORLD_SIZE=str(local_world), DISTTRAIN_LAUNCHER_PID="", OMP_NUM_THREADS="1")
    out, err = tmp_path / "store.out", tmp_path / "store.err"
    store = forked.start(tmp_path / "store.py", [], env, out, err)
    deadline = time.monotonic() + 60
    while not out.is_file() or not out.read_text().endswith("\n"):
        assert store.is_alive() and time.monotonic() < deadline, _text(err)
        time.sleep(0.02)
    port = out.read_text().strip()
    ranks = [
        forked.start(
            tmp_path / "rank.py",
            [port, str(r), str(tmp_path), str(0.02 + 0.03 * r)],
            env,
            tmp_path / f"rank{r}.out",
            tmp_path / f"rank{r}.err",
        )
        for r in (0, 1)
    ]
    return store, ranks


def _text(path: Path) -> str:
    return path.read_text()[-2000:] if path.is_file() else ""


def _steps(tmp_path: Path, rank: int) -> int:
    try:
        return int((tmp_path / f"step{rank}").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _run(
    tmp_path: Path, local_world: int, kill_store: bool, signalled: tuple[int, ...], check: bool = True
) -> list[dict]:
    """Train until step 5, kill the store host if asked, SIGTERM the `signalled` ranks 0.4 s apart;
    each rank's outcome ({} when it ended without one: a peer's exit broke its collective)."""
    store, ranks = _start(tmp_path, local_world)
    errors = [tmp_path / f"rank{r}.err" for r in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while min(_steps(tmp_path, 0), _steps(tmp_path, 1)) < 5:
            assert time.monotonic() < deadline, "the ranks never trained"
            assert all(p.is_alive() for p in ranks), [_text(e) for e in errors]
            time.sleep(0.05)
        if kill_store:
            store.kill()
            store.join()
        for i, r in enumerate(signalled):
            if i:
                time.sleep(0.4)  # rank r's main thread is blocked in the next step's all-reduce by now
            with contextlib.suppress(ProcessLookupError):  # it already stopped: a peer's claim came first
                os.kill(ranks[r].pid, signal.SIGTERM)
        for p in ranks:
            p.join(timeout=60)
        assert all(p.exitcode is not None for p in ranks), "a rank did not end within 60 s"
        if check:
            assert [p.exitcode for p in ranks] == [0, 0], [_text(e) for e in errors]
        files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
        return [json.loads(f.read_text()) if f.is_file() else {} for f in files]
    finally:
        for p in (store, *ranks):
            if p.is_alive():
                p.kill()
            p.join()


def test_without_the_store_every_signalled_rank_stops_after_the_same_step(tmp_path: Path) -> None:
    """D19: the launcher (store host) is SIGKILLed; the kernel SIGTERMs every rank. Rank 0 reaches
    a step boundary first and waits; rank 1 is inside the next all-reduce when its signal lands."""
    a, b = _run(tmp_path, local_world=2, kill_store=True, signalled=(0, 1))
    assert "unagreed" not in a and "unagreed" not in b, (a, b)
    assert a["stopped"] == b["stopped"] > 5
    assert a["signal"] == b["signal"] == signal.SIGTERM
    assert a["sum"] == b["sum"] == 2 * a["stopped"]


def test_a_lone_signalled_rank_is_heard_through_the_store(tmp_path: Path) -> None:
    """The store alive, only rank 1 signalled: rank 0 learns it from the stop key; same step."""
    a, b = _run(tmp_path, local_world=2, kill_store=False, signalled=(1,))
    assert a["stopped"] == b["stopped"] > 5
    assert a["signal"] == b["signal"] == signal.SIGTERM


def test_across_nodes_the_claims_meet_in_the_store(tmp_path: Path) -> None:
    """LOCAL_WORLD_SIZE < WORLD_SIZE (several nodes): no stop group; the store carries the claims."""
    a, b = _run(tmp_path, local_world=1, kill_store=False, signalled=(0, 1))
    assert a["stopped"] == b["stopped"] > 5


def test_across_nodes_without_the_store_no_rank_saves_a_step_the_others_do_not(tmp_path: Path) -> None:
    """No stop group and no store: the ranks cannot agree and say so; none saves on its own."""
    results = _run(tmp_path, local_world=1, kill_store=True, signalled=(0, 1), check=False)
    assert not any("stopped" in r for r in results), results
    assert any("could not agree" in r.get("unagreed", "") for r in results), results


NAMED = "import ctypes, sys, time; ctypes.CDLL('libc.so.6').prctl(15, sys.argv[1].encode(), 0, 0, 0); print(1, flush=True); time.sleep(60)"


@pytest.mark.parametrize(
    ("local_world", "watchdog", "failed"), [(3, True, True), (2, True, False), (3, False, False)]
)
def test_on_nccl_a_sigterm_after_a_local_rank_died_is_a_failed_run(
    monkeypatch: pytest.MonkeyPatch, local_world: int, watchdog: bool, failed: bool
) -> None:
    """Review GPU #8: NCCL's watchdog SIGABRTs the ranks that waited (no exception, no FAILED_KEY);
    the hung rank's handler then sees fewer live ranks below the launcher than LOCAL_WORLD_SIZE and
    exits at once instead of waiting out stop_grace_s. Two live ranks (real processes named as
    ranks are, children of this test, the launcher) of 3: failed; of 2, or on gloo: a plain stop."""
    import subprocess

    from disttrain.engine.signals import StopFlag

    ranks = [
        subprocess.Popen([sys.executable, "-c", NAMED, f"disttrain r{r}"], stdout=subprocess.PIPE)
        for r in (0, 1)
    ]
    try:
        for child in ranks:
            assert child.stdout is not None and child.stdout.readline() == b"1\n"
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        monkeypatch.setenv("DISTTRAIN_LAUNCHER_PID", str(os.getpid()))
        flag = StopFlag()
        flag._watchdog = watchdog  # what __enter__ finds on an nccl default group
        assert flag._run_failed() is failed
    finally:
        for child in ranks:
            child.kill()
            child.wait()


@pytest.mark.parametrize(
    ("mode", "tears_down"), [(None, True), ("1", True), ("3", True), ("0", False), ("2", False)]
)
def test_which_nccl_error_handling_modes_end_the_ranks(
    monkeypatch: pytest.MonkeyPatch, mode: str | None, tears_down: bool
) -> None:
    from disttrain.engine.signals import nccl_tears_down

    if mode is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode)
    assert nccl_tears_down() is tears_down
