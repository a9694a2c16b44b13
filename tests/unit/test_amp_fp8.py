"""amp=fp8 (torchao Float8Linear) on CPU: emulated float8 matmuls through disttrain's engine against
torchao's own conversion of the same model trained by hand, FSDP's float8 all-gather, and the
refusals before launch (no float8 GPU, no torchao, nothing to convert).

In-process at world size 1 (gloo over a HashStore): the engine as a rank builds it
(worker.build_parts + build_engine); the CLI's refusal through `disttrain.cli.main`.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from unit_support import checked_run, engine_of

from disttrain.config.errors import ConfigError
from disttrain.engine.loop import Engine
from disttrain.models.gpt import GPT
from disttrain.preflight.gpus import check_fp8

# torchao (the fp8 extra) is imported by the tests that use it, not at collection: its import pulls in
# torch._dynamo, seconds in every xdist worker that collects this file.
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        importlib.util.find_spec("torchao") is None, reason="the fp8 extra (torchao) is not installed"
    ),
]

GPT_ARGS = {"dim": 32, "n_layers": 2, "n_heads": 2, "block_size": 16}
TINY = (
    "model=gpt",
    *(f"model.{k}={v}" for k, v in GPT_ARGS.items() if k != "block_size"),
    f"data.block_size={GPT_ARGS['block_size']}",
    "nproc_per_node=1",
    "threads_per_rank=1",
    "trainer.progress=false",
    "trainer.batch_size=4",
    "trainer.log_every=1",
    "trainer.clip_grad_norm=null",
    "observe.sinks=[]",
    "optim=sgd",
    "optim.lr=0.5",
    "optim.momentum=0.0",
    "optim.weight_decay=0.0",
    "sched=constant",
)
FP8 = ("amp=fp8", "amp.fp8_emulate=true")
STEPS = 3


def engine(run_dir: Path, *overrides: str) -> Engine:
    built: Engine = engine_of(run_dir, [*TINY, *overrides])
    return built


def by_hand(state: dict[str, torch.Tensor], recipe: str | None, batches: list[Any]) -> list[float]:
    """torchao's own recipe on the same GPT: convert (head left out; None: not at all), bf16 autocast,
    SGD, by hand."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = GPT(vocab_size=256, **GPT_ARGS)
    model.load_state_dict(state)  # the engine's initial weights, by the plain model's names
    if recipe is not None:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "head.out")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_matches_torchaos_own_conversion(
    tmp_path: Path, one_rank: None, recipe: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="disttrain"):
        e = engine(tmp_path, *FP8, f"amp.fp8_recipe={recipe}")
    from torchao.float8.float8_linear import Float8Linear

    model = e.strategy.unwrap(e.model)
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    per_block = ["attn.proj", "attn.qkv", "fc", "fc_out"]
    assert swapped == [f"blocks.{i}.{name}" for i in range(2) for name in per_block]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("amp=fp8"))
    assert "8 Linear layers" in line and "blocks.*.fc (2)" in line and "head.out (the output head)" in line
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert list(state) == list(GPT(vocab_size=256, **GPT_ARGS).state_dict()), "checkpoint keys stay"
    batches = list(itertools.islice(iter(e.train_loader), STEPS))
    losses = [float(e.train_step([batch])[0]) for batch in batches]
    assert losses == by_hand(state, recipe, batches)  # bitwise: the same casts, scales and matmuls
    assert by_hand(state, None, batches[:1])[0] != losses[0]  # the float8 casts did take part
    summary = e.strategy.summary_stats(e.model, e.optimizer)
    assert summary["fp8_linears"] == 8
    linear = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert summary["fp8_linear_flops_share"] == round(
        sum(linear[n] for n in swapped) / sum(linear.values()), 4
    )


