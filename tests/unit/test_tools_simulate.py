"""`disttrain plan --simulate`: the strategy's real setup on a fake world of 16 or 64 ranks, in this
process, checked against plan's arithmetic and by hand; failures named by rank and key."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from unit_support import installed

from disttrain.cli import main
from disttrain.config import ConfigError, compose, resolve
from disttrain.config.run import Run
from disttrain.strategies import specs
from disttrain.tools.planner import plan
from disttrain.tools.simulate import fake_world, sample_ranks, setup_rank, simulate

# a small GPT whose sharded dimensions divide by 64: every rank's share is exact
GPT = ["model=gpt", "model.dim=128", "model.n_layers=2", "model.n_heads=8", "data.block_size=64"]


def _cfg(*overrides: str) -> dict[str, Any]:
    return resolve(compose([*GPT, *overrides]))


def test_sampled_ranks_cover_first_second_middle_and_last_of_each_mesh_dimension() -> None:
    two_d = sample_ranks({"dp": 8, "tp": 8, "pp": 1})
    assert [r for r, _ in two_d][:5] == [0, 1, 4, 6, 7] and len(two_d) == 25
    assert two_d[-1] == (63, {"dp": 7, "tp": 7, "pp": 0})
    assert [r for r, _ in sample_ranks({"dp": 1, "tp": 1, "pp": 16})] == [0, 1, 8, 14, 15]
    assert [r for r, _ in sample_ranks({"dp": 2, "tp": 1, "pp": 1})] == [0, 1]


def test_fsdp_tp_world_64_bytes_by_hand_and_the_step_collectives() -> None:
    cfg = _cfg("amp=bf16", "trainer.batch_size=1", "nodes=8", "nproc_per_node=8", "strategy=fsdp+tp")
    cfg["strategy"]["tp_degree"] = 8
    result = plan(Run.of(cfg))
    sim = simulate(Run.of(cfg), result)
    assert sim["layout"] == {"layout": "fsdp+tp", "dp": 8, "tp": 8, "pp": 1, "zero": 3, "shard": 8}
    assert len(sim["ranks"]) == 25 and {0, 63} <= {r["rank"] for r in sim["ranks"]}
    # by hand: planned Linears (q, k, v, fc with biases; proj, fc_out weights) split 64 ways; what tp
    # keeps whole (embeddings, norms, row-wise biases) only 8 ways (fsdp over dp); 2 + 2 + 12 B each
    d, layers, vocab, seq = 128, 2, 256, 64
    sharded = layers * (3 * (d * d + d) + d * 4 * d + 4 * d + d * d + 4 * d * d)
    whole = vocab * d + seq * d + layers * (4 * d + 2 * d) + 2 * d
    assert sharded + whole == result["model"]["params"]
    expected = 16 * (sharded / 64 + whole / 8)
    assert all(r["bytes"]["total"] == expected and r["on_meta"] for r in sim["ranks"])
    # plan assumes all of it split 64 ways: this small model's embeddings put it ~69% over
    assert sim["plan_bytes"]["params"] == result["model"]["params"] * 2 / 64
    assert all(
        r["deviation"] == pytest.approx(expected / (16 * result["model"]["params"] / 64) - 1)
        for r in sim["ranks"]
    )
    assert not any(r["agrees"] for r in sim["ranks"])
    # one step: per block 2 row-wise forward + 2 column-wise backward (fused qkv, fc) all-reduces; FSDP units per
    # block + the root (review G5): 3 all-gathers for forward, the 2 blocks again for backward (the
    # root is not resharded after forward: G12), 3 reduce-scatters
    fb = sim["collectives"]["phases"]["forward+backward"]
    assert fb == {"all_reduce": 4 * layers, "allgather_base": 3 + layers, "reduce_scatter_base": 3}
    # tp's clip no longer reads the norm back (G8), so it is simulated: the (dp, tp) mesh's norm
    # reduced over both dimensions, the dp-only DTensors' (embeddings, norms) over dp
    assert sim["collectives"]["phases"]["clip"] == {"all_reduce": 3}


def test_fsdp_world_16_bytes_equal_plan_and_step_gathers_each_unit_twice() -> None:
    cfg = _cfg("nproc_per_node=16", "strategy=fsdp", "strategy.wrap_classes=[Block]", "optim=adamw")
    sim = simulate(Run.of(cfg), plan(Run.of(cfg)))
    assert [r["rank"] for r in sim["ranks"]] == [0, 1, 8, 14, 15]
    # fp32 AdamW: 4 + 4 + 8 bytes per parameter, each rank 1/16 of every tensor exactly
    params = plan(Run.of(cfg))["model"]["params"]
    assert all(r["bytes"]["total"] == 16 * params / 16 and r["deviation"] == 0 for r in sim["ranks"])
    # units: 2 blocks + root; forward gathers 3, backward the 2 blocks again (the root is left to
    # FSDP2's own choice, not resharded after forward: review G12); 3 reduce-scatters
    fb = sim["collectives"]["phases"]["forward+backward"]
    assert fb == {"allgather_base": 5, "reduce_scatter_base": 3}
    assert sim["collectives"]["phases"]["clip"] == {"all_reduce": 1}  # the global grad norm


def test_pipeline_with_more_stages_than_layers_is_named_by_rank_and_key() -> None:
    # 2 blocks + embed + head = 4 pipeline layers for 16 stages
    cfg = _cfg("nproc_per_node=16", "strategy=pipeline", "model.tie_weights=false", "trainer.batch_size=16")
    cfg["strategy"]["n_microbatches"] = 16
    with pytest.raises(ConfigError) as err:
        simulate(Run.of(cfg), plan(Run.of(cfg)))
    assert err.value.key == "strategy.stages_per_rank"
    assert "rank(s) 0, 1, 8, 14, 15" in str(err.value) and "16 stages but only 4 splittable layers" in str(
        err.value
    )


def test_fsdp_unit_larger_than_the_device_is_named_by_rank_and_key() -> None:
    # one block (nothing repeats) and min_num_params huge: the root is the one unit, all of it
    # gathered at once
    cfg = _cfg("nproc_per_node=16", "strategy=fsdp", "strategy.min_num_params=1000000000", "model.n_layers=1")
    params = plan(Run.of(cfg))["model"]["params"]
    cfg["plan"]["gpu_mem_gb"] = params * 4 / 2 / 2**30 / 0.9  # half the gathered model fits
    with pytest.raises(ConfigError) as err:
        simulate(Run.of(cfg), plan(Run.of(cfg)), step=False)
    assert err.value.key == "strategy.wrap_classes" and "rank(s) 0, 1, 8, 14, 15" in str(err.value)
    assert "one FSDP unit all-gathers to" in str(err.value)


class Allocations(TorchDispatchMode):
    """Bytes of every new non-meta storage created (a DTensor's: its local shard's), and the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if isinstance(t, DTensor) else t
                if not local.is_meta:
                    storage = local.untyped_storage()
                    self.storages[storage.data_ptr()] = storage.nbytes()
        return out


