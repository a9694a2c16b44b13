"""The rich summary table rank 0 prints at the end of a run (the same numbers as summary.json)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("disttrain")

ROWS = (
    ("steps", "steps", "{:d}"),
    ("samples", "samples", "{:,d}"),
    ("train_time_s", "train time", "{:.1f} s"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("enter_to_first_step_s", "Enter to first step", "{:.2f} s"),
    ("time_to_first_step_s", "launch to first step", "{:.2f} s"),
    ("tflops", "TFLOP/s per device (last window)", "{:.3g}"),
    ("mfu", "MFU (last window)", "{:.1%}"),
    ("val/loss", "val loss", "{:.4f}"),
    ("val_ema/loss", "val loss of the EMA weights", "{:.4f}"),
    ("val/acc", "val accuracy", "{:.4f}"),
    ("val/mse", "val MSE", "{:.4f}"),
    ("val/ppl", "val perplexity", "{:.2f}"),
    ("amp/scale", "fp16 loss scale", "{:g}"),
    ("amp/skipped_steps", "fp16 skipped steps", "{:.0f}"),
    ("anomaly_skipped_steps", "non-finite skipped steps", "{:.0f}"),
    ("state_bytes_per_rank", "state bytes (rank 0)", "{:,d}"),
    ("gpu_mem_allocated_peak_gib", "peak GPU memory allocated (max rank)", "{:.2f} GiB"),
    ("gpu_mem_reserved_peak_gib", "peak GPU memory reserved (max rank)", "{:.2f} GiB"),
    ("host_rss_peak_mib", "peak host memory, RSS (max rank)", "{:,.0f} MiB"),
)


def summary_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="disttrain run summary", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, label, fmt in ROWS:
        value = summary.get(key)
        if value is None:
            continue
        try:
            table.add_row(label, fmt.format(value))
        except (ValueError, TypeError):
            table.add_row(label, str(value))
    return table


def record_summary(summary: dict[str, Any], path: Path, trained: bool) -> None:
    """Rank 0: summary.json and the table. Not after a signal stopped the run (it resumes later),
    nor when no step ran (a finished run resumed): that run's summary.json stays as it was."""
    from disttrain.rundir import write_json

    if not trained:
        log.warning("no step ran (the run had already finished): summary.json left as it was")
    elif not summary.get("stopped_by"):
        write_json(path, summary)
        print_summary(summary)


def print_summary(summary: dict[str, Any]) -> None:
    """Rank 0, to stderr (stdout carries the one-line `done:` summary scripts parse)."""
    from rich.console import Console

    from disttrain.observe.log import console

    Console(file=console.file, width=100).print(summary_table(summary))  # stderr, or its saved copy


def print_done(run_dir: Path) -> dict[str, Any] | None:
    """The one `done:` line on stdout (what scripts parse) from the run's summary.json; the summary
    itself, or None when the run wrote none."""
    import json
    import sys

    from disttrain.rundir import RunDir

    path = RunDir(run_dir).summary
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    vals = " ".join(f"{k}={s[k]:.4f}" for k in sorted(s) if k.startswith("val/"))
    gpu = s.get("gpu_mem_allocated_peak_gib")  # CUDA runs only: the CPU line stays as it was
    mem = f", peak GPU memory {gpu:.2f} GiB ({s['gpu_mem_reserved_peak_gib']:.2f} reserved)" if gpu else ""
    stopped = f" (stopped early: {s['stop_reason']})" if s.get("early_stopped") else ""
    sys.stdout.write(
        f"done: {s['steps']} steps{stopped}, {vals or 'no validation'}, {s['samples_per_s']:.0f} samples/s, "
        f"{s['train_time_s']:.1f} s training{mem} | run dir: {run_dir}\n"
    )
    return dict(s)
