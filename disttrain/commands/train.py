"""`disttrain train`'s shared step: freeze a checked config into its run dir and launch it.

`resume` and `rerun` train through this public function. (`cmd_train` and the body of this step
still live in disttrain/cli.py; they move here next, see issue 15.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def freeze_and_launch(cfg: dict[str, Any], run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Write the frozen run dir for the checked `cfg`, launch its ranks (or submit its job), wait;
    the run's summary, or None when a scheduler trains it or it wrote none."""
    from disttrain.cli import _freeze_and_launch

    return _freeze_and_launch(cfg, run_dir, overrides)
