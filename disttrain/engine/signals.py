"""A stop flag that SIGTERM/SIGINT raise between steps: every rank stops after the same step."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger("disttrain")


# ------------------------------------------------------------------------------------------ signals
FAILED_KEY = "disttrain/failed"  # set by a rank whose collective timed out (engine.loop._stragglers)


def nccl_tears_down() -> bool:
    """Whether NCCL's watchdog ends a rank whose collective timed out (SIGABRT, no Python exception):
    TORCH_NCCL_ASYNC_ERROR_HANDLING 1 (torchrun's default) or 3 (torch's default)."""
    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") in ("1", "3")


def local_rank_gone(launcher: int) -> bool:
    """Fewer live ranks below `launcher` than this node runs (Linux /proc; False when unknown)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    if not launcher or local < 2:
        return False
    from disttrain.procs import rank_pids

    try:
        return len(rank_pids(launcher)) < local
    except OSError:
        return False


class StopFlag:
    """SIGTERM/SIGINT: every rank stops after the same step, within about one step, at any log_every.

    Nothing runs per step but an attribute read: no collective. A watcher thread on every rank
    wakes on this rank's own signal (through signal.set_wakeup_fd: even while the main thread waits
    inside a collective) or on a peer's stop key in the rendezvous store (polled every POLL_S). It
    claims the step this rank can stop after (the step it is in, or the boundary the main thread
    waits at) and agrees with the others: all stop after the largest claim. No rank has passed it
    (a rank is at the step it claimed, or before it), so every rank saves the same step.

    On one node the claims meet in one all-reduce(MAX) on a gloo group of their own, made at the
    start: its collectives never interleave with training's, whatever step each rank is in, and it
    needs no store after the start. So when a SIGKILLed launcher takes the rendezvous store with it,
    the ranks (each SIGTERMed by the kernel as its parent dies) still agree and save. Across nodes
    the claims meet in the store (a dead store host there means no signal checkpoint). A second
    signal restores the default handler and re-raises it: the user can always force quit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    POLL_S = 0.25  # 4 store round trips a second: ~0.2 % of a core; only a lone signalled rank waits on it
    REPEAT_S = 1.0  # the same signal again within this: one event (see _handle), not "force quit"
    KEY = "disttrain/stop"

    def __init__(self, progress: Callable[[], int] = lambda: 0, timeout_s: float = 300.0) -> None:
        self.signum: int = 0  # this rank's own signal
        self.agreed: int = 0  # the signal every rank stops on, once they stop
        self.stop_at: int | None = None
        self._progress, self._timeout_s = progress, timeout_s  # progress(): the last finished step
        self._saved: dict[int, Any] = {}
        self._requested = False  # a peer asked (seen by the watcher) or this rank was signalled
        self._claim: int | None = None  # the step this rank can stop after, once claimed
        self._woken = 0  # a signal the watcher saw arrive (before the main thread may run its handler)
        self._outcome: tuple[int, int] | str = ""  # (stop step, signal), or why the ranks cannot agree
        self._all_signal = 0  # the signal the ranks stop on (a peer's, when this rank got none)
        self._decided = threading.Event()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._store: Any = None
        self._group: Any = None  # one node: the gloo group the claims meet in
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._old_wakeup = -1
        self._rank, self._world = 0, 1
        self._launcher = int(os.environ.get("DISTTRAIN_LAUNCHER_PID", 0) or 0)
        self._first_at = 0.0
        self._watchdog = False  # NCCL's watchdog ends timed-out ranks by SIGABRT (see _run_failed)

    def __enter__(self) -> StopFlag:
        import torch.distributed as dist

        from disttrain.dist import default_store

        main = threading.current_thread() is threading.main_thread()
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            self._store = default_store()
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            self._watchdog = "nccl" in str(dist.get_backend()) and nccl_tears_down()
            if int(os.environ.get("LOCAL_WORLD_SIZE", self._world) or 0) == self._world:
                # One node: every rank gets its parent-death signal when the launcher dies.
                # Made BEFORE the handlers exist: a rank signalled earlier dies at once (nothing
                # trained yet), and a peer waiting here for it must die as well on its SIGTERM, not
                # sit in C++ (where a Python handler cannot run) until stop_grace_s ends in SIGKILL.
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._timeout_s))
        if main:
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        if distributed:
            if main:
                self._wake = socket.socketpair()
                for end in self._wake:
                    end.setblocking(False)
                self._old_wakeup = signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
            self._done.clear()
            self._watcher = threading.Thread(target=self._watch, name="disttrain-stop", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
        if self._wake is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup)
        self._done.set()
        self._poke()
        if self._watcher is not None:
            self._watcher.join(timeout=5 * self.POLL_S)
            if not self._watcher.is_alive() and self._wake is not None:
                for end in self._wake:
                    end.close()
                self._wake = None
            self._watcher = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signum and (
            time.monotonic() - self._first_at < self.REPEAT_S
            or (self._launcher and os.getppid() != self._launcher)
        ):
            # The launcher died: the kernel sends its parent-death SIGTERM once per thread that
            # inherited the setting, so one event arrives as a burst of signals.
            return
        if self.signum:  # second signal: stop now
            from disttrain.observe.progress import close_live

            # Whatever the words do: this handler may run inside the first one's write to the
            # console (a double Ctrl-C with the ranks in sessions of their own: torch's agent
            # sends SIGINT, then SIGTERM milliseconds later), where a nested write raises
            # "reentrant call inside BufferedWriter"; the rank then went on to save alone and
            # failed on the peer that had stopped.
            try:
                close_live()  # the bar's line ends: the messages after it start on their own
                log.warning("%s: exiting without a checkpoint", self._second(signum))
            finally:
                self.__exit__()
                signal.raise_signal(signum)
            return
        # Taken before anything slow: a handler may run again inside this one (a burst of
        # parent-death signals), and must then see a repeat, not a second signal.
        self.signum, self._first_at = signum, time.monotonic()
        if self._run_failed():  # hung while the others failed: torchrun's SIGTERM ends it now
            log.error("%s received after another rank failed: exiting now", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        log.warning("%s received: stopping after this step", signal.Signals(signum).name)

    def _second(self, signum: int) -> str:
        """The second signal as it came: "SIGINT again", or "SIGTERM after SIGINT", and when the
        parent is gone, why a SIGTERM came (the kernel's parent-death signal: the launcher exited,
        most often on a second Ctrl-C, which does not wait for the ranks' save)."""
        first, now = signal.Signals(self.signum).name, signal.Signals(signum).name
        said = f"{now} again" if signum == self.signum else f"{now} after {first}"
        parent = int(os.environ.get("DISTTRAIN_RANK_PARENT") or self._launcher or 0)
        if signum == signal.SIGTERM and parent and os.getppid() != parent:
            said += " (the launcher exited: a second Ctrl-C there does not wait for the save)"
        return said

    def _run_failed(self) -> bool:
        """Another rank failed: one whose collective timed out set FAILED_KEY (engine.loop); or, on
        NCCL, whose watchdog SIGABRTs the waiting ranks without a Python exception (nothing set), a
        rank of this node is gone: torchrun's SIGTERM then follows that death, not a user's stop."""
        try:
            if self._store is not None and self._store.check([FAILED_KEY]):
                return True
        except Exception:
            pass
        return self._watchdog and local_rank_gone(self._launcher)

    def _poke(self) -> None:
        """Wake the watcher now (a zero byte: no signal)."""
        try:
            if self._wake is not None:
                self._wake[1].send(b"\0")
        except OSError:
            pass

    def _sleep(self) -> None:
        """Up to POLL_S, or until a signal arrives (the C-level handler writes its number)."""
        if self._wake is None:
            self._done.wait(self.POLL_S)
            return
        try:
            if select.select([self._wake[0]], [], [], self.POLL_S)[0]:
                got = self._wake[0].recv(256)
                self._woken = self._woken or next((s for s in got if s in self.SIGNALS), 0)
        except (OSError, ValueError):  # closed under us at exit
            self._done.wait(self.POLL_S)

    def _watch(self) -> None:
        """Thread: wait for a reason to stop, claim this rank's step, agree on the step to stop after."""
        store_alive = True
        while not (self.signum or self._woken or self._requested):
            self._sleep()
            if self._done.is_set():
                return
            if store_alive and not (self.signum or self._woken):
                try:
                    if self._store.check([self.KEY]):
                        break
                except Exception:  # the launcher's store is gone: this rank's own signal still counts
                    store_alive = False
        with self._lock:
            self._requested = True  # first: a step boundary from now on waits for the outcome
            if self._claim is None:
                self._claim = self._progress() + 1  # the step this rank is in (or about to start)
            claim = self._claim
        try:
            self._outcome = self._agree(claim, self.signum or self._woken)
        except Exception as exc:
            self._outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self._decided.set()

    def _agree(self, claim: int, signum: int) -> tuple[int, int]:
        """(the step every rank stops after, the signal) from every rank's claim."""
        import torch
        import torch.distributed as dist

        if signum:  # tell the others (they poll the key); a dead store: they had their own signal
            try:
                self._store.set(self.KEY, str(signum))
            except Exception:
                if self._group is None:
                    raise
        if self._group is not None:
            both = torch.tensor([claim, signum], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group)
            return int(both[0]), int(both[1])
        self._store.set(f"{self.KEY}/rank{self._rank}", str(claim))
        keys = [f"{self.KEY}/rank{r}" for r in range(self._world)]
        self._store.wait(keys, timedelta(seconds=self._timeout_s))
        return max(int(self._store.get(k)) for k in keys), int(self._store.get(self.KEY))

    def should_stop(self, step: int) -> bool:
        """After every step (`step` just finished), on every rank: True when all ranks stop here."""
        if not (self.signum or self._requested):
            return False
        if self._store is None:  # one process
            self.agreed = self.signum
            return True
        if self.stop_at is None:
            self.stop_at = self._wait_outcome(step)
        if step < self.stop_at:
            return False
        self.agreed = self.signum or self._all_signal
        return True

    def _wait_outcome(self, step: int) -> int:
        with self._lock:
            self._requested = True
            if self._claim is None:
                self._claim = step  # the main thread waits at this boundary: it has not passed it
        self._poke()
        if not self._decided.wait(self._timeout_s + 5.0):
            self._outcome = f"no outcome within {self._timeout_s + 5.0:g} s"
        if isinstance(self._outcome, str):
            raise StopUnagreed(
                f"stopping on a signal: the ranks could not agree on a step to save at ({self._outcome}); "
                "no signal checkpoint. A rank or the launcher probably died (SIGKILL?): `disttrain "
                "resume` continues from the latest checkpoint."
            )
        stop_at, self._all_signal = self._outcome[0], self._outcome[1] or signal.SIGTERM
        if self._rank == 0:
            log.warning("every rank stops after step %d (the signal came at step %d here)", stop_at, step)
        return stop_at

    @property
    def name(self) -> str:
        sig = self.agreed or self.signum
        return signal.Signals(sig).name if sig else ""


class StopUnagreed(RuntimeError):
    """A signal stop the ranks could not coordinate (the launcher's store is gone)."""
