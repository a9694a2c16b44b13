"""The tools on real runs: 2 gloo ranks through the real CLI (bounded by timeouts, no orphans)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from disttrain.tools.collectives import OPS

from .conftest import (
    CLI,
    FAST,
    QUICK,
    clean_env,
    cli_in_process,
    run_cli,
    run_disttrain,
)
from .terminal import Terminal

pytestmark = pytest.mark.slow

BENCH = (CLI, "bench", "comm", "--json", "--iters", "3", "--warmup", "1", "nproc_per_node=2", "backend=gloo")


def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.stdout.strip(), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_bench_comm_every_collective_correct_on_two_ranks(tmp_path: Path) -> None:
    proc = run_disttrain([*BENCH, "--max-bytes", "64K", "threads_per_rank=1"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _json(proc)
    assert (
        report["schema"] == "disttrain.bench.comm/1" and report["world_size"] == 2 and report["errors"] == []
    )
    assert {r["op"] for r in report["results"]} == set(OPS)  # by default, every collective the bench knows
    for r in report["results"]:
        assert r["status"] == "ok" and r["correct"] is True, r
        assert r["time_us"] > 0 and r["iters"] == 3
        if r["op"] == "barrier":
            assert r["busbw_gbps"] is None
            continue
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        factor = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0}.get(r["op"], 0.5)
        assert r["busbw_gbps"] == pytest.approx(
            r["algbw_gbps"] * factor
        )  # n = 2: 2(n-1)/n = 1, (n-1)/n = 1/2
    assert sorted({r["bytes"] for r in report["results"] if r["op"] == "all_reduce"}) == [
        8,
        32,
        128,
        512,
        2048,
        8192,
        32768,
        65536,
    ]


def test_bench_comm_names_a_wrong_result_and_a_timeout(tmp_path: Path) -> None:
    wrong = clean_env(DISTTRAIN_COMMBENCH_FAULT="wrong:all_gather:1")
    cmd = [
        *BENCH,
        "--ops",
        "all_reduce,all_gather",
        "--max-bytes",
        "32",
        "launcher=spawn",
        "threads_per_rank=1",
    ]
    proc = run_disttrain(cmd, tmp_path, timeout=120, env=wrong)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = _json(proc)["errors"]
    assert {(e["op"], e["rank"]) for e in errors} == {("all_gather", 1)} and len(errors) == 2  # both sizes
    assert "all_gather of 8 B on rank 1: wrong result: 1 of 2 elements wrong" in proc.stderr

    hang = clean_env(DISTTRAIN_COMMBENCH_FAULT="hang:broadcast:1")
    cmd = [*BENCH, "--ops", "broadcast", "--max-bytes", "8", "--timeout", "3", "threads_per_rank=1"]
    proc = run_disttrain(cmd, tmp_path, timeout=120, env=hang)
    assert proc.returncode == 1
    assert "broadcast of 8 B failed on rank 0 of 2" in proc.stderr and "backend.timeout=3 s" in proc.stderr


def test_runs_show_compare_and_plan_on_finished_failed_interrupted_runs(
    tmp_path: Path, baseline: tuple[subprocess.CompletedProcess[str], Path]
) -> None:
    # The finished run: a copy of the session's baseline (QUICK, 2 ranks, ddp) among the others.
    done = tmp_path / "runs" / "default" / "done"
    shutil.copytree(baseline[1], done)
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "bad.py").write_text(
        "import os\n\nimport torch\n\nclass Bad(torch.nn.Linear):\n"
        "    def __init__(self, in_features: int, num_classes: int):\n"
        "        super().__init__(in_features, num_classes)\n\n"
        "    def forward(self, x):\n"
        "        if 'RANK' in os.environ:  # in a rank, not in the parent's pre-launch dry step\n"
        "            raise RuntimeError('boom in forward')\n"
        "        return super().forward(x)\n"
    )
    wired = ("model.in_features=${data.num_features}", "model.num_classes=${data.num_classes}")
    _, failed = run_cli(tmp_path, *QUICK, "model._target_=mylab.bad.Bad", *wired, expect_rc=1, timeout=120)
    interrupted = _interrupt_a_run(tmp_path)

    runs = _json(cli_in_process("runs", "runs", "--json", cwd=tmp_path))["runs"]
    status = {Path(r["run_dir"]): r for r in runs}
    assert status[done]["status"] == "finished" and status[done]["step"] == 6
    assert status[failed]["status"] == "failed" and "boom in forward" in status[failed]["error"]
    assert status[interrupted]["status"] == "interrupted"
    assert {r["strategy"] for r in runs} == {"ddp"} and {r["world_size"] for r in runs} == {2}

    shown = _json(cli_in_process("show", str(done), "--json", cwd=tmp_path))
    assert {"key": "trainer.max_steps", "default": -1, "run": 6} in shown["config_diff_vs_defaults"]
    assert shown["final_metrics"]["steps"] == 6 and shown["checkpoints"][0]["path"].endswith("final.pt")
    assert shown["reproduce"].startswith("disttrain train ") and "trainer.max_steps=6" in shown["reproduce"]
    cmp = _json(cli_in_process("compare", str(done), str(failed), "--json", cwd=tmp_path))
    assert {d["key"] for d in cmp["config_diff"]} >= {"model._target_"}
    assert any(m["metric"] == "steps" for m in cmp["metrics"])
    table = cli_in_process("runs", "runs", cwd=tmp_path, env=clean_env())  # COLUMNS=200: whole cells
    assert table.returncode == 0 and "interrupted" in table.stdout and "failed" in table.stdout

    # plan vs the measured state of the 2-rank ddp run: fp32 params + grads + AdamW's two moments
    # (4 + 4 + 8 B/param; grads count only if the engine has not freed them with set_to_none when it
    # measures), plus AdamW's one 4-byte `step` scalar per parameter tensor, which the plan leaves out.
    plan = _json(cli_in_process("plan", "--json", *QUICK, *FAST, cwd=tmp_path))  # no rank: in this process
    measured = json.loads((done / "summary.json").read_text())["state_bytes_per_rank"]
    ddp = next(r for r in plan["layouts"] if r["layout"] == "ddp")["bytes"]
    steps = 4 * plan["model"]["param_tensors"]
    assert measured - steps in (
        ddp["params"] + ddp["grads"] + ddp["optimizer"],
        ddp["params"] + ddp["optimizer"],
    )


FIRST_BYTE_S = 3.0  # loose: the first line leaves before Hydra or torch is imported (~0.1 s idle)


def _interrupt_a_run(tmp_path: Path) -> Path:
    """A long run on a pseudo-terminal (issue 37): the first byte on stderr at once, the start-up
    phases as one live line ending in `ranks up`, the bar moving between log steps (log_every is
    past the run's end); then Ctrl-C to the whole process group: exit 130, no traceback."""
    cmd = [CLI, "train", "threads_per_rank=1", *QUICK, "trainer.max_steps=100000", "name=long"]
    cmd += ["trainer.progress=true", "trainer.log_every=100000"]
    term = Terminal(cmd, tmp_path)
    try:
        moved = term.read(
            lambda text: len({n for n in re.findall(r" (\d+)/100000 ", text) if n != "0"}) >= 2, 120
        )
        assert moved, f"the bar did not move between log steps in 120 s:\n{term.text[-3000:]}"
        term.ctrl_c()
        left = term.leftovers()
    finally:
        term.close()
    proc, first_byte = term.proc, term.first_byte
    err = term.text
    assert left == [], f"processes {left} outlived the Ctrl-C\n{err[-2000:]}"
    assert first_byte is not None and first_byte < FIRST_BYTE_S, f"first byte after {first_byte} s"
    assert err.lstrip("\n").startswith("disttrain: compose"), err[:300]
    phases = next((line for line in err.splitlines() if line.endswith(" · ranks up")), "")
    assert re.fullmatch(
        r"disttrain: compose [\d.]+ s · checks [\d.]+ s · model on meta [\d.]+ s · dry step [\d.]+ s · "
        r"launch 2 ranks [\d.]+ s · ranks up",
        phases,
    ), err[:3000]
    # A frame from step 2 on: rates need two steps (a loaded machine may draw step 1 first).
    bar = next(
        line for line in err.splitlines() if (m := re.search(r" (\d+)/100000 ", line)) and int(m[1]) >= 2
    )
    assert "epoch 1/" in bar and " it/s " in bar and "samples/s" in bar and "eta" in bar, bar
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "interrupted by SIGINT" in err, err[-3000:]
    # Issue 26 #7: torch's elastic agent's account of the Ctrl-C ("Received 2 death signal, shutting
    # down workers", "Closing process N via signal SIGINT") goes to the launcher's log, not the console.
    assert "torch/distributed/elastic" not in err and "death signal" not in err, err[-2000:]
    (run_dir,) = (tmp_path / "runs" / "long").iterdir()
    launcher_log = (run_dir / "logs" / "launcher.log").read_text()
    assert "Received 2 death signal, shutting down workers" in launcher_log, launcher_log[-2000:]
    return run_dir
