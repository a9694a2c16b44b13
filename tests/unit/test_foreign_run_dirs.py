"""Run dirs made by others are data (review 2026-11-25-reliability, D1, D2 and D4).

D4: a folder of a run dir that is a symbolic link (`checkpoints -> ../victim/checkpoints`) was
followed: keep-N and the `.tmp-*` cleanup deleted another run's checkpoints, `export` overwrote an
outside model. D2: `export` of a checkpoint folder took the config.yaml of any parent, up to `/`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from unit_support import checked, disttrain_in_process, said

from disttrain.commands.export import owning_run_dir
from disttrain.config.errors import ConfigError
from disttrain.rundir import OWN_FOLDERS, git_state, planted_links, refuse_planted_links
from disttrain.trust import check_trusted, foreign_targets, made_by_me, sign, take_trust_flag


@pytest.fixture(scope="module")
def saved() -> dict:
    return checked(["data=synthetic", "trainer.max_steps=30"])


def _run(root: Path, cfg: dict, name: str = "run") -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run / "command.txt").write_text("disttrain train data=synthetic trainer.max_steps=30\n")
    (run / "status.json").write_text(json.dumps({"status": "finished", "pid": 1, "host": "elsewhere"}))
    return run


def _victim(root: Path) -> Path:
    ckpts = root / "victim" / "checkpoints"
    (ckpts / "step_00000010").mkdir(parents=True)
    (ckpts / ".tmp-keepme").mkdir()
    (ckpts / ".tmp-keepme" / "notes.txt").write_text("important")
    return ckpts


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_resume_refuses_a_planted_checkpoints_link_and_touches_nothing(saved: dict, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    before = _tree(victim)
    run = _run(tmp_path, saved)
    (run / "checkpoints").symlink_to(victim)
    proc = disttrain_in_process("resume", str(run), "checkpoint.keep=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert "checkpoints/ is a symbolic link" in proc.stderr and "checkpoint.dir=" in proc.stderr
    assert _tree(victim) == before
    assert not (run / "logs").exists()  # no rank started


@pytest.mark.parametrize("folder", ["logs", "tensorboard", "profile", "export"])
def test_every_own_folder_is_checked(saved: dict, tmp_path: Path, folder: str) -> None:
    run = _run(tmp_path, saved)
    (tmp_path / "elsewhere").mkdir()
    (run / folder).symlink_to(tmp_path / "elsewhere")
    assert folder in OWN_FOLDERS
    with pytest.raises(ConfigError, match=f"{folder}/ is a symbolic link"):
        refuse_planted_links(run, "RUN_DIR", saved)


def test_an_explicit_checkpoint_dir_may_be_a_link(saved: dict, tmp_path: Path) -> None:
    """checkpoint.dir set: the run never uses <run dir>/checkpoints, whatever it is."""
    run = _run(tmp_path, saved)
    (run / "checkpoints").symlink_to(_victim(tmp_path))
    cfg = {**saved, "checkpoint": {**saved["checkpoint"], "dir": str(tmp_path / "mine")}}
    assert planted_links(run, cfg) == {}
    assert planted_links(run, saved) == {"checkpoints": str(tmp_path / "victim" / "checkpoints")}


def test_export_refuses_a_planted_export_link(saved: dict, tmp_path: Path) -> None:
    models = tmp_path / "victim_models"
    models.mkdir()
    (models / "model.pt").write_text("precious model")
    run = _run(tmp_path, saved)
    (run / "export").symlink_to(models)
    proc = disttrain_in_process("export", str(run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "export/ is a symbolic link" in proc.stderr
    assert (models / "model.pt").read_text() == "precious model"


def test_export_never_takes_a_config_from_a_folder_above_the_run(saved: dict, tmp_path: Path) -> None:
    """D2: a config.yaml dropped into a parent folder (/tmp, /mnt/shared) is not a run's config."""
    planted = {**saved, "model": {"_target_": "builtins.print", "_args_": ["PAYLOAD"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(planted))
    step = tmp_path / "shared" / "ckpts" / "step_00000030"
    step.mkdir(parents=True)
    proc = disttrain_in_process("export", str(step), "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "PAYLOAD" not in proc.stdout + proc.stderr
    assert said(proc.stderr)[0].startswith(f"disttrain: config error: RUN_DIR={step} is not valid"), (
        proc.stderr
    )


def test_export_finds_the_run_of_its_own_checkpoints(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved)
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    assert owning_run_dir(step, str(step)) == run
    assert owning_run_dir(step.parent, str(step.parent)) == run
    assert owning_run_dir(run, str(run)) == run
    nested = run / "checkpoints" / "step_00000010" / "deeper"
    nested.mkdir()
    with pytest.raises(ConfigError):
        owning_run_dir(nested, str(nested))


# ------------------------------------------------------------------------------------------------ D1
# `rerun`, `resume` and `export` of a run dir someone else made built its config's `_target_`s:
# `sympy.sympify` (not on Hydra's blocklist; sympy ships with torch) evaluates a string.


def _payload(marker: Path) -> dict:
    code = f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')*0"
    return {"_target_": "builtins.float", "_args_": [{"_target_": "sympy.sympify", "a": code}]}


@pytest.fixture
def own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This user's signing key in a folder of the test's own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "disttrain" / "run-key"


def _foreign_copy(tmp_path: Path, saved: dict, edit: Callable[[dict], None]) -> Path:
    """A run dir as someone sends it: a config.yaml disttrain never signed for this user."""
    cfg = json.loads(json.dumps(saved))
    edit(cfg)
    return _run(tmp_path, cfg, "foreign")


@pytest.mark.parametrize(
    "command",
    [
        ["rerun", "{run}", "--run-dir", "{tmp}/rr"],
        ["resume", "{run}"],
        ["export", "{run}", "--out", "{tmp}/m.pt"],
    ],
)
def test_a_foreign_config_payload_never_runs(
    saved: dict, tmp_path: Path, own_key: Path, command: list
) -> None:
    marker = tmp_path / "PWNED"
    run = _foreign_copy(
        tmp_path, saved, lambda c: c["task"]["criterion"].__setitem__("label_smoothing", _payload(marker))
    )
    args = [a.format(run=run, tmp=tmp_path) for a in command]
    proc = disttrain_in_process(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert (
        "task.criterion.label_smoothing._args_[0]=sympy.sympify" in proc.stderr and "--trust" in proc.stderr
    )
    assert not (tmp_path / "rr").exists() and not (tmp_path / "m.pt").exists()


# Gadgets the review did not list: each would write or run something if built.
HELD_OUT = {
    "open_w": lambda c, m: c.__setitem__("model", {"_target_": "builtins.open", "file": str(m), "mode": "w"}),
    "copyfile": lambda c, m: c["data"].__setitem__(
        "train", {"_target_": "shutil.copyfile", "src": "/etc/hostname", "dst": str(m)}
    ),
    "in_a_list": lambda c, m: c["optim"].__setitem__(
        "betas", [0.9, {"_target_": "builtins.exec", "_args_": [f"open({str(m)!r}, 'w')"]}]
    ),
    "torch_hub": lambda c, m: c.__setitem__(
        "model", {"_target_": "torch.hub.load", "repo_or_dir": str(m), "model": "x", "source": "local"}
    ),
    "runpy": lambda c, m: c["sched"].__setitem__("_target_", "runpy.run_path"),
}


@pytest.mark.parametrize("gadget", sorted(HELD_OUT))
def test_held_out_gadgets_are_refused_before_anything_is_built(
    saved: dict, tmp_path: Path, own_key: Path, gadget: str
) -> None:
    marker = tmp_path / "PWNED"
    run = _foreign_copy(tmp_path, saved, lambda c: HELD_OUT[gadget](c, marker))
    proc = disttrain_in_process("rerun", str(run), "--run-dir", str(tmp_path / "rr"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--trust" in proc.stderr and not marker.exists()


def test_builtin_targets_need_no_trust(saved: dict, tmp_path: Path, own_key: Path) -> None:
    run = _foreign_copy(tmp_path, saved, lambda c: None)
    assert foreign_targets(saved) == []
    check_trusted(run, saved, trusted=False)  # disttrain's and torch's own classes only


def test_own_runs_are_signed_and_an_edit_breaks_the_signature(
    saved: dict, tmp_path: Path, own_key: Path
) -> None:
    cfg = {**saved, "model": {"_target_": "mylab.models.Net", "width": 8}}
    run = _run(tmp_path, cfg)
    assert not made_by_me(run)
    sign(run)
    assert own_key.stat().st_mode & 0o777 == 0o600
    assert made_by_me(run)
    check_trusted(run, cfg, trusted=False)  # the user's own code, in the user's own run
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("width: 8", "width: 9"))
    assert not made_by_me(run)
    with pytest.raises(ConfigError, match=r"model=mylab\.models\.Net"):
        check_trusted(run, cfg, trusted=False)
    check_trusted(run, cfg, trusted=True)  # --trust: the user's explicit consent


def test_trust_flag_lets_a_foreign_rerun_through_the_check(
    saved: dict, tmp_path: Path, own_key: Path
) -> None:
    marker = tmp_path / "PWNED"
    run = _foreign_copy(tmp_path, saved, lambda c: c.__setitem__("seed", _payload(marker)))
    args, trusted = take_trust_flag(["rerun", str(run), "--trust", "seed=1"])
    assert trusted and args == ["rerun", str(run), "seed=1"]


def test_git_never_runs_the_repos_fsmonitor(tmp_path: Path) -> None:
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    marker = tmp_path / "FSMONITOR"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.txt").write_text("a")
    subprocess.run(["git", "-C", str(repo), "add", "a.txt"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=True,
    )
    hook = repo / "monitor.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    subprocess.run(["git", "-C", str(repo), "config", "core.fsmonitor", str(hook)], check=True)
    (repo / "a.txt").write_text("b")
    state = git_state(repo)
    assert state["dirty"] is True and not marker.exists()


def test_export_of_checkpoints_elsewhere_takes_the_named_config(saved: dict, tmp_path: Path) -> None:
    """D2's fix leaves one way to export a checkpoint folder outside its run dir: --config."""
    run = _run(tmp_path, saved)
    step = tmp_path / "shared" / "ckpts" / "step_00000030"
    step.mkdir(parents=True)
    proc = disttrain_in_process("export", str(step), "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    assert proc.returncode == 2 and "--config RUN_DIR/config.yaml" in proc.stderr, proc.stderr
    named = ("--config", str(run / "config.yaml"), "--out", str(tmp_path / "w.pt"))
    proc = disttrain_in_process("export", str(step), *named, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr  # the config is taken; the (empty) folder has no checkpoint
    assert "a run dir with a committed checkpoint" in proc.stderr and str(step) in proc.stderr
    proc = disttrain_in_process("export", str(step), "--config", str(tmp_path / "x.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and said(proc.stderr)[0].startswith("disttrain: config error: --config="), (
        proc.stderr
    )


# ------------------------------------------------------------------- review 2026-11-28-reliability D1
# The allow-list was a text prefix: Hydra walks attributes, so names under `torch.nn.` and
# `disttrain.` reached torch.load(weights_only=False) and a writer of any path.


def _review_payload(tmp: Path) -> dict:
    """The review's D1 reproduction: write a protocol-0 pickle, then torch.load it unsafely."""
    return {
        "_target_": "torch.nn.init.torch.load",
        "weights_only": False,
        "f": {
            "_target_": "disttrain.safefile.write_text_atomic",
            "path": {"_target_": "disttrain.safefile.Path", "_args_": [str(tmp / "evil.pkl")]},
            "text": f"cos\nsystem\n(S'echo PWNED >> {tmp / 'PWN'}'\ntR.",
        },
    }


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "{run}"],
        ["resume", "{run}"],
    ],
)
def test_d1_attribute_walks_under_builtin_prefixes_never_run(
    saved: dict, tmp_path: Path, own_key: Path, command: list
) -> None:
    payload = _review_payload(tmp_path)
    run = _foreign_copy(
        tmp_path, saved, lambda c: c["task"]["criterion"].__setitem__("label_smoothing", payload)
    )
    (run / "checkpoints" / "step_00000030").mkdir(parents=True)  # eval looks for one first
    proc = disttrain_in_process(*[a.format(run=run) for a in command], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    # eval's look at the (empty) checkpoint may log one line first; the refusal is one paragraph
    said = proc.stderr.strip().splitlines()[-1]
    assert said.startswith("disttrain: config error: RUN_DIR=") and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    assert "label_smoothing=torch.nn.init.torch.load" in said and "--trust" in said
    assert "f=disttrain.safefile.write_text_atomic" in said
    assert not (tmp_path / "evil.pkl").exists() and not (tmp_path / "PWN").exists()


D1_REFUSED = [
    "torch.nn.init.torch.load",  # a module re-exported under another module's name
    "disttrain.rng.torch.load",
    "disttrain.launch.slurm.shutil.copyfile",
    "disttrain.safefile.write_text_atomic",  # disttrain's own, but a writer of any path
    "disttrain.safefile.Path",
    "disttrain.__main__.main",  # importing it runs the CLI
    "torch.nn.Module.__init__.__globals__",
    "torch.optim.SGD.step",
    "torch.nn.functional.handle_torch_function",  # re-exported from torch.overrides
    "torch.nn.no_such_thing",
    "torch.nnx.Linear",
]
D1_ALLOWED = [
    "torch.nn.Linear",
    "torch.nn.CrossEntropyLoss",
    "torch.nn.functional.mse_loss",
    "torch.optim.AdamW",
    "torch.optim.lr_scheduler.StepLR",
    "torch.optim.lr_scheduler.ReduceLROnPlateau",
    "disttrain.models.gpt.GPT",
    "disttrain.testing.FaultMLP",
    "disttrain.tasks.Classification",
    "disttrain.data.tokens.load_tokens",
    "disttrain.models.gpt.gpt_tp_plan",
]


def test_d1_trust_checks_the_object_a_target_names_not_its_text() -> None:
    from disttrain.trust import builtin_object

    assert [t for t in D1_REFUSED if builtin_object(t)] == []
    assert [t for t in D1_ALLOWED if not builtin_object(t)] == []


def test_d1_every_builtin_options_target_needs_no_trust() -> None:
    from disttrain.config.schema import OptimConfig  # noqa: F401 - the schema's own targets below
    from disttrain.data.specs import DATA
    from disttrain.models.specs import MODELS
    from disttrain.tasks.specs import TASKS
    from disttrain.trust import builtin_object

    builtin = [s.target for r in (DATA, MODELS, TASKS) for s in r.all()]
    builtin += ["torch.optim.AdamW", "torch.optim.SGD", "torch.optim.lr_scheduler.OneCycleLR"]
    assert len(builtin) >= 13
    assert [t for t in builtin if not builtin_object(t)] == []


# ------------------------------------------------------------------- review 2026-11-28-reliability D2
# `launcher.kubectl` of a foreign config.yaml was a program `disttrain resume` ran.


def _k8s(cfg: dict, kubectl: str) -> None:
    cfg["launcher"] = {"name": "k8s", "image": "busybox", "kubectl": kubectl, "dry_run": False}


def test_d2_a_foreign_kubectl_is_never_run(saved: dict, tmp_path: Path, own_key: Path) -> None:
    marker = tmp_path / "PWNED"
    run = _foreign_copy(tmp_path, saved, lambda c: _k8s(c, "sh"))
    (run / "apply").write_text(f"echo PWNED >> {marker}\n")
    proc = disttrain_in_process("resume", ".", "trainer.max_steps=40", cwd=run)
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert "run launcher.kubectl=sh" in proc.stderr and "launcher.kubectl=YOURS" in proc.stderr
    assert "launcher.image=busybox" in proc.stderr and "--trust" in proc.stderr
    assert not marker.exists() and not (run / "k8s").exists()


def test_d2_program_keys_come_from_the_command_line_or_stay_default(saved: dict) -> None:
    from disttrain.trust import foreign_programs

    cfg = json.loads(json.dumps(saved))
    _k8s(cfg, "sh")
    assert foreign_programs(cfg) == [("launcher.kubectl", "sh"), ("launcher.image", "busybox")]
    given = ["launcher.kubectl=/usr/bin/kubectl", "launcher.image=mine:1"]
    assert foreign_programs(cfg, given) == []
    assert foreign_programs(cfg, ["launcher=spawn"]) == []  # the whole launcher replaced
    _k8s(cfg, "kubectl")
    assert foreign_programs(cfg, ["launcher.image=mine:1"]) == []  # the default: the user's PATH
    assert foreign_programs(saved) == []  # a local launcher names no program


# ------------------------------------------------------------- trust review of D1's fix (2026-11-28)
# A frozen config.yaml holds no interpolation; a foreign one's `${oc.create:...}` / `${oc.decode:...}`
# became a `_target_` node when `apply_overrides` resolved the config, after the check looked.

INTERPOLATED = {
    "oc_create": "${oc.create:{_target_: builtins.open, file: '%s', mode: w}}",
    "oc_decode": "${oc.decode:'{_target_: builtins.open, file: \"%s\", mode: w}'}",
    "escaped": "\\${oc.create:{_target_: builtins.open, file: '%s', mode: w}}",
}


@pytest.mark.parametrize("form", sorted(INTERPOLATED))
def test_a_foreign_interpolation_that_builds_a_target_is_refused(
    saved: dict, tmp_path: Path, own_key: Path, form: str
) -> None:
    marker = tmp_path / "PWNED"
    payload = INTERPOLATED[form] % marker
    run = _foreign_copy(
        tmp_path, saved, lambda c: c["task"]["criterion"].__setitem__("label_smoothing", payload)
    )
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert foreign_targets(cfg) == []  # no `_target_` is visible before resolution
    with pytest.raises(ConfigError) as refused:
        check_trusted(run, cfg, trusted=False)
    said = str(refused.value)
    assert f"resolve task.criterion.label_smoothing={payload}" in said and "--trust" in said
    assert not marker.exists()
    check_trusted(run, cfg, trusted=True)  # --trust: the user's consent
    sign(run)
    check_trusted(run, cfg, trusted=False)  # in the user's own run it is the user's own config


def test_a_foreign_interpolation_never_runs_through_the_cli(
    saved: dict, tmp_path: Path, own_key: Path
) -> None:
    marker = tmp_path / "PWNED"
    payload = INTERPOLATED["oc_create"] % marker
    run = _foreign_copy(
        tmp_path, saved, lambda c: c["task"]["criterion"].__setitem__("label_smoothing", payload)
    )
    proc = disttrain_in_process("rerun", str(run), "--run-dir", str(tmp_path / "rr"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert (
        said(proc.stderr)[0].startswith("disttrain: config error: RUN_DIR=")
        and "resolve task.criterion" in proc.stderr
    )
    assert not marker.exists() and not (tmp_path / "rr").exists()


def test_d2_slurm_extra_lines_and_k8s_env_are_programs(saved: dict, tmp_path: Path, own_key: Path) -> None:
    """`#SBATCH --export=ALL,BASH_ENV=x.sh` makes the job's bash source x.sh; a pod's LD_PRELOAD or
    PYTHONPATH picks the code its python runs: both came from a foreign config.yaml unasked."""
    from disttrain.trust import foreign_programs

    slurm = json.loads(json.dumps(saved))
    slurm["launcher"] = {"name": "slurm", "extra": ["#SBATCH --export=ALL,BASH_ENV=x.sh"], "dry_run": False}
    assert foreign_programs(slurm) == [("launcher.extra", "['#SBATCH --export=ALL,BASH_ENV=x.sh']")]
    assert foreign_programs(slurm, ["launcher.extra=[]"]) == []
    slurm["launcher"]["extra"] = []  # the schema's default
    assert foreign_programs(slurm) == []
    k8s = json.loads(json.dumps(saved))
    _k8s(k8s, "kubectl")
    k8s["launcher"]["env"] = {"LD_PRELOAD": "/runs/x.so"}
    assert foreign_programs(k8s, ["launcher.image=mine:1"]) == [
        ("launcher.env", "{'LD_PRELOAD': '/runs/x.so'}")
    ]
    assert foreign_programs(k8s, ["launcher.image=mine:1", "launcher.env={}"]) == []
    k8s["launcher"]["env"] = {}
    assert foreign_programs(k8s, ["launcher.image=mine:1"]) == []
    run = _foreign_copy(
        tmp_path,
        saved,
        lambda c: c.__setitem__("launcher", slurm["launcher"] | {"extra": ["#SBATCH --output=/x"]}),
    )
    with pytest.raises(ConfigError, match=r"run launcher\.extra=\['#SBATCH --output=/x'\]"):
        check_trusted(run, yaml.safe_load((run / "config.yaml").read_text()), trusted=False, launches=[])


def test_d3_a_foreign_checkpoint_dir_outside_the_run_is_never_written(
    saved: dict, tmp_path: Path, own_key: Path
) -> None:
    """A copy whose checkpoint.dir named one of this user's folders: resume saved there, deleted its
    `.tmp-*` entries and pruned its step_* folders (no owner.json to refuse them), exit 0."""
    mine = tmp_path / "mine"
    (mine / ".tmp-notes").mkdir(parents=True)
    (mine / ".tmp-notes" / "notes.txt").write_text("precious")
    (mine / "step_00000001").mkdir()
    before = _tree(mine)
    run = _foreign_copy(tmp_path, saved, lambda c: c["checkpoint"].update(dir=str(mine), keep=1))
    proc = disttrain_in_process("resume", str(run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert f"write into checkpoint.dir={mine}" in proc.stderr and "checkpoint.dir=YOURS" in proc.stderr
    assert _tree(mine) == before and not (run / "logs").exists()
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    check_trusted(run, cfg, trusted=False, launches=[f"checkpoint.dir={mine}"], writes=True)  # the user's
    check_trusted(run, cfg, trusted=False, launches=[])  # rerun: its checkpoints are its own
    inside = {**cfg, "checkpoint": {**cfg["checkpoint"], "dir": str(run / "ckpts")}}
    check_trusted(run, inside, trusted=False, launches=[], writes=True)
    (run / "ckpts").symlink_to(mine)  # inside by name, outside in fact
    with pytest.raises(ConfigError, match=r"write into checkpoint\.dir="):
        check_trusted(run, inside, trusted=False, launches=[], writes=True)


@pytest.mark.parametrize(
    "aliases",
    [
        "loop: &a [*a]\n",  # a list inside itself: the trust check's walk was a RecursionError traceback
        "l0: &l0 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]\n"  # 10^5 lists by aliases (nine levels: hours)
        + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6)),
    ],
    ids=["recursive", "nested"],
)
def test_a_config_of_yaml_aliases_is_one_paragraph(saved: dict, tmp_path: Path, aliases: str) -> None:
    from disttrain.rundir import read_config

    run = _run(tmp_path, saved)
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + aliases)
    with pytest.raises(ConfigError, match="YAML alias"):
        read_config(run)
    assert read_config(_run(tmp_path, saved, "plain")) == saved
