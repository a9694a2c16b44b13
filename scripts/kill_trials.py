"""kill -9 one rank mid-run, N times: does torchrun's restart resume and finish, and how fast?
Or SIGTERM the launcher at a random step far from any log step: do the ranks save and resume exactly?

    python scripts/kill_trials.py --trials 10
    python scripts/kill_trials.py --mode sigterm --trials 10

Each trial runs `disttrain train launcher.max_restarts=1` (2 gloo ranks, checkpoints every 10
steps, a model slowed to ~20 ms per step), kills rank 1 with SIGKILL once the run passed step
`--kill-after`, and then waits for the run to finish by itself. A trial passes when the CLI exits
0 after exactly one restart and the final weights equal an uninterrupted reference run's, bitwise.
Recovery = kill -> the restarted ranks resumed from the checkpoint (logged), and kill -> first new step.

`--mode sigterm` runs with `trainer.log_every=1000` (no log step before the end), waits for the
step-10 checkpoint, sends the launcher SIGTERM after a random 0 to `--term-window` seconds, and
passes when the CLI exits 143 saying it saved, the latest checkpoint is that signal checkpoint,
no rank outlives the CLI, and `disttrain resume` finishes with bitwise-equal final weights.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLI = shutil.which("disttrain", path=str(Path(sys.executable).parent)) or "disttrain"


def overrides(steps: int, delay: float, log_every: int = 1) -> list[str]:
    return [
        "data=synthetic",
        f"trainer.max_steps={steps}",
        "trainer.ckpt_every=10",
        f"trainer.log_every={log_every}",
        "trainer.progress=false",
        "threads_per_rank=1",
        "launcher.max_restarts=1",
        "model._target_=disttrain.testing.FaultMLP",
        "model.in_features=${data.num_features}",  # a swapped node starts clean: wire it to the data
        "model.num_classes=${data.num_classes}",
        f"model.delay={delay}",
    ]


def start(run_dir: Path, args: list[str]) -> subprocess.Popen[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.Popen(
        [CLI, "train", *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -999, out
    return proc.returncode, out


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(ln)["step"] for ln in lines if ln.strip() and "train/loss" in ln]
    return steps[-1] if steps else 0


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank` of the run in `run_dir` (its launcher's pid is in status.json)."""
    from disttrain.procs import rank_pids

    try:
        launcher = json.loads((run_dir / "status.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return rank_pids(launcher).get(rank)


def final_weights(run_dir: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)["model"])


def log_times(run_dir: Path, needle: str) -> list[float]:
    out = []
    for line in (run_dir / "logs" / "rank0.log").read_text().splitlines():
        if needle in line:
            stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.timestamp())
    return out


def trial(root: Path, i: int, args: argparse.Namespace, reference: dict[str, Any]) -> dict[str, Any]:
    run_dir = root / f"trial{i}"
    proc = start(run_dir, overrides(args.steps, args.delay))
    deadline = time.time() + 180
    while last_step(run_dir) < args.kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    pid = rank_pid(run_dir, 1)
    if pid is None or proc.poll() is not None:
        rc, out = finish(proc, 10)
        return {"trial": i, "ok": False, "why": f"no rank 1 to kill (rc {rc})", "tail": out[-800:]}
    killed_at_step = last_step(run_dir)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    rc, out = finish(proc, args.timeout)
    import torch

    resumed = [t for t in log_times(run_dir, "resuming from") if t > t_kill - 1]
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    first_new = min((r["time"] for r in steps if r["time"] > t_kill and "train/loss" in r), default=None)
    same = False
    if rc == 0:
        w = final_weights(run_dir)
        same = w.keys() == reference.keys() and all(torch.equal(w[k], reference[k]) for k in w)
    result = {
        "trial": i,
        "ok": rc == 0 and same and len(resumed) == 1,
        "rc": rc,
        "killed_at_step": killed_at_step,
        "restarts": len(resumed),
        "resume_s": round(resumed[0] - t_kill, 2) if resumed else None,
        "first_step_s": round(first_new - t_kill, 2) if first_new else None,
        "weights_equal": same,
    }
    if not result["ok"]:
        result["tail"] = out[-1500:]
    return result


