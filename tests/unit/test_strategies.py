"""The strategy registry: every registered spec keeps its contract, a new strategy needs one module +
one spec + one YAML, and no code outside the registry and the strategies compares strategy names.

The contract (a) is a set of functions run for every registered spec, and again for the toy
strategy of the acceptance test (b): defaults compose from the spec's dataclass alone, the spec's
`layout` is the strategy's (its data-parallel size included), and setup + a state-dict round trip resume a step
bit for bit in one process (world size 1, gloo over a HashStore) wherever the spec's checks allow one rank.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn import functional as F
from unit_support import checked, disttrain, installed, run_env

import disttrain as package
from disttrain.config import ConfigError, compose, resolve
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.preflight.checks import check_static
from disttrain.strategies import build_strategy, specs
from disttrain.strategies.specs import StrategySpec

CPU = torch.device("cpu")
WORLDS = (1, 2, 4, 8)


def composed(spec: StrategySpec, config_dir: str | None = None) -> dict[str, Any]:
    """`strategy=<name>` composed and resolved once (Hydra is the slow part); copies are checked."""
    key = (spec.name, config_dir)
    if key not in _COMPOSED:
        _COMPOSED[key] = resolve(compose([f"strategy={spec.name}"], config_dir))
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED: dict[tuple[str, str | None], dict[str, Any]] = {}


def static_ok(
    spec: StrategySpec, world: int, config_dir: str | None = None, **top: Any
) -> dict[str, Any] | None:
    """The config of `strategy=<name>` at `world` ranks if the static checks pass, else None."""
    cfg = composed(spec, config_dir)
    cfg.update(nodes=1, nproc_per_node=world, **top)
    try:
        check_static(Run.of(cfg))
    except ConfigError:
        return None
    return cfg


# ------------------------------------------------------------------------------------ (a) contract
def contract_defaults_compose(spec: StrategySpec, config_dir: str | None = None) -> None:
    """`strategy=<name>` composes to exactly the dataclass defaults: the YAML restates none of them."""
    cfg = composed(spec, config_dir)
    node = OmegaConf.create({"amp": cfg["amp"], "s": OmegaConf.structured(spec.config)})
    assert cfg["strategy"] == OmegaConf.to_container(node, resolve=True)["s"]
    assert static_ok(spec, 1, config_dir) or static_ok(spec, 2, config_dir)


def contract_dp_degree(spec: StrategySpec, config_dir: str | None = None) -> list[int]:
    """At every world size the checks accept, the strategy's data-parallel size is the spec's."""
    accepted = []
    for world in WORLDS:
        cfg = static_ok(spec, world, config_dir)
        if cfg is None:
            continue
        accepted.append(world)
        env = DistEnv(world - 1, world - 1, world, world, "gloo", CPU)  # the last rank: no collective
        strategy = spec.load()(spec.typed(cfg["strategy"]), env)
        rank, size = strategy.data_parallel_rank_size()
        assert strategy.layout == spec.layout(spec.typed(cfg["strategy"]), world) == specs.layout(Run.of(cfg))
        assert size == strategy.layout.dp
        assert 0 <= rank < size
    return accepted


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a (nested) state dict; DTensors as their local shard, tensors cloned to CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: v for key, sub in state.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(state, list | tuple):
        return {k: v for i, sub in enumerate(state) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    if isinstance(state, DTensor):
        state = state.to_local()
    return {prefix[:-1]: state.detach().cpu().clone() if torch.is_tensor(state) else state}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def contract_round_trip(spec: StrategySpec, env: DistEnv, config_dir: str | None = None) -> None:
    """Setup, one step, save; a second step; load and redo it: the same state, bit for bit."""
    cfg = static_ok(spec, 1, config_dir)
    if cfg is None:
        pytest.skip(f"strategy={spec.name} needs more than one rank (its checks say so)")
    strategy = build_strategy(cfg["strategy"], env)
    assert strategy.name == spec.name and isinstance(strategy, spec.load())
    from disttrain.models.mlp import MLP

    torch.manual_seed(0)
    plain = MLP(in_features=8, num_classes=3, hidden=[16])
    keys = set(plain.state_dict())
    model = strategy.setup_module(plain)
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)]

    def step(i: int) -> None:
        x, y = batches[i]
        strategy.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)
    saved = copy.deepcopy(strategy.state_dict(model, optimizer))
    before = _flat(saved)
    step(1)
    after = _flat(strategy.state_dict(model, optimizer))
    assert not _same(before, after), "a training step changed nothing"
    strategy.load_state_dict(model, optimizer, saved)
    assert _same(_flat(strategy.state_dict(model, optimizer)), before)
    step(1)
    assert _same(_flat(strategy.state_dict(model, optimizer)), after), "resumed step differs"
    assert set(strategy.model_state_dict(model)) == keys  # plain PyTorch names (export)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[DistEnv]:
    """A world-size-1 gloo process group over a HashStore: collectives run, no port, no process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(0, 0, 1, 1, "gloo", CPU)
    finally:
        dist.destroy_process_group()


