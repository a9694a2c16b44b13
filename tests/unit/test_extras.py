"""Optional extras a run needs are checked before launch (disttrain/config/extras.py): one paragraph
with the exact install command, exit 2, nothing started or written (review 2026-11-28-ux #7: a
missing wandb failed after the ranks started and left a failed run dir; a missing Optuna sweeper
pointed at a YAML file to write)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from unit_support import disttrain_in_process, said

from disttrain.config import extras

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_matches_pyproject_s_extras() -> None:
    """Each extra's install command names a real extra, with the package pyproject lists for it."""
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the package supports 3.10)
    for name, extra in extras.EXTRAS.items():
        line = re.search(rf"^{name} = \[(.*)\]", text, re.M)
        assert line is not None and f'"{extra.package}"' in line[1], f"disttrain[{name}]: {line}"
    for need in extras.NEEDS:
        assert need.extra in extras.EXTRAS


@pytest.mark.parametrize(
    ("argv", "missing", "install"),
    [
        (["train", "observe.sinks=[tensorboard,{_target_:wandb,project:p}]"], "wandb", "wandb"),
        (["train", "observe.sinks=[mlflow]"], "mlflow", "mlflow"),
        (
            ["train", "-m", "hydra/sweeper=optuna", "optim.lr=1e-3,1e-2"],
            "hydra_plugins.hydra_optuna_sweeper",
            "optuna",
        ),
        (["train", "peft=lora"], "peft", "peft"),
    ],
    ids=["wandb", "mlflow", "optuna", "peft"],
)
def test_a_missing_extra_is_refused_before_anything_starts(
    argv: list[str], missing: str, install: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: find_spec finds nothing
    proc = disttrain_in_process(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(said(proc.stderr)) == 1, "one paragraph"
    assert f"install it: pip install 'disttrain[{install}]' (or pip install '" in proc.stderr, proc.stderr
    assert re.search(
        rf"\({re.escape(missing)} is not: it comes with the extra disttrain\[{install}\]\)", proc.stderr
    )
    assert list(tmp_path.iterdir()) == [], "no run dir, no sweep dir"


def test_needs_follow_the_config() -> None:
    """What each row looks at: a built-in sink by alias or class path (not a user's own class named
    WandB), amp=fp8, and peft=lora."""
    uses = {need.value: need.uses for need in extras.NEEDS}
    assert uses["wandb"](
        {"observe": {"sinks": ["tensorboard", {"_target_": "disttrain.observe.sinks.WandB"}]}}
    )
    assert not uses["wandb"]({"observe": {"sinks": [{"_target_": "mylab.sinks.WandB"}]}})
    assert uses["mlflow"]({"observe": {"sinks": ["mlflow"]}}) and not uses["mlflow"](
        {"observe": {"sinks": []}}
    )
    assert uses["fp8"]({"amp": {"name": "fp8"}}) and not uses["fp8"]({"amp": {"name": "bf16"}})
    assert uses["lora"]({"peft": {"name": "lora"}}) and not uses["lora"]({"peft": {"name": "none"}})
    assert not uses["lora"]({})  # a config.yaml from before the peft group
