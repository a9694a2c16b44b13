"""disttrain.strategies.precision and guards: autocast on CPU, fp16 loss scaling skips overflow steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from unit_support import HostReads

from disttrain.strategies.precision import Precision

CPU = torch.device("cpu")


def _step(prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, poison: bool = False) -> int:
    """One step; the host reads (syncs on a GPU) that `Precision.step` made."""
    with prec.autocast():
        out = model(torch.ones(4, 8))
        loss = out.float().pow(2).mean()
    if poison:
        loss = loss * float("inf")
    prec.scale(loss).backward()
    prec.unscale(opt)
    with HostReads() as reads:
        prec.step(opt)
    opt.zero_grad(set_to_none=True)
    return reads.count


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_linear_layers_in_the_amp_dtype_on_cpu(name: str, dtype: torch.dtype) -> None:
    prec = Precision({"name": name, "dtype": str(dtype).split(".")[1]}, CPU)
    with prec.autocast():
        assert nn.Linear(8, 8)(torch.ones(2, 8)).dtype == dtype
    assert prec.scaling == (name == "fp16")


def test_off_is_a_no_op_scaler() -> None:
    prec = Precision({"name": "off", "dtype": "float32"}, CPU)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    _step(prec, model, opt)
    assert not torch.equal(before, model.weight)
    assert prec.scale_value() == 1.0 and not prec.scaling and prec.skipped_steps == 0


def test_fp16_overflow_skips_the_step_and_halves_the_scale_without_a_host_sync() -> None:
    """Review G8: two `get_scale()` per step were two syncs on a GPU. With a fused optimizer (which
    skips an overflowing step on the device) the step reads nothing back; the skipped steps are
    counted on the device and read when logged."""
    prec = Precision({"name": "fp16", "dtype": "float16", "init_scale": 1024.0}, CPU)
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    assert _step(prec, model, opt) == 0 and prec.skipped_steps == 0
    before = model.weight.detach().clone()
    assert _step(prec, model, opt, poison=True) == 0
    assert torch.equal(before, model.weight), "an overflowing step leaves the weights alone"
    assert prec.scale_value() == 512.0 and prec.skipped_steps == 1
    state = prec.scaler.state_dict()
    assert state["scale"] == 512.0, "the scaler's state goes into checkpoints"


def test_split_batches_keeps_every_sample_in_order() -> None:
    from disttrain.engine.loop import split_batches

    x, y = torch.arange(8.0).reshape(8, 1), torch.arange(8)
    parts = split_batches([(x, y)], 4)
    assert [len(b[1]) for b in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([b[1] for b in parts]), y)
    assert split_batches([(x, y)], 1) == [(x, y)]


def test_throughput_has_no_mfu_on_cpu_and_summary_table_renders() -> None:
    from disttrain.dist import DistEnv
    from disttrain.models.gpt import GPT
    from disttrain.observe.summary import summary_table
    from disttrain.observe.throughput import Throughput, device_peak_flops

    assert device_peak_flops(CPU) is None
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device=CPU)
    rates = Throughput(GPT(block_size=8, dim=16, n_layers=1, n_heads=2), env).rates(1000, 2.0, 4)
    assert rates["tokens_per_s"] == 500 and rates["flops_per_step"] > 0 and "mfu" not in rates
    assert Throughput(nn.Linear(2, 2), env).rates(0, 1.0, 1) == {}
    assert summary_table({"steps": 3, "val/ppl": 4.5, "samples_per_s": 10.0}).row_count == 3


@pytest.mark.parametrize(
    ("grads_synced", "averaged_last", "averages"),
    [(True, False, 0), (False, True, 0), (False, False, 1)],
)
def test_localsgd_averages_at_the_end_only_when_replicas_may_differ(
    monkeypatch: pytest.MonkeyPatch, grads_synced: bool, averaged_last: bool, averages: int
) -> None:
    """In sync after a warm-up backward (gradients all-reduced) or an averaging step; a skipped step
    (detect_anomaly=skip) runs backward without an optimizer step, so the hook's phase decides."""
    from disttrain.dist import DistEnv
    from disttrain.strategies import localsgd

    calls: list[int] = []
    monkeypatch.setattr(
        localsgd, "average_parameters", lambda params, process_group: calls.append(len(list(params)))
    )
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, backend="gloo", device=CPU)
    from disttrain.strategies.specs.data_parallel import LocalSGDStrategyConfig

    strategy = localsgd.LocalSGDStrategy(LocalSGDStrategyConfig(sync_every=4, warmup_steps=2), env)
    strategy.averager = SimpleNamespace(averaged_last=averaged_last)  # type: ignore[assignment]
    strategy.grads_synced = grads_synced
    model = torch.nn.Linear(3, 2)
    strategy.end_of_training(model)
    assert calls == [2] * averages
    assert strategy.allreduced["params"] == averages * (6 + 2) * 4
