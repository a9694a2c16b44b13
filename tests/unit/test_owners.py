"""One owner per run dir and per checkpoint dir (review 2026-11-25-reliability D3, D6, D7).

D7: two `disttrain resume` of one run (or two `train hydra.run.dir=X`) started together both passed
the status.json check and trained into one run dir. D6: two runs sharing `checkpoint.dir` resumed
and overwrote each other's checkpoints. D3: `rerun` of a run with `checkpoint.dir` resumed the
original's checkpoints (0 steps trained) and, with overrides, pruned them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from unit_support import checked, checked_run, disttrain_in_process, said

from disttrain import owner
from disttrain.commands.rerun import own_checkpoints
from disttrain.config.errors import ConfigError
from disttrain.rundir import reuse


def _holding(code: str, procs: list[subprocess.Popen]) -> int:
    """Run `code` in a process of its own, which prints `held` once it holds its lock: its pid."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc.pid


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.fixture
def other_launcher(tmp_path: Path) -> Iterator[callable]:
    """Start a process that holds a folder's lock as a live launcher would; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(folder: Path, run_dir: Path) -> int:
        code = textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from disttrain.owner import hold
            hold(Path({str(folder)!r}), Path({str(run_dir)!r}), "k", "folder")
            print("held", flush=True)
            time.sleep(60)
        """)
        return _holding(code, procs)

    yield start
    _end(procs)


def _finished(root: Path, cfg: dict, name: str = "run") -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (run / "status.json").write_text(json.dumps({"status": "finished", "pid": 1, "host": "elsewhere"}))
    return run


def test_a_second_resume_of_a_live_run_is_refused_naming_the_owner(tmp_path: Path, other_launcher) -> None:
    run = _finished(tmp_path, checked(["data=synthetic", "trainer.max_steps=30"]))
    pid = other_launcher(run, run)  # the first `resume`, still checking (status.json not yet `running`)
    proc = disttrain_in_process("resume", str(run), "optim.lr=0.5", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1, proc.stderr
    assert f"process {pid} on" in proc.stderr and str(run) in proc.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] != 0.5  # nothing frozen


def test_two_trains_into_one_run_dir_race_no_more(tmp_path: Path, other_launcher) -> None:
    run = tmp_path / "X"
    cfg = checked_run(["data=synthetic"])
    pid = other_launcher(run, run)
    with pytest.raises(ConfigError, match=f"process {pid}"):
        reuse(run, cfg)
    assert sorted(p.name for p in run.iterdir()) == [owner.LOCK]


def test_the_lock_goes_with_its_holder(tmp_path: Path, other_launcher) -> None:
    """A launcher killed with SIGKILL leaves no stale lock: the kernel drops a flock with its process."""
    run = tmp_path / "X"
    other_launcher(run, run)
    with pytest.raises(ConfigError):
        owner.hold(run, run, "k", "folder")
    assert owner.holder(run)["run_dir"] == str(run)


def test_a_shared_checkpoint_dir_in_use_is_refused(tmp_path: Path, other_launcher) -> None:
    from disttrain.commands.train import own_checkpoint_dir

    ck = tmp_path / "ck"
    pid = other_launcher(ck, tmp_path / "A")
    cfg = checked_run(["data=synthetic", f"checkpoint.dir={ck}"])
    with pytest.raises(ConfigError, match=f"checkpoint.dir={ck} is not valid.*process {pid}.*/A"):
        own_checkpoint_dir(cfg, tmp_path / "B")


def test_an_object_store_checkpoint_dir_is_said_to_be_unlocked_once_per_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """checkpoint.dir=s3://... takes no lock (a lock object would outlive a killed launcher): two
    runs writing one prefix at once were not told. Once per command (train claims it twice: with
    the run dir, then at the freeze); the next command is told again."""
    from disttrain.commands.train import own_checkpoint_dir

    cfg = checked_run(["data=synthetic", "checkpoint.dir=s3://lab-ckpt/gpt"])
    own_checkpoint_dir(cfg, tmp_path / "A")
    own_checkpoint_dir(cfg, tmp_path / "A")
    err = capsys.readouterr().err
    assert err.count("warning: checkpoint.dir=s3://lab-ckpt/gpt is in an object store") == 1, err
    assert "holds no lock" in err and "HINT: give each run a prefix of its own" in err
    owner.release_all()  # the command's end
    own_checkpoint_dir(cfg, tmp_path / "B")
    assert capsys.readouterr().err.count("checkpoint.dir=s3://lab-ckpt/gpt is in an object store") == 1
    owner.release_all()


