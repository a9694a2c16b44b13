"""Reading a run dir as data, for the read-only tools (`runs`, `show`, `compare`, `--plot`).

A run dir may come from anyone (a teammate's, a downloaded one), so every file is read the same
guarded way: a regular file only (a FIFO would block, `/dev/zero` would never end, a symlink may
point anywhere), opened with O_NOFOLLOW|O_NONBLOCK, size-capped, decoded strictly; YAML without
aliases (a 9x9 alias "billion laughs" expands to gigabytes); and every value type-checked before
use. What fails is not an exception: it is left out and named in `problems`, one line each, so
one bad field or run never hides the others.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from disttrain.rundir import CONFIG

SMALL_CAP = 1 << 20  # config.yaml, status.json, git.json, ...: a few KB when disttrain writes them
METRICS_CAP = 128 << 20  # metrics.jsonl: ~1M records; longer runs are read up to here, with a note
MAX_DEPTH = 64  # a frozen config nests a few levels; deeper is crafted (and would overflow recursion)
MAX_STEP = 2**53  # larger "steps" are no step count (and overflow int64 and float arithmetic)
MAX_TIME = 1e11  # seconds since 1970 (year 5138): larger or negative timestamps are not dates
SHA = re.compile(r"[0-9a-f]{7,40}")


class Unreadable(Exception):
    """A file of the run dir that is not read: why, in a few words."""


def read_capped(path: Path, cap: int = SMALL_CAP) -> tuple[bytes, bool]:
    """Up to `cap` bytes of the regular file at `path`, and whether it held more.

    FileNotFoundError when absent; Unreadable for a symlink, a FIFO, a device or a folder. The
    non-blocking open returns at once even for a FIFO, and fstat decides before any read.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            raise Unreadable("a symbolic link (only regular files are read)") from None
        raise Unreadable(exc.strerror or type(exc).__name__) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Unreadable(f"not a regular file ({_kind(mode)})")
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data[:cap], len(data) > cap


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a file"


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses `*alias` references: disttrain never writes them (its configs are
    plain trees), and a few nested aliases expand exponentially (the billion-laughs bomb)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"a YAML alias (*{event.anchor}) is not read here", event.start_mark
            )
        return super().compose_node(parent, index)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of dicts and lists, counted up to `limit + 1` (no recursion)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            break
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


def plain(value: Any) -> Any:
    """A YAML value as JSON would hold it: string keys, and dates (YAML reads `2026-01-01` as one)
    or other scalars JSON has no type for as their text."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def is_int(value: Any, low: int = 0, high: int = MAX_STEP) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any) -> TypeGuard[int | float]:
    """A float (NaN and inf too: a diverged loss is data) or an int a float holds."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) < 2**63)


def is_time(value: Any) -> bool:
    return is_number(value) and math.isfinite(value) and 0 <= value <= MAX_TIME


