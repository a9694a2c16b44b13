"""`launcher=slurm` against a real Slurm (Debian's slurm-wlm): munged, slurmctld, slurmd.

The `slurm` fixture installs slurm-wlm and munge with apt-get when they are missing, writes a
one-host slurm.conf (2 CPUs, no cgroups: proctrack/linuxproc, task/none), starts the three daemons
on private sockets and ports, and stops every one of them afterwards. The `slurm2` fixture runs
two slurmd in their own network/mount/UTS namespaces: two nodes with their own addresses.
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

from disttrain.testing import FAULT_MLP

from .conftest import _TAG, CLI, FAST, QUICK, clean_env, run_cli, run_command, train_losses

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


def _start_cluster(daemons: list[list[str]], env: dict[str, str], root: Path) -> None:
    """Start the daemons in order and wait until every node is idle; skip, saying why, if not."""
    for cmd in daemons:
        res = _sh(*cmd, env=env)
        if res.returncode != 0:
            pytest.skip(f"Slurm cannot start here: `{' '.join(cmd)}` failed: {res.stderr.strip()[-300:]}")
    deadline = time.monotonic() + 60
    while _sh("sinfo", "-h", "-o", "%T", env=env).stdout.split() != ["idle"]:
        if time.monotonic() > deadline:
            logs = [p.read_text()[-400:] for p in sorted(root.glob("slurm*.log"))]
            pytest.skip(f"Slurm's nodes never became idle in 60 s: {logs}")
        time.sleep(0.5)


def _stop_cluster(env: dict[str, str], root: Path) -> None:
    """Cancel every job, let slurmstepd end the jobs' processes, then stop every daemon in `root`."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _sh("scancel", "--full", "--user=root", env=env)
        deadline = time.monotonic() + 60
        while _sh("squeue", "-h", env=env).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
    for pidfile in [*sorted(root.glob("slurmd*.pid")), root / "slurmctld.pid", root / "munged.pid"]:
        _stop_pidfile(pidfile)


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
        _start_cluster([munge, ["slurmctld", "-f", str(conf)], ["slurmd", "-f", str(conf)]], env, root)
        yield env
    finally:
        _stop_cluster(env, root)


