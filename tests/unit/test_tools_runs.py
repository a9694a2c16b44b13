"""The run browser on run dirs written by hand: statuses, best values, diffs, reproduce command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disttrain.config import compose, resolve
from disttrain.rundir import run_status
from disttrain.tools.runs import (
    best_val,
    checkpoints,
    compare,
    config_diff,
    find_runs,
    flatten,
    reproduce,
    run_info,
    show,
)


def _run(root: Path, name: str, status: dict | None, metrics: list[dict], **cfg_over) -> Path:
    d = root / "runs" / name / "2026-01-01_00-00-00"
    (d / ".hydra").mkdir(parents=True)
    cfg = resolve(compose([]))
    cfg.update(cfg_over)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / ".hydra" / "config.yaml").write_text("not a run dir")
    (d / "overrides.yaml").write_text(yaml.safe_dump(["optim.lr=0.1", "name=x y"]))
    (d / "command.txt").write_text("disttrain train --config-dir ./cfgs optim.lr=0.1 'name=x y'\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 9, "trunc')
    if status is not None:
        (d / "status.json").write_text(json.dumps(status))
    return d


METRICS = [
    {"step": 1, "train/loss": 2.0},
    {"step": 2, "val/loss": 1.5, "val/acc": 0.5},
    {"step": 3, "train/loss": 1.0},
    {"step": 4, "val/loss": 1.2, "val/acc": 0.7},
    {"step": 5, "val/loss": 1.3, "val/acc": 0.6},
]


def test_statuses_including_a_dead_launcher(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dirs = {
        "fin": _run(tmp_path, "fin", {"status": "finished", "started": 1.0, "ended": 3.5}, METRICS),
        "bad": _run(tmp_path, "bad", {"status": "failed", "error": "RuntimeError: boom", "started": 2.0}, []),
        "int": _run(tmp_path, "int", {"status": "interrupted", "started": 3.0}, METRICS[:1]),
        "run": _run(
            tmp_path, "run", {"status": "running", "host": host, "pid": dead.pid, "started": 4.0}, []
        ),
        "old": _run(tmp_path, "old", None, []),
    }
    assert find_runs(tmp_path / "runs") == sorted(dirs.values())
    info = {k: run_info(d) for k, d in dirs.items()}
    assert info["fin"]["status"] == "finished" and info["fin"]["duration_s"] == 2.5
    assert info["fin"]["step"] == 5 and info["fin"]["last_loss"] == 1.0  # the cut last line is skipped
    assert info["fin"]["best_val"] == {"metric": "val/acc", "value": 0.7, "step": 4}
    assert info["bad"]["status"] == "failed" and info["bad"]["error"] == "RuntimeError: boom"
    assert info["int"]["status"] == "interrupted"
    assert info["run"]["status"] == "interrupted" and "is gone" in info["run"]["note"]
    assert info["old"]["status"] == "unknown"


def test_run_status_marker(tmp_path: Path) -> None:
    with run_status(tmp_path):
        assert json.loads((tmp_path / "status.json").read_text())["status"] == "running"
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "finished"
    with pytest.raises(ValueError), run_status(tmp_path):
        raise ValueError("bad thing")
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["status"] == "failed" and st["error"] == "bad thing" and st["ended"] >= st["started"]
    with pytest.raises(KeyboardInterrupt), run_status(tmp_path):
        raise KeyboardInterrupt
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "interrupted"

    class Stopped(RuntimeError):  # a LaunchError whose ranks exited on SIGTERM (128 + 15)
        exit_code = 143

    with pytest.raises(Stopped), run_status(tmp_path):
        raise Stopped("stopped by SIGTERM")
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "interrupted"


def test_best_val_prefers_a_metric_over_loss() -> None:
    assert best_val([{"step": 1, "val/loss": 2.0}, {"step": 2, "val/loss": 1.0}]) == {
        "metric": "val/loss",
        "value": 1.0,
        "step": 2,
    }
    assert best_val([{"step": 1, "train/loss": 1.0}]) is None


def test_diffs_show_and_compare(tmp_path: Path) -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}
    assert config_diff({"a": {"b": 1}}, {"a": {"b": 2, "c": 3}}) == [
        {"key": "a.b", "a": 1, "b": 2},
        {"key": "a.c", "a": "<absent>", "b": 3},
    ]
    a = _run(tmp_path, "a", {"status": "finished"}, METRICS, seed=5)
    b = _run(tmp_path, "b", {"status": "finished"}, METRICS[:3], seed=6)
    (a / "summary.json").write_text(json.dumps({"steps": 5, "val/acc": 0.6, "first_step_at": 1e9}))
    (a / "checkpoints").mkdir()
    (a / "checkpoints" / "final.pt").write_bytes(b"x" * 10)
    data = show(a)
    assert {"key": "seed", "default": 0, "run": 5} in data["config_diff_vs_defaults"]
    assert data["final_metrics"] == {"steps": 5, "val/acc": 0.6}
    assert data["checkpoints"][0]["bytes"] == 10
    assert data["reproduce"] == "disttrain train --config-dir ./cfgs optim.lr=0.1 'name=x y'"
    assert reproduce(b) == data["reproduce"]
    cmp = compare(a, b)
    assert cmp["config_diff"] == [{"key": "seed", "values": [5, 6], "a": 5, "b": 6}]
    steps = next(m for m in cmp["metrics"] if m["metric"] == "step")  # b has no summary: last logged values
    assert steps == {"metric": "step", "values": [None, 3], "a": None, "b": 3, "delta": None}
    assert next(m for m in cmp["metrics"] if m["metric"] == "val/acc")["delta"] == pytest.approx(0.5 - 0.6)


def _small_run(root: Path, path: str, seed: int, overrides: list[str], loss: float) -> Path:
    d = root / path
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"name": "digits", "seed": seed, "optim": {"lr": 0.1}}))
    (d / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / "status.json").write_text(json.dumps({"status": "finished", "started": 1.0, "ended": 75.0}))
    (d / "summary.json").write_text(json.dumps({"steps": 4, "val/loss": loss}))
    return d


def test_compare_takes_n_runs_each_labelled_by_name_and_the_overrides_that_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 2026-11-28-ux #9: `compare A B C` was refused (two runs only) and runs were told
    apart by timestamps; `runs` had no overrides column."""
    from disttrain.cli import main

    common = ["trainer.max_steps=4", "name=digits"]
    runs = [
        _small_run(tmp_path, "runs/digits/t1", 0, [*common, "seed=0"], 0.5),
        _small_run(tmp_path, "runs/digits/t2", 1, [*common, "seed=1"], 0.4),
        _small_run(tmp_path, "runs/digits/t3", 1, [*common, "seed=1"], 0.3),  # the same command again
    ]
    cmp = compare(*runs)
    assert cmp["labels"] == ["digits · seed=0", "digits · seed=1 · t2", "digits · seed=1 · t3"]
    assert cmp["config_diff"] == [{"key": "seed", "values": [0, 1, 1]}], "only the keys that differ"
    assert {"metric": "val/loss", "values": [0.5, 0.4, 0.3]} in cmp["metrics"]
    assert [r["overrides"] for r in cmp["runs"]] == [[*common, f"seed={s}"] for s in (0, 1, 1)]
    assert main(["compare", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    assert "A: digits · seed=0  " in out and "C: digits · seed=1 · t3  " in out
    assert any(
        line.split() == ["│", "val/loss", "│", "0.5", "│", "0.4", "│", "0.3", "│"]
        for line in out.splitlines()
    )
    assert main(["compare", str(runs[0])]) == 2, "one run: use show"
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert [r["overrides"] for r in rows] == [r["overrides"] for r in cmp["runs"]]
    assert main(["runs", str(tmp_path / "runs")]) == 0
    listing = capsys.readouterr().out
    assert "overrides" in listing and "1 min 14 s" in listing


def test_show_sums_the_files_of_a_checkpoint_folder(tmp_path: Path) -> None:
    """Review 2026-11-28-ux #17: a DCP checkpoint folder was listed at its inode size (4.00 KiB)."""
    run = _small_run(tmp_path, "r", 0, [], 0.5)
    step = run / "checkpoints" / "step_00000020"
    (step / "nested").mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 300_000)
    (step / "nested" / ".metadata").write_bytes(b"y" * 1_000)
    (step / "link").symlink_to("/dev/zero")  # a link is not followed (nor counted)
    (run / "checkpoints" / "final.pt").write_bytes(b"z" * 10)
    sizes = {Path(c["path"]).name: c["bytes"] for c in checkpoints(run)}
    assert sizes == {"step_00000020": 301_000, "final.pt": 10}


def _write_status_many_times(path: str) -> int:
    from disttrain.rundir import write_json

    for i in range(300):
        write_json(Path(path), {"i": i, "pid": os.getpid()})
    return os.getpid()


def test_nodes_sharing_a_run_dir_never_rename_each_others_temp_files(tmp_path: Path) -> None:
    """Every node of a multi-node run writes status.json/config.yaml into one shared run dir."""
    import multiprocessing

    target = tmp_path / "status.json"
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pids = pool.map(_write_status_many_times, [str(target)] * 2)  # raises if a rename lost its file
    assert json.loads(target.read_text())["pid"] in pids
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"], "no temp file left behind"


def test_runs_of_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    """`disttrain runs /nonexistent` said "0 runs" and exited 0: a typo looked like an empty list."""
    from unit_support import disttrain

    proc = disttrain("runs", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"disttrain: config error: DIR={tmp_path / 'nope'} is not valid")


def test_show_flags_a_rank_at_least_1_3x_slower_than_the_median(tmp_path: Path) -> None:
    """Issue 26 #4: summary.json's per-rank step-time p50/p95; `show` names the straggler."""
    from disttrain.tools.runs import stragglers

    d = _run(tmp_path, "s", {"status": "finished"}, METRICS)
    summary = {
        "steps": 5,
        "step_time_p50_s_by_rank": [0.1, 0.1, 0.2, 0.129],
        "step_time_p95_s_by_rank": [1, 1, 0.5, 1],
    }
    (d / "summary.json").write_text(json.dumps(summary))
    assert show(d)["stragglers"] == [
        "straggler: rank 2 step time p50 0.2 s = 1.75x the median 0.115 s (p95 0.5 s)"
    ]
    assert stragglers({"step_time_p50_s_by_rank": [0.1, 0.1, 0.1299]}) == []  # under 1.3x
    assert stragglers({"step_time_p50_s_by_rank": "crafted"}) == []
    assert stragglers({"step_time_p50_s_by_rank": [0.1, 0.3]}) == [
        "straggler: rank 1 step time p50 0.3 s = 1.50x the median 0.2 s"
    ]


def test_show_names_a_url_checkpoint_dir_and_never_reads_it_as_a_local_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.dir = s3://b/run was read as `<cwd>/s3:/b/run`: a local folder of that name was listed."""
    from disttrain.tools.rundata import RunFiles

    run = _small_run(tmp_path, "r", 0, [], 0.5)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "checkpoint": {"dir": "s3://b/run"}}))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "b" / "run" / "step_00000001").mkdir(parents=True)
    files = RunFiles(run)
    assert checkpoints(run, files) == []
    assert any("s3://b/run" in p and "object store" in p for p in files.problems)
