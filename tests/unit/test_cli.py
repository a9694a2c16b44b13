"""The real `disttrain` command: config printing, user folders and code, and every mistake's exit.

A mistake must exit 2 with one `disttrain: config error: KEY=VALUE ... Allowed: ... HINT: ...` line,
no traceback, and no run directory: the checks run in the parent before Hydra makes one and before
any rank starts. Every call runs in an empty scratch directory, which must stay empty.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from unit_support import (
    BAD_RUNTIME,
    BAD_STATIC,
    CLI_TIMEOUT,
    Bad,
    disttrain,
    disttrain_in_process,
    run,
    run_env,
    write_module,
)

from disttrain import __version__

ERROR_LINE = re.compile(
    r"^disttrain: config error: (?P<key>\S+?)=(?P<value>.*) is not valid\. Allowed: .+\. HINT: .+$"
)


def assert_config_error(
    proc: subprocess.CompletedProcess[str], bad: Bad, cwd: Path, leftovers: frozenset[str] = frozenset()
) -> None:
    out, err, rc = proc.stdout, proc.stderr, proc.returncode
    assert rc == 2, f"exit {rc}, expected 2\n--- stderr\n{err}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("disttrain: config error:")]
    assert len(lines) == 1, f"expected one error line\n--- stderr\n{err}"
    m = ERROR_LINE.match(lines[0])
    assert m is not None, f"not in the error format: {lines[0]}"
    assert (m["key"], m["value"]) == (bad.key, bad.shown(cwd)), lines[0]
    assert not (cwd / "runs").exists(), "a run dir was created for a config that cannot run"
    assert {p.name for p in cwd.iterdir()} <= leftovers, (
        f"left behind: {sorted(p.name for p in cwd.iterdir())}"
    )
    assert out == "", f"nothing on stdout for a mistake, got:\n{out}"


# ------------------------------------------------------------------------------------ mistakes
# Every mistake goes through `disttrain.cli.main` in this process (the console script's whole body);
# one also through the installed console script, for the exit status of a real process.
@pytest.mark.parametrize("bad", [b.param for b in BAD_STATIC])
def test_config_rejects_static_mistake(bad: Bad, scratch: Path) -> None:
    bad.make_files(scratch)
    proc = disttrain_in_process("config", *bad.argv, cwd=scratch)
    assert_config_error(proc, bad, scratch, leftovers=frozenset(bad.files))


TRAIN_CASES = [b.param for b in BAD_RUNTIME] + [
    b.param
    for b in BAD_STATIC
    if b.id in {"unknown-key", "unknown-option", "nproc-zero", "missing-config-dir", "sweep-without-m"}
]


@pytest.mark.timeout(60)  # a check that let the run through would launch (and be stopped here)
@pytest.mark.parametrize("bad", TRAIN_CASES)
def test_train_rejects_mistake_before_any_rank_starts(bad: Bad, scratch: Path) -> None:
    bad.make_files(scratch)
    proc = disttrain_in_process("train", *bad.argv, cwd=scratch)
    assert_config_error(proc, bad, scratch, leftovers=frozenset(bad.files))


def test_console_script_exits_2_on_a_mistake(scratch: Path) -> None:
    """The installed console script, once: a runtime mistake of `train` (after the torch import)
    is exit status 2 of a real process. Every mistake's message is checked in-process above.
    The timeout bounds it: a check that let the run through would launch (and be killed here)."""
    bad = BAD_RUNTIME[1]
    bad.make_files(scratch)
    proc = disttrain("train", *bad.argv, cwd=scratch, timeout=CLI_TIMEOUT)
    assert_config_error(proc, bad, scratch, leftovers=frozenset(bad.files))


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_train_announces_its_first_phase_before_composing(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2026-11-28-ux #1: 10-36 s under one static line on a terminal, nothing when piped.
    The first phase is on stderr before the config is composed (before Hydra is imported), on a
    terminal as a live line that ends before the error, off a terminal as plain lines; stdout
    (the result only) gets nothing of it."""
    from disttrain.cli import main
    from disttrain.commands import train
    from disttrain.observe.phases import ENTER_ENV, PHASE_LINE

    compose_checked = train._compose_checked
    said_first: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        said_first.append(err.getvalue())
        return compose_checked(*args, **kwargs)

    monkeypatch.setattr(train, "_compose_checked", spy)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() appends the cwd
    monkeypatch.delenv(ENTER_ENV, raising=False)  # main() sets it for the ranks
    monkeypatch.setenv("TERM", "xterm")  # a terminal that can rewrite a line
    monkeypatch.chdir(scratch)
    err, out = _Terminal(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(["train", "trainer.max_epoch=5"])
    assert (rc, out.getvalue()) == (2, "")
    assert len(said_first) == 1 and "disttrain: compose" in said_first[0] and "\n" not in said_first[0]
    live, error = err.getvalue().split("\n")[:2]  # the live line ends before the error starts
    assert live.startswith("\r\x1b[Kdisttrain: compose") and "\n" not in live, repr(err.getvalue())
    assert error.startswith("disttrain: config error: trainer.max_epoch=5 "), repr(err.getvalue())
    piped = disttrain_in_process("train", "trainer.max_epoch=5", cwd=scratch)
    assert piped.stderr.splitlines()[0] == "disttrain: compose ..." and piped.returncode == 2
    assert all(PHASE_LINE.match(line) for line in piped.stderr.splitlines()[:-1]), piped.stderr
    assert list(scratch.iterdir()) == []


NET = """
from torch import nn


class Net(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)
"""


def test_train_rejects_user_model_missing_a_required_argument(scratch: Path) -> None:
    write_module(scratch, "mylab.nets", NET)
    wiring = ("model.in_features=${data.num_features}", "model.num_classes=${data.num_classes}")
    proc = disttrain_in_process("train", "model._target_=mylab.nets.Net", *wiring, cwd=scratch)
    assert_config_error(
        proc, Bad("missing-arg", (), "model.width", "(missing)"), scratch, frozenset({"mylab"})
    )
    assert "model.width=VALUE" in proc.stderr and "+model.width" not in proc.stderr


CNN = """
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, hidden_size: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_classes))

    def forward(self, x):
        return self.body(x)
"""


@pytest.mark.parametrize("plus", ["", "+"])
def test_train_rejects_a_typo_in_a_user_model_argument(scratch: Path, plus: str) -> None:
    """Real-clients review §5: `+model.hiden_size=128` used to train the default model, exit 0."""
    write_module(scratch, "mycnn", CNN)
    proc = disttrain_in_process(
        "train", "model._target_=mycnn.SmallCNN", "model.num_classes=10", f"{plus}model.hiden_size=128",
        cwd=scratch,
    )  # fmt: skip
    bad = Bad("typo", (), "model.hiden_size", "128")
    assert_config_error(proc, bad, scratch, frozenset({"mycnn.py", "__pycache__"}))
    assert "did you mean model.hidden_size?" in proc.stderr


def test_unknown_subcommand(scratch: Path) -> None:
    proc = disttrain_in_process("frobnicate", "optim.lr=1", cwd=scratch)
    assert proc.returncode == 2
    assert "unknown command 'frobnicate'" in proc.stderr and "train, config" in proc.stderr
    assert "HINT:" in proc.stderr and "Traceback" not in proc.stderr
    assert list(scratch.iterdir()) == []


# -------------------------------------------------------------------------------- good commands
def test_config_prints_the_resolved_yaml(scratch: Path) -> None:
    proc = disttrain_in_process(
        "config", "optim.lr=1e-2", "model.hidden=[256,256]", "data=synthetic", "seed=7", cwd=scratch
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["optim"]["lr"] == pytest.approx(1e-2)
    assert cfg["model"]["hidden"] == [256, 256]
    assert (cfg["data"]["name"], cfg["seed"]) == ("synthetic", 7)
    assert (cfg["model"]["in_features"], cfg["model"]["num_classes"]) == (32, 4), "interpolations resolved"
    assert "${" not in proc.stdout and "hydra" not in cfg
    assert list(scratch.iterdir()) == [], "`disttrain config` writes nothing"


def test_config_dir_with_a_user_experiment(scratch: Path) -> None:
    exp = scratch / "myconfigs" / "experiment"
    exp.mkdir(parents=True)
    (exp / "paper.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /data: synthetic\n  - override /optim: sgd\n"
        "name: paper\noptim:\n  lr: 0.123\ntrainer:\n  max_steps: 7\n"
    )
    proc = disttrain_in_process(
        "config", "--config-dir", "myconfigs", "experiment=paper", "seed=3", cwd=scratch
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["name"], cfg["data"]["name"], cfg["optim"]["_target_"]) == (
        "paper",
        "synthetic",
        "torch.optim.SGD",
    )
    assert (cfg["optim"]["lr"], cfg["trainer"]["max_steps"], cfg["seed"]) == (0.123, 7, 3)
    # `train --cfg job` goes through @hydra.main itself: the same folder, the same result, no run dir.
    proc = disttrain_in_process(
        "train",
        "--config-dir",
        "myconfigs",
        "experiment=paper",
        "seed=3",
        "--cfg",
        "job",
        "--resolve",
        cwd=scratch,
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == cfg
    assert {p.name for p in scratch.iterdir()} == {"myconfigs"}


def test_user_model_target_importable_from_the_working_directory(scratch: Path) -> None:
    write_module(scratch, "mylab.nets", NET)
    proc = disttrain_in_process(
        "config", "model._target_=mylab.nets.Net", "model.width=512", "model.in_features=${data.num_features}",
        cwd=scratch,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model = yaml.safe_load(proc.stdout)["model"]
    assert model == {"_target_": "mylab.nets.Net", "width": 512, "in_features": 64}, "a clean node"


def test_train_cfg_job_prints_the_settled_node_of_a_swapped_target(scratch: Path) -> None:
    write_module(scratch, "mylab.nets", NET)
    proc = disttrain_in_process(
        "train", "model._target_=mylab.nets.Net", "model.width=8", "--cfg", "job", cwd=scratch
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"] == {"_target_": "mylab.nets.Net", "width": 8}
    assert {p.name for p in scratch.iterdir()} == {"mylab"}


def test_train_cfg_job_prints_without_launching(scratch: Path) -> None:
    proc = disttrain_in_process("train", "optim.lr=0.5", "--cfg", "job", cwd=scratch)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["optim"]["lr"] == 0.5
    assert list(scratch.iterdir()) == []


def test_train_cfg_job_prints_what_config_yaml_will_hold(scratch: Path) -> None:
    """configuration.md: `--cfg job` is "what config.yaml would hold": every `${...}` resolved
    (docs-as-written review 2E: it printed `in_features: ${data.num_features}`)."""
    proc = disttrain_in_process("train", "--cfg", "job", cwd=scratch)
    assert proc.returncode == 0, proc.stderr
    assert "${" not in proc.stdout
    job = yaml.safe_load(proc.stdout)
    assert job["model"]["in_features"] == 64 and job["model"]["num_classes"] == 10
    assert isinstance(job["nproc_per_node"], int), "frozen as a number, as config.yaml holds it"


def test_train_cfg_hydra_resolve_resolves_against_the_job(scratch: Path) -> None:
    """Hydra drops the job's keys before resolving `hydra`, so its `${name}` failed with a traceback."""
    proc = disttrain_in_process("train", "name=paper", "--cfg", "hydra", "--resolve", cwd=scratch)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    hydra = yaml.safe_load(proc.stdout)["hydra"]
    assert hydra["run"]["dir"].startswith("runs/paper/") and "${" not in hydra["run"]["dir"]
    assert hydra["sweep"]["subdir"] == "???", "hydra.job.num exists only in a running sweep job"
    assert "help" not in hydra and hydra["runtime"]["choices"]["strategy"] == "ddp"
    assert list(scratch.iterdir()) == []


def test_help_and_version(scratch: Path, no_torch_report: dict[str, dict]) -> None:
    for args in ((), ("--help",), ("help",)):
        proc = disttrain_in_process(*args, cwd=scratch)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: disttrain"), proc.stderr
        assert "train" in proc.stdout and "config" in proc.stdout
    proc = disttrain_in_process("--version", cwd=scratch)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"disttrain {__version__}")
    # `train --help` (Hydra's help: ~3 CPU-s) as the torch-free run below printed it (it wrote nothing).
    train_help = no_torch_report["train --help"]
    assert train_help["rc"] == 0, train_help["stderr"]
    stdout = train_help["stdout"]
    for group in ("backend", "strategy", "model", "data", "optim", "sched", "launcher", "experiment"):
        assert f"{group}:" in stdout, f"`train --help` lists the {group} group"
    assert "strategy: ddp, dp, fsdp, fsdp+tp, hsdp, localsgd, pipeline, single, tp, zero, zero2\n" in stdout
    assert "base_" not in stdout.split("== Config keys")[0], "schemas are not options"
    assert list(scratch.iterdir()) == []


def test_train_help_is_one_page_listing_each_key_once_with_help(no_torch_report: dict[str, dict]) -> None:
    """Docs-as-written review 3.11: `train --help` was 250 lines, Hydra's dump of the whole config
    and then the key table with the same keys, and optim.lr, data.num_features had no help text.
    Now: the groups and their options, then each key once (key=default, type), its help below it;
    review 2026-11-28-ux #10: no line wider than 100 columns (120 of 147 lines were over 120)."""
    import textwrap

    from disttrain.config import compose
    from disttrain.config.keyhelp import INDENT, WIDTH, key_rows

    stdout = no_torch_report["train --help"]["stdout"]
    lines = stdout.splitlines()
    assert "== Config ==" not in stdout and "_target_: disttrain.models.mlp.MLP" not in stdout, "no dump"
    assert WIDTH == 100 and max(map(len, lines)) <= WIDTH, max(lines, key=len)
    for key, kind, default, text in key_rows(compose([])):
        at = [i for i, line in enumerate(lines) if line.split("=", 1)[0].split(" ", 1)[0] == key]
        assert len(at) == 1, f"{key} is shown {len(at)} times"
        head = lines[at[0]]
        assert head == (f"{key}  ({kind})" if kind == "group" else f"{key}={default}  ({kind})"), head
        below = []
        for line in lines[at[0] + 1 :]:
            if not line.startswith(INDENT):
                break
            below.append(line[len(INDENT) :])
        assert text.strip() and " ".join(below) == " ".join(textwrap.wrap(text, WIDTH)), f"{key}: {below}"
    assert lines[-1] == "Use --hydra-help to view Hydra specific help"


def test_train_help_is_printed_without_hydra_and_is_what_hydra_renders(scratch: Path) -> None:
    """`train --help` took 4.5-5.9 CPU-s (review 2026-11-28-ux #10: Hydra's app_help deep-copies the
    config repository 159 times): it prints the page rendered ahead of time (commands/train_help.txt,
    `python -m disttrain.commands.train_help` writes it), importing neither Hydra nor torch; the
    page must be what rendering prints today. Speed itself: scripts/bench_help.py, not asserted."""
    from disttrain.commands.train_help import PAGE, fingerprint, render

    code = (
        "import sys; from disttrain.cli import main; rc = main(['train', '--help']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'torch', 'omegaconf')); "
        "sys.stderr.write(repr(heavy)); raise SystemExit(rc)"
    )
    proc = run([sys.executable, "-c", code], scratch)
    assert proc.returncode == 0 and proc.stderr == "[]", proc.stderr[-2000:]
    stale = "stale: run `python -m disttrain.commands.train_help`"
    assert PAGE.read_text(encoding="utf-8") == f"fingerprint {fingerprint()}\n{proc.stdout}", stale
    assert render() == proc.stdout, stale


# ------------------------------------------------------------------------------- no torch import
NO_TORCH_ARGVS = [
    ["--help"],
    ["config"],
    ["config", "optim.lr=1e-2", "model.hidden=[256,256]", "data=synthetic", "seed=7"],
    ["config", "experiment=digits_sgd", "strategy=single", "nproc_per_node=1"],
    ["train", "--help"],
    ["train", "--cfg", "job"],
]

# One fresh interpreter runs the commands one after the other and reports, after each, its exit
# status and whether torch is imported by then (sys.modules only grows: the first command that
# imports torch is the first with `torch` true, and every later one fails too).
NO_TORCH = """
import contextlib, io, json, sys
from disttrain.cli import main
report = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            rc = main(argv)
        except SystemExit as exc:  # Hydra's --help and --cfg exit through SystemExit
            rc = exc.code or 0
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    report.append({"rc": rc, "torch": heavy[:5], "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]})
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def no_torch_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cwd = tmp_path_factory.mktemp("no_torch")
    proc = run([sys.executable, "-c", NO_TORCH, json.dumps(NO_TORCH_ARGVS)], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == [], "none of these commands writes a file"
    return {" ".join(argv): r for argv, r in zip(NO_TORCH_ARGVS, json.loads(proc.stdout), strict=True)}


@pytest.mark.parametrize("argv", NO_TORCH_ARGVS, ids=" ".join)
def test_command_does_not_import_torch(argv: list[str], no_torch_report: dict[str, dict]) -> None:
    report = no_torch_report[" ".join(argv)]
    assert report["rc"] == 0, report["stderr"]
    assert report["torch"] == [], f"`disttrain {' '.join(argv)}` (or one before it) imported torch"


@pytest.mark.parametrize("argv", [["--help"], ["config"]], ids=" ".join)
def test_console_script_does_not_import_torch(argv: list[str], scratch: Path) -> None:
    """The installed entry point itself, measured by Python's own import profiler."""
    proc = disttrain(*argv, cwd=scratch, env=run_env(PYTHONPROFILEIMPORTTIME="1"))
    assert proc.returncode == 0, proc.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "yaml" in imported or argv == ["--help"], "the import profile was captured"
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


# ----------------------------------------------------------------- D7: the cwd is not trusted
SHADOW = "import pathlib\npathlib.Path(__file__).with_name('PWNED').write_text('ran')\nraise ImportError('shadow')\n"


@pytest.mark.parametrize("argv", [["runs"], ["config"], ["show", "nowhere"], ["env", "--json"]], ids=" ".join)
def test_read_only_commands_never_import_from_the_cwd(argv: list[str], scratch: Path) -> None:
    """A `yaml.py` (or `rich.py`) lying in the working directory is not run by a listing."""
    for module in ("yaml", "rich", "omegaconf"):
        (scratch / f"{module}.py").write_text(SHADOW)
    proc = disttrain(*argv, cwd=scratch, timeout=120)
    assert not (scratch / "PWNED").exists(), f"`disttrain {' '.join(argv)}` ran a module from the cwd"
    assert "shadow" not in proc.stderr


def test_train_appends_the_cwd_after_the_dependencies(scratch: Path) -> None:
    """`train` still finds the user's own package in the cwd, but a stray yaml.py never shadows."""
    (scratch / "yaml.py").write_text(SHADOW)
    write_module(scratch, "mylab.nets", NET)
    proc = disttrain("train", "model._target_=mylab.nets.Net", cwd=scratch, timeout=CLI_TIMEOUT)
    assert not (scratch / "PWNED").exists()
    assert proc.returncode == 2 and "model.width" in proc.stderr, proc.stderr  # imported mylab.nets


# ------------------------------------------------------- D20: `+` only where a class reads the key
def test_typo_in_typed_block_suggests_the_key_not_plus(scratch: Path) -> None:
    for argv in (["trainer.max_step=10"], ["+trainer.max_step=10"]):
        proc = disttrain_in_process("config", *argv, cwd=scratch)
        assert proc.returncode == 2, proc.stderr
        assert "did you mean trainer.max_steps?" in proc.stderr
        assert "+trainer.max_step=VALUE" not in proc.stderr, "never recommend + into a typed block"


def test_plus_still_adds_keys_under_a_target(scratch: Path) -> None:
    proc = disttrain_in_process("config", "+optim.amsgrad=true", "+model.note=x", cwd=scratch)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["optim"]["amsgrad"], cfg["model"]["note"]) == (True, "x")


def test_a_runs_task_overrides_leave_out_hydras_own() -> None:
    """What a run freezes as its overrides (overrides.yaml), as Hydra's hydra.overrides.task lists them."""
    from disttrain.commands.train import task_overrides

    given = ["optim.lr=1e-3", "hydra.run.dir=/x", "++hydra.job.chdir=true", "hydra/launcher=basic", "+seed=3"]
    assert task_overrides(given) == ["optim.lr=1e-3", "+seed=3"]
    assert task_overrides(["~hydra.job.env_set", "model=gpt", "hydrate=1"]) == ["model=gpt", "hydrate=1"]