@dataclass
class RunFiles:
    """The files of one run dir, read as data; `problems` names what was left out and why."""

    path: Path
    problems: list[str] = field(default_factory=list)
    _records: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    def note(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def checked(
        self, name: str, data: dict[str, Any], checks: dict[str, Any], texts: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """`data` without the values that fail their check (`checks[key]`, or a str for `texts`)."""
        out = {}
        for key, value in data.items():
            check = checks.get(key) or ((lambda v: isinstance(v, str)) if key in texts else None)
            if check is not None and not check(value):
                self.note(f"{name}: {key} = {short_repr(value)} is not valid: left out")
                continue
            out[key] = value
        return out

    def text(self, name: str, cap: int = SMALL_CAP) -> str | None:
        """The file's text; None (and a problem named) when it is absent, unreadable or too big."""
        try:
            data, cut = read_capped(self.path / name, cap)
        except FileNotFoundError:
            return None
        except (Unreadable, OSError) as exc:
            self.note(f"{name}: {exc}: not read")
            return None
        if cut and cap <= SMALL_CAP:
            self.note(f"{name}: larger than {_size(cap)} (disttrain writes a few KB): not read")
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.note(f"{name}: not UTF-8 text: not read")
            return None

    def json(self, name: str) -> Any:
        text = self.text(name)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            self.note(f"{name}: not JSON ({_first_line(exc)}): not read")
            return None
        return value

    def yaml(self, name: str) -> Any:
        text = self.text(name)
        if text is None:
            return None
        try:
            value = load_yaml(text)
        except (yaml.YAMLError, RecursionError) as exc:
            self.note(f"{name}: not read ({_first_line(exc)})")
            return None
        if depth(value) > MAX_DEPTH:
            self.note(f"{name}: nested deeper than {MAX_DEPTH} levels: not read")
            return None
        return plain(value)

    def mapping(self, name: str, loader: str = "json") -> dict[str, Any]:
        """A JSON/YAML file that must hold a mapping: {} (and a problem) otherwise."""
        value = self.json(name) if loader == "json" else self.yaml(name)
        if value is None or isinstance(value, dict):
            return value or {}
        self.note(f"{name}: a {type(value).__name__}, not a mapping: not read")
        return {}

    def metrics(self, name: str = "metrics.jsonl", cap: int | None = None) -> list[dict[str, Any]]:
        """metrics.jsonl's records: a dict with an integer `step` and numbers. Other lines are skipped
        and named in one problem line; a last line a crash cut mid-write is skipped silently."""
        cap = METRICS_CAP if cap is None else cap
        if (name, cap) not in self._records:  # show reads them for the row and the final metrics
            self._records[name, cap] = self._read_metrics(name, cap)
        return self._records[name, cap]

    def _read_metrics(self, name: str, cap: int) -> list[dict[str, Any]]:
        try:
            data, cut = read_capped(self.path / name, cap)
        except FileNotFoundError:
            return []
        except (Unreadable, OSError) as exc:
            self.note(f"{name}: {exc}: not read")
            return []
        if cut:
            self.note(f"{name}: larger than {_size(cap)}: only its first {_size(cap)} read")
        lines = data.decode("utf-8", errors="replace").split("\n")
        out, bad = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            why = _record_problem(line)
            if not isinstance(why, str):
                out.append(why)
            elif number < len(lines):  # the last piece: cut by a crash mid-write (or by the cap)
                bad.append((number, why))
        if bad:
            shown = "; ".join(f"line {n}: {why}" for n, why in bad[:3]) + ("; ..." if len(bad) > 3 else "")
            self.note(f"{name}: {len(bad)} record(s) skipped ({shown})")
        return out


def _record_problem(line: str) -> dict[str, Any] | str:
    """The record of one metrics line, or why it is skipped."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not an object"
    if not is_int(record.get("step")):
        return f"step {short_repr(record.get('step'))} is not a step number"
    for key, value in record.items():
        if not is_number(value):
            return f"{short_repr(key)} = {short_repr(value)} is not a number"
    return record


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def short_repr(value: Any, width: int = 40) -> str:
    """repr(value) cut to `width` characters: a crafted value is named, not printed whole."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


# ------------------------------------------------------------------------------------ a run's config and labels
def config(run_dir: Path, files: RunFiles | None = None) -> dict[str, Any]:
    """The frozen config.yaml as a mapping; {} (named in problems) when it is unreadable."""
    return (files or RunFiles(run_dir)).mapping(CONFIG, loader="yaml")


def overrides(run_dir: Path, files: RunFiles) -> list[str]:
    """The run's overrides.yaml, its non-text entries left out (and named in `files.problems`)."""
    value = files.yaml("overrides.yaml")
    if value is None:
        return []
    if not isinstance(value, list):
        files.note(f"overrides.yaml: a {type(value).__name__}, not a list of overrides: left out")
        return []
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        files.note(
            f"overrides.yaml: {len(bad)} entr(ies) not key=value text, e.g. {short_repr(bad[0])}: left out"
        )
    return [v for v in value if isinstance(v, str)]


LABEL_WIDTH = 70  # a legend entry or a column title stays readable


def run_labels(runs: list[Path]) -> list[str]:
    """A short name per run that tells it from the others: its `name`, then the overrides that are
    not shared by every run compared (`digits_sgd · optim.lr=0.05`; one run: all of its overrides);
    where two labels still coincide, the run dir's own folder names are added (`… · 2026-11-28_03-02-58`)."""
    names, chosen = [], []
    for run in runs:
        files = RunFiles(run)
        name = config(run, files).get("name")
        names.append(str(name) if isinstance(name, str | int) and not isinstance(name, bool) else run.name)
        chosen.append([o for o in overrides(run, files) if not o.lstrip("+~").startswith("name=")])
    shared = set.intersection(*map(set, chosen)) if len(runs) > 1 else set()
    labels = [
        " · ".join([n, *(o for o in ovs if o not in shared)]) for n, ovs in zip(names, chosen, strict=True)
    ]
    tails = _tails(runs)
    labels = [
        f"{label} · {tail}" if labels.count(label) > 1 else label
        for label, tail in zip(labels, tails, strict=True)
    ]
    return [label if len(label) <= LABEL_WIDTH else label[: LABEL_WIDTH - 1] + "…" for label in labels]


def _tails(runs: list[Path]) -> list[str]:
    """Short distinct paths: the run dir names, with parents added while two coincide."""
    depth = 1
    while True:
        tails = ["/".join(r.parts[-depth:]) for r in runs]
        if len(set(tails)) == len(tails) or depth >= max(len(r.parts) for r in runs):
            return tails
        depth += 1
