"""D2/D8/D26: nothing a user writes can add a line to the generated sbatch script.

A newline in `name`, `hydra.run.dir` or an argument would start a shell line of its own in the
job script, run on the compute node before `set -e`; the first such line also makes sbatch ignore
every later #SBATCH directive. Each is refused before anything is written; paths with blanks are
quoted; the #SBATCH block comes first.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from unit_support import disttrain_in_process, said

from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.launch.slurm import check_script_inputs, sbatch_script

PAYLOAD = "x\ntouch {marker}\n#"
DRY = ("launcher=slurm", "launcher.dry_run=true")


def _cfg(name: str = "demo") -> Run:
    from unit_support import checked_run

    return checked_run([*DRY, f"name={name}"])


def _bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    bash = shutil.which("bash")
    assert bash, "bash is needed to syntax-check the script"
    proc = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def _directives_first(script: str) -> list[str]:
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    head = [ln for ln in lines[1:] if ln.startswith("#SBATCH")]
    assert lines[1 : 1 + len(head)] == head, "the #SBATCH block follows the shebang directly"
    return head


@pytest.mark.parametrize(
    "override",
    [
        "name='{payload}'",
        "hydra.run.dir='{scratch}/r{payload}'",
        "data.name='{payload}'",  # any argument: it is copied into the script's comment
    ],
    ids=["name", "run-dir", "argument"],
)
def test_newline_payload_is_refused_before_anything_is_written(override: str, scratch: Path) -> None:
    marker = scratch / "PWNED"
    payload = PAYLOAD.format(marker=marker)
    arg = override.format(payload=payload, scratch=scratch)
    proc = disttrain_in_process("train", *DRY, arg, cwd=scratch)
    assert proc.returncode == 2, proc.stderr
    assert "config error:" in proc.stderr and "Traceback" not in proc.stderr
    assert len(said(proc.stderr)) == 1, "one paragraph, the newline shown escaped"
    assert list(scratch.iterdir()) == [], "nothing written"
    assert proc.stdout == ""


def test_time_with_a_trailing_newline_is_refused() -> None:
    """A config file's `launcher.time: "04:00:00\\n"` passed `re.match(...$)` (reliability D23)."""
    from disttrain.launch.slurm import check_static
    from disttrain.launch.specs.slurm import SlurmLauncherConfig

    check_static(SlurmLauncherConfig(time="1-04:00:00"))
    for bad in ("04:00:00\n", "04:00:00\r", "4h"):
        with pytest.raises(ConfigError) as err:
            check_static(SlurmLauncherConfig(time=bad))
        assert err.value.key == "launcher.time"


def test_name_rejects_traversal_and_separators() -> None:
    from disttrain.config.run import check_name

    for bad in ("../../escape", "a/b", "..", ".", "x y", "x\ny", ""):
        with pytest.raises(ConfigError) as err:
            check_name({"name": bad})
        assert err.value.key == "name"
    check_name({"name": "lr-sweep_3.v2"})


def _run_with_fake_slurm(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the job script under bash with stand-ins for srun and scontrol (which just echo)."""
    import os

    fake = tmp_path / "fakebin"
    fake.mkdir()
    for tool, body in (("srun", 'echo "srun $*"'), ("scontrol", "echo node0")):
        (fake / tool).write_text(f"#!/bin/sh\n{body}\n")
        (fake / tool).chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node0",
        "SLURM_JOB_ID": "1",
    }
    return subprocess.run(
        ["bash", str(path)], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path
    )


def test_script_escapes_and_quotes_what_it_embeds(tmp_path: Path) -> None:
    """Defence in depth: even a value that reached sbatch_script unchecked runs nothing."""
    marker = tmp_path / "PWNED"
    run_dir = tmp_path / f"my run\ntouch {marker}\n#"
    argv = ["disttrain", "train", f"a=1\ntouch {marker}\n#", "b='x y'"]
    script = sbatch_script(_cfg(), run_dir, argv)
    _bash_n(script, tmp_path)
    head = _directives_first(script)
    assert any(h.startswith('#SBATCH --output="') for h in head), head
    assert f"a=1\\ntouch {marker}" in script, "the comment shows the newline escaped"
    proc = _run_with_fake_slurm(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "srun " in proc.stdout
    assert not marker.exists(), "a line of the user's input ran as a command"


def test_run_dir_with_blanks_is_quoted(tmp_path: Path) -> None:
    run_dir = tmp_path / "my run"
    script = sbatch_script(_cfg(), run_dir, ["disttrain", "train", "name=demo"])
    _bash_n(script, tmp_path)
    head = _directives_first(script)
    assert f'#SBATCH --output="{run_dir}/slurm/job-%j.out"' in head
    assert "#SBATCH --job-name=disttrain-demo" in head
    assert f"sbatch '{run_dir}/slurm/job.sbatch'" in script
    assert f"disttrain.launch.slurm_node '{run_dir}'" in script


def test_check_script_inputs(tmp_path: Path) -> None:
    check_script_inputs(tmp_path / "ok dir", ["disttrain", "train", "name=x"])
    for run_dir, argv in (
        (tmp_path / "a\nb", []),
        (tmp_path / 'a"b', []),
        (tmp_path, ["x=\x1b[2J"]),
    ):
        with pytest.raises(ConfigError):
            check_script_inputs(run_dir, argv)


def test_dry_run_with_blank_in_run_dir_writes_a_valid_script(scratch: Path) -> None:
    proc = disttrain_in_process("train", *DRY, "hydra.run.dir='my run'", cwd=scratch)
    assert proc.returncode == 0, proc.stderr
    script = (scratch / "my run" / "slurm" / "job.sbatch").read_text()
    _bash_n(script, scratch)
    _directives_first(script)
