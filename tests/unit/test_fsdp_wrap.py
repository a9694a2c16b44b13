"""FSDP units by default (issue 23): the repeated block of models nobody on this project wrote,
never a container without forward; the models are built on the meta device (no weights, cheap),
and `fully_shard` itself takes the chosen units on a fake process group (world 2, cpu mesh)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.models.gpt import GPT
from disttrain.models.mlp import MLP
from disttrain.strategies.fsdp import modules_to_wrap
from disttrain.strategies.specs.sharded import FSDPStrategyConfig, check_fsdp_model

NANOGPT = Path(__file__).resolve().parents[1] / "clients" / "nanogpt"


def x_transformers_lm() -> nn.Module:
    """The review's model: blocks in nested ModuleLists, [norm list, Attention|FeedForward, Residual]."""
    xt = pytest.importorskip("x_transformers")
    decoder = xt.Decoder(dim=64, depth=2, heads=2)
    return xt.AutoregressiveWrapper(
        xt.TransformerWrapper(num_tokens=256, max_seq_len=64, attn_layers=decoder)
    )


def hf_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertForSequenceClassification(config)


def nanogpt() -> nn.Module:
    """The vendored nanoGPT (tests/clients/nanogpt/model.py), as test_clients trains it."""
    sys.path.insert(0, str(NANOGPT))
    try:
        import model as nanogpt_model  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(NANOGPT))
    config = nanogpt_model.GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256, dropout=0.0, bias=True
    )
    return nanogpt_model.GPT(config)  # type: ignore[no-any-return]


# model -> {unit class: count} with the default settings (min_num_params 100_000)
MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, int]]] = {
    # The review's failure: the size policy picked the 132k-parameter `layers` ModuleList. Each
    # layer is a ModuleList [norms, Attention|FeedForward, Residual]: attention and feed-forward are
    # the units; the per-layer norms (64 parameters) stay with the root.
    "x-transformers": (x_transformers_lm, {"Attention": 2, "FeedForward": 2}),
    "bert": (hf_bert, {"BertLayer": 2}),
    "nanogpt": (nanogpt, {"Block": 2}),
    "gpt": (lambda: GPT(n_layers=3), {"Block": 3}),
    "mlp": (lambda: MLP(64, 10, hidden=[128, 128]), {"Linear": 3}),  # Sequential(Flatten, Linear, ReLU..)
}


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


@pytest.mark.parametrize("name", list(MODELS))
def test_default_units_are_the_repeated_blocks(name: str) -> None:
    factory, expected = MODELS[name]
    model = build_on_meta(factory)
    units = modules_to_wrap(model, set(), 100_000)
    assert Counter(type(m).__name__ for m in units) == expected
    assert not any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in units)


def test_wrap_classes_override_and_never_a_container() -> None:
    model = build_on_meta(x_transformers_lm)
    linears = modules_to_wrap(model, {"Linear"}, 0)
    assert len(linears) == 13 and all(isinstance(m, nn.Linear) for m in linears)  # 4 x 2 + 2 x 2 + head
    # A container is never a unit, by class or by size: its parameters move up to the root.
    assert modules_to_wrap(model, {"ModuleList"}, 0) == []
    units = modules_to_wrap(build_on_meta(lambda: GPT(n_layers=1)), set(), 1000)  # no repeated block
    # size policy: attention's fused qkv and proj, the MLP's two Linears, the (tied) embedding
    assert Counter(type(m).__name__ for m in units) == {"Linear": 4, "Embedding": 1}


