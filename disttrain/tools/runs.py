"""The run browser: `disttrain runs [DIR]`, `disttrain show RUN_DIR`, `disttrain compare RUN_A RUN_B`.

Reads only what a run dir holds (config.yaml, status.json, metrics.jsonl, summary.json, command.txt,
overrides.yaml, checkpoints/); no torch import. Status comes from status.json, which the launching
parent writes: running, then finished / failed / interrupted. A `running` run whose launcher process
is gone from this host is reported as interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from disttrain.config.fingerprint import differences, flatten
from disttrain.observe.metrics import read_metrics
from disttrain.rundir import CONFIG, RunDir


# ------------------------------------------------------------------------------------ reading
def find_runs(root: Path) -> list[Path]:
    """Every run dir under `root` (it holds the frozen config.yaml; Hydra's .hydra/ copy is not one)."""
    if RunDir(root).is_run():
        return [root]
    return sorted(p.parent for p in root.rglob(CONFIG) if RunDir(p.parent).is_run())


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def status_of(run_dir: Path) -> dict[str, Any]:
    st = _json(RunDir(run_dir).status)
    if not isinstance(st, dict):
        done = RunDir(run_dir).summary.is_file()
        return {"status": "finished" if done else "unknown", "note": "no status.json (older run)"}
    if st.get("status") == "running" and st.get("host") == socket.gethostname() and not _alive(st.get("pid")):
        return {**st, "status": "interrupted", "note": f"launcher process {st.get('pid')} is gone"}
    return st


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
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


def run_info(run_dir: Path) -> dict[str, Any]:
    """One row of `disttrain runs`."""
    cfg = _config(run_dir)
    records = read_metrics(run_dir)
    st = status_of(run_dir)
    train = [r for r in records if "train/loss" in r]
    env = _json(RunDir(run_dir).env) or {}
    started = st.get("started") or env.get("started") or RunDir(run_dir).config.stat().st_mtime
    return {
        "run_dir": str(run_dir),
        "name": cfg.get("name"),
        "started": started,
        "status": st["status"],
        "error": st.get("error"),
        "note": st.get("note"),
        "step": max((r.get("step", 0) for r in records), default=0),
        "last_loss": train[-1]["train/loss"] if train else None,
        "best_val": best_val(records),
        "strategy": (cfg.get("strategy") or {}).get("name"),
        "world_size": _world_size(cfg),
        "duration_s": (st["ended"] - st["started"]) if "ended" in st and "started" in st else None,
    }


def _world_size(cfg: dict[str, Any]) -> int | None:
    """nodes x nproc_per_node of a saved config; None (unknown) when config.yaml is unreadable."""
    if "nodes" not in cfg or "nproc_per_node" not in cfg:
        return None
    return int(cfg["nodes"]) * int(cfg["nproc_per_node"])


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        cfg = yaml.safe_load(RunDir(run_dir).config.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


# ------------------------------------------------------------------------------------ diffs
def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "a": va, "b": vb} for k, va, vb in differences(flatten(a), flatten(b))]


def default_config(run_dir: Path) -> dict[str, Any]:
    """Today's defaults, composed from the config folder the run used (--config-dir in command.txt)."""
    from disttrain.config import compose, resolve

    argv = _command(run_dir)
    user_dir = None
    for i, tok in enumerate(argv):
        if tok == "--config-dir" and i + 1 < len(argv):
            user_dir = argv[i + 1]
        elif tok.startswith("--config-dir="):
            user_dir = tok.split("=", 1)[1]
    if user_dir and not Path(user_dir).is_dir():
        user_dir = None
    return resolve(compose([], user_dir))


def _command(run_dir: Path) -> list[str]:
    try:
        return shlex.split(RunDir(run_dir).command.read_text().strip())
    except (OSError, ValueError):
        return []


def reproduce(run_dir: Path) -> str:
    """`disttrain train` with the run's overrides (one job even when it came from a -m sweep)."""
    try:
        overrides = yaml.safe_load(RunDir(run_dir).overrides.read_text()) or []
    except (OSError, yaml.YAMLError):
        overrides = []
    argv = _command(run_dir)
    extra = [
        t for i, t in enumerate(argv) if t.startswith("--config-dir") or (i and argv[i - 1] == "--config-dir")
    ]
    return shlex.join(["disttrain", "train", *extra, *overrides])


def rerun_command(run_dir: Path) -> str:
    """The exact rerun: the run's code (`git checkout SHA` in its repo), then its frozen config."""
    git = _json(run_dir / "git.json") or {}
    steps = []
    if git.get("repo") and git.get("sha"):
        steps.append(f"cd {shlex.quote(str(git['repo']))} && git checkout {git['sha']}")
        if git.get("dirty"):
            steps.append(f"git apply {shlex.quote(str(run_dir.resolve() / 'git.diff'))}")
    steps.append(shlex.join(["disttrain", "rerun", str(run_dir.resolve())]))
    return " && ".join(steps)


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    from disttrain.shared_dir import checkpoint_dir

    cfg = _config(run_dir)
    saved = cfg.get("checkpoint")  # an unreadable or hand-made config: the run dir's own folder
    known = isinstance(saved, dict) and "dir" in saved
    folder = checkpoint_dir(cfg, run_dir) if known else RunDir(run_dir).checkpoints  # checkpoint.dir, if set
    if not folder.is_dir():
        return []
    return [
        {"path": str(p), "bytes": p.stat().st_size, "modified": p.stat().st_mtime}
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".")
    ]


