"""How long the help pages take, and how wide they are (issue 37's goal: `train --help` under 1 s and at
most 100 columns). A benchmark, not a test: timings depend on the machine and its load.

    python scripts/bench_help.py [--repeats 5]

Each command runs --repeats times in a fresh interpreter, in turn (interleaved); the table shows the
median wall time, the median CPU time of the child (user + sys) and the widest line. The load average
is printed beside: on a loaded machine the wall time says little, the CPU time more.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "train --help": ["train", "--help"],
    "train --help model=gpt": ["train", "--help", "model=gpt"],  # rendered: composes the config
    "config --help": ["config", "--help"],
    "--help": ["--help"],
}


def once(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, child CPU s, widest line) of `python -m disttrain ARGV`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "disttrain", *argv], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, max((len(line) for line in proc.stdout.splitlines()), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            results[name].append(once(argv))
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, {args.repeats} runs each (medians)")
    print(f"{'command':<26}{'wall s':>8}{'CPU s':>8}{'widest':>8}")
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"{name:<26}{wall:>8.2f}{cpu:>8.2f}{max(r[2] for r in runs):>8}")


if __name__ == "__main__":
    main()
