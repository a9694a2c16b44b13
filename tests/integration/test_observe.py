"""Issue 14: progress in any log, metric sinks (MLflow, W&B, CSV) with tracker resume, rerun, plots."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROGRESS = re.compile(r"step (\d+)/(\d+) loss [\d.e+-]+ lr [\d.e+-]+ [\d,]+ samples/s")


def test_progress_lines_go_to_stderr_and_rank0_log_stdout_is_the_result(
    baseline: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """No TTY: one plain progress line per log_every on stderr and in rank0.log; stdout: `done:` only.
    (The session's baseline: 6 steps, log_every=1; the line comes with each logged metrics record.)"""
    proc, run_dir = baseline
    steps = [int(m.group(1)) for m in PROGRESS.finditer(proc.stderr)]
    assert steps == [1, 2, 3, 4, 5, 6], proc.stderr
    assert all(m.group(2) == "6" for m in PROGRESS.finditer(proc.stderr))
    logged = [int(m.group(1)) for m in PROGRESS.finditer((run_dir / "logs" / "rank0.log").read_text())]
    assert logged == [1, 2, 3, 4, 5, 6]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("done: 6 steps"), proc.stdout


# ------------------------------------------------------------------------------------ trackers
# A sink after the tracker that SIGKILLs rank 0 at step 10 on the first attempt only (a marker file):
# the run dies between its step-8 checkpoint and the end, with steps 9 and 10 already in the tracker.
KILLER = """
import os, signal
from pathlib import Path


class KillOnce:
    def __init__(self, marker: str, at: int, sig: str = "SIGKILL") -> None:
        self.marker, self.at, self.sig = Path(marker), at, getattr(signal, sig)

    def open(self, ctx): pass
    def log_hparams(self, params): pass
    def state(self): return {}
    def close(self): pass

    def log(self, step, values):
        if step == self.at and "train/loss" in values and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), self.sig)
"""

TRACKED = (
    "launcher=spawn",
    "data=synthetic",
    "trainer.max_steps=12",
    "trainer.ckpt_every=4",
    "trainer.log_every=1",
)


def _sinks(*sinks: str | None) -> str:
    return f"observe.sinks=[{','.join(s for s in sinks if s)}]"


def _mlflow_sink(root: Path) -> str:
    return f"{{_target_:mlflow,tracking_uri:'{(root / 'mlruns').as_uri()}'}}"


WANDB_SINK = "{_target_:wandb,mode:offline,project:disttrain-test}"


@pytest.fixture(scope="module")
def trackers_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with an MLflow file store; the variables both trackers need (file store, quiet)."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        mp.setenv("WANDB_SILENT", "true")
        yield root


@pytest.fixture(scope="module")
def straight(trackers_root: Path) -> Path:
    """The uninterrupted run both tracker tests compare against: MLflow (sink 0) and W&B (sink 1)
    log the same history of one training (a sink only reads what the engine hands it)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    sinks = _sinks(_mlflow_sink(trackers_root), WANDB_SINK)
    _, run_dir = run_cli(trackers_root, *TRACKED, sinks, "hydra.run.dir=straight", timeout=240)
    assert run_dir is not None
    return run_dir


def _killed_and_resumed(root: Path, name: str, tracker: str, sig: str = "SIGKILL") -> Path:
    """A run stopped at step 10 by `sig` (SIGKILL: the checkpoint is step 8's; SIGTERM: the engine
    saves one as it stops), then `disttrain resume`d; its run dir."""
    from tests.integration.conftest import CLI, FAST, cli_in_process, run_command, write_module

    write_module(root, "killsink", KILLER)
    marker = root / f"{name}.marker"
    killer = f"{{_target_:killsink.KillOnce,marker:'{marker}',at:10,sig:{sig}}}"
    cmd = [CLI, "train", *FAST, *TRACKED, _sinks(tracker, killer), f"hydra.run.dir={name}"]
    stopped = run_command(cmd, root)
    killed = root / name
    assert stopped.returncode != 0 and marker.exists(), stopped.stderr[-3000:]
    resumed = cli_in_process("resume", str(killed), cwd=root)  # its ranks fork from this worker's server
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return killed


def _mlflow_history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def test_mlflow_run_killed_and_resumed_has_the_uninterrupted_history(
    trackers_root: Path, straight: Path
) -> None:
    import json

    uri = (trackers_root / "mlruns").as_uri()
    killed = _killed_and_resumed(trackers_root, "killed_mlflow", _mlflow_sink(trackers_root))
    ids = {d: json.loads((d / "trackers.json").read_text())["0:MLflow"]["run_id"] for d in (straight, killed)}
    meta = json.loads((killed / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["trackers"]["0:MLflow"]["run_id"] == ids[killed], "the run id is saved with the checkpoint"
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(tracking_uri=uri).search_runs(
        [e.experiment_id for e in MlflowClient(tracking_uri=uri).search_experiments()]
    )
    assert sorted(r.info.run_id for r in runs) == sorted(ids.values()), "the resume made no second run"
    a, b = _mlflow_history(uri, ids[straight]), _mlflow_history(uri, ids[killed])
    timing = {"samples_per_s", "step_time_s", "data_wait_frac", "tokens_per_s", "tflops", "mfu"}
    assert a.keys() == b.keys() and "train/loss" in a
    for key in a.keys() - timing:
        assert a[key] == b[key], key
    assert [s for s, _ in b["train/loss"]] == list(range(1, 13)), "steps 9 and 10 replaced, not duplicated"
    assert MlflowClient(tracking_uri=uri).get_run(ids[killed]).info.status == "FINISHED"


# ------------------------------------------------------------------------------------ rerun
def test_rerun_of_a_finished_two_rank_run_is_bitwise_equal(baseline: tuple[object, Path]) -> None:
    """`disttrain rerun RUN --run-dir NEW` from the frozen config: the same losses and weights, bit for
    bit; `show` prints the rerun with the run's git SHA; an unknown SHA is warned about."""
    import json

    import torch

    from tests.integration.conftest import cli_in_process, final_weights, train_losses

    _, run_dir = baseline
    cwd = Path(json.loads((run_dir / "git.json").read_text())["repo"])  # the baseline's git repo
    new = cwd / "rerun_of_baseline"
    proc = cli_in_process("rerun", str(run_dir), "--run-dir", str(new), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # same SHA, clean tree: no warning; the launch's warm-up warning (6 steps under cosine's 20
    # warm-up steps) is not repeated by the rerun of that frozen config
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == [], proc.stderr[-3000:]
    assert proc.stdout.startswith("done: ") and str(new) in proc.stdout
    assert train_losses(new) == train_losses(run_dir)
    a, b = final_weights(run_dir), final_weights(new)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (new / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()

    shown = json.loads(cli_in_process("show", str(run_dir), "--json", cwd=cwd).stdout)  # no rank: here
    sha = json.loads((run_dir / "git.json").read_text())["sha"]
    assert shown["rerun"].endswith(f"git checkout {sha} && disttrain rerun {run_dir.resolve()}")

    elsewhere = cli_in_process("rerun", str(run_dir), "--run-dir", str(cwd / "x"), "nonsense.key=1", cwd=cwd)
    assert elsewhere.returncode == 2 and "Traceback" not in elsewhere.stderr  # bad input: nothing runs
    assert not (cwd / "x").exists()


# ------------------------------------------------------------------------------------ sweeper plugins
def test_optuna_sweep_over_an_interval_runs_both_trials(tmp_path: Path) -> None:
    """`-m hydra/sweeper=optuna optim.lr=interval(...)`: the pre-launch check takes the base job, the
    plugin picks the values, both trials train end to end and Optuna gets val/loss as the objective.
    (One rank per trial: nothing here is collective; test_multirun sweeps 2-rank jobs.)"""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import yaml

    from tests.integration.conftest import FAST, cli_in_process, find_run_dirs

    cmd = [
        "train", "-m", *FAST, "launcher=spawn", "nproc_per_node=1", "data=synthetic", "trainer.max_steps=3",
        "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
        "optim.lr=interval(1e-4,1e-2)",
    ]  # fmt: skip
    proc = cli_in_process(*cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = find_run_dirs(tmp_path)
    assert len(runs) == 2 and all((r / "summary.json").is_file() for r in runs)
    lrs = [yaml.safe_load((r / "config.yaml").read_text())["optim"]["lr"] for r in runs]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and lrs[0] != lrs[1]
    assert [ln for ln in proc.stdout.splitlines() if ln.strip()] == [
        ln for ln in proc.stdout.splitlines() if ln.startswith("done: ")
    ], "stdout: the result lines only"
    assert "Best value" in proc.stderr
    assert "\x1b[" not in proc.stderr, "no colour codes where stderr is a file (optuna's colorlog)"
    assert "setup plugin" not in proc.stderr, "alembic's import lines are not the sweep's"
    optimized = yaml.safe_load(next(tmp_path.rglob("optimization_results.yaml")).read_text())
    assert "optim.lr" in optimized["best_params"]


def _wandb_history(offline_run: Path) -> dict[int, dict[str, float]]:
    """step -> logged values, read from an offline run's .wandb file (LevelDB-log framed protobufs)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = next(offline_run.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out, block = 7, b"", {}, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item
                }
                out[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def test_wandb_offline_run_stopped_and_resumed_continues_the_same_run(
    trackers_root: Path, straight: Path
) -> None:
    """W&B offline (no network): a run stopped by SIGTERM (a requeue) and resumed reopens the
    checkpoint's run id and logs on from the step after the checkpoint; both attempts together (what
    `wandb sync` uploads as one run) equal an uninterrupted run's history. (SIGKILL loses what W&B's
    writer had not flushed; the MLflow test covers the replacement of steps after the checkpoint.)"""
    import json

    killed = _killed_and_resumed(trackers_root, "killed_wandb", WANDB_SINK, sig="SIGTERM")
    run_id = json.loads((killed / "trackers.json").read_text())["0:WandB"]["run_id"]
    latest = (killed / "checkpoints" / "latest").read_text().strip()
    step_dirs = sorted((killed / "checkpoints").glob("step_*"))
    meta = json.loads((step_dirs[-2] / "meta.json").read_text())  # the signal checkpoint (before final)
    assert latest == step_dirs[-1].name and meta["reason"] == "signal", [d.name for d in step_dirs]
    assert meta["trackers"]["0:WandB"]["run_id"] == run_id
    attempts = sorted((killed / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(a.name.endswith(f"-{run_id}") for a in attempts), attempts
    first, second = (_wandb_history(a) for a in attempts)
    assert max(first) == meta["step"] and min(second) == meta["step"] + 1
    merged = {**{s: v for s, v in first.items() if s <= meta["step"]}, **second}
    (only,) = (straight / "wandb").glob("offline-run-*")
    uninterrupted = _wandb_history(only)
    assert sorted(merged) == sorted(uninterrupted)
    timing = {"samples_per_s", "step_time_s", "data_wait_frac", "tokens_per_s", "tflops", "mfu"}
    for step, values in uninterrupted.items():
        assert {k: v for k, v in merged[step].items() if k not in timing} == {
            k: v for k, v in values.items() if k not in timing
        }, step
