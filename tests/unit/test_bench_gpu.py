"""scripts/bench_gpu.py on CPU: a failed run shows why (review GPU #10) and keeps its files; its rows
are config overrides, and each run dir is gone once its numbers are read (review G11)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(120)


def bench() -> ModuleType:
    path = Path(__file__).parents[2] / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_disttrain_run_shows_its_stderr_and_keeps_its_dir(tmp_path: Path) -> None:
    """heads=3 does not divide dim=32: disttrain refuses (exit 2) and bench_gpu says why, not just
    "non-zero exit status"."""
    b = bench()
    opts = b.SMALL_CPU | {"device": "cpu", "amp": "off", "heads": 3}
    with pytest.raises(b.BenchFailed) as info:
        b.disttrain(opts, tmp_path, b.ROWS["single"])
    text = str(info.value)
    assert "exited 2" in text and "--- stderr (tail)" in text and "model.n_heads" in text, text
    assert "run dir kept: " + str(tmp_path) in text


def test_a_failed_rank_shows_the_tail_of_each_rank_log(tmp_path: Path) -> None:
    b = bench()
    run_dir = tmp_path / "run"
    fail = (
        "import pathlib, sys; d = pathlib.Path(sys.argv[1]) / 'logs'; d.mkdir(parents=True); "
        "[(d / f'rank{r}.log').write_text('\\n'.join(f'line {i}' for i in range(40)) + f'\\nrank {r} boom') "
        "for r in (0, 1)]; sys.exit('training failed: rank 1 raised')"
    )
    with pytest.raises(b.BenchFailed) as info:
        b.run_logged([sys.executable, "-c", fail, str(run_dir)], run_dir)
    text = str(info.value)
    assert "exited 1" in text and "training failed: rank 1 raised" in text
    for r in (0, 1):
        assert f"{run_dir / 'logs' / f'rank{r}.log'} (tail)" in text and f"rank {r} boom" in text
    assert "\nline 15\n" not in text and "\nline 16\n" in text  # the last 25 lines of 41
    assert (run_dir / "logs" / "rank1.log").is_file()


def test_rows_are_config_overrides_replacing_the_common_ones() -> None:
    """Issue 34 #6: eager, regional compile, selective AC and fp8 rows, each one override of the
    `single` run; fsdp across every GPU. A group chosen twice (amp=bf16 amp=fp8) Hydra refuses."""
    b = bench()
    assert list(b.ROWS) == ["bare", "single", "regional compile", "selective AC", "fp8", "fsdp"]
    opts = b.SMALL_CPU | {"device": "cuda", "amp": "bf16"}
    args = {a.partition("=")[0]: a for a in b.command(opts, Path("run"), b.ROWS["single"])[4:]}
    assert args["strategy"] == "strategy=single" and args["amp"] == "amp=bf16"
    for row, key, value in [
        ("regional compile", "trainer.compile", "regional"),
        ("selective AC", "trainer.activation_checkpointing", "selective"),
        ("fp8", "amp", "fp8"),
    ]:
        cmd = b.command(opts, Path("run"), b.ROWS[row])
        assert f"{key}={value}" in cmd and sum(a.startswith(f"{key}=") for a in cmd) == 1, row
    fsdp = b.command(opts, Path("run"), b.fsdp_overrides(4))
    assert "strategy=fsdp" in fsdp and "nproc_per_node=4" in fsdp and "nproc_per_node=1" not in fsdp
    assert "nproc_per_node=1" in b.fsdp_overrides(0)  # no GPU: one rank


def test_one_run_dir_at_a_time_and_none_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review G11: every run dir (each with its ~16 GB final checkpoint at the default size) stayed
    until the end: ~58 GB. Runs faked here: each writes its metrics and a checkpoint."""
    b = bench()
    work = tmp_path / "work"
    seen: list[int] = []

    def fake_run(cmd: list[str], run_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
        assert run_dir is not None
        seen.append(len(list(work.iterdir())))  # run dirs already there when this one starts
        if "amp=fp8" in cmd:
            raise b.BenchFailed(f"`{' '.join(cmd)}` exited 2\nrun dir kept: {run_dir}")
        (run_dir / "checkpoints" / "final").mkdir(parents=True)
        (run_dir / "checkpoints" / "final" / "model.distcp").write_bytes(b"0" * 4096)
        rows = [{"step": s, "tokens_per_s": 100.0 * s, "train/loss": 5.0 - s / 10} for s in (10, 20)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_mkdtemp(prefix: str) -> str:
        work.mkdir()
        return str(work)

    monkeypatch.setattr(b, "run_logged", fake_run)
    monkeypatch.setattr(b.tempfile, "mkdtemp", fake_mkdtemp)
    opts = b.SMALL_CPU | {"device": "cpu", "amp": "off", "warmup": 5, "repeats": 2}
    table = b.measure(opts, ["single", "fp8", "fsdp"], gpus=2)
    assert seen == [0, 0, 0, 0, 0]  # single, fp8 (refused: not retried), fsdp, single, fsdp
    assert table["single"] == {"tokens_per_s": 1500.0, "mfu": pytest.approx(float("nan"), nan_ok=True),
                               "loss": 3.0}  # fmt: skip
    assert isinstance(table["fp8"], str) and "exited 2" in table["fp8"]
    assert not work.exists()  # nothing kept: the refused run made no dir here
