"""Tensor-parallel plans from config (issue 23): `strategy.tp_plan` as a mapping of module name
patterns to style names or a `_target_` factory, and a Hugging Face model's own base_model_tp_plan.
Applied by TPStrategy.setup_module in process on torch's fake process group (rank 0 of 2, cpu
mesh); the checks before launch run on models built on the meta device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from disttrain.config.errors import ConfigError
from disttrain.dist import DistEnv
from disttrain.models.gpt import GPT, gpt_tp_plan
from disttrain.models.parallel import plan_matches, tp_plan_source
from disttrain.strategies.specs.model_parallel import TPStrategyConfig, check_tp_model, check_tp_plan
from disttrain.strategies.tp import TPStrategy

CPU = torch.device("cpu")
PLAN = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """A user's model with no tp_plan() method: two blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_llama(**overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    settings = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,  # 2 per tp rank
        num_key_value_heads=2,  # 1 per tp rank
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **overrides}))


@pytest.fixture
def fake_world() -> Iterator[DistEnv]:
    """Rank 0 of 2 on torch's fake process group (collectives return at once, nothing is sent)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DistEnv(0, 0, 2, 2, "gloo", CPU)
    finally:
        dist.destroy_process_group()


def placements(param: torch.Tensor) -> tuple[Any, ...] | None:
    return tuple(param.placements) if isinstance(param, DTensor) else None


def test_a_mapping_plan_splits_a_users_model(fake_world: DistEnv) -> None:
    model = TPStrategy(TPStrategyConfig(tp_plan=dict(PLAN)), fake_world).setup_module(Net())
    for layer in model.layers:
        assert placements(layer.fc1.weight) == (Shard(0),) and placements(layer.fc1.bias) == (Shard(0),)
        assert placements(layer.fc2.weight) == (Shard(1),) and placements(layer.fc2.bias) == (Replicate(),)
        assert layer.fc1.weight.to_local().shape == (8, 8)  # 16 output features over 2 ranks
    assert placements(model.head.weight) is None  # not in the plan: whole on every rank


def test_a_target_factory_is_called_with_the_model() -> None:
    model = GPT(n_layers=2)
    source, factory = tp_plan_source(model, {"_target_": "disttrain.models.gpt.gpt_tp_plan"})  # type: ignore[misc]
    plan = factory()
    assert source == "strategy.tp_plan" and plan.keys() == gpt_tp_plan(model).keys()
    assert isinstance(plan["blocks.1.attn.qkv"], ColwiseParallel)


def test_a_hugging_face_models_own_plan_is_used(fake_world: DistEnv) -> None:
    """LlamaConfig.base_model_tp_plan (q/k/v/gate/up colwise, o/down rowwise) plus what transformers
    adds around it: the vocabulary-parallel embedding and the gathered head."""
    source, factory = tp_plan_source(tiny_llama())  # type: ignore[misc]
    plan = factory()
    assert source == "config.base_model_tp_plan"
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert plan["lm_head"].output_layouts == (Replicate(),)  # colwise_gather_output
    assert plan["model.embed_tokens"].input_layouts == (Replicate(),)  # embedding_rowwise
    model = TPStrategy(TPStrategyConfig(), fake_world).setup_module(tiny_llama())
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, model.lm_head):
        assert placements(linear.weight) == (Shard(0),)
    assert placements(attn.o_proj.weight) == (Shard(1),) and placements(mlp.down_proj.weight) == (Shard(1),)
    assert placements(model.model.embed_tokens.weight) == (Shard(0),)  # rows: the vocabulary
    assert attn.k_proj.weight.to_local().shape == (8, 32)  # 1 of 2 kv heads of 8 dims per rank
    assert placements(model.model.norm.weight) is None


def test_patterns_select_modules_as_parallelize_module_does() -> None:
    model = Net()
    assert plan_matches(model, "layers.*.fc1") == ["layers.0.fc1", "layers.1.fc1"]
    assert plan_matches(model, "layers.1.fc*") == ["layers.1.fc1", "layers.1.fc2"]
    assert plan_matches(model, "layers.fc1") == [] and plan_matches(model, "head") == ["head"]


@pytest.mark.parametrize(
    ("plan", "says"),
    [
        ({"layers.*.fc1": "colwize"}, "style names one of colwise, rowwise"),
        ({"layers.*.fc1": 3}, "style names"),
        ("colwise", "a mapping {module name pattern: style name}"),
    ],
)
def test_bad_style_names_fail_the_static_check(plan: Any, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_tp_plan(TPStrategyConfig(tp_plan=plan))
    assert info.value.key == "strategy.tp_plan" and says in str(info.value)


def on_meta(factory: Any, **kwargs: Any) -> nn.Module:
    with torch.device("meta"):
        return factory(**kwargs)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("plan", "says"),
    [
        ({"layers.*.fc3": "colwise"}, "'layers.*' selects layers.0, layers.1, whose children are fc1, fc2"),
        ({"blocks.*.fc1": "colwise"}, "the model's children are layers, head"),
        ({"layers.*": "colwise"}, "selects layers.0, a Block"),
        ({"layers.*.fc1": "colwise", "head": "rowwise"}, None),  # a valid plan: no error
    ],
)
def test_plans_that_cannot_apply_are_named_before_launch(plan: dict[str, str], says: str | None) -> None:
    s = TPStrategyConfig(tp_plan=plan)
    if says is None:
        check_tp_model({}, s, on_meta(Net), 2)
        return
    with pytest.raises(ConfigError) as info:
        check_tp_model({}, s, on_meta(Net), 2)
    assert info.value.key == "strategy.tp_plan" and says in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (
            {"num_attention_heads": 2, "num_key_value_heads": 1},
            "model.config.num_key_value_heads",
            "tensor-parallel degree 2",
        ),
        ({"tie_word_embeddings": True}, "model", "shares a parameter with"),
        (
            {"base_model_tp_plan": {"layers.*.mlp.gate_proj": "packed_colwise"}},
            "strategy.tp_plan",
            "uses 'packed_colwise' for 'model.layers.*.mlp.gate_proj'",
        ),
    ],
)
def test_hugging_face_plans_that_cannot_apply_are_named(
    overrides: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_tp_model({}, TPStrategyConfig(), on_meta(tiny_llama, **overrides), 2)
    assert info.value.key == key and says in str(info.value)
