"""The rich progress bar on rank 0; a no-op object elsewhere or when disabled."""

from __future__ import annotations

from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from disttrain.observe.log import console


class NullProgress:
    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, step: int, **fields: Any) -> None:
        pass


class RichProgress(NullProgress):
    def __init__(self, total: int, description: str) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(description, total=total, status="")

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def update(self, step: int, **fields: Any) -> None:
        status = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self._progress.update(self._task, completed=step, status=status)


def make_progress(enabled: bool, total: int, description: str) -> NullProgress:
    return RichProgress(total, description) if enabled else NullProgress()