def test_fsdp_casts_weights_to_float8_before_the_all_gather(tmp_path: Path, one_rank: None) -> None:
    """tensorwise under fsdp: weights are torchao's float8-all-gather subclass inside the DTensor,
    the scales are precomputed after each step, and the losses are those of single."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    single = engine(tmp_path / "single", *FP8)
    state = {k: v.detach().clone() for k, v in single.strategy.unwrap(single.model).state_dict().items()}
    batches = list(itertools.islice(iter(single.train_loader), STEPS))
    fsdp = engine(tmp_path / "fsdp", *FP8, "strategy=fsdp", "strategy.param_dtype=float32")  # as single: fp32
    weight = fsdp.model.get_submodule("blocks.0.fc").weight
    assert isinstance(weight, DTensor) and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    assert fsdp.precision.fp8 is not None and fsdp.precision.fp8.precompute
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sharded = get_model_state_dict(fsdp.model)
    assert list(sharded) == list(state), "DCP's keys are the plain model's"
    for name, value in sharded.items():  # the same seed: the same initial weights as single's
        assert torch.equal(value.full_tensor(), state[name]), name
    assert (
        weight._local_tensor._precomputed_scale is None
    )  # before the first step: computed in the all-gather
    expected = [float(single.train_step([b])[0]) for b in batches]
    got = [float(fsdp.train_step([b])[0]) for b in batches]
    assert got == pytest.approx(expected, rel=1e-5)
    scale = weight._local_tensor._precomputed_scale  # after the last step, from the updated weights
    amax = weight.full_tensor().detach().abs().max().double()
    assert float(scale) == pytest.approx(float(torch.finfo(torch.float8_e4m3fn).max / amax), rel=1e-6)


# --------------------------------------------------------------------------------- before launch
def test_amp_fp8_on_cpu_is_refused_with_the_emulation_hint() -> None:
    """The CLI's exit 2, one line and no run dir: BAD_RUNTIME's "fp8-without-gpu" in test_cli."""
    run = checked_run(["amp=fp8", "nproc_per_node=1"])
    with pytest.raises(ConfigError) as err:
        check_fp8(run, 0)
    assert (err.value.key, err.value.value) == ("amp", "fp8") and "CPU ranks" in err.value.allowed
    assert "compute capability >= 8.9" in err.value.allowed and "amp.fp8_emulate=true" in err.value.hint
    check_fp8(checked_run([*FP8, "nproc_per_node=1"]), 0)  # emulated: a numerics check on any machine


def _gpus(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int]) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_fp8_needs_compute_capability_8_9_and_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    _gpus(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    run = checked_run(["amp=fp8", "nproc_per_node=1"])
    with pytest.raises(ConfigError) as err:
        check_fp8(run, 1)
    assert (err.value.key, err.value.value) == ("amp", "fp8") and "A100" in err.value.allowed
    assert "8.0" in err.value.allowed and "amp=bf16" in err.value.hint
    _gpus(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    check_fp8(run, 1)  # Hopper: float8 tensor cores
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else find_spec(n, *a)
    )
    with pytest.raises(ConfigError) as err:
        check_fp8(run, 1)
    assert "pip install 'disttrain[fp8]'" in err.value.hint and "torchao" in err.value.allowed


def test_a_model_with_nothing_to_convert_is_refused_before_launch() -> None:
    """An MLP of 32 -> 20 -> 4 features (the last is the head): no float8 GEMM."""
    with pytest.raises(ConfigError) as err:
        checked_run([*FP8, "nproc_per_node=1", "data=synthetic", "model.hidden=[20]"], runtime=True)
    assert (err.value.key, err.value.value) == ("amp", "fp8")
    assert "the output head" in err.value.allowed and "not multiples of 16" in err.value.allowed


def test_fp8_runs_under_the_strategies_torchao_supports() -> None:
    with pytest.raises(ConfigError) as err:
        checked_run([*TINY, *FP8, "strategy=tp", "nproc_per_node=2"])
    assert err.value.key == "amp" and "fsdp" in err.value.allowed and err.value.hint == "use amp=bf16."


def test_the_layers_left_in_bf16_and_why() -> None:
    """Plain Linears of 16-multiples convert; a tied weight, a subclass (nn.MultiheadAttention's
    out_proj, whose weight the attention reads itself) and the head (the last Linear) stay."""
    from torch import nn

    from disttrain.strategies.float8 import choose_linears

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.body = nn.Linear(32, 32)
            self.odd = nn.Linear(32, 24)
            self.attn = nn.MultiheadAttention(32, 2)
            self.tied = nn.Linear(32, 64, bias=False)
            self.head = nn.Linear(32, 64)
            self.tied.weight = self.embed.weight = nn.Parameter(torch.zeros(64, 32))

    choice = choose_linears(Net())
    assert choice.converted == ["body"]
    assert choice.kept == {
        "odd": "32 -> 24 features, not multiples of 16",
        "attn.out_proj": "NonDynamicallyQuantizableLinear, a subclass of nn.Linear",
        "tied": "its weight is tied to another module",
        "head": "the output head",
    }
    assert choice.converted_weights == 32 * 32 and choice.linear_weights == 32 * (32 + 24 + 32 + 64 + 64)
