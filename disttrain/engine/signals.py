"""A stop flag that SIGTERM/SIGINT raise between steps: every rank stops after the same step."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("disttrain")


# ------------------------------------------------------------------------------------------ signals
FAILED_KEY = "disttrain/failed"  # set by a rank whose collective timed out (engine.loop._stragglers)


class StopFlag:
    """SIGTERM/SIGINT: every rank stops after the same step, within about one step, at any log_every.

    Nothing runs per step but an attribute read: no collective. A signalled rank posts, in the
    rendezvous store, the step it can stop after; a thread on every rank polls the store's stop key
    (every POLL_S) and posts for its rank the step after the one it is in. Once every rank posted,
    all stop after the largest posted step: no rank has passed it (a rank is at the step it posted,
    or before it), so every rank saves the same step. A second signal restores the default handler
    and re-raises it: the user can always force quit.
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
        self._posted = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._store: Any = None
        self._rank, self._world = 0, 1
        self._lost: str = ""  # the store stopped answering (the launcher died)
        self._launcher = int(os.environ.get("DISTTRAIN_LAUNCHER_PID", 0) or 0)
        self._first_at = 0.0

    def __enter__(self) -> StopFlag:
        import torch.distributed as dist

        from disttrain.dist import default_store

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._store = default_store()
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            self._done.clear()
            self._watcher = threading.Thread(target=self._watch, name="disttrain-stop", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
        self._done.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5 * self.POLL_S)
            self._watcher = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signum and (
            time.monotonic() - self._first_at < self.REPEAT_S
            or (self._launcher and os.getppid() != self._launcher)
        ):
            # The launcher died: the kernel sends its parent-death SIGTERM once per thread that
            # inherited the setting, so one event arrives as a burst of signals.
            return
        if self._run_failed():  # hung while the others failed: torchrun's SIGTERM ends it now
            log.error("%s received after another rank failed: exiting now", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        if self.signum:  # second signal: stop now
            log.warning("second %s: exiting without a checkpoint", signal.Signals(signum).name)
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.signum, self._first_at = signum, time.monotonic()
        log.warning("%s received: stopping after this step", signal.Signals(signum).name)

    def _run_failed(self) -> bool:
        try:
            return self._store is not None and bool(self._store.check([FAILED_KEY]))
        except Exception:
            return False

    def _watch(self) -> None:
        """Thread: learn that a peer was signalled; post the step this rank can stop after."""
        while not self._done.wait(self.POLL_S):
            try:
                if not (self.signum or self._store.check([self.KEY])):
                    continue
                with self._lock:
                    self._requested = True  # first: a step boundary from now on waits for the posts
                    self._post(self._progress() + 1)  # the step this rank is in (or about to start)
            except Exception as exc:  # the store is gone: the launcher died
                self._lost, self._requested = f"{type(exc).__name__}: {exc}", True
            return

    def _post(self, step: int) -> None:
        if not self._posted:
            if self.signum:
                self._store.set(self.KEY, str(self.signum))
            self._store.set(f"{self.KEY}/rank{self._rank}", str(step))
            self._posted = True

    def should_stop(self, step: int) -> bool:
        """After every step (`step` just finished), on every rank: True when all ranks stop here."""
        if not (self.signum or self._requested):
            return False
        if self._store is None:  # one process
            self.agreed = self.signum
            return True
        if self.stop_at is None:
            self.stop_at = self._agree(step)
        if step < self.stop_at:
            return False
        self.agreed = self.signum or int(self._store.get(self.KEY))
        return True

    def _agree(self, step: int) -> int:
        from datetime import timedelta

        try:
            if self._lost:
                raise RuntimeError(self._lost)
            with self._lock:
                self._requested = True
                self._post(step)
            keys = [f"{self.KEY}/rank{r}" for r in range(self._world)]
            self._store.wait(keys, timedelta(seconds=self._timeout_s))
            stop_at = max(int(self._store.get(k)) for k in keys)
        except Exception as exc:
            raise StopUnagreed(
                f"stopping on a signal: the ranks could not agree on a step to save at through the "
                f"launcher's store ({self._lost or exc}); no signal checkpoint. The launcher probably "
                "died (SIGKILL?): `disttrain resume` continues from the latest checkpoint."
            ) from None
        if self._rank == 0:
            log.warning("every rank stops after step %d (the signal came at step %d here)", stop_at, step)
        return stop_at

    @property
    def name(self) -> str:
        sig = self.agreed or self.signum
        return signal.Signals(sig).name if sig else ""


class StopUnagreed(RuntimeError):
    """A signal stop the ranks could not coordinate (the launcher's store is gone)."""