def sigterm_trial(root: Path, i: int, args: argparse.Namespace, reference: dict[str, Any]) -> dict[str, Any]:
    import torch

    run_dir = root / f"term{i}"
    proc = start(run_dir, overrides(args.steps, args.delay, log_every=1000))
    first = run_dir / "checkpoints" / "step_00000010"
    deadline = time.time() + 180
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if proc.poll() is not None or not first.is_dir():
        rc, out = finish(proc, 10)
        return {"trial": i, "ok": False, "why": f"no step-10 checkpoint (rc {rc})", "tail": out[-800:]}
    time.sleep(random.uniform(0, args.term_window))
    t_term = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    rc, out = finish(proc, args.timeout)
    exit_s = time.time() - t_term
    time.sleep(0.5)
    orphans = [r for r in (0, 1) if rank_pid(run_dir, r) is not None]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((run_dir / "checkpoints" / latest / "meta.json").read_text())
    saved = (
        rc == 128 + signal.SIGTERM
        and meta["reason"] == "signal"
        and f"saved the signal checkpoint {latest}" in out
    )
    result: dict[str, Any] = {
        "trial": i,
        "rc": rc,
        "signal_step": meta["step"],
        "reason": meta["reason"],
        "term_to_exit_s": round(exit_s, 2),
        "orphans": orphans,
    }
    same = False
    if saved and not orphans:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        resumed = subprocess.run(
            [CLI, "resume", str(run_dir)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        result["resume_rc"] = resumed.returncode
        if resumed.returncode == 0:
            w = final_weights(run_dir)
            same = w.keys() == reference.keys() and all(torch.equal(w[k], reference[k]) for k in w)
        else:
            out = resumed.stderr
    result["weights_equal"] = same
    result["ok"] = saved and not orphans and same
    if not result["ok"]:
        result["tail"] = out[-1500:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["kill", "sigterm"], default="kill")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--term-window", type=float, default=1.0, help="sigterm: random delay after step 10 (s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-after", type=int, default=25)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    args = parser.parse_args()
    random.seed(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kill_trials_"))
    ref_dir = root / "reference"
    ref = start(ref_dir, overrides(args.steps, args.delay))
    rc, out = finish(ref, args.timeout)
    if rc != 0:
        sys.stdout.write(f"reference run failed (rc {rc}):\n{out[-2000:]}\n")
        return 1
    reference = final_weights(ref_dir)
    results = []
    for i in range(args.trials):
        r = (sigterm_trial if args.mode == "sigterm" else trial)(root, i, args, reference)
        results.append(r)
        sys.stdout.write(json.dumps(r) + "\n")
        sys.stdout.flush()
    ok = [r for r in results if r["ok"]]
    if args.mode == "sigterm":
        exits = sorted(r["term_to_exit_s"] for r in ok)
        sys.stdout.write(
            f"\n{len(ok)}/{len(results)} trials saved a signal checkpoint on SIGTERM (log_every=1000) and "
            "resumed to bitwise-equal final weights\n"
        )
        if ok:
            steps = sorted(r["signal_step"] for r in ok)
            sys.stdout.write(
                f"signal steps {steps}; SIGTERM -> CLI exit: median {exits[len(exits) // 2]:.2f} s, "
                f"max {exits[-1]:.2f} s\n"
            )
    else:
        resume = sorted(r["resume_s"] for r in ok)
        first = sorted(r["first_step_s"] for r in ok)
        sys.stdout.write(
            f"\n{len(ok)}/{len(results)} trials recovered on the first restart with bitwise-equal final weights\n"
        )
        if ok:
            sys.stdout.write(
                f"kill -> resumed from checkpoint: median {resume[len(resume) // 2]:.2f} s, max {resume[-1]:.2f} s\n"
                f"kill -> first new training step: median {first[len(first) // 2]:.2f} s, max {first[-1]:.2f} s\n"
            )
    if args.keep:
        sys.stdout.write(f"run dirs kept under {root}\n")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
