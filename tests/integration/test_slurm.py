"""`launcher=slurm` against a real one-host Slurm (Debian's slurm-wlm): munged, slurmctld, slurmd.

The fixture installs slurm-wlm and munge with apt-get when they are missing, writes a one-host
slurm.conf (2 CPUs, no cgroups: proctrack/linuxproc, task/none), starts the three daemons on
private sockets and ports, and stops every one of them afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import _TAG, CLI, FAST, QUICK, clean_env, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONF = """\
ClusterName=disttraintest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sh(
    *cmd: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _install() -> None:
    """apt-get install slurm-wlm munge when missing (CI installs them in .ci/run already)."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and cannot be installed here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        res = _sh(*cmd, env=env, timeout=600)
        if res.returncode != 0:
            pytest.skip(f"cannot install Slurm: `{' '.join(cmd)}` failed: {res.stderr.strip()[-300:]}")


def _stop_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(path.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running one-host Slurm; yields the environment for its commands (SLURM_CONF)."""
    _install()
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=host, root=root, ctld_port=_free_port(), slurmd_port=_free_port()))
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    # No orphan-hunting tag: the daemons (and so the jobs) must outlive the submitting command.
    env = {k: v for k, v in clean_env(SLURM_CONF=str(conf)).items() if k != _TAG}
    munge = ["munged", "-f", f"--socket={root}/munge.sock", f"--key-file={key}"]
    munge += [f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/seed"]
    try:
        for cmd in (munge, ["slurmctld", "-f", str(conf)], ["slurmd", "-f", str(conf)]):
            res = _sh(*cmd, env=env)
            if res.returncode != 0:
                pytest.skip(f"Slurm cannot start here: `{cmd[0]}` failed: {res.stderr.strip()[-300:]}")
        deadline = time.monotonic() + 60
        while "idle" not in _sh("sinfo", "-h", "-o", "%T", env=env).stdout:
            if time.monotonic() > deadline:
                log = (root / "slurmd.log").read_text()[-500:] if (root / "slurmd.log").exists() else ""
                pytest.skip(f"Slurm's node never became idle in 60 s; slurmd.log: {log}")
            time.sleep(0.5)
        yield env
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _sh("scancel", "--full", "--user=root", env=env)
            deadline = time.monotonic() + 60  # let slurmstepd end the jobs' processes before slurmd goes
            while _sh("squeue", "-h", env=env).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            _stop_pidfile(root / name)


def _job_field(job: str, env: dict[str, str], key: str) -> str:
    out = _sh("scontrol", "show", "job", job, env=env).stdout
    values = [w.split("=", 1)[1] for w in out.split() if w.startswith(f"{key}=")]
    return values[0] if values else ""


def _wait_for(job: str, env: dict[str, str], states: tuple[str, ...], timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while (state := _job_field(job, env, "JobState")) not in states:
        if time.monotonic() > deadline:
            pytest.fail(f"SLURM job {job} is {state}, not {states}, after {timeout:.0f} s")
        time.sleep(1)
    return state


def _records(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("train/loss") if path.is_file() else 0


def _submit(tmp_path: Path, env: dict[str, str], *overrides: str) -> tuple[str, Path]:
    proc = run_command([CLI, "train", *FAST, "launcher=slurm", *overrides], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "submitted: SLURM job" in proc.stdout and "follow:  tail -F" in proc.stdout, proc.stdout
    run_dir = Path(proc.stdout.split("run dir:")[1].split()[0])
    return (run_dir / "slurm" / "job_id").read_text().strip(), run_dir


def test_submitted_job_trains_and_completes_the_run_dir(tmp_path: Path, slurm: dict[str, str]) -> None:
    job, run_dir = _submit(tmp_path, slurm, *QUICK, "launcher.time=10", "hydra.run.dir=sl_quick")
    assert _wait_for(job, slurm, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) == "COMPLETED", (
        run_dir / "slurm" / f"job-{job}.out"
    ).read_text()[-2000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --time=10" in script
    assert f"job {job} on" in (run_dir / "slurm" / f"job-{job}.out").read_text()


def test_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path: Path, slurm: dict[str, str]) -> None:
    steps = ("data=synthetic", "trainer.max_steps=1500", "trainer.log_every=10", "trainer.ckpt_every=0")
    job, run_dir = _submit(tmp_path, slurm, *steps, "hydra.run.dir=sl_requeue")
    deadline = time.monotonic() + 180
    while _records(run_dir) < 5:
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.5)
    _sh("scancel", "--signal=USR1", job, env=slurm)  # what --signal=USR1@T sends before the limit
    deadline = time.monotonic() + 120
    while _job_field(job, slurm, "Restarts") in ("", "0"):
        assert time.monotonic() < deadline, "the job did not requeue itself after SIGUSR1"
        time.sleep(0.5)
    _sh("scontrol", "update", f"JobId={job}", "StartTime=now", env=slurm)  # skip the requeue delay
    assert _wait_for(job, slurm, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED"
    log = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert "requeueing SLURM job" in log and "(saved: signal)" in log, log[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1500


def test_allocation_that_disagrees_with_the_config_fails_before_training(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    cmd = ["srun", "--ntasks=2", CLI, "train", *FAST, *QUICK]
    proc = run_command(cmd, tmp_path, env=slurm, timeout=120)
    assert proc.returncode != 0
    assert "SLURM_NTASKS=2 but nodes=1" in proc.stderr and "--ntasks-per-node=1" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()