BUILTIN = sorted(specs.names())


def test_the_registry_holds_every_strategy_option() -> None:
    """Every spec has a YAML option of its name; the planner's zero2 is one of them."""
    from disttrain.config import config_dir

    options = {p.stem for p in (config_dir() / "strategy").glob("*.yaml")}
    assert set(BUILTIN) <= options and "zero2" in BUILTIN
    for name in BUILTIN:
        assert specs.get(name).config().name == name


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_defaults_compose(name: str) -> None:
    contract_defaults_compose(specs.get(name))


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_dp_degree(name: str) -> None:
    assert contract_dp_degree(specs.get(name)), "no world size passes the checks"


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_setup_and_state_dict_round_trip(name: str, one_rank: DistEnv) -> None:
    contract_round_trip(specs.get(name), one_rank)


def test_fsdp_tp_dp_degree_is_the_configured_one() -> None:
    """fsdp+tp's dp_degree is read (it was checked and then ignored): spec and mesh agree."""
    spec = specs.get("fsdp+tp")
    cfg = checked(["strategy=fsdp+tp", "nproc_per_node=8", "strategy.tp_degree=2", "strategy.dp_degree=4"])
    strategy = spec.load()(spec.typed(cfg["strategy"]), DistEnv(5, 5, 8, 8, "gloo", CPU))
    assert (strategy.dp, strategy.tp) == (4, 2) and strategy.data_parallel_rank_size() == (2, 4)
    with pytest.raises(ConfigError) as info:
        checked(["strategy=fsdp+tp", "nproc_per_node=8", "strategy.dp_degree=2"])
    assert info.value.key == "strategy.dp_degree"


def test_amp_support_comes_from_the_specs() -> None:
    """fp16 where the spec allows it (hsdp is fsdp: allowed); a mode the spec lacks fails on amp."""
    assert checked(["strategy=hsdp", "amp=fp16"])["strategy"]["name"] == "fsdp"
    for name in BUILTIN:
        spec = specs.get(name)
        world = 1 if static_ok(spec, 1) else 2
        for mode, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
            amp = {**composed(spec)["amp"], "name": mode, "dtype": dtype}
            if mode in spec.amp:
                assert static_ok(spec, world, amp=amp) is not None, (name, mode)
            else:
                cfg = composed(spec)
                cfg.update(nodes=1, nproc_per_node=world, amp=amp)
                with pytest.raises(ConfigError) as info:
                    check_static(Run.of(cfg))
                assert info.value.key == "amp", (name, mode)


def test_fsdp_dtype_names_are_the_precision_dtypes() -> None:
    from disttrain.config.common import ComputeDtype
    from disttrain.strategies.precision import DTYPES

    assert {m.value for m in ComputeDtype} == set(DTYPES)


