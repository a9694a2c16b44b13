"""`disttrain compare A B --plot p.png` / `show RUN --plot`: curves of several runs on shared axes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.cli import main

pytest.importorskip("matplotlib")


def _run(
    root: Path,
    name: str,
    losses: list[float],
    val: float,
    run_name: str = "x",
    overrides: str = "",
    **more: float,
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: {run_name}\n")
    if overrides:
        (run / "overrides.yaml").write_text(overrides)
    records = [{"step": i + 1, "train/loss": v, "lr": 0.1} for i, v in enumerate(losses)]
    records.append({"step": len(losses), "val/loss": val, **more})
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
    # both named x, with no overrides: the run dirs' folder names tell them apart
    assert drawn["train/loss"] == {
        "x · a": ([1, 2, 3], [2.0, 1.5, 1.0]),
        "x · b": ([1, 2, 3], [2.5, 1.2, 0.8]),
    }
    assert drawn["val/loss"] == {"x · a": ([3], [0.9]), "x · b": ([3], [0.7])}
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


def test_each_run_keeps_one_colour_in_every_panel_and_one_legend_entry(tmp_path: Path) -> None:
    """Review 2026-11-28-ux #5: colours were assigned per panel while the legend was global, so in a
    panel one run lacked (val/ppl: only the gpt run), the gpt run took the first run's colour; the
    labels were timestamps. Now a run's colour is fixed across panels and its label is its name with
    the overrides that differ between the runs compared."""
    from disttrain.tools.plot import figure

    common = "- trainer.max_steps=3\n"
    runs = [
        _run(
            tmp_path,
            "runs/default/t1",
            [2.0, 1.5],
            1.4,
            "default",
            common + "- optim.lr=0.01\n",
            **{"val/acc": 0.5},
        ),
        _run(
            tmp_path,
            "runs/default/t2",
            [2.2, 1.2],
            1.1,
            "default",
            common + "- optim.lr=0.05\n",
            **{"val/acc": 0.6},
        ),
        _run(tmp_path, "runs/gpt/t3", [4.0, 3.2], 3.1, "gpt", common + "- model=gpt\n", **{"val/ppl": 22.0}),
    ]
    fig, _ = figure(runs)
    expected = {"default · optim.lr=0.01": "C0", "default · optim.lr=0.05": "C1", "gpt · model=gpt": "C2"}
    panels = {
        ax.get_ylabel(): {line.get_label(): line.get_color() for line in ax.get_lines()} for ax in fig.axes
    }
    assert set(panels) == {"train/loss", "val/loss", "val/acc", "val/ppl", "lr"}
    for metric, colours in panels.items():
        assert colours == {label: expected[label] for label in colours}, metric
    assert panels["val/ppl"] == {"gpt · model=gpt": "C2"}, "the gpt run keeps its colour where it is alone"
    assert [ax.get_legend() for ax in fig.axes] == [None] * 5, "no per-panel legend"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == list(expected)
    assert [h.get_color() for h in legend.legend_handles] == list(expected.values())
    import matplotlib.pyplot as plt

    plt.close(fig)
