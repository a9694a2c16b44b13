"""Issue 37: the first minute and the last second of a run, in this process.

The start-up phases on stderr (plain lines off a terminal, one live line on it), Ctrl-C in each
phase before the launch (one line, exit 130, nothing written), the bar between log steps, the
fork server's stop at exit and the names of a second signal. The pseudo-terminal run of a real
two-rank job is tests/integration/test_tools.py (`_interrupt_a_run`).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from disttrain.observe import phases, progress
from disttrain.observe.phases import PHASE_LINE, Phases


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_phases_off_a_terminal_are_one_plain_line_each_with_the_time_of_the_one_before() -> None:
    out = io.StringIO()
    said = Phases(out)
    said.start("compose")
    said.start("checks")
    said.end("ranks up")
    lines = out.getvalue().splitlines()
    assert lines[0] == "disttrain: compose ..."
    assert lines[1].startswith("disttrain: compose 0.") and lines[1].endswith(" s | checks ...")
    assert lines[2].startswith("disttrain: checks 0.") and lines[2].endswith(" s | ranks up")
    assert [bool(PHASE_LINE.match(line)) for line in lines] == [True, True, False]


def test_phases_on_a_terminal_are_one_live_line_ended_before_anything_else_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TERM", "xterm")
    out = _Terminal()
    said = Phases(out)
    said.start("compose")
    said.start("checks")
    said.end("launch")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)  # one line, rewritten in place
    final = text.rsplit("\r\x1b[K", 1)[1]
    assert (
        final.startswith("disttrain: compose 0.")
        and " s · checks 0." in final
        and final.endswith(" s · launch\n")
    ), repr(final)
    aborted = _Terminal()
    cut = Phases(aborted)
    cut.start("compose")
    cut.abort()  # Ctrl-C: the message after it starts on a line of its own
    assert aborted.getvalue().endswith("\n") and "compose" in aborted.getvalue()


def test_ctrl_c_while_the_live_line_starts_its_ticker_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C inside `Thread.start()` of the live line's ticker (it waits for the new thread: the
    first milliseconds of `compose`, seen under load by the test below) left the unstarted thread
    behind, and `abort` joined it: RuntimeError "cannot join thread before it is started", a
    traceback instead of `interrupted (SIGINT) during compose`."""

    class Interrupted(threading.Thread):
        def start(self) -> None:
            raise KeyboardInterrupt

    monkeypatch.setenv("TERM", "xterm")
    said = Phases(_Terminal())
    monkeypatch.setattr(threading, "Thread", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        said.start("compose")
    said.abort()
    assert said.cut == "compose"


PRE_LAUNCH = ("compose", "checks", "model on meta", "dry step")


class _WatchedTerminal(_Terminal):
    """A terminal's stderr that tells `seen` when `phase` is announced as the running phase."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase, self.seen = phase, threading.Event()

    def write(self, text: str) -> int:
        if self.phase in text.rsplit("·", 1)[-1] and "interrupted" not in text:
            self.seen.set()
        return super().write(text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", PRE_LAUNCH)
def test_ctrl_c_in_each_phase_before_the_launch_is_one_line_and_exit_130(
    phase: str, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT as the terminal sends it (from another thread, at any point of the phase's work),
    once the phase is announced: the command ends with one line naming the phase, exit 130, no
    traceback, no run dir. One rank, so every phase before the launch runs in this process (the
    fork server's own Ctrl-C: below).

    The phase cannot end before the signal lands (events, no sleep): `model on meta` takes ~0.03 s,
    and on a loaded machine the sender thread once woke after the launch had begun. The next
    phase's start waits until the signal is sent, and the KeyboardInterrupt comes before it."""
    from disttrain.cli import main

    err, out = _WatchedTerminal(phase), io.StringIO()
    sent = threading.Event()
    start = Phases.start

    def ctrl_c() -> None:
        if err.seen.wait(100):
            os.kill(os.getpid(), signal.SIGINT)
            sent.set()

    def held(self: Phases, name: str) -> None:
        if self.name == phase:  # the phase ends here: not before the Ctrl-C reached this thread
            if not sent.wait(100):
                raise AssertionError(f"no SIGINT sent during {phase}:\n{err.getvalue()}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the handler raises KeyboardInterrupt here, on this thread
            raise AssertionError(f"the SIGINT sent during {phase} never arrived:\n{err.getvalue()}")
        start(self, name)

    sender = threading.Thread(target=ctrl_c, daemon=True)
    monkeypatch.setattr(Phases, "start", held)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() appends the cwd
    monkeypatch.delenv(phases.ENTER_ENV, raising=False)  # main() sets it (for the ranks)
    monkeypatch.chdir(scratch)
    sender.start()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(["train", "nproc_per_node=1", "strategy=single", "data=synthetic"])
    except KeyboardInterrupt:
        pytest.fail(f"Ctrl-C during {phase} escaped the CLI:\n{err.getvalue()}")
    sender.join()
    text = err.getvalue()
    assert sent.is_set(), f"{phase} was never announced:\n{text}"
    assert rc == 130 and "Traceback" not in text, text
    assert text.splitlines()[-1] == f"disttrain: interrupted (SIGINT) during {phase}", repr(text)
    assert out.getvalue() == "" and list(scratch.iterdir()) == []


def test_the_fork_server_ignores_ctrl_c_from_its_first_preload_and_its_ranks_do_not() -> None:
    """Review 2026-11-28-ux #3: a Ctrl-C during the checks printed a KeyboardInterrupt traceback
    from the fork server importing torch (it shields itself only after its preloads). Its first
    preload now ignores SIGINT (in the server only); a rank forked from it restores the default."""
    from disttrain.launch import forkserver

    probe = (
        "import signal, disttrain.launch.forkserver; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    )
    for flag, expected in (("1", "True"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != forkserver.SERVER_FLAG}
        env.update({forkserver.SERVER_FLAG: flag} if flag else {})
        said = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        assert said.stdout.strip() == expected, said.stderr
    assert forkserver.PRELOAD[0] == "disttrain.launch.forkserver"  # before torch
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.rank_signals()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # ends it at once, as SIGTERM
    finally:
        signal.signal(signal.SIGINT, saved)


def test_stop_ends_a_fork_server_that_would_linger_at_once_and_reaps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review #2: the prompt came back 3.5-9.4 s after `done:` while `stop` waited up to 5 s each
    for the fork server (tearing down torch) and the tracker. A server that does not exit on EOF
    of its pipe (as one busy tearing down) is now ended at once, and no process is left."""
    from multiprocessing import forkserver as mp_forkserver
    from multiprocessing import resource_tracker

    from disttrain.launch import forkserver

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    read, write = os.pipe()
    os.close(read)
    server = mp_forkserver._forkserver
    monkeypatch.setattr(server, "_forkserver_pid", slow.pid)
    monkeypatch.setattr(server, "_forkserver_alive_fd", write)
    monkeypatch.setattr(server, "_forkserver_address", "fake")
    monkeypatch.setattr(resource_tracker._resource_tracker, "_fd", None)
    began = time.monotonic()
    try:
        forkserver.stop()
        took = time.monotonic() - began
    finally:
        with contextlib.suppress(ProcessLookupError):
            slow.kill()
    assert took < 1.0, f"stop took {took:.2f} s"
    with pytest.raises(ChildProcessError):
        os.waitpid(slow.pid, os.WNOHANG)  # reaped by stop
    assert server._forkserver_pid is None and server._forkserver_alive_fd is None
    slow.returncode = -signal.SIGKILL  # reaped above: Popen must not wait for it again


def test_rates_are_steps_samples_and_tokens_per_second_over_the_last_seconds() -> None:
    rates = progress.Rates()
    assert rates.per_second() is None
    for step in range(1, 6):
        rates.add(step, samples=64, tokens=0, now=10.0 + 0.5 * step)
    assert rates.per_second() == pytest.approx((2.0, 128.0, 0.0))
    rates.add(6, samples=64, tokens=0, now=30.0)  # a long pause: the window keeps its last seconds
    assert rates.per_second() == pytest.approx((1 / 17.5, 64 / 17.5, 0.0))


def test_the_bar_moves_every_step_with_epoch_and_throughput_between_log_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review #6: the bar moved only every `log_every` steps and showed no throughput or epoch."""
    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(
        progress, "console", Console(file=screen, force_terminal=True, color_system=None, width=200)
    )
    bar = progress.make_progress(True, True, 100, "train", epochs=4)
    assert isinstance(bar, progress.RichProgress)
    with bar:
        bar.update(0)
        for step in range(1, 8):  # no log step among them
            bar.advance(step, epoch=1, samples=64, tokens=0)
        bar._progress.refresh()
        shown = _last_line(screen.getvalue())
        assert " 7/100 " in shown and "epoch 2/4" in shown and "it/s" in shown and "samples/s" in shown
        bar.update(8, loss=0.5, lr=1e-3)
        bar.advance(9, epoch=1, samples=64, tokens=4096)  # a language model: tokens/s
        bar._progress.refresh()
        shown = _last_line(screen.getvalue())
        assert " 9/100 " in shown and "loss 0.5" in shown and "tok/s" in shown, shown
    assert progress._LIVE == []


def _last_line(screen: str) -> str:
    """What a terminal shows last of a live display's output (its escape codes dropped)."""
    import re

    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).replace("\r", "\n").rstrip("\n").rsplit("\n", 1)[-1]


def test_a_second_signal_is_named_as_it_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review #12: a double Ctrl-C was logged as "second SIGTERM": the second SIGINT made the
    launcher exit, and the kernel's parent-death SIGTERM reached the rank. Each is named now."""
    from disttrain.engine.signals import StopFlag

    flag: Any = StopFlag()
    flag.signum = signal.SIGINT
    assert flag._second(signal.SIGINT) == "SIGINT again"
    monkeypatch.setenv("DISTTRAIN_RANK_PARENT", str(os.getppid()))  # the parent lives
    assert flag._second(signal.SIGTERM) == "SIGTERM after SIGINT"
    monkeypatch.setenv("DISTTRAIN_RANK_PARENT", "1" if os.getppid() != 1 else "2")  # it is gone
    assert flag._second(signal.SIGTERM) == (
        "SIGTERM after SIGINT (the launcher exited: a second Ctrl-C there does not wait for the save)"
    )


def test_a_second_signal_inside_the_first_ones_console_write_still_ends_the_rank() -> None:
    """A double Ctrl-C with the ranks in sessions of their own: torch's agent sends each rank
    SIGINT, then SIGTERM milliseconds later, and the second handler ran inside the first one's
    console write, where its own write raised ("reentrant call inside BufferedWriter"): rank 0
    went on to save alone and failed on its stopped peer. Whatever its words do, the second
    signal ends the rank (the handler the flag restores). In a forked child."""
    from disttrain.engine import signals
    from disttrain.engine.signals import StopFlag

    def reentered(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            signal.signal(signal.SIGTERM, lambda *_: os._exit(77))  # restored by the flag: the end
            with StopFlag():
                signal.raise_signal(signal.SIGINT)  # the first: stop after this step
                signals.log.warning = reentered  # type: ignore[method-assign]
                signal.raise_signal(signal.SIGTERM)
            code = 3  # the second signal was lost
        except BaseException:
            code = 2  # ... or escaped as an exception from the handler
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 77


def test_the_summary_says_enter_to_first_step_and_launch_to_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from disttrain.observe.summary import ROWS

    labels = {key: label for key, label, _ in ROWS}
    assert labels["enter_to_first_step_s"] == "Enter to first step"
    assert labels["time_to_first_step_s"] == "launch to first step"
    monkeypatch.setenv(phases.ENTER_ENV, "100.0")
    monkeypatch.setenv("DISTTRAIN_LAUNCH_TIME", "103.0")
    assert phases.first_step_line(104.5) == "first step 4.50 s after Enter (launch to first step 1.50 s)"


def test_the_launcher_counts_the_signals_that_reach_it_while_the_agent_runs() -> None:
    """Review #12: a double Ctrl-C was reported with the hint for a slow save. The launcher counts
    what arrives (set_wakeup_fd, whatever torch's handler does): twice is a forced stop."""
    from disttrain.launch.torchrun import SignalCount

    saved = signal.signal(signal.SIGINT, lambda *_: None)  # as torch's agent: a Python handler
    try:
        with SignalCount() as signals:
            signal.raise_signal(signal.SIGINT)
            assert signals.count(signal.SIGINT) == 1
            signal.raise_signal(signal.SIGINT)
        assert signals.count(signal.SIGINT) == 2 and signals.count(signal.SIGTERM) == 0
        assert signal.set_wakeup_fd(-1) == -1  # restored: no wakeup fd left behind
    finally:
        signal.signal(signal.SIGINT, saved)