def test_a_new_run_never_takes_another_runs_checkpoints_unless_resume_names_them(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    owner.claim_checkpoints(ck, tmp_path / "A", "auto")
    (ck / "step_00000010").mkdir()
    owner.claim_checkpoints(ck, tmp_path / "A", "auto")  # A itself continues (resume, restart)
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*of .*/A; this run would resume and prune"):
        owner.claim_checkpoints(ck, tmp_path / "B", "auto")
    owner.claim_checkpoints(ck, tmp_path / "B", str(ck))  # resume= names them: B's from now on
    assert json.loads((ck / owner.OWNER).read_text()) == {"run_dir": str(tmp_path / "B")}


def test_rerun_moves_checkpoints_off_the_originals_folder(tmp_path: Path) -> None:
    cfg = checked_run(["data=synthetic", f"checkpoint.dir={tmp_path / 'ck'}"])
    run, note = own_checkpoints(cfg, tmp_path / "again", [])
    assert run.checkpoint.dir is None and "stays as it is" in note  # <new run dir>/checkpoints
    assert cfg.checkpoint.dir == str(tmp_path / "ck")  # the checked run itself never changes
    cfg = checked_run(
        ["data=synthetic", f"checkpoint.dir={tmp_path / 'ck'}", "nodes=2", "master_addr=10.0.0.1"]
    )
    run, _ = own_checkpoints(cfg, tmp_path / "again", [])
    assert run.checkpoint.dir == str(tmp_path / "again")  # several nodes: a shared sibling
    cfg = checked_run(["data=synthetic", f"checkpoint.dir={tmp_path / 'ck'}"])
    run, _ = own_checkpoints(cfg, tmp_path / "again", [f"checkpoint.dir={tmp_path / 'mine'}"])
    assert run.checkpoint.dir == str(tmp_path / "ck")  # the override (applied before) wins


ONE = ("nproc_per_node=1", "trainer.progress=false", "threads_per_rank=1", "observe.sinks=[]")


def test_rerun_of_a_run_with_checkpoint_dir_trains_again_and_leaves_the_original(tmp_path: Path) -> None:
    """The review's reproduction, one rank in process: the rerun trains its 6 steps from step 0
    into its own checkpoints; the original's checkpoint.dir is untouched. The launch's warm-up
    warning is not repeated by the rerun."""
    ck = tmp_path / "ck"
    args = ("data=synthetic", "trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.log_every=1")
    proc = disttrain_in_process(
        "train", *ONE, *args, f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / 'orig'}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    warmup = "sched.warmup_steps=20 is not shorter than the run (6 optimizer steps)"
    assert proc.stderr.count(warmup) == 1, proc.stderr  # cosine's 20 warm-up steps: said at launch
    before = {p.name: p.stat().st_mtime_ns for p in ck.iterdir()}
    proc = disttrain_in_process(
        "rerun", str(tmp_path / "orig"), "optim.lr=0.5", "--run-dir", str(tmp_path / "again"), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "warmup_steps" not in proc.stderr, proc.stderr  # the rerun changes nothing it reads: not again
    assert {p.name: p.stat().st_mtime_ns for p in ck.iterdir()} == before
    records = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "again" / "checkpoints" / "final.pt").is_file()
    # review 2026-11-28-reliability D6: each run's rank took its run dir's ranks lock (and let it go)
    for run in (tmp_path / "orig", tmp_path / "again"):
        assert (run / owner.RANKS).is_file() and _rank_holders(run) == []


# --------------------------------------------------------- review 2026-11-28-reliability D3, D14
# D3: a run with the default checkpoint folder wrote no owner.json, so `checkpoint.dir=<its run
# dir>/checkpoints` resumed, pruned and replaced its checkpoints (finished or live). D14: a
# checkpoint.dir refusal was a Hydra traceback, exit 1, with an empty run dir left.

TRAIN = ("train", "data=synthetic", "trainer.max_steps=50", *ONE)


def _finished_with_checkpoints(root: Path) -> Path:
    ref = _finished(root, {"seed": 0}, "ref")  # a run dir: its config.yaml beside checkpoints/
    for step in (10, 20, 30):
        (ref / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (ref / "checkpoints" / "final.pt").write_bytes(b"ref's weights")
    return ref


def _one_paragraph(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert len(said(proc.stderr)) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_d3_d14_another_runs_default_checkpoints_are_never_taken(tmp_path: Path) -> None:
    ref = _finished_with_checkpoints(tmp_path)
    before = sorted(p.name for p in (ref / "checkpoints").iterdir())
    new = tmp_path / "new"
    proc = disttrain_in_process(
        *TRAIN, f"checkpoint.dir={ref / 'checkpoints'}", f"hydra.run.dir={new}", cwd=tmp_path
    )
    said = _one_paragraph(proc)
    assert f"it holds the checkpoints of {ref};" in said and f"disttrain resume {ref}" in said
    assert sorted(p.name for p in (ref / "checkpoints").iterdir()) == before  # no owner.json, no prune
    assert (ref / "checkpoints" / "final.pt").read_bytes() == b"ref's weights"
    assert not new.exists()  # D14: no run dir left


def test_d3_a_live_runs_checkpoints_are_refused_naming_its_launcher(tmp_path: Path, other_launcher) -> None:
    """Even with resume= naming them: two launchers would commit into one folder."""
    from disttrain.commands.train import own_checkpoint_dir

    ref = _finished_with_checkpoints(tmp_path)
    pid = other_launcher(ref, ref)  # ref trains (or is resumed) now
    ck = ref / "checkpoints"
    run = checked_run(["data=synthetic", f"checkpoint.dir={ck}", f"resume={ck}"])
    try:
        with pytest.raises(ConfigError) as info:
            own_checkpoint_dir(run, tmp_path / "B")
    finally:
        owner.release_all()
    assert (info.value.key, info.value.value) == ("checkpoint.dir", str(ck))
    assert f"the checkpoints/ folder of the run {ref}, and process {pid} on" in info.value.hint
    assert not (ck / owner.OWNER).exists()


# ------------------------------------------------------------------ review 2026-11-28-reliability D15
# A planted `.lock`: a FIFO was an OSError traceback, a link or folder a paragraph that named
# neither `.lock` nor the way out ("choose another" for `resume`).

PLANTED = {
    "a symbolic link": lambda lock, target: lock.symlink_to(target),
    "a FIFO": lambda lock, target: os.mkfifo(lock),
    "a directory": lambda lock, target: lock.mkdir(),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_d15_a_planted_lock_is_named_and_left_as_it_is(tmp_path: Path, kind: str) -> None:
    run, target = tmp_path / "run", tmp_path / "target.txt"
    run.mkdir()
    target.write_text("precious")
    lock = run / owner.LOCK
    PLANTED[kind](lock, target)
    mode = os.lstat(lock).st_mode
    with pytest.raises(ConfigError) as info:
        owner.hold(run, run, "RUN_DIR", "run dir")
    assert f"{lock} is {kind}, which disttrain never makes" in info.value.hint
    assert f"rm -r {lock}" in info.value.hint and "choose another" not in str(info.value)
    assert os.lstat(lock).st_mode == mode and target.read_text() == "precious"
    assert run not in owner._HELD


def test_d15_resume_with_a_planted_fifo_lock_is_one_paragraph(tmp_path: Path) -> None:
    run = _finished(tmp_path, {"seed": 0})
    os.mkfifo(run / owner.LOCK)
    proc = disttrain_in_process("resume", str(run), cwd=tmp_path)
    said = _one_paragraph(proc)
    assert f"RUN_DIR={run} is not valid" in said and f"{run / owner.LOCK} is a FIFO" in said


# ------------------------------------------------------------------- review 2026-11-28-reliability D6
# The run dir's lock died with a SIGKILLed launcher while its ranks lived on (saving for 25 s); a
# resume started at once trained beside them and deleted their save in progress.


@pytest.fixture
def old_rank(tmp_path: Path) -> Iterator[callable]:
    """A process holding the ranks' shared lock of a run dir, as a killed launcher's rank does,
    for `seconds`; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(run: Path, seconds: float) -> int:
        code = textwrap.dedent(f"""
            import time
            from pathlib import Path
            from disttrain.owner import rank_lock
            assert rank_lock(Path({str(run)!r})) is not None
            print("held", flush=True)
            time.sleep({seconds})
        """)
        return _holding(code, procs)

    yield start
    _end(procs)


def test_d6_a_run_dir_is_not_taken_while_ranks_of_a_dead_launcher_live(
    tmp_path: Path, old_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    pid = old_rank(run, 60)  # still saving
    monkeypatch.setattr(owner, "RANKS_WAIT_S", 0.6)
    with pytest.raises(ConfigError) as info:
        owner.hold(run, run, "RUN_DIR", "run dir")
    assert f"rank process(es) {pid} of an earlier launcher there still run" in info.value.hint
    assert f"kill -TERM {pid}" in info.value.hint
    assert f"waiting for rank process(es) {pid}" in capsys.readouterr().err
    owner.release_all()
    os.kill(pid, signal.SIGKILL)  # it ends (its lock goes with it) ...
    pid = old_rank(run, 0.5)  # ... and another's save ends soon: the launcher waits, then holds the run dir
    monkeypatch.setattr(owner, "RANKS_WAIT_S", 30.0)
    owner.hold(run, run, "RUN_DIR", "run dir")
    assert owner.holder(run)["pid"] == os.getpid() and _rank_holders(run) == []
    owner.release_all()


def _rank_holders(run: Path) -> list[int]:
    fd = os.open(run / owner.RANKS, os.O_RDONLY)
    try:
        return owner.lock_holders(fd)
    finally:
        os.close(fd)


def test_d6_a_rank_lock_is_shared_and_named_by_pid(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    first, second = owner.rank_lock(run), owner.rank_lock(run)  # every rank of a node: shared
    assert first is not None and second is not None
    assert _rank_holders(run) == [os.getpid()]
    os.close(first)
    os.close(second)
    assert _rank_holders(run) == []


def test_rerun_of_a_multi_node_run_keeps_its_url_checkpoints_in_the_store(
    s3_bucket: str, tmp_path: Path
) -> None:
    """s3://b/run: the rerun's checkpoints are s3://b/<new run dir's name>, not a local
    `<cwd>/s3:/b/<name>` (a URL taken for a path)."""
    cfg = checked_run(
        ["data=synthetic", f"checkpoint.dir={s3_bucket}/run", "nodes=2", "master_addr=10.0.0.1"]
    )
    run, note = own_checkpoints(cfg, tmp_path / "again", [])
    assert run.checkpoint.dir == f"{s3_bucket}/again"
    assert f"checkpoints: {s3_bucket}/again;" in note