def test_tiny_blocks_stay_with_the_root_and_the_size_policy_covers_the_rest() -> None:
    """A block list of 2 small layers beside a big one: the blocks are the units; the remainder goes
    to the size policy (the big projection), never inside a block."""

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Small(), Small()])
            self.proj = nn.Linear(8, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.proj(x)

    model = Net()
    assert modules_to_wrap(model, set(), 100) == [model.blocks[0], model.blocks[1], model.proj]
    assert modules_to_wrap(model, set(), 0) == [model.blocks[0], model.blocks[1]]


def test_no_size_policy_unit_inside_a_wrap_class_unit() -> None:
    """Review G7: `strategy.wrap_classes=[Block]` (the help's example) with the default
    min_num_params also wrapped every >= 100k-parameter Linear inside each Block: 84 units, not 12."""
    model = build_on_meta(lambda: GPT(256, 64, dim=1024, n_layers=12, n_heads=16))
    assert Counter(type(m).__name__ for m in modules_to_wrap(model, {"Block"}, 100_000)) == {"Block": 12}
    # a class named inside a chosen unit is still the user's choice
    both = Counter(type(m).__name__ for m in modules_to_wrap(model, {"Block", "Attention"}, 100_000))
    assert both == {"Block": 12, "Attention": 12}


@pytest.fixture(params=[2])
def fake_world(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Rank 0 of `param` (2 unless parametrized) on torch's fake process group, and its cpu mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    try:
        yield init_device_mesh("cpu", (request.param,))
    finally:
        dist.destroy_process_group()


def _reshards_after_forward(module: nn.Module) -> bool:
    """FSDP2's own flag: a unit with a post-forward mesh frees its gathered parameters after forward."""
    groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    return any(g.post_forward_mesh_info is not None for g in groups)


@pytest.mark.parametrize("fake_world", [2, 1], indirect=True)
def test_the_root_and_a_one_rank_shard_group_keep_their_parameters_after_forward(
    fake_world: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Review G12: the root got reshard_after_forward=True explicitly, so torch's exemption for the
    root (auto: not resharded, backward needs it first) never applied. Review G9: on a shard group
    of one rank resharding only gathers the same parameters again in backward."""
    from torch.distributed.fsdp import FSDPModule

    from disttrain.dist import DistEnv
    from disttrain.strategies import build_strategy

    world = fake_world.size()
    env = DistEnv(0, 0, world, world, "fake", torch.device("cpu"))
    strategy = build_strategy({"name": "fsdp", "param_dtype": "float32"}, env)
    with caplog.at_level("INFO", logger="disttrain"):
        model = strategy.setup_module(GPT(64, 16, dim=16, n_layers=2, n_heads=2))
    model(torch.randint(0, 64, (2, 16)))  # the first forward settles which unit is the root
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert len(blocks) == 2 and not _reshards_after_forward(model)
    assert all(_reshards_after_forward(b) for b in blocks) == (world > 1)
    assert ("a shard group of one rank: reshard_after_forward=false" in caplog.text) == (world == 1)


def test_fully_shard_takes_the_default_units(fake_world: Any) -> None:
    """The units as FSDPStrategy.setup_module applies them (units, then the root), on meta models:
    before the fix the x-transformers model raised fully_shard's ValueError on a ModuleList."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name in ("x-transformers", "bert", "nanogpt"):
        factory, expected = MODELS[name]
        model = build_on_meta(factory)
        units = modules_to_wrap(model, set(), 100_000)
        for unit in units:
            fully_shard(unit, mesh=fake_world)
        fully_shard(model, mesh=fake_world)
        # fully_shard swaps each unit's class for a subclass named FSDP<Class>
        sharded = Counter(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
        expected = {f"FSDP{cls}": n for cls, n in expected.items()}
        assert sharded == {**expected, type(model).__name__: 1}, name  # the root, already renamed


def test_what_fully_shard_refuses_is_named_before_launch() -> None:
    model = build_on_meta(x_transformers_lm)
    with pytest.raises(ConfigError) as info:
        check_fsdp_model({}, FSDPStrategyConfig(wrap_classes=["ModuleList"]), model, 0)
    assert info.value.key == "strategy.wrap_classes" and "containers without forward" in str(info.value)

    class Scaled(nn.Module):  # CLIP's logit_scale: a 0-dim parameter
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.logit_scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.logit_scale

    with pytest.raises(ConfigError) as info:
        check_fsdp_model({}, FSDPStrategyConfig(), build_on_meta(Scaled), 0)
    assert (
        info.value.key == "model" and "logit_scale" in str(info.value) and "torch.zeros(1)" in str(info.value)
    )
    check_fsdp_model({}, FSDPStrategyConfig(), model, 0)  # the default units: nothing to refuse

    # Review F6: channels_last weights are not contiguous, which fully_shard refuses in every rank
    def channels_last() -> nn.Module:
        return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten()).to(memory_format=torch.channels_last)

    with pytest.raises(ConfigError) as info:
        check_fsdp_model({}, FSDPStrategyConfig(), build_on_meta(channels_last), 0)
    assert info.value.key == "model" and "0.weight (stride (18, 1, 6, 2))" in str(info.value)
    assert "contiguous parameters with strategy=fsdp" in str(info.value) and "channels_last" in str(
        info.value
    )
