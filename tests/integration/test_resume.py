"""Exact resume through the real CLI: bitwise equal to an uninterrupted run, across world sizes,
with `disttrain resume` and `disttrain export` (2 gloo ranks, synthetic data, 40 steps).

The uninterrupted runs are the jobs of one `disttrain train -m` sweep and the `resume=` runs of a
second one (tests/integration/sweep.py: one start-up per sweep, each job a complete run with its
own run dir); `disttrain resume` and the rerun are commands of their own."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from shared_support import S3_ENV

from .conftest import cli_in_process, final_weights, read_yaml, run_cli, train_losses
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two sweeps: 3 + 5 x JOB_BUDGET

STEPS = 40
RUN = ("data=synthetic", f"trainer.max_steps={STEPS}", "trainer.ckpt_every=17", "trainer.log_every=1")
STEP17 = "checkpoints/step_00000017"
# checkpoint.dir in an object store: the session's S3 server (moto, tests/conftest.py), one bucket
S3 = "s3://resume-sweep/run"
# The runs that need no other run's checkpoint (test_resume's sweep jobs: name -> own overrides).
FIRST = {
    "straight": (),
    "async": ("checkpoint.async=true",),
    "fsdp_straight": ("strategy=fsdp",),
    "s3": (f"checkpoint.dir={S3}", "checkpoint.keep=2"),
}


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss; metrics.jsonl was cut back to the resumed step, so each step is there once."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = final_weights(a), final_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _log(run_dir: Path) -> str:
    return (run_dir / "logs" / "rank0.log").read_text()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def s3(s3_endpoint: str) -> Iterator[None]:
    """The S3 server reached the standard way (AWS_ENDPOINT_URL and keys in the environment, which
    the sweeps' ranks inherit) for this module's runs, and S3's bucket."""
    import s3fs

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
            mp.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(S3[len("s3://") :].partition("/")[0])
        yield


@pytest.fixture(scope="module")
def first(root: Path, s3: None) -> Sweep:
    """The uninterrupted runs, as the jobs of one sweep (one parent process and fork server)."""
    return run_sweep(root / "first", FIRST, *RUN)


@pytest.fixture(scope="module")
def straight(first: Sweep) -> Path:
    return first["straight"]


@pytest.fixture(scope="module")
def resumes(first: Sweep, root: Path) -> Sweep:
    """The runs that resume from the first runs' step-17 checkpoints, as the jobs of a second sweep."""
    s, a, f = (first[n] / STEP17 for n in ("straight", "async", "fsdp_straight"))
    return run_sweep(
        root / "resumes",
        {
            "resumed": (f"resume={s}",),
            "one": (f"resume={s}", "nproc_per_node=1"),
            "async_resumed": (f"resume={a}",),
            "fsdp_resumed": ("strategy=fsdp", f"resume={f}"),
            "fsdp_one": ("strategy=fsdp", f"resume={f}", "nproc_per_node=1"),
            "s3_resumed": (f"resume={S3}/step_00000034",),
        },
        *RUN,
    )


def test_checkpoints_committed_with_latest_and_retention(straight: Path) -> None:
    ckpts = straight / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000040"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000017", "step_00000034", "step_00000040"]
    meta = json.loads((ckpts / "step_00000017" / "meta.json").read_text())
    assert (meta["step"], meta["epoch"], meta["epoch_samples"]) == (17, 0, 17 * 64)  # mid-epoch (32 steps)
    assert meta["world_size"] == 2 and len(list((ckpts / "step_00000017").glob("rng_rank*.pt"))) == 2


def test_resume_mid_epoch_is_bitwise_identical(straight: Path, resumes: Sweep) -> None:
    resumed = resumes["resumed"]
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(18, STEPS + 1)), "the resumed run starts at step 18: no replayed batch"
    assert all(a[s] == b[s] for s in b), "losses differ after resuming"
    assert _same_weights(straight, resumed)


