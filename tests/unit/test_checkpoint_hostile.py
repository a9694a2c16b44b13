"""Checkpoints, disks and signals that misbehave (review 2026-11-25-reliability D5, D12-D18).

Each test reproduces the review's case in one process: a manifest naming files outside its folder
(D13), a deflate bomb in a record torch.load would inflate (D12), a stale `.tmp-` entry that cannot
be removed (D17), owner-only files (D18), a full disk (D16), an unwritable checkpoint.dir found
only at the first save (D15), the start-up SIGTERM window (D14), the MLflow rewind (D5).
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.checkpoint import fallback as ckpt_fallback
from disttrain.checkpoint import files as ckpt_files
from disttrain.checkpoint import layout as ckpt_layout
from disttrain.checkpoint import reading as ckpt_reading
from disttrain.checkpoint.manager import DiskFull, named_disk_full
from disttrain.checkpoint.reading import CorruptCheckpoint
from disttrain.rng import rng_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(ckpt_dir: Path, step: int) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    msd, osd = get_state_dict(model, opt)
    meta = {"step": step, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    checkpoint.save(
        ckpt_dir, step, {"model": msd, "optim": osd}, rng_state(), meta, rank=0, keep=3, verify="hash"
    )
    return ckpt_dir / ckpt_layout.step_name(step)


# --------------------------------------------------------------------------------------- D13
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    """Before: an entry `../outside.bin` whose size and hash match made the loader read a file of
    the loader's choosing (the review's `../../proc/kmsg` blocked export forever)."""
    path = _save(tmp_path / "ck", 10)
    outside = tmp_path / "ck" / "outside.bin"
    outside.write_bytes(b"x" * 64)
    manifest = json.loads((path / ckpt_layout.MANIFEST).read_text())
    manifest["files"]["../outside.bin"] = ckpt_reading.file_digest(outside, "xxh3_64")
    (path / ckpt_layout.MANIFEST).write_text(json.dumps(manifest))
    why = ckpt_fallback.problem(path)
    assert why is not None and "outside the checkpoint folder" in why
    assert ckpt_fallback.choose(tmp_path / "ck") is None


def test_a_planted_link_inside_a_checkpoint_is_not_read(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", 10)
    rng = path / "rng_rank0.pt"
    (tmp_path / "elsewhere.pt").write_bytes(rng.read_bytes())
    rng.unlink()
    rng.symlink_to(tmp_path / "elsewhere.pt")
    assert "is not a regular file" in (ckpt_fallback.problem(path) or "")


# --------------------------------------------------------------------------------------- D12
def _bomb(n: int) -> bytes:
    """torch.save of n zero bytes, its data record deflated (as the review's bomb.py)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(n, dtype=torch.uint8), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            deflate = info.filename.endswith("/data/0")
            dst.writestr(
                info, src.read(info), compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            )
    return out.getvalue()


def test_a_deflate_bomb_is_refused_before_torch_load(tmp_path: Path) -> None:
    n = 20_000_000
    bomb = tmp_path / "rng_rank0.pt"
    bomb.write_bytes(_bomb(n))
    assert bomb.stat().st_size < n // 500  # ~1,000x amplification
    assert torch.load(bomb, weights_only=True).numel() == n  # torch.load inflates it in full
    with pytest.raises(CorruptCheckpoint, match="is compressed"):
        ckpt_files.load(bomb)
    ok = tmp_path / "ok.pt"
    torch.save({"a": torch.arange(5)}, ok)
    assert torch.equal(ckpt_files.load(ok)["a"], torch.arange(5))  # torch.save's own files still load


# --------------------------------------------------------------------------------------- D17
def test_a_stale_tmp_entry_that_is_a_link_never_stops_the_save(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save(ck, 10)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (ck / ".tmp-step_00000020").symlink_to(elsewhere)
    _save(ck, 20)  # before: FileExistsError, the run died after training to step 20
    assert (ck / "step_00000020").is_dir() and (elsewhere / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------- D18
@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_files_written_atomically_keep_the_users_umask(tmp_path: Path, umask_022: None) -> None:
    from disttrain.safefile import write_atomic

    write_atomic(tmp_path / "config.yaml", b"a: 1\n")
    ckpt_files.save_atomic({"x": torch.ones(1)}, tmp_path / "final.pt")
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == 0o644  # before: 0600
    assert (tmp_path / "final.pt").stat().st_mode & 0o777 == 0o644
    os.umask(0o077)
    write_atomic(tmp_path / "private.yaml", b"a: 1\n")
    assert (tmp_path / "private.yaml").stat().st_mode & 0o777 == 0o600


# --------------------------------------------------------------------------------------- D16
def test_a_full_disk_is_named_with_the_space_free_and_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    _save(tmp_path, 10)
    need = sum(f.stat().st_size for f in (tmp_path / "step_00000010").iterdir())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=need // 3))
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with pytest.raises(DiskFull) as err, named_disk_full(tmp_path):
        raise short_write
    assert err.value.errno == errno.ENOSPC and "is full" in str(err.value) and "KB" in str(err.value)
    with pytest.raises(DiskFull), named_disk_full(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ValueError, match="unrelated"), named_disk_full(tmp_path):
        raise ValueError("unrelated")  # anything else passes through as it was


# --------------------------------------------------------------------------------------- D15
def test_an_unusable_checkpoint_dir_is_found_before_launch(tmp_path: Path) -> None:
    from unit_support import checked_run

    from disttrain.commands.train import own_checkpoint_dir
    from disttrain.config.errors import ConfigError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = checked_run(["data=synthetic", f"checkpoint.dir={blocker / 'ck'}"])
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.* is not valid"):
        own_checkpoint_dir(cfg, tmp_path / "run")


# --------------------------------------------------------------------------------------- D14
def test_the_stop_group_exists_before_the_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank signalled before its handlers exist dies at once; a peer then blocked in new_group
    (C++, where no Python handler runs) waited until stop_grace_s ended in SIGKILL (121 s). Made
    first, the group is never waited for under a Python handler: a SIGTERM there kills at once."""
    import torch.distributed as dist

    from disttrain.engine import signals

    seen: list[object] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda **kw: seen.append(signal.getsignal(signal.SIGTERM)))
    monkeypatch.setattr("disttrain.dist.default_store", lambda: dist.HashStore())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = signal.getsignal(signal.SIGTERM)
    with signals.StopFlag() as flag:
        assert signal.getsignal(signal.SIGTERM) == flag._handle
    assert seen == [before]


def test_a_start_up_stop_does_not_blame_on_signal(tmp_path: Path) -> None:
    from disttrain.launch.errors import stopped_message

    (tmp_path / "config.yaml").write_text("checkpoint: {on_signal: true}\n")
    text = stopped_message("SIGTERM", tmp_path, 0.0)
    assert "before the first step" in text and "on_signal=true saves one" not in text
    (tmp_path / "config.yaml").write_text("checkpoint: {on_signal: false}\n")
    assert "checkpoint.on_signal=true saves one" in stopped_message("SIGTERM", tmp_path, 0.0)


# --------------------------------------------------------------------------------------- D5
def test_mlflow_rewind_leaves_a_readable_run(tmp_path: Path) -> None:
    """Before: metrics logged only after the resume step were rewritten as 0-byte files, and
    MLflow's file store refused the run for good ("Metric 'val/acc' is malformed")."""
    pytest.importorskip("mlflow")
    from disttrain.observe.sinks import MLflow, SinkContext

    uri = (tmp_path / "mlruns").as_uri()
    sink = MLflow(tracking_uri=uri)
    sink.open(SinkContext(tmp_path / "run", "x", {}))
    for step in range(1, 31):
        sink.log(step, {"train/loss": 1.0 / step, **({"val/acc": 0.5} if step == 25 else {})})
    state = sink.state()
    again = MLflow(tracking_uri=uri)
    again.open(SinkContext(tmp_path / "run", "x", {}, resume=state, resume_step=20))
    run = again._client.get_run(state["run_id"])
    assert "val/acc" not in run.data.metrics and run.data.metrics["train/loss"] == pytest.approx(1 / 20)
    history = again._client.get_metric_history(state["run_id"], "train/loss")
    assert max(m.step for m in history) == 20


def test_a_checkpoint_from_another_run_opens_new_tracker_runs(tmp_path: Path) -> None:
    from disttrain.observe.metrics import tracker_resume

    theirs = {"0:MLflow": {"run_id": "theirs"}}
    meta = {"step": 10, "trackers": theirs}
    assert tracker_resume(tmp_path, meta) == (None, 10)  # a new run dir: its own tracker runs
    (tmp_path / "trackers.json").write_text(json.dumps(theirs))
    assert tracker_resume(tmp_path, meta) == (theirs, 10)  # this run dir's own: continue them