def final_metrics(run_dir: Path) -> dict[str, Any]:
    """summary.json's numbers; for a run without one, the last logged value of every metric."""
    summary = _json(RunDir(run_dir).summary)
    if isinstance(summary, dict):
        return {k: v for k, v in summary.items() if isinstance(v, int | float) and k != "first_step_at"}
    last: dict[str, Any] = {}
    for r in read_metrics(run_dir):
        last.update({k: v for k, v in r.items() if k not in ("time", "epoch")})
    return last


def show(run_dir: Path) -> dict[str, Any]:
    cfg = _config(run_dir)
    return {
        "run": run_info(run_dir),
        "config_diff_vs_defaults": [
            {"key": d["key"], "default": d["a"], "run": d["b"]}
            for d in config_diff(default_config(run_dir), cfg)
        ],
        "final_metrics": final_metrics(run_dir),
        "checkpoints": checkpoints(run_dir),
        "command": " ".join(_command(run_dir)),
        "reproduce": reproduce(run_dir),
        "rerun": rerun_command(run_dir),
    }


def compare(a: Path, b: Path) -> dict[str, Any]:
    ma, mb = final_metrics(a), final_metrics(b)
    metrics = []
    for k in sorted(set(ma) | set(mb)):
        va, vb = ma.get(k), mb.get(k)
        delta = vb - va if isinstance(va, int | float) and isinstance(vb, int | float) else None
        metrics.append({"metric": k, "a": va, "b": vb, "delta": delta})
    return {
        "a": run_info(a),
        "b": run_info(b),
        "config_diff": config_diff(_config(a), _config(b)),
        "metrics": metrics,
    }


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
    rows = [run_info(d) for d in find_runs(Path(args.dir).resolve())]
    rows.sort(key=lambda r: r["started"] or 0)
    if args.json:
        from disttrain.tools.render import print_json

        print_json({"schema": "disttrain.runs/1", "root": str(Path(args.dir).resolve()), "runs": rows})
        return 0
    from disttrain.tools.render import console, table

    root = Path(args.dir).resolve()
    cells = [
        (
            os.path.relpath(r["run_dir"], root),
            r["name"],
            _when(r["started"]),
            r["status"],
            r["step"],
            _num(r["last_loss"]),
            f"{r['best_val']['metric']}={r['best_val']['value']:.4f}" if r["best_val"] else "-",
            r["strategy"],
            r["world_size"],
        )
        for r in rows
    ]
    cols = ["run", "name", "started", "status", ">step", ">last loss", "best val", "strategy", ">world"]
    console().print(table(f"{len(rows)} runs under {root}", cols, cells))
    return 0


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
    from disttrain.tools.plot import plot

    drawn = plot(runs, Path(out))
    import sys

    sys.stderr.write(f"plotted {', '.join(drawn)} of {len(runs)} run(s) -> {Path(out).resolve()}\n")


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
    from disttrain.tools.render import console, human_bytes, short, table

    out, r = console(), data["run"]
    out.print(f"{r['run_dir']}  status: {r['status']}" + (f" ({r['error']})" if r["error"] else ""))
    diff = [(d["key"], short(d["default"]), short(d["run"])) for d in data["config_diff_vs_defaults"]]
    out.print(
        table("config vs defaults", ["key", "default", "this run"], diff or [("(same as defaults)", "", "")])
    )
    out.print(
        table("final metrics", ["metric", ">value"], [(k, _num(v)) for k, v in data["final_metrics"].items()])
    )
    ck = [(Path(c["path"]).name, human_bytes(c["bytes"]), _when(c["modified"])) for c in data["checkpoints"]]
    out.print(table("checkpoints", ["file", ">size", "written"], ck or [("(none)", "", "")]))
    out.print(f"command:   {data['command']}\nrerun:     {data['rerun']}\nrecompose: {data['reproduce']}")
    return 0


def cmd_compare(rest: list[str]) -> int:
    rest, plot_out = _plot_flag(rest)
    positional = [t for t in rest if not t.startswith("-")]
    if plot_out and len(positional) != 2:  # several runs: the picture only
        if not positional:
            from disttrain.config.errors import ConfigError

            raise ConfigError(
                "RUN_DIR", None, "one or more run directories", "disttrain compare A B C --plot p.png."
            )
        _write_plot([_run_dir(p) for p in positional], plot_out)
        return 0
    args = _args("compare", rest, ("run_a", "first run directory"), ("run_b", "second run directory"))
    if plot_out:
        _write_plot([_run_dir(args.run_a), _run_dir(args.run_b)], plot_out)
    data = compare(_run_dir(args.run_a), _run_dir(args.run_b))
    if args.json:
        from disttrain.tools.render import print_json

        print_json(data)
        return 0
    from disttrain.tools.render import console, short, table

    out = console()
    out.print(
        f"A: {data['a']['run_dir']} ({data['a']['status']})\nB: {data['b']['run_dir']} ({data['b']['status']})"
    )
    diff = [(d["key"], short(d["a"], 40), short(d["b"], 40)) for d in data["config_diff"]]
    out.print(table("config", ["key", "A", "B"], diff or [("(identical)", "", "")]))
    rows = [(m["metric"], _num(m["a"]), _num(m["b"]), _num(m["delta"], signed=True)) for m in data["metrics"]]
    out.print(table("metrics", ["metric", ">A", ">B", ">B - A"], rows))
    return 0


def _num(v: Any, signed: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.4g}" if signed else f"{v:.4g}"
    return str(v)


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"