def test_fsdp_model_4x_the_device_is_never_whole_on_a_rank() -> None:
    """Meta build, real fully_shard on rank 5 of 16, then `to_empty` materialises the local shards:
    every byte this rank ever allocates is its 1/16, below a device a quarter of the model's size."""
    cfg = _cfg("nproc_per_node=16", "strategy=fsdp", "strategy.wrap_classes=[Block]")
    with torch.device("meta"):
        from disttrain.models import build_model

        total = sum(p.numel() * 4 for p in build_model(cfg["model"]).parameters())
    device_bytes = total // 4
    with fake_world(5, 16):
        with Allocations() as at_setup:
            _, model = setup_rank(Run.of(cfg), 5, 16)
        with Allocations() as materialised:
            model.to_empty(device="cpu")
        local = [p.to_local() for p in model.parameters()]
        assert dist.get_world_size() == 16
    assert all(isinstance(p, DTensor) for p in model.parameters()) and not any(t.is_meta for t in local)
    assert sum(at_setup.storages.values()) < 1024  # the device mesh's rank lists, nothing of the model
    held = sum(t.numel() * t.element_size() for t in local)
    seen = materialised
    assert held == total // 16 < device_bytes
    # Module._apply visits the tied embedding/head weight once per holder: its 1/16 is created twice,
    # the first copy swapped out (freed) at once; everything else exactly once
    tied = model.embed.tok.weight.to_local()
    assert sum(seen.storages.values()) == held + tied.numel() * 4 < device_bytes
    assert max(seen.storages.values()) < max(p.numel() * 4 for p in model.parameters())  # no full tensor


