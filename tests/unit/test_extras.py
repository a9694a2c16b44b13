"""Optional extras a run needs are checked before launch (disttrain/config/extras.py): one paragraph
with the exact install command, exit 2, nothing started or written (review 2026-11-28-ux #7: a
missing wandb failed after the ranks started and left a failed run dir; a missing Optuna sweeper
pointed at a YAML file to write)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from unit_support import disttrain_in_process, said

from disttrain.config import extras
from disttrain.config.errors import ConfigError
from disttrain.config.schema import AmpConfig, CheckpointConfig, Data, InitConfig, ObserveConfig, PeftConfig

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


def run(sinks: list[Any] = [], amp: str = "off", peft: str = "none", **where: Any) -> Any:  # noqa: B006
    """What extras.check_run reads of a Run: its typed blocks; `where`: a checkpoint.dir or data.path."""
    return SimpleNamespace(
        observe=ObserveConfig(sinks),
        amp=AmpConfig(amp),
        peft=PeftConfig(peft),
        checkpoint=CheckpointConfig(dir=where.get("dir")),
        init=InitConfig(),
        resume=None,
        data=Data.of({"path": where.get("path")}),
    )


def test_needs_follow_the_config() -> None:
    """What each row looks at: a built-in sink by alias or class path (not a user's own class named
    WandB), amp=fp8, and peft=lora (the typed Run's blocks)."""
    uses = {need.value: need.uses for need in extras.NEEDS}

    assert uses["wandb"](run(["tensorboard", {"_target_": "disttrain.observe.sinks.WandB"}]))
    assert not uses["wandb"](run([{"_target_": "mylab.sinks.WandB"}]))
    assert uses["mlflow"](run(["mlflow"])) and not uses["mlflow"](run([]))
    assert uses["fp8"](run(amp="fp8")) and not uses["fp8"](run(amp="bf16"))
    assert uses["lora"](run(peft="lora")) and not uses["lora"](run())


def test_an_object_store_url_needs_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint.dir=gs://... without gcsfs names the key and the gcs extra; a local path needs none."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    extras.check_run(run(dir="/tmp/ckpt", path="train.bin"))
    with pytest.raises(ConfigError) as err:
        extras.check_run(run(dir="gs://bucket/ckpt"))
    assert (err.value.key, err.value.value) == ("checkpoint.dir", "gs://...")
    assert "pip install 'disttrain[gcs]'" in err.value.hint
