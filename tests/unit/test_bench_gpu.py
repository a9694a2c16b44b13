"""scripts/bench_gpu.py on CPU: a failed run shows why (review GPU #10) and keeps its files."""

from __future__ import annotations

import importlib.util
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
        b.disttrain(opts, tmp_path, "single")
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
