"""`disttrain compare RUN_A RUN_B ... --plot out.png` and `disttrain show RUN --plot out.png`: the
loss and metric curves of several runs on shared axes, one panel per metric, from metrics.jsonl.
matplotlib is an optional extra (`pip install disttrain[plot]`), imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.tools.render import clean
from disttrain.tools.rundata import RunFiles

METRICS = ("train/loss", "val/loss", "val/acc", "val/mse", "val/ppl", "lr")

Series = dict[str, dict[str, tuple[list[int], list[float]]]]  # metric -> run label -> (steps, values)


def series(runs: list[Path], metrics: tuple[str, ...] = METRICS, problems: list[str] | None = None) -> Series:
    """Each metric's (steps, values) per run, in step order, the last record of a step winning.
    Records that do not check out are skipped and named in `problems` (`rundata.RunFiles.metrics`).
    A run is keyed by its label (`rundata.run_labels`: name and distinguishing overrides)."""
    from disttrain.tools.rundata import run_labels

    out: Series = {}
    for run, label in zip(runs, [_label(t) for t in run_labels(runs)], strict=True):
        files = RunFiles(run)
        records = files.metrics()
        if problems is not None:
            problems.extend(f"{run}: {p}" for p in files.problems)
        for metric in metrics:
            points: dict[int, float] = {}
            for r in records:
                if metric in r:
                    points[r["step"]] = float(r[metric])
            if points:
                steps = sorted(points)
                out.setdefault(metric, {})[label] = (steps, [points[s] for s in steps])
    return out


def _label(text: str) -> str:
    """A legend label shown as written: matplotlib reads `$...$` as mathtext (a crafted `$\\frac{$`
    raised), and hides labels starting with `_`."""
    text = clean(text).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def figure(runs: list[Path], problems: list[str] | None = None) -> tuple[Any, Series]:
    """The matplotlib figure of every metric the runs logged (one panel each) and what it draws.

    A run keeps one colour (`C0`, `C1`, ... in the order given) and one marker in every panel, and
    the one legend (the figure's, above the panels) names each run once: a run missing from a panel
    leaves its colour unused there instead of shifting the others' (review 2026-11-28-ux #5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    data = series(runs, problems=problems)
    if not data:
        raise ConfigError("RUN_DIR", " ".join(map(str, runs)), "runs with metrics.jsonl", "train first.")
    labels = list(dict.fromkeys(label for by_run in data.values() for label in by_run))
    style = {label: (f"C{i % 10}", MARKERS[i % len(MARKERS)]) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(
        len(data), 1, figsize=(8, 1.0 + 2.6 * len(data)), sharex=True, squeeze=False, layout="constrained"
    )
    handles: dict[str, Any] = {}
    for ax, (metric, by_run) in zip(axes[:, 0], data.items(), strict=True):
        for label, (steps, values) in by_run.items():
            colour, marker = style[label]
            (line,) = ax.plot(
                steps, values, color=colour, marker=marker if len(steps) < 30 else None, ms=4, label=label
            )
            handles.setdefault(label, line)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if metric.endswith("loss") and all(v > 0 for _, vs in by_run.values() for v in vs):
            ax.set_yscale("log")  # plain numbers on the ticks (0.3, not 3x10^-1), minor ones too
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
    axes[-1, 0].set_xlabel("step")
    fig.legend(
        handles=[handles[label] for label in labels],
        labels=labels,
        loc="outside upper center",
        fontsize="small",
        title=f"{len(labels)} run{'s' if len(labels) > 1 else ''}: name · distinguishing overrides",
        title_fontsize="small",
    )
    return fig, data


def plot(runs: list[Path], out: Path, problems: list[str] | None = None) -> Series:
    """Draw every metric the runs logged into `out` (PNG, SVG, PDF by suffix); return what was drawn.
    Records left out are named in `problems`."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        from disttrain.config.extras import EXTRAS

        raise ConfigError(
            "--plot", str(out), "a plot needs matplotlib", EXTRAS["plot"].install + "."
        ) from None
    fig, data = figure(runs, problems)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return data
