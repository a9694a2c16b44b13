"""D25: files written into a run dir never follow a symlink planted at a predictable name."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from disttrain import checkpoint
from disttrain.checkpoint import files as ckpt_files
from disttrain.observe.log import setup_logging, teardown_logging
from disttrain.rundir import write_json
from disttrain.safefile import open_append, write_atomic


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_point_latest_does_not_write_through_a_planted_temp_symlink(tmp_path: Path) -> None:
    victim, ckpts = _victim(tmp_path), tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / ".latest.tmp").symlink_to(victim)
    checkpoint.point_latest(ckpts, "step_00000001")
    assert victim.read_text() == "precious\n"
    latest = ckpts / "latest"
    assert latest.is_file() and not latest.is_symlink()
    assert latest.read_text() == "step_00000001\n"


def test_point_latest_replaces_a_planted_latest_symlink(tmp_path: Path) -> None:
    victim, ckpts = _victim(tmp_path), tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "latest").symlink_to(victim)
    checkpoint.point_latest(ckpts, "step_00000002")
    assert victim.read_text() == "precious\n"
    assert not (ckpts / "latest").is_symlink() and checkpoint.read_latest(ckpts) == "step_00000002"


def test_save_atomic_and_write_json_use_unpredictable_temp_names(tmp_path: Path, monkeypatch) -> None:
    import os

    victim = _victim(tmp_path)
    pid = os.getpid()
    (tmp_path / f".model.pt.tmp-{pid}").symlink_to(victim)  # the old predictable names
    (tmp_path / f".status.json.{os.uname().nodename}.{pid}.tmp").symlink_to(victim)
    checkpoint.save_atomic({"w": 1}, tmp_path / "model.pt")
    write_json(tmp_path / "status.json", {"status": "running"})
    assert victim.read_text() == "precious\n"
    assert checkpoint.load(tmp_path / "model.pt") == {"w": 1}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def test_write_synced_refuses_a_symlink(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "meta.json").symlink_to(victim)
    with pytest.raises(OSError):
        ckpt_files._write_synced(tmp_path / "meta.json", b"{}")
    assert victim.read_text() == "precious\n"


def test_appends_refuse_a_planted_symlink(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        open_append(tmp_path / "metrics.jsonl")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").symlink_to(victim)
    try:
        with pytest.raises(OSError):
            setup_logging(logs, 0, to_console=False)
    finally:
        teardown_logging()
    assert victim.read_text() == "precious\n"
    setup_logging(logs, 1, to_console=False)  # a plain file: appended as before
    logging.getLogger("disttrain").info("hello")
    teardown_logging()
    assert "hello" in (logs / "rank1.log").read_text()


def test_write_atomic_leaves_no_temp_file_on_error(tmp_path: Path) -> None:
    def boom(f: object) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "x.bin", boom)
    assert list(tmp_path.iterdir()) == []


def test_truncated_metrics_are_never_written_through_the_old_temp_name(tmp_path: Path) -> None:
    from disttrain.observe.metrics import truncate_metrics

    victim = _victim(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / ".metrics.jsonl.tmp").symlink_to(victim)  # the old predictable temp name
    truncate_metrics(metrics, 1)
    assert victim.read_text() == "precious\n"
    assert metrics.read_text() == '{"step": 1}\n' and not metrics.is_symlink()


def test_safetensors_export_never_writes_through_the_old_temp_name(tmp_path: Path) -> None:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from disttrain.rng import rng_state

    victim = _victim(tmp_path)
    model = nn.Linear(4, 2)
    meta = {"step": 1, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    ckpts = tmp_path / "checkpoints"
    state = {"model": get_state_dict(model, [])[0]}
    checkpoint.save(ckpts, 1, state, rng_state(), meta, rank=0, keep=1, verify="size")
    out = tmp_path / "model.safetensors"
    (tmp_path / ".model.safetensors.tmp").symlink_to(victim)
    checkpoint.export_model(ckpts, out, nn.Linear(4, 2))
    assert victim.read_text() == "precious\n"
    assert out.is_file() and not out.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [".model.safetensors.tmp"]


def test_csv_sink_never_reads_or_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    from disttrain.observe.sinks import CSV, SinkContext

    victim = _victim(tmp_path)
    (tmp_path / "metrics.csv").symlink_to(victim)
    with pytest.raises(OSError):
        CSV().open(SinkContext(tmp_path, "x", {}))  # appending would have followed it
    with pytest.raises(OSError):  # a resume would have copied the target's lines into the run dir
        CSV().open(SinkContext(tmp_path, "x", {}, resume={"resumable": True}, resume_step=0))
    assert victim.read_text() == "precious\n"


def test_job_script_replaces_a_planted_symlink_and_keeps_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`disttrain resume` re-submits into the same run dir: job.sbatch may be a planted link."""
    import os

    from unit_support import checked_run

    from disttrain.launch import slurm

    victim = _victim(tmp_path)
    os.chmod(victim, 0o600)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / slurm.SCRIPT).symlink_to(victim)
    monkeypatch.setattr(slurm, "sbatch_script", lambda *a: "#!/bin/bash\necho hi\n")
    run = checked_run(["launcher=slurm", "launcher.dry_run=true"])
    slurm.submit(run, run_dir, ["python", "-m", "disttrain.worker"])
    assert victim.read_text() == "precious\n" and (victim.stat().st_mode & 0o777) == 0o600
    script = run_dir / slurm.SCRIPT
    assert not script.is_symlink() and (script.stat().st_mode & 0o777) == 0o755


def test_an_interrupted_run_leaves_no_unfinished_write_in_its_run_dir(tmp_path: Path) -> None:
    """The clean-clone CI at load 20: a Ctrl-C while the ranks started ended rank 0 inside its
    env.json write (SIGINT's default action until the stop flag is up: no cleanup runs), and
    `.env.json.RANDOM.tmp` stayed in the run dir. The launcher removes such leftovers once the ranks
    are gone, after a failed or interrupted run; a planted link is removed, never followed."""
    from disttrain.rundir import read_status, run_status
    from disttrain.safefile import write_atomic

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".env.json.8jro01cl.tmp").write_text("{")  # what the killed rank left
    (run_dir / ".status.json.planted.tmp").symlink_to(target)
    (run_dir / ".tmp-step_00000004").mkdir()  # a checkpoint's: resume's business, not this
    (run_dir / "notes.tmp").write_text("the user's")
    with pytest.raises(KeyboardInterrupt), run_status(run_dir):
        write_atomic(run_dir / "config.yaml", b"x: 1\n")
        raise KeyboardInterrupt
    assert read_status(run_dir)["status"] == "interrupted"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".tmp-step_00000004",
        "config.yaml",
        "notes.tmp",
        "status.json",
    ]
    assert target.read_text() == "keep"
