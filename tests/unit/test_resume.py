"""`disttrain resume RUN key=value` (D5): overrides are typed like `disttrain train`'s, checked,
and frozen only afterwards; a bad one leaves the finished run as it was. A running run is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from unit_support import checked, disttrain_in_process
from unit_support import said as lines_said  # `said` is a parameter below

from disttrain.commands.resume import apply_overrides
from disttrain.config.errors import ConfigError


@pytest.fixture(scope="module")
def saved() -> dict:
    return checked(["data=synthetic", "trainer.max_steps=30"])


def _finished(tmp_path: Path, cfg: dict) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run / "command.txt").write_text("disttrain train data=synthetic trainer.max_steps=30\n")
    (run / "status.json").write_text(json.dumps({"status": "finished", "pid": 1, "host": "elsewhere"}))
    return run


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("seed=abc", "seed"),
        ("nproc_per_node=abc", "nproc_per_node"),
        ("trainer.batch_size=[1,2]", "trainer.batch_size"),
        ("optim.lr=null", "optim.lr"),
        ("trainer.max_step=40", "trainer.max_step"),
        ("+trainer.max_step=40", "trainer.max_step"),
        ("trainer=5", "trainer"),
        ("model=gpt", "model"),
    ],
)
def test_bad_override_is_a_config_error(saved: dict, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(json.loads(json.dumps(saved)), [override])
    assert err.value.key == key, err.value
    assert "null" not in str(err.value.key)


def test_overrides_are_typed_like_train(saved: dict) -> None:
    cfg = apply_overrides(json.loads(json.dumps(saved)), ["seed=7", "optim.lr=1", "trainer.max_steps=40"])
    assert (cfg["seed"], cfg["optim"]["lr"], cfg["trainer"]["max_steps"]) == (7, 1.0, 40)
    assert isinstance(cfg["optim"]["lr"], float)
    cfg = apply_overrides(json.loads(json.dumps(saved)), ["+optim.amsgrad=true", "+model.note=x"])
    assert (cfg["optim"]["amsgrad"], cfg["model"]["note"]) == (True, "x")


def test_strategy_option_switches_on_resume(saved: dict) -> None:
    cfg = apply_overrides(json.loads(json.dumps(saved)), ["strategy=fsdp"])
    assert cfg["strategy"]["name"] == "fsdp"
    assert cfg["strategy"]["param_dtype"] == "float32", "${amp.dtype} resolved against the saved amp"
    assert "bucket_cap_mb" not in cfg["strategy"]
    assert cfg["trainer"]["max_steps"] == 30, "the rest of the saved config stays"


@pytest.mark.parametrize("override", ["seed=abc", "optim.lr=null", "strategy=nope"])
def test_cli_bad_value_leaves_the_finished_run_untouched(saved: dict, override: str, tmp_path: Path) -> None:
    run = _finished(tmp_path, saved)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    proc = disttrain_in_process("resume", str(run), override, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and lines_said(proc.stderr)[0].startswith(
        "disttrain: config error:"
    )
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_cli_refuses_a_run_that_is_still_running(saved: dict, tmp_path: Path) -> None:
    run = _finished(tmp_path, saved)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = {"status": "running", "pid": sleeper.pid, "host": socket.gethostname()}
        (run / "status.json").write_text(json.dumps(state))
        proc = disttrain_in_process("resume", str(run), cwd=tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 2, proc.stderr
    assert len(lines_said(proc.stderr)) == 1 and str(sleeper.pid) in proc.stderr
    assert json.loads((run / "status.json").read_text())["pid"] == sleeper.pid != os.getpid()


@pytest.mark.parametrize(
    ("name", "plant", "said"),
    [
        ("trackers.json", "[1, 2]", "trackers.json holds list"),
        ("trackers.json", '"x"', "trackers.json holds str"),
        ("trackers.json", "5", "trackers.json holds int"),
        ("trackers.json", "{", "trackers.json holds no JSON"),
        ("config.yaml", "link:notes.txt", "it holds a str, not a mapping"),
        ("config.yaml", "a: [", "it is not YAML text"),
        ("commands.txt", "link:notes.txt", "commands.txt is a symbolic link (to notes.txt)"),
        ("metrics.jsonl", "link:/dev/null", "metrics.jsonl is a symbolic link (to /dev/null)"),
    ],
)
def test_crafted_run_files_are_one_paragraph(
    saved: dict, tmp_path: Path, name: str, plant: str, said: str
) -> None:
    """Reliability D20: each was a traceback (AttributeError on a rank, OSError ELOOP at freeze).
    `seed=abc` stops the resume before any launch if the file passed."""
    run = _finished(tmp_path, saved)
    (run / "notes.txt").write_text("some notes\n")
    (run / name).unlink(missing_ok=True)
    if plant.startswith("link:"):
        (run / name).symlink_to(plant[5:])
    else:
        (run / name).write_text(plant)
    proc = disttrain_in_process("resume", str(run), "seed=abc", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines_said(proc.stderr)) == 1 and f"RUN_DIR={run} is not valid" in proc.stderr
    assert said in proc.stderr


def test_a_pid_that_is_no_process_id_is_not_a_running_launcher(saved: dict, tmp_path: Path) -> None:
    """status.json `running` with pid 2**70 on this host: OverflowError in running_pid (D20)."""
    from disttrain.rundir import running_pid

    run = _finished(tmp_path, saved)
    (run / "status.json").write_text(
        json.dumps({"status": "running", "pid": 2**70, "host": socket.gethostname()})
    )
    assert running_pid(run) is None
    proc = disttrain_in_process("resume", str(run), "seed=abc", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "config error: seed=abc is not valid" in proc.stderr


@pytest.mark.parametrize("where", ["/nonexistent/run", "{tmp}"])
def test_export_names_the_location_it_was_given(where: str, tmp_path: Path) -> None:
    """`export /nonexistent` reported RUN_DIR=/ (it walked up to the root looking for config.yaml)."""
    location = where.format(tmp=tmp_path)
    proc = disttrain_in_process("export", location, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert lines_said(proc.stderr)[0].startswith(
        f"disttrain: config error: RUN_DIR={location} is not valid"
    ), proc.stderr


def test_a_rank_takes_a_trackers_json_that_is_no_mapping_as_none(tmp_path: Path) -> None:
    """The rank's own read (a restart before the first checkpoint): a list raised AttributeError."""
    from disttrain.observe.metrics import tracker_resume

    (tmp_path / "trackers.json").write_text("[1, 2]")
    assert tracker_resume(tmp_path, None) == (None, 0)
    (tmp_path / "trackers.json").write_text('{"0:mlflow": {"run_id": "r"}}')
    assert tracker_resume(tmp_path, None) == ({"0:mlflow": {"run_id": "r"}}, 0)