def test_zero2_is_fsdp_without_resharding_after_forward(one_rank: DistEnv) -> None:
    cfg = checked(["strategy=zero2", "nproc_per_node=1"])
    strategy = build_strategy(cfg["strategy"], one_rank)
    assert type(strategy) is specs.get("fsdp").load() and strategy.cfg.reshard_after_forward is False
    with pytest.raises(ConfigError) as info:
        checked(["strategy=zero2", "strategy.reshard_after_forward=true"])
    assert info.value.key == "strategy.reshard_after_forward"


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_precision_is_a_constructor_argument(name: str, one_rank: DistEnv) -> None:
    """The run's amp choice is fixed when the strategy is built (no later assignment to order)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    cfg = checked([f"strategy={name}", "nproc_per_node=1"])
    fp16 = build_strategy(cfg["strategy"], one_rank, {"name": "fp16", "dtype": "float16", "init_scale": 8.0})
    assert fp16.precision.name == "fp16" and fp16.precision.scaling and fp16.precision.scale_value() == 8.0
    assert isinstance(fp16.precision.scaler, ShardedGradScaler) is (name == "fsdp")  # sharded grads
    off = build_strategy(cfg["strategy"], one_rank).precision
    assert (off.name, off.enabled, off.scaling) == ("off", False, False)


def test_setting_another_strategys_name_is_one_paragraph() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["strategy=ddp", "strategy.name=fsdp"])
    assert info.value.key == "strategy.name" and "strategy=fsdp" in info.value.hint


# ------------------------------------------------------------------------------------ (b) acceptance
TOY_MODULE = '''
"""ddp under another name: the strategy class (imports torch only when a rank builds it)."""
from disttrain.strategies.ddp import DDPStrategy


class ToyStrategy(DDPStrategy):
    pass
'''

TOY_SPEC = '''
"""toylab: its strategy spec, torch-free (registered when the entry point is loaded)."""
from dataclasses import dataclass, replace

from disttrain.strategies import specs
from disttrain.strategies.specs.data_parallel import DDP, DDPStrategyConfig


@dataclass
class ToyStrategyConfig(DDPStrategyConfig):
    name: str = "toy"


def plan(shape):
    return [specs.data_parallel_row("toy", shape, preference=5, note="ddp by another name")]


SPEC = specs.register(
    replace(DDP, name="toy", config=ToyStrategyConfig, target="toylab.strategy:ToyStrategy",
            plan=plan)
)
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    yield from installed(tmp_path, monkeypatch, "toy", "toylab", TOY_SPEC, TOY_MODULE)


def test_a_new_strategy_is_one_module_one_spec_one_yaml(toy: tuple[Path, Path], one_rank: DistEnv) -> None:
    from disttrain.tools.planner import plan

    _, conf = toy
    assert "toy" not in specs.names()
    specs.rediscover()  # what a fresh `disttrain` process does at its first registry use
    spec = specs.get("toy")
    # config composition (a typed schema node: a typo fails at compose time) and the checks
    cfg = checked(["strategy=toy"], config_dir=str(conf))
    assert cfg["strategy"]["name"] == "toy" and cfg["strategy"]["bucket_cap_mb"] == 25.0
    for bad, key in (("strategy.bucket_cap=1", "strategy.bucket_cap"), ("strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb")):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            checked(["strategy=toy", bad], config_dir=str(conf))
        assert info.value.key == key
    # plan
    rows = {r["layout"]: r for r in plan(Run.of(cfg))["layouts"]}
    assert rows["toy"]["run"] == "strategy=toy" and rows["toy"]["bytes"] == rows["ddp"]["bytes"]
    assert plan(Run.of(cfg))["recommendation"]["layout"] == "toy"  # preference 5: before ddp
    # the contract test
    contract_defaults_compose(spec, str(conf))
    assert contract_dp_degree(spec, str(conf)) == list(WORLDS)
    contract_round_trip(spec, one_rank, str(conf))
    assert type(build_strategy(cfg["strategy"], one_rank)).__name__ == "ToyStrategy"


def test_a_new_strategy_is_found_by_a_fresh_cli_process(toy: tuple[Path, Path], scratch: Path) -> None:
    """`disttrain config strategy=toy` in a new process finds the plugin by its entry point alone."""
    site, conf = toy
    env = run_env(PYTHONPATH=f"{site}:{Path(package.__file__).parent.parent}")
    proc = disttrain("config", "--config-dir", str(conf), "strategy=toy", cwd=scratch, env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^strategy:\n  name: toy\n  bucket_cap_mb: 25.0$", proc.stdout, re.M)


# ------------------------------------------------------------------------------------ (c) grep
def name_comparisons(source: str, names: list[str]) -> list[str]:
    """Lines comparing with a strategy name: ==/!= a name, `in` a literal holding one, or a literal
    tuple/list/set of two or more names (a family kept by hand)."""
    quoted = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    name = rf"""["'](?:{quoted})["']"""
    patterns = [
        rf"(?:==|!=)\s*{name}",
        rf"{name}\s*(?:==|!=)",
        rf"\bin\s*[(\[{{][^)\]}}]*{name}",
        rf"\bcase\s+{name}",
        rf"[(\[{{]\s*{name}\s*,\s*{name}",
    ]
    found = re.compile("|".join(patterns))
    return [line.strip() for line in source.splitlines() if found.search(line)]


def test_the_grep_finds_what_it_looks_for() -> None:
    names = ["ddp", "fsdp", "zero", "fsdp+tp"]
    bad = 'if cfg["strategy"]["name"] == "ddp":\nx = name in ("fsdp", "zero")\nF = ("ddp", "zero")\n'
    bad += "match name:\n    case 'fsdp+tp':\n"
    good = 'row = {"ddp": 1}\nif r["dp"] == 1: pass\nlayout("ddp", shape)\n'
    assert len(name_comparisons(bad, names)) == 4 and name_comparisons(good, names) == []


def test_no_strategy_name_comparison_outside_the_registry_and_the_strategies() -> None:
    from disttrain.config import config_dir

    root = Path(package.__file__).parent
    names = sorted({*specs.names(), *(p.stem for p in (config_dir() / "strategy").glob("*.yaml"))})
    hits = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if "strategies" not in path.relative_to(root).parts
        for lines in [name_comparisons(path.read_text(), names)]
        if lines
    }
    assert hits == {}, f"strategy names compared outside disttrain/strategies/: {hits}"
