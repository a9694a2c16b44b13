"""`launcher=slurm`: a readable sbatch script in the run dir; srun starts one launcher per node.

Each node runs `python -m disttrain.launch.slurm_node RUN_DIR`: it reads the run dir's frozen
config, takes its node rank from SLURM_NODEID and the master address from the first host of the
allocation, and starts torchrun's agent for its `nproc_per_node` ranks (multi-node: the same roll
call and c10d rendezvous as by hand). SIGUSR1 (time limit near) or SIGTERM (preemption) makes the
ranks checkpoint; node 0 then requeues the job, which resumes from that checkpoint (resume=auto).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, cast

from disttrain.config.errors import ConfigError
from disttrain.launch.base import Launcher
from disttrain.launch.multinode import node_bounds
from disttrain.launch.specs.slurm import SlurmLauncherConfig
from disttrain.safefile import write_text_atomic

if TYPE_CHECKING:
    from disttrain.config.run import Run

SCRIPT = "slurm/job.sbatch"
SWEEP_SCRIPT = "slurm/sweep.sbatch"  # in the sweep folder: the job array of a `-m` sweep
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")  # fullmatch: `$` also matches before a final \n


class SlurmLauncher(Launcher):
    """sbatch a job script; on each node of the job, `slurm_node` runs torchrun's agent."""

    scheduler = True
    sweeps = True

    def check_static(self, run: Run) -> None:
        check_static(cast(SlurmLauncherConfig, run.launcher))

    def check_runtime(self, run: Run) -> None:
        if not cast(SlurmLauncherConfig, run.launcher).dry_run and shutil.which("sbatch") is None:
            raise ConfigError(
                "launcher",
                "slurm",
                "a machine with `sbatch` on PATH (a cluster login node)",
                "submit from the cluster, or launcher.dry_run=true to print the script here.",
            )

    def check_command(self, run_dir: Path, command: list[str]) -> None:
        check_script_inputs(run_dir, command)

    def submit(self, run: Run, run_dir: Path, command: list[str]) -> bool:
        submit(run, run_dir, command)  # the job's nodes train; status.json is theirs
        return True

    def check_sweep(self, runs: Sequence[Run], run_dirs: Sequence[Path]) -> None:
        check_sweep(runs, run_dirs)

    def submit_sweep(
        self,
        jobs: Sequence[tuple[int, Run, Path]],
        sweep_dir: Path,
        max_parallel: int,
        submitted: Callable[[int, str], None],
    ) -> None:
        submit_array(jobs, sweep_dir, max_parallel, submitted)  # one job array: its tasks train

    def sweep_states(self, ids: Mapping[int, str], timeout: float) -> dict[int, tuple[str, str]]:
        return array_states(ids, timeout)

    def launch(self, run: Run, run_dir: Path, entry: str) -> None:
        from disttrain.launch.torchrun import launch_torchrun

        launch_torchrun(run, run_dir, entry)  # one node of the job (slurm_node): torchrun's agent


def check_static(lc: SlurmLauncherConfig) -> None:
    if lc.time is not None and not SLURM_TIME.fullmatch(lc.time):
        raise ConfigError(
            "launcher.time",
            lc.time,
            "MM, HH:MM:SS or D-HH:MM:SS (sbatch --time)",
            "e.g. launcher.time=04:00:00.",
        )
    for key in ("gpus_per_node", "cpus_per_task", "signal_before_s"):
        value = getattr(lc, key)
        if value < 0:
            raise ConfigError(f"launcher.{key}", value, "an integer >= 0", "0 leaves it to the cluster.")
    for key in ("partition", "account", "qos"):
        value = getattr(lc, key)
        if value is not None and not re.fullmatch(r"[\w.,-]+", value):
            raise ConfigError(
                f"launcher.{key}",
                value,
                "a SLURM name: letters, digits, _ . , -",
                "`sinfo` lists partitions.",
            )
    for line in lc.extra:
        if "\n" in line or not line.startswith("#SBATCH "):
            raise ConfigError(
                "launcher.extra",
                line,
                "single lines starting with '#SBATCH '",
                "e.g. launcher.extra='[\"#SBATCH --constraint=a100\"]'.",
            )


def _printable(text: str) -> str:
    """`text` with control characters escaped (\\n, \\x1b): safe inside a one-line `#` comment."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _sbatch_value(value: object) -> str:
    """A #SBATCH option value; sbatch splits on blanks, so one with a blank is double-quoted."""
    text = _printable(str(value))
    return f'"{text}"' if any(c.isspace() for c in text) else text


