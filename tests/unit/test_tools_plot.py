"""`disttrain compare A B --plot p.png` / `show RUN --plot`: curves of several runs on shared axes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.cli import main

pytest.importorskip("matplotlib")


def _run(root: Path, name: str, losses: list[float], val: float) -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    records = [{"step": i + 1, "train/loss": v, "lr": 0.1} for i, v in enumerate(losses)]
    records.append({"step": len(losses), "val/loss": val})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_compare_plot_writes_a_png_of_both_runs_series(tmp_path: Path) -> None:
    from disttrain.tools.plot import plot, series

    a = _run(tmp_path, "a", [2.0, 1.5, 1.0], 0.9)
    b = _run(tmp_path, "b", [2.5, 1.2, 0.8], 0.7)
    out = tmp_path / "p.png"
    assert main(["compare", str(a), str(b), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    drawn = plot([a, b], tmp_path / "q.png")
    assert drawn["train/loss"] == {"a": ([1, 2, 3], [2.0, 1.5, 1.0]), "b": ([1, 2, 3], [2.5, 1.2, 0.8])}
    assert drawn["val/loss"] == {"a": ([3], [0.9]), "b": ([3], [0.7])}
    assert drawn == series([a, b])


def test_compare_plot_takes_several_runs_and_show_plots_one(tmp_path: Path) -> None:
    runs = [_run(tmp_path, n, [1.0, 0.5], 0.4) for n in ("r1", "r2", "r3")]
    assert main(["compare", *map(str, runs), "--plot", str(tmp_path / "three.png")]) == 0
    assert (tmp_path / "three.png").is_file()
    assert main(["show", str(runs[0]), "--plot", str(tmp_path / "one.svg")]) == 0
    assert "<svg" in (tmp_path / "one.svg").read_text()


def test_compare_plot_without_a_path_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _run(tmp_path, "a", [1.0], 1.0)
    assert main(["compare", str(a), str(a), "--plot"]) == 2
    assert "--plot" in capsys.readouterr().err
