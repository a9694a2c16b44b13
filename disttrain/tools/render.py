"""Output shared by the tools: rich tables for people, one JSON document for scripts. No torch here."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
# C0 and C1 control characters (ESC starts a terminal escape: clear the screen, set the title, hide
# text) and the bidirectional overrides that reorder what a line shows.
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def console() -> Any:
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=False, emoji=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = 140  # piped or captured: do not fold tables at rich's default 80 columns
    return out


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], **kw: Any) -> Any:
    """A rich Table; numeric-looking columns (time, bytes, bandwidth) are right-aligned by the caller.
    Every cell and the title are plain text: values from run dirs are data, never rich markup."""
    from rich.table import Table

    t = Table(title=text(title) if title is not None else None, title_justify="left", **kw)
    for col in columns:
        right = col.startswith(">")
        t.add_column(col.lstrip(">"), justify="right" if right else "left", overflow="fold")
    for row in rows:
        t.add_row(*(text("" if v is None else v) for v in row))
    return t


def clean(value: Any) -> str:
    """`value` as one line of plain text: control characters out (tab and newline become spaces),
    everything else intact (`observe.sinks=[mlflow]` stays as it is)."""
    return CONTROLS.sub(lambda m: " " if m.group() in "\t\n\r" else "", str(value))


def text(value: Any) -> Any:
    """A rich Text of `value`, cleaned: never read as markup (`[/bold]`, `[red]`) or emoji codes."""
    from rich.text import Text

    return Text(clean(value))


def say(out: Any, *lines: Any) -> None:
    """Print lines of data (run-dir values inside) as they are: no markup, no emoji codes, no
    hard wrap (a command stays one physical line a user can copy)."""
    for line in lines:
        out.print(text(line), soft_wrap=True)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for scale, unit in UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> int:
    """'8', '64K', '4M', '1G' (powers of 1024; 'KiB'/'KB' spellings too) -> bytes."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    number = s[:-1] if scale > 1 else s
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a size: use bytes or K/M/G suffixes, e.g. 8, 64K, 4M") from None
    if value < 0:
        raise ValueError(f"{text!r}: a size must be >= 0")
    return int(value)


def short(value: Any, width: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"
