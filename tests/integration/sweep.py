"""Several independent CLI runs as the jobs of ONE `disttrain train -m` sweep.

Every job is still a complete, real multi-rank run with its own run dir; what the jobs share is the
parent process (interpreter, torch import, compose and checks) and the fork server, paid once per
sweep instead of once per run (~6 CPU-s each on the CI machine). For tests that compare the numbers
and files of finished runs and say nothing about the parent process.

Runs with different overrides (strategy, nproc_per_node, options) become the options of one config
group in a temporary `--config-dir`: `case/jN.yaml` (`# @package _global_`) holds run N's overrides
(a config group choice as a defaults-list `override`, every other key as a value), and the sweep is
`disttrain train -m --config-dir DIR +case=j0,j1,... COMMON...`. Each job's overrides.yaml names its
case, which maps its run dir back to the run's name; a job that failed (or never ran because an
earlier one stopped the sweep) fails the tests that read it, naming the job and its logs' tail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from .conftest import CLI, FAST, _tail, find_run_dirs, pinned_backend, read_yaml, run_disttrain

JOB_BUDGET = 60.0  # seconds per job (a 20-step 2-rank run trains in ~3 s); a sweep gets the sum


def case_yaml(overrides: Sequence[str]) -> str:
    """`overrides` (command-line syntax) as one `# @package _global_` config file."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from disttrain.config import config_dir

    groups = {p.name for p in config_dir().iterdir() if p.is_dir()}
    defaults: list[dict[str, str]] = []
    values = OmegaConf.create()
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key, value = override.key_or_group, override.value()
        if key in groups:
            assert isinstance(value, str), override
            defaults.append({f"{'' if override.is_add() else 'override '}/{key}": value})
        else:
            OmegaConf.update(values, key, value, force_add=True)
    body = OmegaConf.to_container(values)
    assert isinstance(body, dict)
    text = OmegaConf.to_yaml({"defaults": [*defaults, "_self_"], **body})
    return f"# @package _global_\n{text}"


class Sweep(Mapping[str, Path]):
    """name -> run dir of each job that finished; reading a job that did not fails the test.

    `add` puts runs made otherwise (in process, or a resume of a job) beside the jobs."""

    def __init__(
        self, cwd: Path, jobs: dict[str, Path | None], cmd: list[str], rc: int, stdout: str, stderr: str
    ) -> None:
        self._jobs, self._cmd, self._rc, self._stderr = jobs, cmd, rc, stderr
        self.output = stdout + stderr  # the sweep's console
        self.cwd = cwd  # where the sweep ran
        self._other: dict[str, Path] = {}

    def add(self, name: str, run_dir: Path) -> None:
        self._other[name] = run_dir

    def finished(self, name: str) -> bool:
        run_dir = self._jobs[name]
        return run_dir is not None and _status(run_dir) == "finished" and (run_dir / "summary.json").is_file()

    def __getitem__(self, name: str) -> Path:
        if name in self._other:
            return self._other[name]
        if name not in self._jobs:
            pytest.fail(
                f"run {name!r} was not made: a sweep job it needs did not finish\n{_tail(self._stderr)}"
            )
        run_dir = self._jobs[name]
        if run_dir is None or not self.finished(name):
            logs = "".join(p.read_text() for p in sorted(run_dir.glob("logs/*.log"))) if run_dir else ""
            pytest.fail(
                f"sweep job {name!r} did not finish (run dir {run_dir}, status "
                f"{_status(run_dir) if run_dir else 'never started: an earlier job stopped the sweep'}); "
                f"the sweep exited {self._rc}: {' '.join(self._cmd)}\n"
                f"--- the job's rank logs tail\n{_tail(logs)}\n--- the sweep's stderr tail\n{_tail(self._stderr)}"
            )
        return run_dir

    def __iter__(self) -> Iterator[str]:
        return iter({**self._other, **self._jobs})

    def __len__(self) -> int:
        return len({**self._other, **self._jobs})

    def log(self, name: str) -> str:
        """What the job's ranks logged (logs/rank*.log): its share of the sweep's console."""
        return "".join(p.read_text() for p in sorted(self[name].glob("logs/rank*.log")))


def _status(run_dir: Path) -> str:
    path = run_dir / "status.json"
    return str(json.loads(path.read_text()).get("status")) if path.is_file() else "none"


def run_sweep(
    cwd: Path,
    runs: Mapping[str, Sequence[str]],
    *common: str,
    budget: float = JOB_BUDGET,
    config_dir: Path | None = None,
    separate: bool = False,
) -> Sweep:
    """`disttrain train -m` in `cwd`: one job per entry of `runs` (name -> its own overrides), in that
    order, each with FAST + `common` too; in this process, or with `separate` in a process of its own,
    bounded by `budget` seconds per job (`run_disttrain`). `config_dir`: the
    user's own --config-dir, which gets the case/ group (else a new one in `cwd`)."""
    # a key both in `common` and in a run's own overrides would silently take common's value
    shared = {o.lstrip("+~").partition("=")[0] for o in common}
    for name, overrides in runs.items():
        clash = shared & {o.lstrip("+~").partition("=")[0] for o in overrides}
        assert not clash, f"run {name!r} sets {sorted(clash)}, which the sweep's common overrides set too"
    conf = config_dir or cwd / "sweep_conf"
    (conf / "case").mkdir(parents=True)
    cases = {f"j{i}": name for i, name in enumerate(runs)}
    for case, name in cases.items():
        (conf / "case" / f"{case}.yaml").write_text(case_yaml(runs[name]))
    pin = pinned_backend(
        *common, *(o for overrides in runs.values() for o in overrides)
    )  # gloo, unless `gpu`
    cmd = [CLI, "train", "-m", "--config-dir", str(conf), f"+case={','.join(cases)}", *FAST, *pin, *common]
    proc = run_disttrain(cmd, cwd, timeout=budget * len(runs), separate=separate)
    jobs: dict[str, Path | None] = dict.fromkeys(runs)
    for run_dir in find_run_dirs(cwd):
        case = next(
            o.partition("=")[2] for o in read_yaml(run_dir / "overrides.yaml") if o.startswith("+case=")
        )
        jobs[cases[case]] = run_dir
    return Sweep(cwd, jobs, cmd, proc.returncode, proc.stdout, proc.stderr)
