"""The sweep folder's record: `SWEEP_DIR/sweep.json`, each job's overrides, folder and scheduler ids.

`disttrain train -m` writes it before the first job runs or is submitted, and again as each job is
handed to a scheduler; `disttrain sweep status DIR` and `disttrain sweep resume DIR` read it back.
Read back, it is data: every field is checked for its type and shape, a job's folder must lie inside
the sweep folder (no `..`, no absolute path, no link out of it), and nothing in it is run: resume
builds each job from its run dir's config.yaml under the same trust rule as `disttrain resume`
(`disttrain.trust`) and writes any job script anew from that config.

A job's state comes from its scheduler where the launcher can ask one (squeue/sacct, kubectl), else
from its run dir's status.json (`state_of_files`), in one vocabulary: `STATES`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.safefile import write_atomic

RECORD = "sweep.json"
VERSION = 1
# pending: waits in the scheduler's queue (or a local sweep has not reached it); not run: a local
# sweep stopped before it (sweep.stop_on_failure); unknown: submitted, and neither the scheduler nor
# its run dir says more (the scheduler forgot it before it ever started).
STATES = ("pending", "running", "finished", "failed", "cancelled", "not run", "unknown")
RERUN = ("failed", "cancelled")  # what `sweep resume` submits again
_ID = re.compile(r"[\w.\-\[\]%]{1,200}")  # a scheduler's job id or a Kubernetes name (squeue: 12_3)
_NAME = re.compile(r"[\w.\-]{1,100}")


@dataclass
class SweepJob:
    """Job `num` (Hydra's `hydra.job.num`) of the sweep: its overrides, its folder relative to the
    sweep folder, and the scheduler's id of each submission of it (the last is current)."""

    num: int
    folder: str
    overrides: list[str]
    submitted: list[str] = field(default_factory=list)


@dataclass
class SweepRecord:
    launcher: str  # `launcher.name` of every job (one launcher per sweep)
    max_parallel: int
    jobs: list[SweepJob]
    command: list[str] = field(default_factory=list)

    def job(self, num: int) -> SweepJob:
        return next(j for j in self.jobs if j.num == num)

    def save(self, sweep_dir: Path) -> None:
        data = {
            "version": VERSION,
            "launcher": self.launcher,
            "max_parallel": self.max_parallel,
            "command": self.command,
            "jobs": [vars(j) for j in self.jobs],
        }
        write_atomic(sweep_dir / RECORD, (json.dumps(data, indent=2) + "\n").encode("utf-8"))

    def run_dir(self, sweep_dir: Path, job: SweepJob) -> Path:
        """The job's folder, which must lie inside the sweep folder (links resolved)."""
        base = sweep_dir.resolve()
        path = (base / job.folder).resolve()
        if base not in path.parents:
            _refuse(sweep_dir, f"job {job.num}'s folder {job.folder!r} lies outside the sweep folder")
        return path


def load(sweep_dir: Path) -> SweepRecord:
    """The record in `sweep_dir`, checked field by field: a ConfigError naming what is wrong."""
    path = sweep_dir / RECORD
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            "SWEEP_DIR",
            str(sweep_dir),
            f"a sweep folder holding {RECORD} (written by `disttrain train -m`)",
            "pass the folder `train -m` printed (`launching N jobs in DIR`), e.g. runs/NAME/multirun_DATE.",
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _refuse(sweep_dir, f"it is not JSON text ({str(exc).splitlines()[0]})")
    if not isinstance(data, dict) or data.get("version") != VERSION:
        _refuse(sweep_dir, f"it is not a version-{VERSION} record")
    launcher, limit, command, jobs = (data.get(k) for k in ("launcher", "max_parallel", "command", "jobs"))
    if not isinstance(launcher, str) or not _NAME.fullmatch(launcher):
        _refuse(sweep_dir, "its launcher is no launcher name")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        _refuse(sweep_dir, "its max_parallel is no integer >= 0")
    if not _strings(command) or not isinstance(jobs, list) or not jobs:
        _refuse(sweep_dir, "its command or jobs are not lists of the right shape")
    record = SweepRecord(launcher, limit, [_job(sweep_dir, j, n) for n, j in enumerate(jobs)], command)
    for job in record.jobs:
        record.run_dir(sweep_dir, job)
    return record


def _job(sweep_dir: Path, data: Any, index: int) -> SweepJob:
    if not isinstance(data, dict) or set(data) != {"num", "folder", "overrides", "submitted"}:
        _refuse(sweep_dir, f"job #{index} is not {{num, folder, overrides, submitted}}")
    num, folder, overrides, submitted = data["num"], data["folder"], data["overrides"], data["submitted"]
    if num != index or isinstance(num, bool):
        _refuse(sweep_dir, f"job #{index} has the number {num!r}")
    if not isinstance(folder, str) or not folder or not folder.isprintable() or Path(folder).is_absolute():
        _refuse(sweep_dir, f"job {num}'s folder {folder!r} is not a relative path")
    if not _strings(overrides) or not _strings(submitted) or not all(_ID.fullmatch(s) for s in submitted):
        _refuse(sweep_dir, f"job {num}'s overrides or scheduler ids are not lists of plain strings")
    return SweepJob(num, folder, list(overrides), list(submitted))


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v.isprintable() for v in value)


