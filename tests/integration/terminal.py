"""`disttrain` on a pseudo-terminal, as a user's shell runs it: stderr is the terminal, the command
leads a process group of its own, and Ctrl-C is SIGINT to that whole group (as the terminal's line
discipline sends it). The test reads the screen until an event shows on it, never for a set time.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .conftest import _TAG, _TAGS, _group_members, _kill_group, clean_env

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def shown(screen: bytes) -> str:
    """What a terminal shows of `screen`: escape codes dropped, each rewrite of a line (\\r) a line."""
    return ANSI.sub("", screen.decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")


class Terminal:
    """`cmd` in `cwd` with its stderr on a new pseudo-terminal (stdout piped), in a session of its
    own; `read` until an event, `ctrl_c`, `close` (always: kills what is left of the command)."""

    def __init__(self, cmd: Sequence[str], cwd: Path) -> None:
        import pty

        env = clean_env(TERM="xterm")
        self.master, slave = pty.openpty()
        self.began = time.monotonic()
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            start_new_session=True,
        )
        _TAGS[self.proc.pid] = env[_TAG]  # `_kill_group` finds ranks in sessions of their own
        os.close(slave)
        self.screen, self.first_byte = b"", None
        self.closed = False

    @property
    def text(self) -> str:
        return shown(self.screen)

    def read(self, until: Callable[[str], bool], seconds: float) -> bool:
        """Read the terminal until `until(text)` holds (or it closes, or `seconds` pass)."""
        deadline = time.monotonic() + seconds
        while not self.closed and not until(self.text) and time.monotonic() < deadline:
            if not select.select([self.master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every holder of the terminal is gone
                chunk = b""
            if not chunk:
                self.closed = True
                break
            if self.first_byte is None:
                self.first_byte = time.monotonic() - self.began
            self.screen += chunk
        return until(self.text)

    def ctrl_c(self, seconds: float = 60) -> int:
        """SIGINT to the command's process group, as a terminal's Ctrl-C; its exit status, once
        every holder of the terminal has closed it (the ranks included)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.read(lambda text: False, seconds)
        self.proc.communicate(timeout=seconds)
        return self.proc.returncode

    def leftovers(self, seconds: float = 10) -> list[int]:
        """The command's processes still alive `seconds` after it exited (its group, its tag)."""
        deadline = time.monotonic() + seconds
        while (left := _group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def close(self) -> None:
        _kill_group(self.proc.pid)
        self.proc.wait()
        os.close(self.master)