def check_script_inputs(run_dir: Path, command: list[str]) -> None:
    """Everything the job script embeds is one line: no control characters in the run dir or argv.

    A newline there would start a shell line of its own in the script (before `set -e`), and the
    first non-comment line makes sbatch ignore every later #SBATCH directive."""
    bad = [("hydra.run.dir", str(run_dir))] if _printable(str(run_dir)) != str(run_dir) else []
    if '"' in str(run_dir):
        bad.append(("hydra.run.dir", str(run_dir)))
    bad += [("argument", a) for a in command if _printable(a) != a]
    if bad:
        key, value = bad[0]
        raise ConfigError(
            key,
            repr(value),
            "text without control characters (newline, tab, escape) or double quotes",
            "launcher=slurm writes it into the sbatch job script; remove the newline from the value.",
        )


def _head(run: Run, log: Path) -> list[str]:
    """The #SBATCH lines of `run`'s job (its log file `log`), `launcher.extra` last."""
    lc = cast(SlurmLauncherConfig, run.launcher)
    head = [
        f"--job-name={_sbatch_value('disttrain-' + str(run.name))}",
        f"--nodes={node_range(run)}",  # MIN-MAX: Slurm may start the job on fewer nodes (elastic)
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts nproc_per_node ranks
        f"--output={_sbatch_value(log)}",
        "--open-mode=append",  # a requeued job appends to the same log
        "--requeue",
    ]
    optional = {
        "partition": lc.partition,
        "time": lc.time,
        "account": lc.account,
        "qos": lc.qos,
        "gpus-per-node": lc.gpus_per_node or None,
        "cpus-per-task": lc.cpus_per_task or None,
    }
    head += [f"--{k}={_sbatch_value(v)}" for k, v in optional.items() if v is not None]
    if lc.signal_before_s:
        head.append(f"--signal=USR1@{lc.signal_before_s}")  # to the srun tasks: checkpoint + requeue
    return [*[f"#SBATCH {h}" for h in head], *[_printable(str(x)) for x in lc.extra]]  # extra: checked


def _body(run_dir: str) -> list[str]:
    """After `set -e`: srun starts one node launcher per node on the run dir `run_dir` (a quoted
    path, or a quoted shell variable)."""
    return [
        "# Node 0 of the allocation hosts the rendezvous; every node derives its rank from SLURM_NODEID.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"cd {shlex.quote(os.getcwd())}",
        'echo "disttrain: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0}), '
        'master $MASTER_ADDR"',
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        # -P: the cwd (a shared folder) is not put first on sys.path; disttrain appends it itself
        f"  {shlex.quote(sys.executable)} -P -u -m disttrain.launch.slurm_node {run_dir}",
        "",
    ]


def sbatch_script(run: Run, run_dir: Path, command: list[str]) -> str:
    """The job script: the #SBATCH head first (sbatch stops reading directives at the first command),
    then srun of one node launcher per node. Paths are quoted; comments have control chars escaped."""
    lines = [
        "#!/bin/bash",
        *_head(run, run_dir / "slurm" / "job-%j.out"),
        f"# Written by disttrain for run {_printable(str(run_dir))}",
        f"# Submitted with: {_printable(shlex.join(command))}",
        f"# Resubmit by hand: sbatch {_printable(shlex.quote(str(run_dir / SCRIPT)))}",
        "",
        "set -euo pipefail",
        *_body(shlex.quote(str(run_dir))),
    ]
    return "\n".join(lines)


def submit(run: Run, run_dir: Path, command: list[str]) -> str | None:
    """Write the script into the run dir; sbatch it (not with dry_run). Returns the job id."""
    script = sbatch_script(run, run_dir, command)
    path = run_dir / SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script, mode=0o755)  # a run dir is reused on resume: never through a link
    if cast(SlurmLauncherConfig, run.launcher).dry_run:
        sys.stdout.write(script)
        quoted = shlex.quote(str(path))
        sys.stdout.write(f"# dry run: not submitted. Script: {quoted}\n# submit it: sbatch {quoted}\n")
        return None
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ConfigError(
            "launcher", "slurm", "a working sbatch", f"sbatch failed: {detail.strip()}; the script is {path}."
        ) from None
    job = out.strip().split(";")[0]
    write_text_atomic(run_dir / "slurm" / "job_id", job + "\n")
    sys.stdout.write(
        f"submitted: SLURM job {job}\n  run dir: {run_dir}\n  follow:  tail -F {run_dir}/slurm/job-{job}.out"
        f"   (state: squeue -j {job}; cancel: scancel {job})\n"
    )
    return job


