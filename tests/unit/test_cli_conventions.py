"""Issue 14: shell completion (driven through bash itself), per-key help, --version everywhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain import __version__
from disttrain.cli import main
from disttrain.commands.completion import candidates


def _bash_complete(words: list[str], tmp_path: Path) -> list[str]:
    """Source `disttrain completion bash`, set COMP_WORDS/COMP_LINE as bash would, call _disttrain."""
    script = subprocess.run(
        [sys.executable, "-m", "disttrain", "completion", "bash"], capture_output=True, text=True, check=True
    ).stdout
    # The completion calls "${COMP_WORDS[0]}" __complete: a shim for `disttrain` on any PATH.
    shim = tmp_path / "disttrain"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m disttrain "$@"\n')
    shim.chmod(0o755)
    line = " ".join(words)
    # bash splits `strategy=` into `strategy`, `=`, `` (COMP_WORDBREAKS)
    comp_words = []
    for w in words:
        head, eq, tail = w.partition("=")
        comp_words += [head, "=", tail] if eq else [w]
    array = " ".join(f"'{w}'" for w in comp_words)
    test = (
        f"{script}\nCOMP_WORDS=({array}); COMP_CWORD={len(comp_words) - 1}; "
        f"COMP_LINE='{line}'; COMP_POINT={len(line)}; _disttrain; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    out = subprocess.run(
        ["bash", "-c", test],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    return [c for c in out.stdout.splitlines() if c]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_of_groups_and_their_options(tmp_path: Path) -> None:
    assert "strategy=" in _bash_complete(["disttrain", "train", "strat"], tmp_path)
    options = _bash_complete(["disttrain", "train", "strategy="], tmp_path)
    assert {"ddp", "fsdp", "single", "tp", "zero"} <= set(options) and not any("base_" in o for o in options)
    assert _bash_complete(["disttrain", "tr"], tmp_path) == ["train"]


def test_completion_candidates_keys_and_options() -> None:
    assert {"trainer.max_steps=", "trainer.max_epochs="} <= set(candidates("disttrain train trainer.max_"))
    assert "--config-dir" in candidates("disttrain config --config-")
    assert candidates("disttrain show --j") == ["--json"]
    assert "rerun" in candidates("disttrain ")


def test_config_help_lists_each_key_with_type_default_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--help", "strategy=fsdp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("trainer.log_every=10  (int)")  # the key as its override, its type; help below
    assert lines[at + 1] == "    optimizer steps between train-metric logs"
    strategy = [ln for ln in lines if ln.startswith("strategy.")]
    assert any("reshard_after_forward" in ln for ln in strategy), "the chosen option's keys"


@pytest.mark.parametrize(
    "argv", [["--version"], ["train", "--version"], ["config", "--version"], ["show", "--version"]]
)
def test_version_is_disttrains_everywhere(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    assert capsys.readouterr().out == f"disttrain {__version__}\n"


def test_bad_completion_shell_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", "fish"]) == 2
    assert "bash or zsh" in capsys.readouterr().err


def test_a_sweeper_plugins_syntax_is_checked_on_the_base_job() -> None:
    from disttrain.config.compose import expand_sweep

    assert expand_sweep(["optim.lr=1e-3,1e-2", "seed=1"]) == [
        ["optim.lr=0.001", "seed=1"],
        ["optim.lr=0.01", "seed=1"],
    ]
    base = expand_sweep(["hydra/sweeper=optuna", "optim.lr=interval(1e-4,1e-2)", "seed=1"])
    assert base == [["hydra/sweeper=optuna", "seed=1"]], "the plugin picks lr; the rest is checked now"


def test_bad_base_job_of_a_plugin_sweep_fails_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["train", "-m", "hydra/sweeper=optuna", "optim.lr=interval(1e-4,1e-2)", "nproc_per_node=0"]
    assert main(argv) == 2
    assert "nproc_per_node" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_sink_config_errors_are_one_paragraph() -> None:
    from disttrain.config.errors import ConfigError
    from disttrain.observe.sinks import check_sinks

    check_sinks(["tensorboard", "csv", {"_target_": "mlflow", "tracking_uri": "file:///x"}])
    with pytest.raises(ConfigError, match=r"observe.sinks\[0\]=tensorbord"):
        check_sinks(["tensorbord"])
    with pytest.raises(ConfigError, match="keys of WandB: project, entity, mode"):
        check_sinks([{"_target_": "wandb", "projekt": "x"}])


def test_csv_sink_resume_replaces_rows_after_the_checkpoint(tmp_path: Path) -> None:
    from disttrain.observe.sinks import CSV, SinkContext

    first = CSV()
    first.open(SinkContext(tmp_path, "x", {}))
    for step in (1, 2, 3):
        first.log(step, {"loss": float(step)})
    first.close()
    again = CSV()
    again.open(SinkContext(tmp_path, "x", {}, resume=first.state(), resume_step=2))
    again.log(3, {"loss": 30.0})
    again.close()
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows == ["step,key,value", "1,loss,1.0", "2,loss,2.0", "3,loss,30.0"]


def test_csv_sink_resume_drops_a_row_a_crash_cut_short(tmp_path: Path) -> None:
    from disttrain.observe.sinks import CSV, SinkContext

    (tmp_path / "metrics.csv").write_text("step,key,value\n1,loss,1.0\n2,loss,2.0\n3,lo")
    again = CSV()
    again.open(SinkContext(tmp_path, "x", {}, resume={"resumable": True}, resume_step=3))
    again.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,key,value",
        "1,loss,1.0",
        "2,loss,2.0",
    ]