def test_cli_simulate_json_and_a_tp_degree_that_divides_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--simulate", "--no-step", *GPT, "nodes=8", "nproc_per_node=8", "strategy=fsdp+tp"]
    assert main([*args, "--json", "strategy.tp_degree=8"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulate"]
    assert (
        sim["layout"]["tp"] == 8
        and len(sim["ranks"]) == 25
        and sim["collectives"] == {"skipped": "--no-step"}
    )
    assert main([*args, "strategy.tp_degree=6"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "strategy.tp_degree=6 is not valid" in out.err and "Traceback" not in out.err


def test_the_model_checks_run_after_the_setups_tp_heads() -> None:
    """16-way tp of 8 heads sets up (DTensor splits 128 columns 16 ways) but cannot run attention:
    the pre-launch model check names model.n_heads once every sampled rank has set up."""
    cfg = _cfg("nproc_per_node=16", "strategy=fsdp+tp", "amp=bf16")
    cfg["strategy"]["tp_degree"] = 16
    with pytest.raises(ConfigError) as err:
        simulate(Run.of(cfg), plan(Run.of(cfg)), step=False)
    assert err.value.key == "model.n_heads" and err.value.value == 8


def test_d24_a_slow_one_step_rehearsal_says_so_and_how_to_skip_it() -> None:
    """Reliability review 2026-11-28 D24: plan --simulate of a 300-layer model stepped for ~2 min
    with no line at all. Past the notice time, one warning on disttrain's logger (the one logger
    every console message takes, not a print) says it still runs and names --no-step; a step done
    before it says nothing."""
    import logging
    import threading

    from disttrain.observe.log import get_logger
    from disttrain.tools.simulate import slow_step_notice

    said: list[logging.LogRecord] = []
    arrived = threading.Event()

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record)
            arrived.set()

    kept = Kept()
    get_logger().addHandler(kept)
    try:
        with slow_step_notice(60.0):
            pass
        assert said == []
        with slow_step_notice(0.01):
            assert arrived.wait(30), "no notice within 30 s"
    finally:
        get_logger().removeHandler(kept)
    (record,) = said
    assert record.levelno == logging.WARNING, record
    message = record.getMessage()
    assert message.startswith("plan --simulate: still stepping") and "--no-step" in message, message


# ------------------------------------------------------------------------------------ a cp plug-in
CP_MODULE = '''
"""Context parallel's layout as torchtitan's: FSDP shards over the data-parallel and context-parallel
ranks (its dp_shard_cp), and the (dp, cp) mesh whose cp groups would split each sequence (the
sequence split in forward is not this test's: plan and plan --simulate count the layout)."""
from disttrain.strategies.fsdp import FSDPStrategy


class CPStrategy(FSDPStrategy):
    def setup_module(self, model):
        self.cp_mesh = self.layout.mesh(self.env.device.type, ("dp", "cp"))  # the sequence split's groups
        return super().setup_module(model)
'''

CP_SPEC = '''
"""cplab: a context-parallel strategy's spec, torch-free; its degree is declared by its layout."""
from dataclasses import dataclass, replace

from disttrain.strategies import specs
from disttrain.strategies.specs.sharded import FSDPStrategyConfig


@dataclass
class CPStrategyConfig(FSDPStrategyConfig):
    name: str = "cp"
    cp_degree: int = 2


def layout(s, world):
    return specs.Layout(world, dp_shard=world // s.cp_degree, cp=s.cp_degree, zero=3)


def plan(shape):
    note = "the sequence split over 2 ranks"
    return [specs.PlanRow("cp", layout(CPStrategyConfig(), shape.world), "strategy=cp", 90, note)]


SPEC = specs.register(
    replace(specs.get("fsdp"), name="cp", config=CPStrategyConfig, target="cplab.strategy:CPStrategy",
            layout=layout, plan=plan)
)
'''


@pytest.fixture
def cp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    yield from installed(tmp_path, monkeypatch, "cp", "cplab", CP_SPEC, CP_MODULE)


def test_a_context_parallel_plugin_is_planned_and_simulated_at_its_degree(
    cp: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cp degree declared only by the plug-in's layout: plan and plan --simulate count dp = world / cp,
    activations / cp, the state sharded over dp x cp, and FSDP's traffic over all of them."""
    from disttrain.tools.planner import render

    _, conf = cp
    specs.rediscover()
    gpt = ["model=gpt", "model.dim=128", "model.n_layers=2", "model.n_heads=8", "data.block_size=64"]
    args = [
        "--config-dir",
        str(conf),
        *gpt,
        "nproc_per_node=4",
        "strategy=cp",
        "strategy.wrap_classes=[Block]",
    ]
    assert main(["plan", "--simulate", "--json", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("COLUMNS", "200")  # a narrower COLUMNS (xdist's worker) folds the header
    render(result)  # the plan table: the cp row and its degrees
    table = capsys.readouterr().out
    assert "dp x cp x tp x pp" in table and re.search(r"│ cp +│ 2x2x1x1 ", table), table
    rows = {r["layout"]: r for r in result["layouts"]}
    sim, ddp = result["simulate"], rows["ddp"]["bytes"]
    assert {k: v for k, v in rows["cp"].items() if k in sim["layout"]} == sim["layout"]  # plan = simulate
    assert sim["layout"] == {"layout": "cp", "dp": 2, "cp": 2, "tp": 1, "pp": 1, "zero": 3, "shard": 4}
    assert rows["cp"]["bytes"]["activations"] == sim["plan_bytes"]["activations"] == ddp["activations"] / 2
    assert rows["cp"]["bytes"]["params"] == sim["plan_bytes"]["params"] == ddp["params"] / 4
    # the rehearsal: the (dp, cp) ranks each hold a quarter of every tensor, as planned
    assert [(r["rank"], r["coords"]) for r in sim["ranks"]] == [
        (2 * d + c, {"dp": d, "cp": c, "tp": 0, "pp": 0}) for d in (0, 1) for c in (0, 1)
    ]
    assert all(r["deviation"] == 0 and r["bytes"]["total"] == r["plan_total"] for r in sim["ranks"])
    # one step's traffic is FSDP's over all four ranks: 3 units gathered, the blocks again, 3 scatters
    fb = sim["collectives"]["phases"]["forward+backward"]
    assert fb == {"allgather_base": 5, "reduce_scatter_base": 3}
