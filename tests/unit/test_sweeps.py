"""Sweeps: the sweep record and its checks as data, the job-array script, Slurm's states, the status
table, `sweep.stop_on_failure` and `sweep status`/`sweep resume` of a local sweep, in this process.

The real Slurm runs of a sweep (one job array, a cancelled job resumed) are in
tests/integration/test_slurm.py; these tests need no scheduler (a fake squeue where one is asked).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from unit_support import checked_run, disttrain_in_process

from disttrain import sweepdir
from disttrain.config.errors import ConfigError
from disttrain.launch import slurm
from disttrain.testing import FAULT_MLP

# One rank in this process (world size 1: no child, no fork server): a job costs its steps only.
ONE = ("trainer.progress=false", "strategy=single", "nproc_per_node=1", "data=synthetic", *FAULT_MLP)
STEPS = ("trainer.max_steps=2", "trainer.log_every=1", "observe.sinks=[]")


def _record(tmp_path: Path, *folders: str) -> sweepdir.SweepRecord:
    jobs = [sweepdir.SweepJob(n, f, [f"optim.lr={n}", "seed=1"]) for n, f in enumerate(folders)]
    record = sweepdir.SweepRecord("slurm", 2, jobs, ["disttrain", "train", "-m"])
    for folder in folders:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    record.save(tmp_path)
    return record


def _edit(tmp_path: Path, **changes: object) -> None:
    data = json.loads((tmp_path / sweepdir.RECORD).read_text())
    data.update(changes)
    (tmp_path / sweepdir.RECORD).write_text(json.dumps(data))


def test_the_record_reads_back_as_written(tmp_path: Path) -> None:
    record = _record(tmp_path, "0", "lr_1")
    record.job(1).submitted.append("12_1")
    record.save(tmp_path)
    again = sweepdir.load(tmp_path)
    assert again == record and again.run_dir(tmp_path, again.job(1)) == (tmp_path / "lr_1").resolve()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"jobs": [{"num": 0, "folder": "../elsewhere", "overrides": [], "submitted": []}]}, "outside"),
        ({"jobs": [{"num": 0, "folder": "/etc", "overrides": [], "submitted": []}]}, "relative path"),
        (
            {"jobs": [{"num": 0, "folder": "0", "overrides": [], "submitted": ["1;rm -rf /"]}]},
            "plain strings",
        ),
        ({"jobs": [{"num": 3, "folder": "0", "overrides": [], "submitted": []}]}, "number 3"),
        ({"launcher": "slurm; touch x"}, "launcher name"),
        ({"max_parallel": -1}, "max_parallel"),
        ({"version": 2}, "version-1"),
    ],
)
def test_a_changed_record_is_one_paragraph_naming_what_is_wrong(
    tmp_path: Path, change: dict[str, object], problem: str
) -> None:
    """sweep.json is data read back from disk: every field checked, a folder never outside the sweep."""
    _record(tmp_path, "0")
    _edit(tmp_path, **change)
    with pytest.raises(ConfigError, match="SWEEP_DIR") as exc:
        sweepdir.load(tmp_path)
    assert problem in str(exc.value)


def test_a_folder_linked_out_of_the_sweep_is_refused(tmp_path: Path) -> None:
    _record(tmp_path / "sweep", "0")
    (tmp_path / "sweep" / "0").rmdir()
    (tmp_path / "sweep" / "0").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="outside the sweep folder"):
        sweepdir.load(tmp_path / "sweep")


def test_states_come_from_the_scheduler_then_the_run_dirs(tmp_path: Path) -> None:
    record = _record(tmp_path, "0", "1", "2", "3")
    for num, status in ((1, "interrupted"), (2, "finished")):
        (tmp_path / str(num) / "status.json").write_text(json.dumps({"status": status}))
    record.job(3).submitted.append("7_3")
    states = sweepdir.job_states(record, tmp_path, {2: ("failed", "TIMEOUT")})
    assert states == {
        0: ("pending", ""),  # a local sweep has not reached it
        1: ("cancelled", "status.json"),
        2: ("failed", "TIMEOUT"),  # the scheduler's word first
        3: ("unknown", ""),  # submitted, and nobody knows more
    }
    lines = sweepdir.table(record, states).splitlines()
    assert lines[0].split() == ["job", "state", "scheduler", "folder", "overrides"]
    assert lines[3].split() == ["2", "failed", "TIMEOUT", "2", "optim.lr=2"]  # seed=1: every job's
    assert lines[4].split() == ["3", "unknown", "7_3", "3", "optim.lr=3"]
    assert sweepdir.counts(states.values()) == "1 pending, 1 failed, 1 cancelled, 1 unknown"


def _array_jobs(tmp_path: Path, *overrides: str) -> list[tuple[int, object, Path]]:
    runs = [checked_run(["launcher=slurm", f"optim.lr={lr}", *overrides]) for lr in (0.1, 0.2, 0.3)]
    return [(num, run, tmp_path / f"my sweep/{num}") for num, run in enumerate(runs)]


def test_the_array_script_runs_job_n_in_its_folder_and_quotes_every_path(tmp_path: Path) -> None:
    jobs = _array_jobs(tmp_path, "launcher.time=10")
    sweep = tmp_path / "my sweep"
    script = slurm.sweep_script(jobs[1:], sweep, slurm.array_spec([1, 2], 2))  # type: ignore[arg-type]
    head = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --array=1-2%2" in head and "#SBATCH --time=10" in head
    assert f'#SBATCH --output="{sweep}/slurm/array-%A_%a.out"' in head
    assert f"  [2]='{sweep}/2'" in script and "[0]=" not in script  # only the jobs submitted now
    assert 'slurm_node "$RUN_DIR"' in script
    # the script as bash runs it, with srun and scontrol faked: task 2 trains in folder 2, logs there
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool, body in (("scontrol", "echo node0"), ("srun", 'echo "srun $*"')):
        (fake / tool).write_text(f"#!/bin/sh\n{body}\n")
        (fake / tool).chmod(0o755)
    path = tmp_path / "sweep.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node0"}
    env.update(SLURM_JOB_ID="8", SLURM_ARRAY_JOB_ID="5", SLURM_ARRAY_TASK_ID="2")
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    log = (sweep / "2" / "slurm" / "job-5_2.out").read_text()
    assert log.endswith(f"-m disttrain.launch.slurm_node {sweep}/2\n"), log
    env["SLURM_ARRAY_TASK_ID"] = "0"  # a task the script does not list runs nothing
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode != 0 and not (sweep / "0").exists()


def test_jobs_that_ask_for_different_allocations_cannot_share_one_array(tmp_path: Path) -> None:
    jobs = _array_jobs(tmp_path)
    runs = [run for _, run, _ in jobs]
    slurm.check_sweep(runs, [d for _, _, d in jobs])  # type: ignore[arg-type]
    runs[2] = checked_run(["launcher=slurm", "launcher.time=10"])
    with pytest.raises(ConfigError, match="job 2 asks for `#SBATCH --time=10`") as exc:
        slurm.check_sweep(runs, [d for _, _, d in jobs])  # type: ignore[arg-type]
    assert "separate sweeps" in exc.value.hint
    with pytest.raises(ConfigError, match="control characters"):
        slurm.check_sweep(runs[:1], [tmp_path / "a\nb"])  # type: ignore[arg-type]


def test_array_spec() -> None:
    assert slurm.array_spec([0, 1, 2, 3], 2) == "0-3%2"
    assert slurm.array_spec([3], 2) == "3%2"
    assert slurm.array_spec([1, 3], 0) == "1,3"


def test_slurm_states_from_squeue_and_a_cancelled_pending_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """squeue -r lists each task it holds; a pending task cancelled leaves no record: while squeue
    lists its array, the missing task counts as cancelled. sacct answers nothing here (no accounting)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "squeue").write_text(
        '#!/bin/sh\necho "$*" >> "$(dirname "$0")/argv"\nprintf "5_0|COMPLETED\\n5_1|RUNNING\\n9_0|TIMEOUT\\n"\n'
    )
    (fake / "sacct").write_text('#!/bin/sh\necho "Slurm accounting storage is disabled" >&2; exit 1\n')
    for tool in ("squeue", "sacct"):
        (fake / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    ids = {0: "5_0", 1: "5_1", 2: "5_2", 3: "9_0", 4: "11_4"}
    assert slurm.array_states(ids, 10.0) == {
        0: ("finished", "COMPLETED"),
        1: ("running", "RUNNING"),
        2: ("cancelled", "CANCELLED(pending)"),
        3: ("failed", "TIMEOUT"),
    }  # 11_4: squeue knows nothing of its array: left to the run dir
    assert (fake / "argv").read_text().split()[-1] == "11,5,9"


def test_a_local_sweep_keeps_going_and_ends_with_a_table(tmp_path: Path) -> None:
    """The default: job 0 fails, job 1 still trains; the table lists both; the exit status is the
    failed job's. `sweep status` shows the same, and `sweep resume` runs only job 0 again."""
    proc = disttrain_in_process(
        "train", "-m", "+model.raise_at=1,0", *ONE, *STEPS, "hydra.sweep.dir=sw", cwd=tmp_path
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "injected failure at training forward 1" in proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [r[:4] for r in rows] == [
        ["0", "failed", "status.json", "0"],
        ["1", "finished", "status.json", "1"],
    ]
    assert rows[0][-1] == "+model.raise_at=1" and "1 finished, 1 failed" in proc.stderr
    status = disttrain_in_process("sweep", "status", "sw", cwd=tmp_path)
    table = proc.stdout[proc.stdout.index("job  state") :]  # after job 1's `done: ...` line
    assert status.returncode == 0 and status.stdout == table, (status.stdout, table)
    # resume runs job 0 again (it fails again: its config still raises) and leaves job 1 alone
    resumed = disttrain_in_process("sweep", "resume", "sw", cwd=tmp_path)
    assert resumed.returncode == 1 and "resuming 1 of 2 jobs" in resumed.stderr, resumed.stderr[-3000:]
    assert (tmp_path / "sw" / "0" / "commands.txt").read_text().count("\n") == 2  # train -m, then resume
    assert (tmp_path / "sw" / "1" / "commands.txt").read_text().count("\n") == 1


def test_stop_on_failure_stops_the_sweep_at_the_first_failed_job(tmp_path: Path) -> None:
    args = (
        "+model.raise_at=1,0",
        "seed=1,2",
        *ONE,
        *STEPS,
        "sweep.stop_on_failure=true",
        "hydra.sweep.dir=sw",
    )
    proc = disttrain_in_process("train", "-m", *args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    states = [line.split()[1] for line in proc.stdout.splitlines()[1:]]
    assert states == ["failed", "not", "not", "not"], proc.stdout  # "not run"
    assert not (tmp_path / "sw" / "1" / "status.json").exists() and "#1 :" not in proc.stderr


def test_a_sweep_over_sweep_settings_or_launchers_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    for bad, key in (
        ("sweep.max_parallel=1,2", "sweep.max_parallel"),
        (
            "launcher=slurm,torchrun",
            "launcher.name",
        ),  # a cluster launcher submits every job; local jobs may mix
    ):
        proc = disttrain_in_process("train", "-m", bad, *ONE, cwd=tmp_path)
        assert proc.returncode == 2 and f"config error: {key}=" in proc.stderr, proc.stderr[-2000:]
        assert "separate sweeps" in proc.stderr and not (tmp_path / "runs").exists()


def test_sweep_status_of_a_folder_without_a_record_is_one_paragraph(tmp_path: Path) -> None:
    proc = disttrain_in_process("sweep", "status", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "holding sweep.json" in proc.stderr and "Traceback" not in proc.stderr
    assert disttrain_in_process("sweep", "stats", str(tmp_path), cwd=tmp_path).returncode == 2


FAKE_KUBECTL = """#!{python}
import json, pathlib, sys
here = pathlib.Path(__file__).parent
args = sys.argv[1:]
with (here / "kubectl.log").open("a") as f:
    f.write(" ".join(args) + "\\n")
if "get" in args:  # every job it is asked about has completed, unless `gone` lists it (deleted)
    gone = (here / "gone").read_text().split() if (here / "gone").exists() else []
    names = [a for a in args[args.index("get") + 2 :] if not a.startswith("-") and a != "json"]
    done = [{{"type": "Created", "status": "True"}}, {{"type": "Complete", "status": "True"}}]
    items = [{{"metadata": {{"name": n}}, "status": {{"conditions": done}}}} for n in names if n not in gone]
    print(json.dumps({{"kind": "List", "items": items}}))
"""


def test_k8s_sweep_is_one_job_per_point_with_at_most_max_parallel_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three points, max_parallel=2: two Jobs applied, the third only after a look at the cluster
    found one ended; status from kubectl; a deleted Job is cancelled, and resume applies it again
    under its own name (its pods' run dir) after deleting what is left of it."""
    import sys

    from disttrain.launch import k8s

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kubectl"
    fake.write_text(FAKE_KUBECTL.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(k8s, "POLL_S", 0.0)
    k8s_args = (
        "launcher=k8s",
        "launcher.image=lab/train:1",
        f"launcher.kubectl={fake}",
        "sweep.max_parallel=2",
    )
    proc = disttrain_in_process(
        "train", "-m", "optim.lr=0.1,0.2,0.3", *ONE, *k8s_args, "hydra.sweep.dir=sw", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = (bin_dir / "kubectl.log").read_text().splitlines()
    verbs = [c.split()[0] if not c.startswith("-n") else c.split()[2] for c in calls]
    assert verbs == ["apply", "apply", "get", "apply"], calls  # the third waits for a free slot
    record = sweepdir.load(tmp_path / "sw")
    names = [job.submitted[0].split(".", 2)[2] for job in record.jobs]
    assert [job.submitted[0].split(".")[:2] for job in record.jobs] == [["trainjob", "default"]] * 3
    assert calls[2].split()[4:6] == names[:2]  # it asked about the live ones only
    for num, name in enumerate(names):
        assert (tmp_path / "sw" / str(num) / "k8s" / "job_name").read_text().strip() == name
    (bin_dir / "gone").write_text(names[1])
    status = disttrain_in_process("sweep", "status", "sw", cwd=tmp_path)
    rows = [line.split()[1:4] for line in status.stdout.splitlines()[1:]]
    assert rows == [
        ["finished", f"trainjob.default.{names[0]}", "Complete"],
        ["cancelled", f"trainjob.default.{names[1]}", "deleted"],
        ["finished", f"trainjob.default.{names[2]}", "Complete"],
    ], status.stdout
    (bin_dir / "kubectl.log").unlink()
    resumed = disttrain_in_process("sweep", "resume", "sw", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    calls = [c for c in (bin_dir / "kubectl.log").read_text().splitlines() if " get " not in f" {c} "]
    manifest = tmp_path / "sw" / "1" / "k8s" / "job.yaml"
    assert calls == [
        f"-n default delete trainjob,configmap {names[1]} {names[1]}-config --ignore-not-found",
        f"apply -f {manifest}",
    ]
    assert f"name: {names[1]}\n" in manifest.read_text()
    assert sweepdir.load(tmp_path / "sw").job(1).submitted == [f"trainjob.default.{names[1]}"] * 2
