"""`disttrain env`: print the environment report (observe/envreport.py builds it)."""

from __future__ import annotations

from typing import Any

from disttrain.observe.envreport import collect_env


def cmd_env(rest: list[str]) -> int:
    """`disttrain env [--json]`: the environment report with warnings for known traps."""
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain env", description=cmd_env.__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(rest)
    report = collect_env(in_rank=False)
    if args.json:
        from disttrain.tools.render import print_json

        print_json(report)
    else:
        render_env(report)
    return 0


def render_env(report: dict[str, Any]) -> None:
    from disttrain.tools.render import console, human_bytes, table

    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GiB)" for g in report["gpus"]) or "none"
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["backends"].items())
    rows = [
        ("python", report["python"]),
        ("platform", report["platform"]),
        ("cores", f"{report['cpu_affinity']} usable of {report['cpu_count']}"),
        ("torch", report["torch"]),
        ("cuda / cudnn / nccl", f"{report['cuda']} / {report['cudnn']} / {report['nccl']}"),
        ("gpus", gpus),
        ("backends", backends),
        ("/dev/shm", human_bytes(report.get("shm_bytes"))),
        *((p, v or "-") for p, v in report["packages"].items()),
    ]
    out = console()
    out.print(table("environment", ["item", "value"], rows))
    nets = [(i["name"], i["ipv4"] or "-", i["state"] or "-") for i in report["interfaces"]]
    out.print(table("network interfaces", ["name", "ipv4", "state"], nets))
    variables = sorted(report["variables"].items()) or [("(none set)", "")]
    out.print(
        table(
            "variables (MASTER_*, NCCL_*, GLOO_*, SLURM_*, OMP_NUM_THREADS, ...)",
            ["name", "value"],
            variables,
        )
    )
    if report["warnings"]:
        for w in report["warnings"]:
            out.print(f"[yellow]warning:[/yellow] {w}", markup=True)
    else:
        out.print("no known traps found")
