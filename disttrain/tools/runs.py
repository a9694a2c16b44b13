"""The run browser: `disttrain runs [DIR]`, `disttrain show RUN_DIR`, `disttrain compare RUN_A RUN_B`.

Reads only what a run dir holds (config.yaml, status.json, metrics.jsonl, summary.json, command.txt,
overrides.yaml, checkpoints/); no torch import. Status comes from status.json, which the launching
parent writes: running, then finished / failed / interrupted. A `running` run whose launcher process
is gone from this host is reported as interrupted.

Run dirs may come from anyone: every file is read through `rundata` (regular files, size caps, no
YAML aliases) and every value is type-checked; what does not check out is left out and named in the
run's `problems`, and a run that cannot be read at all is listed as `unreadable` with the reason.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any

from disttrain.config.fingerprint import ABSENT, differences, flatten
from disttrain.rundir import CONFIG, STATUS, RunDir
from disttrain.storage import is_url
from disttrain.tools.rundata import SHA, RunFiles, config, is_int, is_number, is_time, run_labels, short_repr
from disttrain.tools.rundata import overrides as _overrides


# ------------------------------------------------------------------------------------ reading
def find_runs(root: Path) -> list[Path]:
    """Every run dir under `root` (it holds the frozen config.yaml; Hydra's .hydra/ copy is not one)."""
    if RunDir(root).is_run():
        return [root]
    return sorted(p.parent for p in root.rglob(CONFIG) if RunDir(p.parent).is_run())


def read_metrics(run_dir: Path, files: RunFiles | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl's well-formed records (`rundata.RunFiles.metrics`)."""
    return (files or RunFiles(run_dir)).metrics()


STATUSES = ("running", "finished", "failed", "interrupted")
STATUS_TYPES = {"started": is_time, "ended": is_time, "pid": lambda v: is_int(v, 1, 2**31 - 1)}


def status_of(run_dir: Path, files: RunFiles | None = None) -> dict[str, Any]:
    files = files or RunFiles(run_dir)
    if not RunDir(run_dir).status.exists() and not RunDir(run_dir).status.is_symlink():
        done = RunDir(run_dir).summary.is_file()
        return {"status": "finished" if done else "unknown", "note": "no status.json (older run)"}
    st = files.checked(STATUS, files.mapping(STATUS), STATUS_TYPES, texts=("status", "error", "note", "host"))
    if st.get("status") not in STATUSES:
        if "status" in st:
            files.note(f"{STATUS}: status {short_repr(st['status'])} is not one of {', '.join(STATUSES)}")
        st["status"] = "unknown"
    if st["status"] == "running" and st.get("host") == socket.gethostname() and not _alive(st.get("pid")):
        return {**st, "status": "interrupted", "note": f"launcher process {st.get('pid')} is gone"}
    return st


def _alive(pid: Any) -> bool:
    if not is_int(pid, 1, 2**31 - 1):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def best_val(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best validation value: max of val/acc (or another val metric), else min of val/loss."""
    vals = [r for r in records if any(k.startswith("val/") for k in r)]
    if not vals:
        return None
    keys = sorted({k for r in vals for k in r if k.startswith("val/")})
    metric = next((k for k in keys if "loss" not in k), keys[0])
    pick = min if "loss" in metric else max
    rec = pick((r for r in vals if metric in r), key=lambda r: r[metric])
    return {"metric": metric, "value": rec[metric], "step": rec.get("step")}


def run_info(run_dir: Path, files: RunFiles | None = None) -> dict[str, Any]:
    """One row of `disttrain runs`; `problems` names each value left out because it did not check."""
    files = files or RunFiles(run_dir)
    cfg = config(run_dir, files)
    records = files.metrics()
    st = status_of(run_dir, files)
    train = [r for r in records if "train/loss" in r]
    env = files.mapping("env.json")
    if "started" in env and not is_time(env["started"]):
        files.note(f"env.json: started = {short_repr(env['started'])} is not a time: left out")
        env.pop("started")
    started = st.get("started") or env.get("started") or _mtime(RunDir(run_dir).config)
    name = cfg.get("name")
    return {
        "run_dir": str(run_dir),
        "name": name if isinstance(name, str | int | float) and not isinstance(name, bool) else None,
        "started": started,
        "status": st["status"],
        "error": st.get("error"),
        "note": st.get("note"),
        "step": max((r["step"] for r in records), default=0),
        "last_loss": train[-1]["train/loss"] if train else None,
        "best_val": best_val(records),
        "strategy": _strategy(cfg, files),
        "world_size": _world_size(cfg, files),
        "duration_s": (st["ended"] - st["started"]) if "ended" in st and "started" in st else None,
        "overrides": _overrides(run_dir, files),
        "problems": files.problems,
    }


def unreadable(run_dir: Path, exc: BaseException) -> dict[str, Any]:
    """The row of a run that could not be read at all: listed, with the reason, among the others."""
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    keys = (
        "name",
        "started",
        "error",
        "note",
        "last_loss",
        "best_val",
        "strategy",
        "world_size",
        "duration_s",
    )
    return {"run_dir": str(run_dir), **dict.fromkeys(keys), "status": "unreadable", "step": 0,
            "overrides": [], "problems": [f"unreadable: {why[:300]}"]}  # fmt: skip


def _mtime(path: Path) -> float | None:
    try:
        return path.lstat().st_mtime
    except OSError:
        return None


def _strategy(cfg: dict[str, Any], files: RunFiles) -> str | None:
    block = cfg.get("strategy")
    if block is None:
        return None
    if isinstance(block, dict) and isinstance(block.get("name"), str):
        return str(block["name"])
    files.note(f"{CONFIG}: strategy = {short_repr(block)} is not a strategy block with a name: left out")
    return None


def _world_size(cfg: dict[str, Any], files: RunFiles) -> int | None:
    """nodes x nproc_per_node of a saved config; None (unknown) when config.yaml is unreadable."""
    if "nodes" not in cfg or "nproc_per_node" not in cfg:
        return None
    nodes, nproc = cfg["nodes"], cfg["nproc_per_node"]
    if not (is_int(nodes, 1, 1 << 20) and is_int(nproc, 1, 1 << 20)):
        files.note(
            f"{CONFIG}: nodes = {short_repr(nodes)}, nproc_per_node = {short_repr(nproc)}: not a world size"
        )
        return None
    return int(nodes * nproc)


# ------------------------------------------------------------------------------------ diffs
def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "a": va, "b": vb} for k, va, vb in differences(flatten(a), flatten(b))]


def default_config(run_dir: Path, files: RunFiles | None = None) -> dict[str, Any]:
    """Today's defaults, composed from the config folder the run used (--config-dir in command.txt);
    the built-in ones when that folder is gone or does not compose."""
    from disttrain.config import compose, resolve

    files = files or RunFiles(run_dir)
    argv = _command(run_dir, files)
    user_dir = None
    for i, tok in enumerate(argv):
        if tok == "--config-dir" and i + 1 < len(argv):
            user_dir = argv[i + 1]
        elif tok.startswith("--config-dir="):
            user_dir = tok.split("=", 1)[1]
    if user_dir and not Path(user_dir).is_dir():
        user_dir = None
    try:
        return resolve(compose([], user_dir))
    except Exception as exc:  # a folder of someone else's YAML: the built-in defaults instead
        if user_dir is None:
            raise
        files.note(f"--config-dir {user_dir} does not compose ({str(exc).splitlines()[0][:200]}): "
                   "diff against the built-in defaults")  # fmt: skip
        return resolve(compose([], None))


def _command(run_dir: Path, files: RunFiles | None = None) -> list[str]:
    files = files or RunFiles(run_dir)
    text = files.text("command.txt")
    if text is None:
        return []
    try:
        return shlex.split(text.strip())
    except ValueError as exc:
        files.note(f"command.txt: not a shell command line ({exc}): left out")
        return []


def reproduce(run_dir: Path, files: RunFiles | None = None) -> str:
    """`disttrain train` with the run's overrides (one job even when it came from a -m sweep)."""
    files = files or RunFiles(run_dir)
    overrides = _overrides(run_dir, files)
    argv = _command(run_dir, files)
    extra = [
        t for i, t in enumerate(argv) if t.startswith("--config-dir") or (i and argv[i - 1] == "--config-dir")
    ]
    return shlex.join(["disttrain", "train", *extra, *overrides])


def rerun_command(run_dir: Path, files: RunFiles | None = None) -> str:
    """The exact rerun: the run's code (`git checkout SHA` in its repo), then its frozen config.
    Every word is shell-quoted, and a `sha` that is not a commit SHA is left out (and named)."""
    files = files or RunFiles(run_dir)
    git = files.mapping("git.json")
    repo, sha = git.get("repo"), git.get("sha")
    steps = []
    if sha is not None and not (isinstance(sha, str) and SHA.fullmatch(sha)):
        files.note(f"git.json: sha = {short_repr(sha)} is not a commit SHA (7-40 hex digits): no checkout")
    elif repo is not None and not (isinstance(repo, str) and os.path.isabs(repo)):
        files.note(f"git.json: repo = {short_repr(repo)} is not an absolute path: no checkout")
    elif repo and sha:
        steps.append(shlex.join(["cd", repo]) + " && " + shlex.join(["git", "checkout", sha]))
        if git.get("dirty") is True:
            steps.append(shlex.join(["git", "apply", str(run_dir.resolve() / "git.diff")]))
    steps.append(shlex.join(["disttrain", "rerun", str(run_dir.resolve())]))
    return " && ".join(steps)


CHECKPOINTS_SHOWN = 1000  # a crafted checkpoint.dir may name a huge folder


def checkpoints(run_dir: Path, files: RunFiles | None = None) -> list[dict[str, Any]]:
    files = files or RunFiles(run_dir)
    cfg = config(run_dir, files)
    saved = cfg.get("checkpoint")  # an unreadable or hand-made config: the run dir's own folder
    chosen = saved.get("dir") if isinstance(saved, dict) else None
    if chosen is not None and not isinstance(chosen, str):
        files.note(
            f"{CONFIG}: checkpoint.dir = {short_repr(chosen)} is not a path: the run dir's checkpoints/"
        )
        chosen = None
    if chosen and is_url(chosen):  # never contacted from a run dir anyone may have written
        files.note(f"{CONFIG}: checkpoint.dir = {short_repr(chosen)} is in an object store: not listed here")
        return []
    folder = Path(chosen).absolute() if chosen else RunDir(run_dir).checkpoints
    out = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                st = entry.stat(follow_symlinks=False)
                size = _folder_bytes(entry.path, files) if entry.is_dir(follow_symlinks=False) else st.st_size
                out.append({"path": entry.path, "bytes": size, "modified": st.st_mtime})
                if len(out) >= CHECKPOINTS_SHOWN:
                    files.note(f"{folder}: more than {CHECKPOINTS_SHOWN} entries: the first shown")
                    break
    except OSError:
        return []
    return sorted(out, key=lambda c: c["path"])


FILES_COUNTED = 100_000  # a checkpoint folder's files summed at most (a crafted one may hold millions)


def _folder_bytes(folder: str, files: RunFiles) -> int:
    """The bytes of the regular files under `folder` (a DCP checkpoint's shards and metadata), not
    its directory entry's 4 KiB (review 2026-11-28-ux #17); links are not followed."""
    total, seen, stack = 0, 0, [folder]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > FILES_COUNTED:
                        files.note(f"{folder}: more than {FILES_COUNTED} files: the size counts the first")
                        return total
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def final_metrics(run_dir: Path, files: RunFiles | None = None) -> dict[str, Any]:
    """summary.json's numbers; for a run without one, the last logged value of every metric."""
    files = files or RunFiles(run_dir)
    summary = files.mapping("summary.json")
    if summary:
        return {k: v for k, v in summary.items() if is_number(v) and k != "first_step_at"}
    last: dict[str, Any] = {}
    for r in files.metrics():
        last.update({k: v for k, v in r.items() if k not in ("time", "epoch")})
    return last


STRAGGLER_RATIO = 1.3  # a rank whose median step time is this many times the ranks' median


def stragglers(summary: dict[str, Any]) -> list[str]:
    """A line per rank whose p50 step time (summary.json, engine.loop) is >= STRAGGLER_RATIO x the
    median over the ranks; nothing for a run without per-rank times (or not a list of numbers)."""
    p50, p95 = summary.get("step_time_p50_s_by_rank"), summary.get("step_time_p95_s_by_rank")
    if not (isinstance(p50, list) and len(p50) > 1 and all(is_number(x) for x in p50)):
        return []
    ordered = sorted(p50)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    tails = p95 if isinstance(p95, list) and len(p95) == len(p50) and all(is_number(x) for x in p95) else None
    return [
        f"straggler: rank {r} step time p50 {t:.3g} s = {t / median:.2f}x the median {median:.3g} s"
        + (f" (p95 {tails[r]:.3g} s)" if tails else "")
        for r, t in enumerate(p50)
        if median > 0 and t >= STRAGGLER_RATIO * median
    ]


def show(run_dir: Path) -> dict[str, Any]:
    files = RunFiles(run_dir)
    cfg = config(run_dir, files)
    info = run_info(run_dir, files)
    return {
        "run": info,
        "ranks": live_ranks(run_dir) if info["status"] == "running" else [],
        "stragglers": stragglers(files.mapping("summary.json")),
        "config_diff_vs_defaults": [
            {"key": d["key"], "default": d["a"], "run": d["b"]}
            for d in config_diff(default_config(run_dir, files), cfg)
        ],
        "final_metrics": final_metrics(run_dir, files),
        "checkpoints": checkpoints(run_dir, files),
        "command": shlex.join(_command(run_dir, files)),
        "reproduce": reproduce(run_dir, files),
        "rerun": rerun_command(run_dir, files),
        "problems": files.problems,
    }


def live_ranks(run_dir: Path) -> list[dict[str, int]]:
    """[{rank, world, pid}] of the run's live ranks on this machine, found by the command-line title
    each rank gives itself (`disttrain rank R/W RUN_DIR`, procs.name_process)."""
    from disttrain.procs import live_ranks as found

    return found(run_dir)


def compare(*runs: Path) -> dict[str, Any]:
    """Two or more runs side by side: each run's row and label (`run_labels`), the config keys whose
    values are not all the same, and every final metric, one value per run (`values`, in order).
    Two runs also keep the A/B form (`a`, `b`, and each row's `a`, `b`, `delta` = b - a)."""
    files = [RunFiles(r) for r in runs]
    finals = [final_metrics(r, f) for r, f in zip(runs, files, strict=True)]
    flat = [flatten(config(r, f)) for r, f in zip(runs, files, strict=True)]
    keys = sorted(set().union(*flat))
    table = [(k, [c.get(k, ABSENT) for c in flat]) for k in keys]
    diff: list[dict[str, Any]] = [
        {"key": k, "values": values} for k, values in table if any(v != values[0] for v in values)
    ]
    metrics: list[dict[str, Any]] = [
        {"metric": k, "values": [m.get(k) for m in finals]} for k in sorted(set().union(*finals))
    ]
    data: dict[str, Any] = {
        "runs": [run_info(r, f) for r, f in zip(runs, files, strict=True)],
        "labels": run_labels(list(runs)),
        "config_diff": diff,
        "metrics": metrics,
    }
    if len(runs) == 2:
        data["a"], data["b"] = data["runs"]
        for row in diff:
            row["a"], row["b"] = row["values"]
        for row in metrics:
            va, vb = row["a"], row["b"] = row["values"]
            row["delta"] = vb - va if is_number(va) and is_number(vb) else None
    return data


# ------------------------------------------------------------------------------------ commands
def _args(prog: str, rest: list[str], *positional: tuple[str, str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"disttrain {prog}")
    for name, help_text in positional:
        p.add_argument(name, nargs="?" if name == "dir" else None, default="runs", help=help_text)
    p.add_argument("--json", action="store_true", help="print JSON")
    return p.parse_args(rest)


def _run_dir(text: str) -> Path:
    from disttrain.config.errors import ConfigError

    path = Path(text).resolve()
    if not RunDir(path).config.is_file():
        raise ConfigError(
            "RUN_DIR", text, "a run directory (it holds config.yaml)", "list runs with `disttrain runs`."
        )
    return path


def cmd_runs(rest: list[str]) -> int:
    args = _args("runs", rest, ("dir", "folder to search for runs (default ./runs)"))
    if not Path(args.dir).is_dir():  # a typo must not read as "0 runs"
        from disttrain.config.errors import ConfigError

        raise ConfigError(
            "DIR",
            args.dir,
            "an existing folder holding run dirs",
            "runs are under ./runs of the folder you trained in (or the hydra.run.dir you chose); "
            "`disttrain runs PATH` searches PATH.",
        )
    root = Path(args.dir).resolve()
    rows = [_row(d) for d in find_runs(root)]
    rows.sort(key=lambda r: r["started"] or 0)
    if args.json:
        from disttrain.tools.render import print_json

        print_json({"schema": "disttrain.runs/1", "root": str(root), "runs": rows})
        return 0
    from disttrain.tools.render import console, say, table, text

    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    cells = [
        (
            os.path.relpath(r["run_dir"], root),
            _when(r["started"])[5:16],  # MM-DD HH:MM
            r["status"],
            r["step"],
            _num(r["last_loss"]),
            f"{r['best_val']['metric']}={r['best_val']['value']:.4g}" if r["best_val"] else "-",
            _duration(r["duration_s"]),
            f"{r['strategy']} x{r['world_size']}"
            if r["strategy"] and r["world_size"]
            else r["strategy"] or "-",
            " ".join(o for o in r["overrides"] if o not in shared) or "-",
        )
        for r in rows
    ]
    cols = ["run", "started", "status", ">step", ">last loss", "best val", ">time", "layout", "overrides"]
    out = console()
    # The folder on a line of its own, never wrapped (a table title wraps to the table's width).
    out.print(text(f"{len(rows)} runs under {root}"), soft_wrap=True)
    listing = table(None, cols, cells)
    for column in listing.columns[1:-1]:  # the short cells stay whole; run and overrides wrap
        column.no_wrap = True
    out.print(listing)
    if shared:
        out.print(text("overrides every run shares: " + " ".join(sorted(shared))), soft_wrap=True)
    say(out, *(f"{os.path.relpath(r['run_dir'], root)}: {p}" for r in rows for p in r["problems"]))
    return 0


def _row(run_dir: Path) -> dict[str, Any]:
    """run_info, or the `unreadable` row: one bad run never hides the others."""
    try:
        return run_info(run_dir)
    except Exception as exc:
        return unreadable(run_dir, exc)


def _plot_flag(rest: list[str]) -> tuple[list[str], str | None]:
    """`--plot OUT.png` (or `--plot=OUT.png`) taken out of the arguments."""
    out, kept, it = None, [], iter(rest)
    for tok in it:
        if tok == "--plot":
            out = next(it, None) or ""
        elif tok.startswith("--plot="):
            out = tok.partition("=")[2]
        else:
            kept.append(tok)
    if out == "":
        from disttrain.config.errors import ConfigError

        raise ConfigError("--plot", None, "an image path (png, svg, pdf)", "e.g. --plot curves.png.")
    return kept, out


def _write_plot(runs: list[Path], out: str) -> None:
    import sys

    from disttrain.tools.plot import plot
    from disttrain.tools.render import clean

    problems: list[str] = []
    drawn = plot(runs, Path(out), problems)
    for line in problems:
        sys.stderr.write(clean(line) + "\n")
    sys.stderr.write(
        clean(f"plotted {', '.join(drawn)} of {len(runs)} run(s) -> {Path(out).resolve()}") + "\n"
    )


def cmd_show(rest: list[str]) -> int:
    rest, plot_out = _plot_flag(rest)
    args = _args("show", rest, ("run_dir", "a run directory"))
    if plot_out:
        _write_plot([_run_dir(args.run_dir)], plot_out)
    data = show(_run_dir(args.run_dir))
    if args.json:
        from disttrain.tools.render import print_json

        print_json(data)
        return 0
    from disttrain.tools.render import console, human_bytes, say, short, table

    out, r = console(), data["run"]
    say(out, f"{r['run_dir']}  status: {r['status']}" + (f" ({r['error']})" if r["error"] else ""))
    if data["ranks"]:
        say(out, "ranks:     " + ", ".join(f"{x['rank']}/{x['world']} pid {x['pid']}" for x in data["ranks"]))
    diff = [(d["key"], short(d["default"]), short(d["run"])) for d in data["config_diff_vs_defaults"]]
    out.print(
        table("config vs defaults", ["key", "default", "this run"], diff or [("(same as defaults)", "", "")])
    )
    out.print(
        table("final metrics", ["metric", ">value"], [(k, _num(v)) for k, v in data["final_metrics"].items()])
    )
    ck = [(Path(c["path"]).name, human_bytes(c["bytes"]), _when(c["modified"])) for c in data["checkpoints"]]
    out.print(table("checkpoints", ["file", ">size", "written"], ck or [("(none)", "", "")]))
    say(out, *data["stragglers"])
    say(out, *(f"left out: {p}" for p in data["problems"]))
    say(
        out, f"command:   {data['command']}", f"rerun:     {data['rerun']}", f"recompose: {data['reproduce']}"
    )
    return 0


def cmd_compare(rest: list[str]) -> int:
    rest, plot_out = _plot_flag(rest)
    p = argparse.ArgumentParser(prog="disttrain compare", description="two or more runs side by side")
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (a sweep's: runs/NAME/multirun_*/*)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="OUT.png", help="also draw their curves into OUT (png, svg, pdf)")
    args = p.parse_args(rest)
    runs = [_run_dir(r) for r in args.run_dirs]
    if plot_out:
        _write_plot(runs, plot_out)
        if len(runs) == 1:
            return 0
    if len(runs) < 2:
        from disttrain.config.errors import ConfigError

        raise ConfigError(
            "RUN_DIR",
            args.run_dirs[0],
            "two or more run directories",
            "disttrain compare A B [C ...]; one run: disttrain show A.",
        )
    data = compare(*runs)
    if args.json:
        from disttrain.tools.render import print_json

        print_json(data)
        return 0
    from disttrain.tools.render import console, say, short, table

    out, letters = console(), _letters(len(runs))
    say(
        out,
        *(
            f"{x}: {label}  {r['run_dir']} ({r['status']})"
            for x, label, r in zip(letters, data["labels"], data["runs"], strict=True)
        ),
    )
    width = max(12, 80 // len(runs))
    diff = [(d["key"], *(short(v, width) for v in d["values"])) for d in data["config_diff"]]
    out.print(table("config", ["key", *letters], diff or [("(identical)", *[""] * len(runs))]))
    two = len(runs) == 2
    rows = [
        (m["metric"], *map(_num, m["values"]), *([_num(m["delta"], signed=True)] if two else []))
        for m in data["metrics"]
    ]
    out.print(table("metrics", ["metric", *(f">{x}" for x in letters), *([">B - A"] if two else [])], rows))
    say(
        out,
        *(
            f"{x.lower()}: left out: {p}"
            for x, r in zip(letters, data["runs"], strict=True)
            for p in r["problems"]
        ),
    )
    return 0


def _letters(n: int) -> list[str]:
    """A, B, ..., Z, then AA, AB, ...: one short column title per run."""
    return [chr(65 + i) if i < 26 else chr(64 + i // 26) + chr(65 + i % 26) for i in range(n)]


def _num(v: Any, signed: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.4g}" if signed else f"{v:.4g}"
    return str(v)


def _duration(seconds: Any) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min: a run's wall time; - when unknown."""
    if not is_number(seconds) or seconds < 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if is_time(ts) and ts else "-"
