"""`plan --simulate --load-at`: DCP's save plan of a world-W layout and its load plan on sampled
ranks of a world-W' layout, on meta tensors and the fake process group; the bytes and the saved
ranks' files each loading rank reads, checked by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from disttrain.cli import main
from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.tools.simulate import fake_world, setup_rank
from disttrain.tools.simulate_load import plan_save, rank_state, simulate_load, target_overrides

# every dimension divides by 16: each rank's shard is exact
GPT = [
    "model=gpt",
    "model.dim=128",
    "model.n_layers=1",
    "model.n_heads=8",
    "data.block_size=64",
    "optim=adamw",
]
PREFIX = "model."  # the checkpoint's app state holds the strategy's state under "model"


def _cfg(*overrides: str) -> dict[str, Any]:
    return resolve(compose([*GPT, *overrides]))


def _tensors(cfg: dict[str, Any]) -> tuple[dict[str, int], int]:
    """fqn -> elements of every tensor a checkpoint of `cfg`'s model holds, from the meta model:
    the model's state dict (tied weights under both names), AdamW's exp_avg and exp_avg_sq; and
    the number of parameters (AdamW keeps one fp32 step scalar for each)."""
    from disttrain.models import build_model

    with torch.device("meta"):
        model = build_model(cfg["model"])
    out = {f"{PREFIX}model.{k}": v.numel() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())  # one name per tied parameter
    for name, p in params.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{PREFIX}optim.state.{name}.{moment}"] = p.numel()
    return out, len(params)


def test_fsdp_16_saved_loads_at_fsdp_4_each_rank_reads_four_saved_ranks() -> None:
    src, tgt = _cfg("nproc_per_node=16", "strategy=fsdp"), _cfg("nproc_per_node=4", "strategy=fsdp")
    load = simulate_load(Run.of(src), Run.of(tgt), detail=True)
    tensors, steps = _tensors(src)
    assert load["loadable"] and load["unread"] == [] and [r["rank"] for r in load["ranks"]] == [0, 1, 2, 3]
    assert load["checkpoint"]["tensor_bytes"] == 4 * sum(tensors.values()) + 4 * steps
    for r in load["ranks"]:
        # by hand: a quarter of every tensor, fp32, read whole from the four 1/16 chunks; each step scalar whole
        assert r["needed_bytes"] == r["read_bytes"] == 4 * sum(tensors.values()) // 4 + 4 * steps
        mine = list(range(4 * r["rank"], 4 * r["rank"] + 4))
        assert {fqn: r["sources"][fqn] for fqn in tensors} == dict.fromkeys(tensors, mine)
        scalars = {fqn: src_ranks for fqn, src_ranks in r["sources"].items() if fqn.endswith(".step")}
        assert len(scalars) == steps and all(len(s) == 1 for s in scalars.values())
        assert r["saved_ranks"] == sorted(set(mine).union(*scalars.values()))
        assert r["objects"] > 0  # the param groups' hyperparameters


def test_fsdp_tp_8_saved_loads_at_fsdp_8_rowwise_chunks_are_read_whole() -> None:
    """fsdp+tp (dp 2 x tp 4) chunks: column-wise Linears 1/8 row blocks (tp outer, dp inner); row-wise
    weights half the rows x a quarter of the columns; the rest half of dim 0 (fsdp over dp). An fsdp
    rank of 8 keeps row block r: one saved chunk of a column-wise tensor, four of a row-wise one."""
    src = _cfg("nproc_per_node=8", "strategy=fsdp+tp", "strategy.tp_degree=4")
    tgt = _cfg("nproc_per_node=8", "strategy=fsdp")
    load = simulate_load(Run.of(src), Run.of(tgt), detail=True)
    tensors, n_params = _tensors(src)
    colwise = {f for f in tensors if any(f".{m}." in f for m in ("attn.qkv", "fc"))}
    rowwise = {f for f in tensors if any(f".{m}.weight" in f for m in ("attn.proj", "fc_out"))}
    steps = 4 * n_params
    for r in load["ranks"]:
        rank = r["rank"]
        assert r["needed_bytes"] == 4 * sum(tensors.values()) // 8 + steps
        # a column-wise tensor's needed block is exactly one saved chunk; everything else's chunk is half
        assert (
            r["read_bytes"] == 4 * sum(n // 8 if f in colwise else n // 2 for f, n in tensors.items()) + steps
        )
        for fqn in colwise:  # row block r = tp rank r // 2's, dp rank r % 2's half of it: saved rank d*4 + t
            assert r["sources"][fqn] == [(rank % 2) * 4 + rank // 2]
        for fqn in rowwise:  # dp half r // 4, all four tp column blocks
            assert sorted(r["sources"][fqn]) == [4 * (rank // 4) + t for t in range(4)]


def test_recomputed_save_plan_of_a_rank_equals_dcps_own() -> None:
    """The save side builds rank 0 with DCP and derives the other ranks' chunks from placements;
    rank 5 of fsdp+tp (dp 1, tp 1), set up for real on the fake group, has exactly those chunks."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    cfg = _cfg("nproc_per_node=8", "strategy=fsdp+tp", "strategy.tp_degree=4")
    saved = plan_save(Run.of(cfg), 8, "fsdp+tp")
    with fake_world(5, 8):
        real = create_default_local_save_plan(rank_state(Run.of(cfg), 5, 8, "fsdp+tp"), False)

    def chunks(plan: Any) -> dict[str, Any]:
        return {i.index.fqn: i.tensor_data.chunk if i.tensor_data else None for i in plan.items}

    assert chunks(saved.local_plans[5]) == chunks(real) != chunks(saved.rank0)