# Two nodes: each slurmd runs in its own network and UTS namespace (its own address and host name),
# on a bridge in the root namespace where slurmctld listens; srun, torchrun's rendezvous and gloo
# then cross real network boundaries, as between machines.
NET = "10.78.{n}.{host}"
TWO_NODES = """\
NodeName=dtn0 NodeAddr={addr0} CPUs=1 State=UNKNOWN
NodeName=dtn1 NodeAddr={addr1} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=dtn[0-1] Default=YES MaxTime=INFINITE State=UP
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return _sh("ip", *args, timeout=30)


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running two-node Slurm (nodes dtn0, dtn1 in two network namespaces); yields its environment."""
    _install()
    if not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter")):
        pytest.skip("needs `ip` (iproute2), `unshare` and `nsenter` to give each slurmd its own namespaces")
    tag = os.urandom(3).hex()
    n = int(tag, 16) % 200 + 20
    addr = [NET.format(n=n, host=h) for h in (1, 2, 3)]
    bridge, ns = f"dtbr{tag}", [f"dtsl{tag}{k}" for k in (0, 1)]
    root = tmp_path_factory.mktemp("slurm2")
    for sub in ("state",):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    head = CONF.format(host=host, root=root, ctld_port=_free_port(), slurmd_port=_free_port())
    head = head.replace("(127.0.0.1)", f"({addr[0]})")
    head = head.replace(f"{root}/spool", f"{root}/spool-%n").replace(f"{root}/slurmd.", f"{root}/slurmd-%n.")
    body = head.split("NodeName=")[0] + TWO_NODES.format(addr0=addr[1], addr1=addr[2])
    conf.write_text(body)
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    env = {k: v for k, v in clean_env(SLURM_CONF=str(conf), GLOO_SOCKET_IFNAME="dteth").items() if k != _TAG}
    try:
        if _ip("netns", "add", ns[0]).returncode != 0:
            pytest.skip("cannot create network namespaces here (needs root and CAP_SYS_ADMIN)")
        _ip("netns", "add", ns[1])
        steps = [
            ("link", "add", bridge, "type", "bridge"),
            ("addr", "add", f"{addr[0]}/24", "dev", bridge),
            ("link", "set", bridge, "up"),
        ]
        for k in (0, 1):
            outer, inner = f"dtv{tag}{k}o", f"dtv{tag}{k}i"
            steps += [
                ("link", "add", outer, "type", "veth", "peer", "name", inner),
                ("link", "set", outer, "master", bridge),
                ("link", "set", outer, "up"),
                ("link", "set", inner, "netns", ns[k]),
                ("-n", ns[k], "link", "set", inner, "name", "dteth"),
                ("-n", ns[k], "addr", "add", f"{addr[k + 1]}/24", "dev", "dteth"),
                ("-n", ns[k], "link", "set", "dteth", "up"),
                ("-n", ns[k], "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"cannot wire the namespaces: `ip {' '.join(step)}` said {res.stderr.strip()!r}")
        hosts = root / "hosts"  # what each node's /etc/hosts becomes (its own mount namespace)
        hosts.write_text(f"127.0.0.1 localhost\n{addr[0]} {host}\n{addr[1]} dtn0\n{addr[2]} dtn1\n")
        munge = ["munged", "-f", f"--socket={root}/munge.sock", f"--key-file={key}"]
        munge += [
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/seed",
        ]
        daemons = [munge, ["slurmctld", "-f", str(conf)]]
        for k in (0, 1):
            (root / f"spool-dtn{k}").mkdir()
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs /sys/fs/cgroup.
            inner = f"mount --bind {hosts} /etc/hosts && hostname dtn{k} && exec slurmd -f {conf}"
            unshare = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", inner]
            daemons.append(["nsenter", f"--net=/run/netns/{ns[k]}", *unshare])
        _start_cluster(daemons, env, root)
        yield env
    finally:
        _stop_cluster(env, root)
        for name in ns:
            _ip("netns", "del", name)
        _ip("link", "del", bridge)


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


def test_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path: Path, slurm: dict[str, str]) -> None:
    # 0.03 s of sleep a step (FaultMLP's delay): the job is still training ~7 s after step 50, when
    # the signal is sent, however fast the machine (1500 steps at full speed did that: measured as a
    # plain 2-rank CLI run, 33.8 CPU-s against 18.9 for these 300)
    steps = ("data=synthetic", *FAULT_MLP, "+model.delay=0.03", "trainer.max_steps=300", "trainer.log_every=10",
             "trainer.ckpt_every=0")  # fmt: skip
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
    # A requeued job waits out a begin-time delay (~160 s here). Skip it once the requeue is done
    # (PENDING) and a little later: a start in the same second as the first run's kill carries a
    # credential the node still counts as revoked, and the job fails ("Job credential revoked").
    # If the update does not take, the job still starts after the delay, within _wait_for's limit.
    _wait_for(job, slurm, ("PENDING",), timeout=60)
    time.sleep(2)
    _sh("scontrol", "update", f"JobId={job}", "StartTime=now", env=slurm)
    assert _wait_for(job, slurm, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED"
    log = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert "requeueing SLURM job" in log and "(saved: signal)" in log, log[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 300


def test_allocation_that_disagrees_with_the_config_fails_before_training(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    cmd = ["srun", "--ntasks=2", CLI, "train", *FAST, *QUICK]
    proc = run_command(cmd, tmp_path, env=slurm, timeout=120)
    assert proc.returncode != 0
    assert "SLURM_NTASKS=2 but nodes=1" in proc.stderr and "--ntasks-per-node=1" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_fsdp_on_two_slurm_nodes_equals_one_node(tmp_path: Path, slurm2: dict[str, str]) -> None:
    """The title command of the multi-node issue, `strategy=fsdp nodes=2`, through sbatch on two
    Slurm nodes with their own addresses: bitwise the losses of one node with the same world size."""
    common = (*QUICK, "strategy=fsdp", "nproc_per_node=1")
    job, run_dir = _submit(tmp_path, slurm2, *common, "nodes=2", "launcher.time=10", "hydra.run.dir=sl_two")
    out = run_dir / "slurm" / f"job-{job}.out"
    state = _wait_for(job, slurm2, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert state == "COMPLETED", out.read_text()[-3000:]
    assert f"job {job} on dtn[0-1]" in out.read_text()
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    records = [json.loads((run_dir / f"rendezvous_node{k}.json").read_text()) for k in (0, 1)]
    assert records[0]["config_hash"] == records[1]["config_hash"] and records[0]["nodes"] == [0, 1]
    assert "#SBATCH --nodes=2\n" in (run_dir / "slurm" / "job.sbatch").read_text()
    (tmp_path / "one").mkdir()
    _, one = run_cli(tmp_path / "one", *common[:-1], "nproc_per_node=2")
    assert one is not None
    a, b = train_losses(run_dir), train_losses(one)
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6, (a, b)


def _sweep_table(cwd: Path, env: dict[str, str]) -> dict[str, list[str]]:
    """`disttrain sweep status sweep`: job number -> its row (state, scheduler id and word, ...)."""
    proc = run_command([CLI, "sweep", "status", "sweep"], cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    return {row[0]: row[1:] for row in rows}


def test_sweep_is_one_job_array_and_resume_reruns_only_the_cancelled_job(
    tmp_path: Path, slurm2: dict[str, str]
) -> None:
    """Frontier review item 8 on the two-node cluster: a four-point sweep with max_parallel=2 is one
    job array `%2` and the command returns at once; `sweep status` shows each job's state; after one
    job is cancelled, `sweep resume` submits only that one again, under its number, in its folder.
    (Also what a single submitted job must do: train to COMPLETED and finish its run dir.)"""
    tiny = (*QUICK, "strategy=single", "nproc_per_node=1", "launcher.time=10", "hydra.sweep.dir=sweep")
    lrs = "optim.lr=1e-3,3e-3,1e-2,3e-2"
    cmd = [CLI, "train", "-m", lrs, *FAST, *tiny, "launcher=slurm", "sweep.max_parallel=2"]
    proc = run_command(cmd, tmp_path, env=slurm2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweep = tmp_path / "sweep"
    jobs = json.loads((sweep / "sweep.json").read_text())["jobs"]
    array = jobs[0]["submitted"][0].split("_")[0]
    _sh("scancel", f"{array}_3", env=slurm2)  # held back by the %2 cap while jobs 0-2 run: cancelled pending
    assert [j["submitted"] for j in jobs] == [[f"{array}_{n}"] for n in range(4)]
    assert [j["folder"] for j in jobs] == ["0", "1", "2", "3"]
    assert "--array=0-3%2" in proc.stdout and f"SLURM job array {array} " in proc.stdout, proc.stdout
    assert _job_field(array, slurm2, "ArrayTaskThrottle") == "2"
    assert "#SBATCH --array=0-3%2\n#" in (sweep / "slurm" / "sweep.sbatch").read_text()
    for n in range(3):
        state = _wait_for(f"{array}_{n}", slurm2, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
        assert state == "COMPLETED", (sweep / str(n) / "slurm" / f"job-{array}_{n}.out").read_text()[-2000:]
    table = _sweep_table(tmp_path, slurm2)
    assert [table[str(n)][:3] for n in range(4)] == [
        *[["finished", f"{array}_{n}", "COMPLETED"] for n in range(3)],
        ["cancelled", f"{array}_3", "CANCELLED(pending)"],
    ], table
    assert table["1"][-1] == "optim.lr=0.003", table  # only what tells the jobs apart
    assert not (sweep / "3" / "status.json").exists()

    proc = run_command([CLI, "sweep", "resume", "sweep"], tmp_path, env=slurm2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--array=3%2" in proc.stdout and "resuming 1 of 4 jobs" in proc.stderr, (proc.stdout, proc.stderr)
    again = json.loads((sweep / "sweep.json").read_text())["jobs"][3]["submitted"][-1]
    assert again.endswith("_3") and again != f"{array}_3"
    log = sweep / "3" / "slurm" / f"job-{again}.out"
    assert _wait_for(again, slurm2, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) == "COMPLETED", (
        log.read_text()[-2000:]
    )
    assert [row[:3] for row in _sweep_table(tmp_path, slurm2).values()][3] == ["finished", again, "COMPLETED"]
    for n in range(4):
        run_dir = sweep / str(n)
        assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
        assert len(train_losses(run_dir)) == 6  # each job trained once: the resumed one from its start
        logs = sorted(p.name for p in (run_dir / "slurm").glob("job-*.out"))
        assert logs == [f"job-{again if n == 3 else f'{array}_{n}'}.out"], logs
    assert "disttrain: job " in log.read_text() and " on dtn" in log.read_text()
    assert (sweep / "3" / "commands.txt").read_text().count("\n") == 2  # train -m, then sweep resume
