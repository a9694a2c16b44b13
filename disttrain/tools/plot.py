"""`disttrain compare RUN_A RUN_B ... --plot out.png` and `disttrain show RUN --plot out.png`: the
loss and metric curves of several runs on shared axes, one panel per metric, from metrics.jsonl.
matplotlib is an optional extra (`pip install disttrain[plot]`), imported only here."""

from __future__ import annotations

from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.tools.render import clean
from disttrain.tools.rundata import RunFiles

METRICS = ("train/loss", "val/loss", "val/acc", "val/mse", "val/ppl", "lr")

Series = dict[str, dict[str, tuple[list[int], list[float]]]]  # metric -> run label -> (steps, values)


def series(runs: list[Path], metrics: tuple[str, ...] = METRICS, problems: list[str] | None = None) -> Series:
    """Each metric's (steps, values) per run, in step order, the last record of a step winning.
    Records that do not check out are skipped and named in `problems` (`rundata.RunFiles.metrics`)."""
    out: Series = {}
    labels = _labels(runs)
    for run, label in zip(runs, labels, strict=True):
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


def _labels(runs: list[Path]) -> list[str]:
    """Short distinct names: the run dir names, with parents added while two coincide."""
    depth = 1
    while True:
        labels = ["/".join(r.parts[-depth:]) for r in runs]
        if len(set(labels)) == len(labels) or depth >= max(len(r.parts) for r in runs):
            return [_label(text) for text in labels]
        depth += 1


def _label(text: str) -> str:
    """A legend label shown as written: matplotlib reads `$...$` as mathtext (a crafted `$\\frac{$`
    raised), and hides labels starting with `_`."""
    text = clean(text).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def plot(runs: list[Path], out: Path, problems: list[str] | None = None) -> Series:
    """Draw every metric the runs logged into `out` (PNG, SVG, PDF by suffix); return what was drawn.
    Records left out are named in `problems`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot", str(out), "a plot needs matplotlib", "pip install 'disttrain[plot]' (or matplotlib)."
        ) from None
    data = series(runs, problems=problems)
    if not data:
        raise ConfigError("RUN_DIR", " ".join(map(str, runs)), "runs with metrics.jsonl", "train first.")
    fig, axes = plt.subplots(len(data), 1, figsize=(8, 3 * len(data)), sharex=True, squeeze=False)
    for ax, (metric, by_run) in zip(axes[:, 0], data.items(), strict=True):
        for label, (steps, values) in by_run.items():
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if metric.endswith("loss") and all(v > 0 for _, vs in by_run.values() for v in vs):
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return data