def node_overrides(overrides: list[str], environ: Mapping[str, str]) -> list[str] | None:
    """An srun step's task is a node's launcher unless RANK/WORLD_SIZE make it one rank of an
    srun that starts every rank (`srun --ntasks=WORLD ... python -m disttrain train`)."""
    if "SLURM_STEP_ID" not in environ or ("RANK" in environ and "WORLD_SIZE" in environ):
        return None
    return allocation_overrides(overrides, environ)


def allocation_overrides(overrides: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Inside an srun step with one task per node: node_rank and master_addr from SLURM's env."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return overrides
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    extra = []
    if "node_rank" not in given and "SLURM_NODEID" in env:
        extra.append(f"node_rank={env['SLURM_NODEID']}")
    if "master_addr" not in given and int(env.get("SLURM_NNODES", "1")) > 1:
        extra.append(f"master_addr={first_host()}")
    return [*overrides, *extra]


def first_host() -> str:
    """The first host of the allocation: node 0, which hosts the rendezvous."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return out.split()[0]


def node_range(run: Run) -> str:
    """sbatch's --nodes: N, or MIN-MAX under elastic membership (nodes=MIN:MAX)."""
    low, nodes = node_bounds(run)
    return str(nodes) if low == nodes else f"{low}-{nodes}"


def check_allocation(run: Run) -> None:
    """Inside an srun step: the allocation must match nodes and one launcher task per node."""
    if "SLURM_JOB_ID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        return
    nnodes = int(os.environ.get("SLURM_NNODES", "1"))
    ntasks = int(os.environ.get("SLURM_NTASKS", str(nnodes)))
    (low, nodes), nproc = node_bounds(run), run.world.nproc_per_node
    if not low <= nnodes <= nodes:
        raise ConfigError(
            "nodes",
            node_range(run).replace("-", ":"),
            f"{nnodes} (SLURM_NNODES of job {os.environ['SLURM_JOB_ID']})",
            f"allocate --nodes={node_range(run)}, or set nodes={nnodes}.",
        )
    if ntasks != nnodes:
        raise ConfigError(
            "nproc_per_node",
            nproc,
            f"one launcher task per node: SLURM_NTASKS={ntasks} but nodes={nodes} "
            f"(nodes x nproc_per_node = {nodes * nproc} ranks are started by disttrain, not srun)",
            "run `srun --ntasks-per-node=1 disttrain train ...`, or use launcher=slurm which writes that.",
        )


# ------------------------------------------------------------------------------ a sweep's job array
def check_sweep(runs: Sequence[Run], run_dirs: Sequence[Path]) -> None:
    """One job array has one #SBATCH head: every job of the sweep must ask for the same allocation
    (a swept `nodes` or `launcher.time` cannot share an array); each run dir is one line of text."""
    heads = [_head(run, Path("SWEEP")) for run in runs]
    for num, head in enumerate(heads):
        if head != heads[0]:
            mine, first = next((a, b) for a, b in zip_longest(head, heads[0], fillvalue="") if a != b)
            raise ConfigError(
                "launcher",
                "slurm",
                "one sbatch head for every job of a launcher=slurm sweep (they run as one job array)",
                f"job {num} asks for `{mine or '(nothing)'}` where job 0 asks for `{first or '(nothing)'}`; "
                "sweep keys that change the allocation (nodes, launcher.*) in separate sweeps.",
            )
    for run_dir in run_dirs:
        check_script_inputs(run_dir, [])


def array_spec(nums: Sequence[int], max_parallel: int) -> str:
    """sbatch --array: `0-3%2` for a whole sweep, `1,3%2` for the jobs a resume submits again."""
    nums = sorted(nums)
    if nums == list(range(nums[0], nums[-1] + 1)) and len(nums) > 1:
        spec = f"{nums[0]}-{nums[-1]}"
    else:
        spec = ",".join(str(n) for n in nums)
    return f"{spec}%{max_parallel}" if max_parallel else spec


def sweep_script(jobs: Sequence[tuple[int, Run, Path]], sweep_dir: Path, array: str) -> str:
    """The job array of `jobs` (number, run, run dir): task N trains job N in its own run dir, its log
    in that folder (a resume submits some jobs again under their own numbers). The head is the
    jobs' shared head (check_sweep) with `--array`; every path is quoted, every comment has its
    control characters escaped."""
    run = jobs[0][1]
    listed = [f"  [{num}]={shlex.quote(str(run_dir))}" for num, _, run_dir in jobs]
    script = sweep_dir / SWEEP_SCRIPT
    lines = [
        "#!/bin/bash",
        *_head(run, sweep_dir / "slurm" / "array-%A_%a.out"),
        f"#SBATCH --array={array}",
        f"# Written by disttrain for the sweep {_printable(str(sweep_dir))}: array task N trains job N",
        f"# Resubmit some of them by hand: sbatch --array=N,M {_printable(shlex.quote(str(script)))}",
        "# (or `disttrain sweep resume` on the sweep folder: the failed and cancelled ones)",
        "",
        "set -euo pipefail",
        "RUN_DIRS=(",
        *listed,
        ")",
        "RUN_DIR=${RUN_DIRS[$SLURM_ARRAY_TASK_ID]}",
        'mkdir -p "$RUN_DIR/slurm"',
        'exec >>"$RUN_DIR/slurm/job-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}.out" 2>&1',
        *_body('"$RUN_DIR"'),
    ]
    return "\n".join(lines)


def submit_array(
    jobs: Sequence[tuple[int, Run, Path]],
    sweep_dir: Path,
    max_parallel: int,
    submitted: Callable[[int, str], None],
) -> str | None:
    """Write the sweep's array script and sbatch the tasks of `jobs` (not with dry_run); each job's
    id is `<array job>_<job number>`."""
    array = array_spec([num for num, _, _ in jobs], max_parallel)
    script = sweep_script(jobs, sweep_dir, array)
    path = sweep_dir / SWEEP_SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script, mode=0o755)
    if cast(SlurmLauncherConfig, jobs[0][1].launcher).dry_run:
        sys.stdout.write(script)
        quoted = shlex.quote(str(path))
        sys.stdout.write(f"# dry run: not submitted. Script: {quoted}\n# submit it: sbatch {quoted}\n")
        return None
    argv = ["sbatch", "--parsable", f"--array={array}", str(path)]  # --array here: the tasks chosen now
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ConfigError(
            "launcher", "slurm", "a working sbatch", f"sbatch failed: {detail.strip()}; the script is {path}."
        ) from None
    array_job = out.strip().split(";")[0]
    for num, _, run_dir in jobs:
        (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "slurm" / "job_id", f"{array_job}_{num}\n")
        submitted(num, f"{array_job}_{num}")
    sys.stdout.write(
        f"submitted: SLURM job array {array_job} (--array={array}: {len(jobs)} jobs)\n"
        f"  sweep:   {sweep_dir}\n  state:   disttrain sweep status {shlex.quote(str(sweep_dir))}"
        f"   (squeue -r -j {array_job}; cancel: scancel {array_job})\n"
    )
    return array_job