def test_resume_two_ranks_to_one_then_back_to_two(root: Path, straight: Path, resumes: Sweep) -> None:
    """2 -> 1: reshard on load, the same global batch (grad_accum 2: the same 64 samples form each
    step), so the losses are the uninterrupted run's up to float summation order; the log says how
    the data order changed. 1 -> 2 via `disttrain resume`."""
    one = resumes["one"]
    log = _log(one)
    assert "world size 2 -> 1" in log and "continues at global sample 1088" in log, log
    assert "nproc_per_node: 2 -> 1" in log, "the config difference is named"
    frozen = read_yaml(one / "config.yaml")["trainer"]
    assert (frozen["batch_size"], frozen["grad_accum"]) == (32, 2), "config.yaml says how the ranks trained"
    a, b = _losses(straight), _losses(one)
    assert sorted(b) == list(range(18, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in b) < 1e-5, {s: (a[s], b[s]) for s in b}

    proc = cli_in_process("resume", str(one), "nproc_per_node=2", f"trainer.max_steps={STEPS + 10}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = _log(one)
    assert "world size 1 -> 2" in log and "resuming from" in log
    assert max(_losses(one)) == STEPS + 10
    cfg = (one / "config.yaml").read_text()
    assert "nproc_per_node: 2" in cfg, "resume re-freezes the config it ran with"
    assert read_yaml(one / "config.yaml")["trainer"]["grad_accum"] == 1, "2 ranks x 32: the global 64 again"


def test_a_finished_run_resumed_at_another_world_size_trains_nothing(root: Path, straight: Path) -> None:
    """One rank, in process (cheap). Counted in epochs (one epoch: 32 steps of 64 at 2 ranks, which
    the 40 steps passed), the run is finished at 1 rank too; before, the halved global batch made an
    epoch 64 steps and the resume trained 24 more."""
    finished = root / "finished_copy"
    shutil.copytree(straight, finished)
    before = _losses(finished)
    epochs = ("trainer.max_steps=-1", "trainer.max_epochs=1")
    proc = cli_in_process("resume", str(finished), "nproc_per_node=1", *epochs, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _losses(finished) == before and _same_weights(straight, finished)


def test_async_saves_match_sync_ones_and_resume_bitwise(first: Sweep, resumes: Sweep) -> None:
    """checkpoint.async=true: 2 ranks stage, write (hashed on the way, gathered to rank 0) and commit
    in the background; training is unchanged and its step-17 checkpoint resumes bitwise."""
    straight, run = first["straight"], first["async"]
    assert _same_weights(straight, run) and _losses(straight) == _losses(run)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000040"
    manifest = json.loads((ckpts / "step_00000017" / "manifest.json").read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata", "meta.json"} <= set(manifest)
    for name, entry in manifest.items():
        data = (ckpts / "step_00000017" / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
    resumed = resumes["async_resumed"]
    assert read_yaml(resumed / "config.yaml")["resume"] == str(ckpts / "step_00000017")
    assert _same_weights(straight, resumed)


def test_s3_checkpoints_commit_prune_verify_and_resume_bitwise(first: Sweep, resumes: Sweep) -> None:
    """checkpoint.dir=s3://: 2 ranks save through DCP's fsspec writer; keep=2 pruned step 17; every
    object matches its manifest's size and xxh3_64; a run resumed from step 34 there is bitwise the
    uninterrupted one."""
    from disttrain import checkpoint
    from disttrain.storage import ObjectPath

    straight, where = first["straight"], ObjectPath(S3)
    assert _losses(first["s3"]) == _losses(straight), "where checkpoints go changes no number"
    assert [p.name for p in checkpoint.committed(where)] == ["step_00000034", "step_00000040"]
    assert checkpoint.read_latest(where) == "step_00000040" and not (where / "step_00000017").exists()
    step34 = where / "step_00000034"
    manifest = json.loads((step34 / "manifest.json").read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata", "meta.json"} <= set(manifest)
    for name, entry in manifest.items():
        data = (step34 / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
    final = torch.load(io.BytesIO((where / "final.pt").read_bytes()), weights_only=True)["model"]
    assert all(torch.equal(final[k], v) for k, v in final_weights(straight).items())
    resumed = resumes["s3_resumed"]
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(35, STEPS + 1)) and all(a[s] == b[s] for s in b)
    assert _same_weights(straight, resumed)


def test_export_loads_into_the_plain_model(root: Path, straight: Path) -> None:
    from safetensors.torch import load_file

    from disttrain.models.mlp import MLP

    for name in ("model.pt", "model.safetensors"):  # starts no rank: in this process
        proc = cli_in_process("export", str(straight), "--out", str(root / name), cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
    plain = MLP(32, 4, [128, 128])
    plain.load_state_dict(torch.load(root / "model.pt", weights_only=True))
    plain.load_state_dict(load_file(str(root / "model.safetensors")))
    ref = final_weights(straight)
    assert all(torch.equal(plain.state_dict()[k], ref[k]) for k in ref)


class _Evil:
    """Unpickling it would create `marker`: a pickle weights_only refuses."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.marker, "w"))


def test_a_checkpoint_only_one_rank_cannot_load_is_skipped_by_every_rank(root: Path, straight: Path) -> None:
    """Review D14/B10 + D13: step 40's rng file for rank 1 is a code-running pickle under a re-hashed
    manifest. Rank 1's load fails, every rank falls back to step 34 together, step 40 moves to
    superseded/, and the run ends bitwise equal to the uninterrupted one."""
    branch = root / "branch"
    shutil.copytree(straight, branch)
    bad = branch / "checkpoints" / "step_00000040"
    marker = root / "pwned"
    torch.save({"x": _Evil(marker)}, bad / "rng_rank1.pt")
    manifest = json.loads((bad / "manifest.json").read_text())
    data = (bad / "rng_rank1.pt").read_bytes()
    manifest["files"]["rng_rank1.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    (branch / "checkpoints" / "final.pt").unlink()

    proc = cli_in_process("resume", str(branch), cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cannot load checkpoint" in (branch / "logs" / "rank1.log").read_text()
    log = _log(branch)
    assert "step_00000040 is not loadable on every rank; falling back" in log
    assert "resuming from" in log and "step_00000034" in log
    assert (branch / "checkpoints" / "superseded" / "step_00000040").is_dir()
    assert sorted(p.name for p in (branch / "checkpoints").glob("step_*")) == [
        "step_00000017",
        "step_00000034",
        "step_00000040",
    ]
    assert _same_weights(straight, branch)
    assert not marker.exists()


def test_fsdp_resume_bitwise_and_to_one_rank(first: Sweep, resumes: Sweep) -> None:
    a, b = first["fsdp_straight"], resumes["fsdp_resumed"]
    la, lb = _losses(a), _losses(b)
    assert sorted(lb)[0] == 18 and all(la[s] == lb[s] for s in lb)
    assert _same_weights(a, b)
    c = resumes["fsdp_one"]
    assert "world size 2 -> 1" in _log(c)
    assert max(train_losses(c)) < 10


def test_rerun_of_a_finished_run_keeps_its_summary(tmp_path: Path) -> None:
    """D18: the same command again into a finished run dir trains nothing and leaves summary.json
    as it was (it was rewritten with a stale last_val and an absurd samples/s); another config is
    refused before launch (one world-1 run, in-process: cheap)."""
    one = (
        "strategy=single",
        "backend=gloo",  # as run_cli pins it: the three commands must compose the same config
        "nproc_per_node=1",
        "data=synthetic",
        "trainer.max_steps=3",
        "hydra.run.dir=done",
    )
    _, run_dir = run_cli(tmp_path, *one)
    assert run_dir is not None
    summary = (run_dir / "summary.json").read_bytes()
    fast = ("trainer.progress=false", "threads_per_rank=1")
    proc = cli_in_process("train", *fast, *one, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no step ran" in proc.stdout + proc.stderr
    assert (run_dir / "summary.json").read_bytes() == summary
    proc = cli_in_process("train", *fast, *one, "optim.lr=0.5", cwd=tmp_path)  # refused: no rank starts
    assert proc.returncode == 2, proc.stderr
    assert "config error: hydra.run.dir=" in proc.stderr and "disttrain resume" in proc.stderr