def _refuse(sweep_dir: Path, problem: str) -> Any:
    raise ConfigError(
        "SWEEP_DIR",
        str(sweep_dir),
        f"a sweep folder whose {RECORD} is the record `disttrain train -m` wrote",
        f"{problem}: it was edited or is not disttrain's; each job's run dir still resumes on its own "
        "(`disttrain resume RUN_DIR`).",
    )


def state_of_files(run_dir: Path) -> str | None:
    """A job's state as its run dir's status.json tells it (None: no status.json)."""
    from disttrain.rundir import read_status

    status = read_status(run_dir).get("status")
    if status not in _FILE_STATES:
        return None
    return "cancelled" if status == "interrupted" else str(status)


_FILE_STATES = ("running", "finished", "failed", "interrupted")


def job_states(
    record: SweepRecord, sweep_dir: Path, scheduler: Mapping[int, tuple[str, str]]
) -> dict[int, tuple[str, str]]:
    """Each job's (state, what says so): the scheduler's word where `scheduler` has one (state and its
    own name for it, e.g. ("cancelled", "CANCELLED")), else the run dir's status.json, else pending
    (a local sweep has not reached it), unknown (submitted, nobody knows more)."""
    out: dict[int, tuple[str, str]] = {}
    for job in record.jobs:
        if job.num in scheduler:
            out[job.num] = scheduler[job.num]
            continue
        files = state_of_files(record.run_dir(sweep_dir, job))
        if files is not None:
            out[job.num] = (files, "status.json")
        else:
            out[job.num] = ("unknown" if job.submitted else "pending", "")
    return out


def table(record: SweepRecord, states: Mapping[int, tuple[str, str]]) -> str:
    """One line per job: number, state, the scheduler's id and word for it, folder, and the overrides
    that tell the jobs apart (those every job shares are left out)."""
    shared = set.intersection(*(set(job.overrides) for job in record.jobs))
    rows = [("job", "state", "scheduler", "folder", "overrides")]
    for job in record.jobs:
        state, source = states.get(job.num, ("unknown", ""))
        where = " ".join(x for x in (job.submitted[-1] if job.submitted else "", source) if x)
        own = " ".join(o for o in job.overrides if o not in shared)
        rows.append((str(job.num), state, where or "-", job.folder, own or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4] + "\n" for r in rows
    )


def counts(states: Iterable[tuple[str, str]]) -> str:
    """`2 finished, 1 failed` in STATES order."""
    found = [s for s, _ in states]
    return ", ".join(f"{found.count(s)} {s}" for s in STATES if s in found)
