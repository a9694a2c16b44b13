"""bench comm without processes: nccl-tests' factors, the sweep, and every op's check against a
reference simulation of the collective (an independent definition of what each rank must receive)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disttrain.tools.collectives import OPS, bus_factor, element_count, make_case
from disttrain.tools.commbench import iterations, sizes

CPU = torch.device("cpu")


def test_bus_factors_are_nccl_tests_definitions() -> None:
    n = 4
    assert bus_factor("all_reduce", n) == pytest.approx(2 * 3 / 4)
    for op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert bus_factor(op, n) == pytest.approx(3 / 4)
    for op in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(op, n) == 1.0
    assert bus_factor("barrier", n) is None


def test_sweep_sizes_and_iterations() -> None:
    assert sizes(8, 2048, 4) == [8, 32, 128, 512, 2048]
    assert sizes(8, 1000, 4) == [8, 32, 128, 512, 1000]  # the max is always measured
    assert iterations(8, 20, 32 << 20) == 20
    assert iterations(16 << 20, 20, 32 << 20) == 3  # big buffers: fewer iterations, at least 3
    assert element_count(8, 2, 4) == 2 and element_count(8, 4, 4) == 4  # >= one element per rank
    assert element_count(100, 3, 4) % 3 == 0


def _simulate(op: str, srcs: list[torch.Tensor], rank: int, n: int) -> torch.Tensor:
    """What `rank` must hold after `op`, from the definitions in torch.distributed's docs."""
    if op == "all_reduce" or op == "reduce":
        return torch.stack(srcs).sum(0)
    if op == "broadcast":
        return srcs[0].clone()
    if op in ("all_gather", "gather"):
        return torch.cat(srcs)
    if op == "scatter":
        return srcs[0].chunk(n)[rank].clone()
    if op == "reduce_scatter":
        return torch.stack(srcs).sum(0).chunk(n)[rank].clone()
    if op == "all_to_all":
        return torch.cat([s.chunk(n)[rank] for s in srcs])
    if op == "send_recv":
        return srcs[(rank - 1) % n].clone()
    raise AssertionError(op)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("op", [o for o in OPS if o != "barrier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_check_accepts_the_true_result_and_rejects_a_wrong_one(op: str, n: int, dtype: torch.dtype) -> None:
    cases = [make_case(op, 1000, r, n, dtype, CPU) for r in range(n)]
    for c in cases:
        c.fill()
    srcs = [c.source.clone() for c in cases]  # type: ignore[union-attr]
    checked = 0
    for rank, c in enumerate(cases):
        if c.result is None:  # reduce off the root: nothing defined to check
            continue
        c.result.copy_(_simulate(op, srcs, rank, n))
        assert c.check() is None, f"{op} rank {rank}: {c.check()}"
        c.result.view(-1)[-1] += 1
        assert "1 of" in (c.check() or ""), "a single wrong element must be caught"
        checked += 1
    assert checked >= 1


def test_a_chunk_from_the_wrong_rank_is_caught() -> None:
    n = 4
    cases = [make_case("all_gather", 64, r, n, torch.float32, CPU) for r in range(n)]
    for c in cases:
        c.fill()
    srcs = [c.source.clone() for c in cases]  # type: ignore[union-attr]
    srcs[1], srcs[2] = srcs[2], srcs[1]  # right values, wrong order
    cases[0].result.copy_(torch.cat(srcs))  # type: ignore[union-attr]
    assert cases[0].check() is not None


def test_one_rank_runs_every_op_in_process(tmp_path, monkeypatch) -> None:
    """The rank entry through disttrain.launch with a world of one (in-process, no port): schema + checks."""
    import json

    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.launch import launch
    from disttrain.rundir import write_json
    from disttrain.tools.commbench import RESULTS, SCHEMA, SPEC

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = resolve(compose(["nproc_per_node=1", "backend=gloo", "threads_per_rank=1"]))
    (tmp_path / "config.yaml").write_text(__import__("yaml").safe_dump(cfg))
    spec = {
        "ops": list(OPS),
        "sizes": [8, 4096],
        "iters": 2,
        "warmup": 1,
        "budget_bytes": 1 << 20,
        "dtype": "float32",
    }
    write_json(tmp_path / SPEC, spec)
    launch(Run.of(cfg), tmp_path, entry="disttrain.tools.commbench")
    report = json.loads((tmp_path / RESULTS).read_text())
    assert report["schema"] == SCHEMA and report["world_size"] == 1 and report["errors"] == []
    rows = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert rows[("send_recv", 8)]["status"].startswith("skipped")
    for (op, _), r in rows.items():
        if op != "send_recv":
            assert r["status"] == "ok" and r["correct"] is True and r["time_us"] > 0, r


def test_merge_exchange_passes_a_strict_device_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review #3: the end-of-bench exchange must not put a CPU tensor on the default group (NCCL
    refuses it after every measurement is done); the merged times are every rank's, per row."""
    from strict_device import strict_world

    from disttrain.tools import commbench

    spec = {"ops": ["all_reduce", "barrier"], "sizes": [8, 64]}
    fake = iter([0.5, 0.25, 0.125])

    def measure(env: Any, op: str, nbytes: int, spec: Any, timeout: float) -> dict[str, Any]:
        return {"op": op, "bytes": nbytes, "status": "ok", "wrong": None, "iters": 3, "time_s": next(fake)}

    monkeypatch.setattr(commbench, "measure", measure)
    with strict_world(2, rank=1, monkeypatch=monkeypatch) as env:
        report = commbench.bench(env, {**spec, "dtype": "float32"}, timeout=5.0)
    assert [(r["op"], r["bytes"]) for r in report["results"]] == [
        ("all_reduce", 8),
        ("all_reduce", 64),
        ("barrier", 0),
    ]
    assert [r["time_us"] for r in report["results"]] == [5e5, 2.5e5, 1.25e5]
    assert report["errors"] == [] and report["world_size"] == 2
