"""Run dirs made by others are data (review 2026-11-25-reliability, D2 and D4).

D4: a folder of a run dir that is a symbolic link (`checkpoints -> ../victim/checkpoints`) was
followed: keep-N and the `.tmp-*` cleanup deleted another run's checkpoints, `export` overwrote an
outside model. D2: `export` of a checkpoint folder took the config.yaml of any parent, up to `/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from unit_support import checked, disttrain_in_process

from disttrain.commands.export import owning_run_dir
from disttrain.config.errors import ConfigError
from disttrain.rundir import OWN_FOLDERS, planted_links, refuse_planted_links


@pytest.fixture(scope="module")
def saved() -> dict:
    return checked(["data=synthetic", "trainer.max_steps=30"])


def _run(root: Path, cfg: dict, name: str = "run") -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run / "command.txt").write_text("disttrain train data=synthetic trainer.max_steps=30\n")
    (run / "status.json").write_text(json.dumps({"status": "finished", "pid": 1, "host": "elsewhere"}))
    return run


def _victim(root: Path) -> Path:
    ckpts = root / "victim" / "checkpoints"
    (ckpts / "step_00000010").mkdir(parents=True)
    (ckpts / ".tmp-keepme").mkdir()
    (ckpts / ".tmp-keepme" / "notes.txt").write_text("important")
    return ckpts


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_resume_refuses_a_planted_checkpoints_link_and_touches_nothing(saved: dict, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    before = _tree(victim)
    run = _run(tmp_path, saved)
    (run / "checkpoints").symlink_to(victim)
    proc = disttrain_in_process("resume", str(run), "checkpoint.keep=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "checkpoints/ is a symbolic link" in proc.stderr and "checkpoint.dir=" in proc.stderr
    assert _tree(victim) == before
    assert not (run / "logs").exists()  # no rank started


@pytest.mark.parametrize("folder", ["logs", "tensorboard", "profile", "export"])
def test_every_own_folder_is_checked(saved: dict, tmp_path: Path, folder: str) -> None:
    run = _run(tmp_path, saved)
    (tmp_path / "elsewhere").mkdir()
    (run / folder).symlink_to(tmp_path / "elsewhere")
    assert folder in OWN_FOLDERS
    with pytest.raises(ConfigError, match=f"{folder}/ is a symbolic link"):
        refuse_planted_links(run, "RUN_DIR", saved)


def test_an_explicit_checkpoint_dir_may_be_a_link(saved: dict, tmp_path: Path) -> None:
    """checkpoint.dir set: the run never uses <run dir>/checkpoints, whatever it is."""
    run = _run(tmp_path, saved)
    (run / "checkpoints").symlink_to(_victim(tmp_path))
    cfg = {**saved, "checkpoint": {**saved["checkpoint"], "dir": str(tmp_path / "mine")}}
    assert planted_links(run, cfg) == {}
    assert planted_links(run, saved) == {"checkpoints": str(tmp_path / "victim" / "checkpoints")}


def test_export_refuses_a_planted_export_link(saved: dict, tmp_path: Path) -> None:
    models = tmp_path / "victim_models"
    models.mkdir()
    (models / "model.pt").write_text("precious model")
    run = _run(tmp_path, saved)
    (run / "export").symlink_to(models)
    proc = disttrain_in_process("export", str(run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "export/ is a symbolic link" in proc.stderr
    assert (models / "model.pt").read_text() == "precious model"


def test_export_never_takes_a_config_from_a_folder_above_the_run(saved: dict, tmp_path: Path) -> None:
    """D2: a config.yaml dropped into a parent folder (/tmp, /mnt/shared) is not a run's config."""
    planted = {**saved, "model": {"_target_": "builtins.print", "_args_": ["PAYLOAD"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(planted))
    step = tmp_path / "shared" / "ckpts" / "step_00000030"
    step.mkdir(parents=True)
    proc = disttrain_in_process("export", str(step), "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "PAYLOAD" not in proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"disttrain: config error: RUN_DIR={step} is not valid"), proc.stderr


def test_export_finds_the_run_of_its_own_checkpoints(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved)
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    assert owning_run_dir(step, str(step)) == run
    assert owning_run_dir(step.parent, str(step.parent)) == run
    assert owning_run_dir(run, str(run)) == run
    nested = run / "checkpoints" / "step_00000010" / "deeper"
    nested.mkdir()
    with pytest.raises(ConfigError):
        owning_run_dir(nested, str(nested))
