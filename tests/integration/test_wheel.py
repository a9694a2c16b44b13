"""The wheel a user installs carries everything: configs and data, found from any directory.

The full install (a fresh venv, torch, the wheel, three commands) is `.ci/run`'s wheel step; this
test checks the wheel's contents the quick way: unpacked onto PYTHONPATH, run from an empty dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_its_configs_and_runs_from_an_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = out.glob("disttrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "disttrain/configs/config.yaml" in names and "disttrain/configs/strategy/ddp.yaml" in names
    assert "disttrain/data/digits.npz" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = clean_env(PYTHONPATH=str(site))  # the unpacked wheel only, never the checkout
    env.pop("DISTTRAIN_CONFIG_DIR", None)
    where = subprocess.run(
        [sys.executable, "-c", "import disttrain.config as c; print(c.config_dir())"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert where.stdout.strip() == str(site / "disttrain" / "configs"), where.stdout + where.stderr
    for args in (["config", "strategy=fsdp"], ["plan", "model=gpt", "nodes=4", "nproc_per_node=8"]):
        proc = subprocess.run(
            [sys.executable, "-m", "disttrain", *args],
            cwd=empty,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert "recommended:" in proc.stdout and "master_addr" not in proc.stdout + proc.stderr
    assert os.listdir(empty) == []  # nothing written by config or plan