def test_cli_load_at_json_and_a_changed_dim_names_the_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    """A save by 2 fsdp ranks loaded by 2 ddp ranks: each reads the whole checkpoint from both files.
    The same save loaded with another model.dim: exit 2, the key and the first tensors named."""
    args = ["plan", "--simulate", "--no-step", *GPT, "nproc_per_node=2", "strategy=fsdp"]
    assert main([*args, "--json", "--load-at", "strategy=ddp"]) == 0
    load = json.loads(capsys.readouterr().out)["simulate"]["load"]
    assert load["saved"]["world"] == 2 and load["loaded"] == {
        "spec": "ddp",
        "world": 2,
        "dp": 2,
        "tp": 1,
        "pp": 1,
    }
    tensors, steps = _tensors(_cfg())
    total = load["checkpoint"]["tensor_bytes"]
    assert total == 4 * (sum(tensors.values()) + steps)
    assert [r["rank"] for r in load["ranks"]] == [0, 1]
    assert all(
        r["needed_bytes"] == r["read_bytes"] == total and r["saved_ranks"] == [0, 1] for r in load["ranks"]
    )
    assert main([*args, "--load-at", "model.dim=64 nproc_per_node=1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "model.dim=64 is not valid" in out.err and "Traceback" not in out.err
    assert "model.model.embed.tok.weight: saved [256, 128], here [256, 64] (ranks 0)" in out.err


def test_load_at_overrides_replace_the_saved_runs_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *GPT, "--load-at", "nodes=1"]) == 2  # the load is planned on simulated ranks
    assert "--load-at=nodes=1 is not valid" in capsys.readouterr().err
    base = ["nodes=2", "strategy=fsdp+tp", "strategy.tp_degree=8", "model.dim=64"]
    assert target_overrides(base, ["strategy=fsdp", "nodes=1"]) == [
        "model.dim=64",
        "strategy=fsdp",
        "nodes=1",
    ]


def test_a_rank_simulated_after_another_gets_its_own_mesh_coordinate() -> None:
    """DTensor's sharding-propagation cache returned rank 0's mesh to rank 5 (meshes compare equal
    across ranks): rank 5's shard was reported at rank 0's offset. fake_world clears the caches."""
    from torch.distributed.tensor import DTensor

    cfg = _cfg("nproc_per_node=8", "strategy=fsdp")
    chunks = []
    for rank in (0, 5):
        with fake_world(rank, 8):
            _, model = setup_rank(Run.of(cfg), rank, 8)
            p = model.blocks[0].fc_out.weight
            assert isinstance(p, DTensor) and p.device_mesh.get_coordinate() == (rank,)
            chunks.append(p.__create_chunk_list__()[0].offsets)
    assert chunks == [torch.Size([0, 0]), torch.Size([80, 0])]  # 128 rows / 8 = 16 per rank