# Slurm's job states (squeue %T, sacct State) in disttrain.sweepdir.STATES.
SLURM_STATES = {
    **dict.fromkeys(("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"), "pending"),
    **dict.fromkeys(
        (
            "RUNNING",
            "CONFIGURING",
            "COMPLETING",
            "RESIZING",
            "SIGNALING",
            "STAGE_OUT",
            "STOPPED",
            "SUSPENDED",
        ),
        "running",
    ),
    "COMPLETED": "finished",
    **dict.fromkeys(("CANCELLED", "PREEMPTED", "REVOKED"), "cancelled"),
    **dict.fromkeys(
        ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"), "failed"
    ),
}


def array_states(ids: Mapping[int, str], timeout: float) -> dict[int, tuple[str, str]]:
    """What Slurm says of each job: squeue (jobs slurmctld still holds, finished ones for MinJobAge),
    then sacct for the rest (where accounting is on); a task missing from an array squeue still
    lists was cancelled while pending. A job nobody knows is left out."""
    wanted = {job_id: num for num, job_id in ids.items()}
    arrays = sorted({job_id.split("_")[0] for job_id in wanted})
    found: dict[str, str] = {}
    queries = (
        ["squeue", "-h", "-r", "--states=all", "-o", "%i|%T", "-j", ",".join(arrays)],
        ["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(arrays)],
    )
    for argv in queries:
        if set(wanted) <= set(found) or shutil.which(argv[0]) is None:
            continue
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            job_id, _, state = line.strip().partition("|")
            word = state.split()[0] if state.split() else ""  # sacct: "CANCELLED by 0"
            if job_id in wanted and job_id not in found and word in SLURM_STATES:
                found[job_id] = word
    states = {wanted[job_id]: (SLURM_STATES[word], word) for job_id, word in found.items()}
    # A pending array task that is cancelled leaves no record of its own (squeue forgets it; only
    # accounting, where it is on, remembers): while slurmctld still lists other tasks of its array,
    # a task it does not list was cancelled before it started.
    listed = {job_id.split("_")[0] for job_id in found}
    for job_id, num in wanted.items():
        if job_id not in found and job_id.split("_")[0] in listed:
            states[num] = ("cancelled", "CANCELLED(pending)")
    return states
