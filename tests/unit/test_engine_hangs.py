"""The hang report (engine/hangs.py): where a rank stands, read from a thread; the paragraph."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from disttrain.engine.hangs import WHERE_KEY, HangWatch, Progress, Where, explain, locate
from disttrain.engine.signals import FAILED_KEY
from disttrain.observe.log import setup_logging, teardown_logging

TORCH = str(Path(torch.__file__).parent)


def _on_dump(watch: HangWatch) -> threading.Event:
    """An event set once `watch` has dumped every thread's stack into the log: the last thing its
    thread does after the record. The test's main thread stays at its line until then (it left on
    the record and closed the log, and the watcher thread, joined for 0.04 s, wrote no stacks on a
    loaded machine)."""
    dumped, dump = threading.Event(), watch.dump_stacks

    def spied(why: str) -> None:
        dump(why)
        dumped.set()

    watch.dump_stacks = spied  # type: ignore[method-assign]
    return dumped


def test_a_rank_hung_in_its_own_code_reports_its_file_line_from_the_watcher_thread(tmp_path: Path) -> None:
    """The main thread sleeps in user code (not in a collective, no signal): once a peer's timeout
    appears in the store, the watcher thread writes this rank's record (the engine's section, the
    main thread's innermost own frame) to the store and every thread's stack into the rank log."""
    store = dist.HashStore()
    progress = Progress()
    setup_logging(tmp_path, rank=1, to_console=False)
    watch = HangWatch(progress, rank=1, world_size=2)
    watch.POLL_S = 0.02
    dumped = _on_dump(watch)
    try:
        watch.start(store)
        with progress.section("ddp train step", 4):
            store.set(FAILED_KEY, "0")  # rank 0's collective timed out
            deadline = time.monotonic() + 60
            while not dumped.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)  # the hung line
    finally:
        watch.__exit__()
        teardown_logging()
    assert dumped.is_set() and store.check([f"{WHERE_KEY}/rank1"]), "no record and stacks in 60 s"
    record = Where(**json.loads(store.get(f"{WHERE_KEY}/rank1")))
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "# the hung line" in t)
    assert record.at == f"tests/unit/test_engine_hangs.py:{line}", record
    assert (record.func, record.op, record.seq, record.step, record.inside) == (
        "test_a_rank_hung_in_its_own_code_reports_its_file_line_from_the_watcher_thread",
        "ddp train step",
        1,
        4,
        True,
    )
    assert record.code == "time.sleep(0.01)  # the hung line" and not record.waiting
    text = (tmp_path / "rank1.log").read_text()
    assert "hang report: rank 1 is in ddp train step #1 (step 4) at tests/unit/test_engine_hangs.py" in text
    # the stacks are dumped a moment after the record: the main thread is in the same loop, at its
    # sleep (the record's line) or at its check one line above (seen under load on 2 cores)
    assert "Python stack of every thread of rank 1" in text
    assert any(f'test_engine_hangs.py", line {n}' in text for n in (line, line - 1)), text[-3000:]


def test_a_section_a_collective_raised_in_stays_current() -> None:
    progress = Progress()
    with progress.section("all_reduce(train/loss)", 3):
        pass
    assert (progress.seq, progress.inside) == (1, False)
    with pytest.raises(RuntimeError), progress.section("validation", 3):
        raise RuntimeError("Timed out")
    assert (progress.op, progress.seq, progress.inside) == ("validation", 2, True)


def test_locate_skips_torch_and_the_standard_library_and_names_the_collective() -> None:
    frames = [
        (f"{TORCH}/distributed/c10d_logger.py", 80, "wrapper"),
        (f"{TORCH}/distributed/distributed_c10d.py", 2900, "all_reduce"),
        (threading.__file__, 300, "wait"),
        ("/home/me/lab/model.py", 12, "forward"),
        ("/home/me/lab/train.py", 40, "main"),
    ]
    assert locate(frames) == ("/home/me/lab/model.py:12", "forward", "", "all_reduce")


def _where(rank: int, at: str, func: str, *, waiting: bool, collective: str = "") -> Where:
    return Where(
        rank, "fsdp train step", 9, 5, True, 20 if waiting else 18, at, func, "x()", collective, waiting
    )


def test_the_paragraph_groups_the_waiting_ranks_and_places_the_others() -> None:
    records = {
        0: _where(0, "disttrain/strategies/base.py:84", "backward", waiting=True),
        1: _where(1, "disttrain/strategies/base.py:84", "backward", waiting=True),
        2: _where(2, "lab/model.py:7", "forward", waiting=False),
        3: _where(3, "disttrain/engine/loop.py:400", "_log_train", waiting=True, collective="all_reduce"),
    }
    text = explain(records, hung=[2, 4])
    assert text == (
        "rank(s) [0, 1] wait in fsdp train step #9 (step 5) at disttrain/strategies/base.py:84 in backward "
        "`x()`, 20 collectives issued; "
        "rank(s) [3] wait in all_reduce in fsdp train step #9 (step 5) at disttrain/engine/loop.py:400 in "
        "_log_train `x()`, 20 collectives issued; "
        "rank 2 is elsewhere: in fsdp train step #9 (step 5) at lab/model.py:7 in forward `x()`, "
        "18 collectives issued; "
        "rank 4 did not answer (dead, stopped, or its store connection is gone)"
    )


def test_a_stalled_rank_writes_where_it_stands_for_the_launcher_before_nccls_watchdog(
    tmp_path: Path,
) -> None:
    """No new section for stall_s (before backend.timeout, when NCCL's watchdog would SIGABRT the
    waiting ranks with no Python left to run): the rank writes logs/where_rankN.json and its
    stacks; the launcher's message for the watchdog case says where the hung rank stood."""
    from disttrain.launch.torchrun import stalled_places

    assert HangWatch(Progress(), 0, 2, timeout_s=300).stall_s == 240  # 1 minute before the timeout
    logs = tmp_path / "logs"
    progress = Progress()
    setup_logging(logs, rank=2, to_console=False)
    watch = HangWatch(progress, rank=2, world_size=4, timeout_s=300)
    watch.POLL_S, watch.stall_s = 0.02, 0.1
    dumped = _on_dump(watch)
    try:
        watch.start(dist.HashStore())
        with progress.section("fsdp train step", 2):
            deadline = time.monotonic() + 60
            while not dumped.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)  # the stalled line
    finally:
        watch.__exit__()
        teardown_logging()
    assert dumped.is_set() and (logs / "where_rank2.json").is_file(), "no record and stacks in 60 s"
    line = next(
        i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "# the stalled line" in t
    )
    assert stalled_places(tmp_path, 2) == (
        ". Where they stood: rank 2 is elsewhere: in fsdp train step #1 (step 2) at "
        f"tests/unit/test_engine_hangs.py:{line} in test_a_stalled_rank_writes_where_it_stands_for_the_launcher_"
        f"before_nccls_watchdog `time.sleep(0.01)  # the stalled line`"
    )
    assert "Python stack of every thread of rank 2" in (logs / "rank2.log").read_text()


def test_stall_records_of_an_earlier_attempt_are_not_read(tmp_path: Path) -> None:
    """A where_rankN.json older than this launch (a previous attempt in the same run dir) is not
    this failure's; a corrupt one is skipped."""
    import os

    from disttrain.engine.hangs import stalled_records

    record = _where(1, "lab/model.py:7", "forward", waiting=False)
    (tmp_path / "where_rank1.json").write_text(json.dumps(record.__dict__))
    (tmp_path / "where_rank2.json").write_text("{not json")
    assert stalled_records(tmp_path) == {1: record}
    os.utime(tmp_path / "where_rank1.json", (1000.0, 1000.0))
    assert stalled_records(tmp_path, since=2000.0) == {}
