"""init.path: sources, key matching, the pre-launch check and the in-rank load, in process.

The sharded load runs under torch's fake process group (rank 1 of 2): `fully_shard` gives each
parameter its rank-1 chunk, and the test checks that chunk holds exactly the source's rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file, save_model
from torch import nn

from disttrain.checkpoint import init_from
from disttrain.config.errors import ConfigError
from disttrain.config.schema import InitConfig
from disttrain.config.typed import typed


class Tied(nn.Module):
    """An embedding tied to its head (stored once by save_model / save_pretrained)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def _init(path: Path | str, **init: object) -> InitConfig:
    """The run's `init` block, typed as a rank's Run holds it."""
    return typed(InitConfig, {"path": str(path), **init})


def _seeded(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def test_rename_strips_or_adds_a_prefix_then_maps() -> None:
    strip = InitConfig(prefix="module.", map={"enc.": "mid.", "w": "head.weight"})
    assert init_from.rename("module.enc.weight", strip) == "mid.weight"  # prefix, then a prefix rename
    assert init_from.rename("w", strip) == "head.weight"  # exact rename; no prefix to strip
    assert init_from.rename("x", InitConfig(prefix="+backbone.")) == "backbone.x"


def test_match_reports_missing_unexpected_and_shapes_and_a_tied_key_is_not_missing() -> None:
    shapes, ties = init_from.model_layout(Tied())
    source = {"embed.weight": (8, 4), "mid.weight": (4, 5), "extra": (1,)}
    m = init_from.match(InitConfig(), shapes, ties, source)
    assert m.pairs == {"embed.weight": "embed.weight"}  # head.weight rides on the tied embedding
    assert m.missing == ["mid.bias"]
    assert m.unexpected == ["extra"]
    assert m.mismatched == [("mid.weight", (4, 4), (4, 5))]
    text = init_from.report(m, init_from.Source("pt", Path("x.pt")), len(shapes))
    assert "1 of 4 model tensors" in text and "mid.bias" in text and "extra" in text
    assert "mid.weight model [4, 4] vs source [4, 5]" in text


def test_resolve_knows_files_hf_shards_and_names_what_it_does_not(tmp_path: Path) -> None:
    sd = {k: v.clone() for k, v in _seeded(0).state_dict().items() if k != "head.weight"}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"embed.weight": sd["embed.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file(
        {k: sd[k] for k in ("mid.weight", "mid.bias")}, str(folder / "model-00002-of-00002.safetensors")
    )
    weight_map = {"embed.weight": "model-00001-of-00002.safetensors"}
    weight_map |= dict.fromkeys(("mid.weight", "mid.bias"), "model-00002-of-00002.safetensors")
    (folder / init_from.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    src = init_from.resolve(str(folder))
    assert src.kind == "safetensors" and src.files["mid.bias"].name == "model-00002-of-00002.safetensors"
    assert init_from.source_shapes(src) == {"embed.weight": (8, 4), "mid.weight": (4, 4), "mid.bias": (4,)}
    (tmp_path / "w.npz").write_bytes(b"")
    for bad, said in (
        (tmp_path / "w.npz", "neither .safetensors nor .pt"),
        (tmp_path / "no", "does not exist"),
    ):
        with pytest.raises(ConfigError) as exc:
            init_from.resolve(str(bad))
        assert exc.value.key == "init.path" and said in str(exc.value)
    with pytest.raises(ConfigError, match=r"no model\.safetensors"):
        init_from.resolve(str(tmp_path))  # a folder with none of the known layouts


def test_check_strict_is_one_paragraph_and_non_strict_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"module.embed.weight": torch.zeros(8, 4), "module.mid.weight": torch.zeros(4, 4)}, str(path))
    with torch.device("meta"):
        model = Tied()
    with pytest.raises(ConfigError) as exc:
        init_from.check(_init(path), model)
    text = str(exc.value)
    assert "init.path=" in text and "0 of 4" in text and "init.prefix" in text and "\n" not in text.strip()
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        init_from.check(_init(path, prefix="module.", strict=False), model)  # 2 of 4 load: allowed, said
    assert "missing in the source (1): mid.bias" in caplog.text
    init_from.check(
        _init(path, prefix="module.", map={"module.mid.weight": "mid.weight"}, strict=False), model
    )


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_apply_loads_a_plain_model_in_place(tmp_path: Path, suffix: str) -> None:
    source, path = _seeded(1), tmp_path / f"w{suffix}"
    if suffix == ".pt":  # checkpoints/final.pt's layout: the state dict under "model"
        torch.save({"model": source.state_dict(), "step": 4}, path)
    else:
        save_model(source, str(path))  # the tied head stored once
    model = _seeded(2)
    init_from.apply(_init(path), model, is_zero=True)
    for (name, got), want in zip(model.state_dict().items(), source.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert model.head.weight is model.embed.weight  # still tied: loaded in place


@pytest.fixture
def rank1_of_2() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _hf_shards(state: dict[str, torch.Tensor], folder: Path) -> Path:
    """A Hugging Face sharded folder: one file per half of the keys, and the index naming them."""
    folder.mkdir()
    keys, weight_map = sorted(state), {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(folder / name))
        weight_map |= dict.fromkeys(part, name)
    (folder / init_from.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("layout", ["file", "hf-shards"])
def test_apply_fills_each_fsdp_shard_with_its_own_rows(tmp_path: Path, rank1_of_2: None, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    source = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    path = tmp_path / "w.safetensors"
    if layout == "file":
        save_model(source, str(path))
    else:
        path = _hf_shards(source.state_dict(), tmp_path / "hf")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    init_from.apply(_init(path), model, is_zero=False)
    want = source.state_dict()
    for name, param in model.named_parameters():
        local = param.to_local()  # type: ignore[attr-defined]
        rows = -(-want[name].shape[0] // 2)  # rank 1 holds the rows after the first ceil(n/2)
        assert torch.equal(local, want[name][rows:]), name


def test_apply_names_keys_as_the_strategy_does(tmp_path: Path) -> None:
    """A pipeline stage holds `stages.0.1.*` for the model's `mid.*`: Strategy.model_key maps it."""
    source, path = _seeded(5), tmp_path / "w.safetensors"
    save_model(source, str(path))
    stage = nn.ModuleDict({"stages": nn.ModuleList([nn.Sequential(nn.Identity(), nn.Linear(4, 4))])})
    init_from.apply(
        _init(path, strict=False), stage, is_zero=True, name=lambda k: k.replace("stages.0.1.", "mid.")
    )
    assert torch.equal(stage["stages"][0][1].weight, source.mid.weight)
    assert torch.equal(stage["stages"][0][1].bias, source.mid.bias)


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4), persistent=False)


def _refuses_meta() -> nn.Module:
    if torch.empty(0).is_meta:
        raise RuntimeError("You are using from_pretrained with a meta device context manager")
    return nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("factory", "cfg", "meta_setup", "on_meta", "said"),
    [
        (lambda: nn.Linear(4, 4), {}, True, True, "built on the meta device"),
        (lambda: nn.Linear(4, 4), {}, False, False, ""),  # ddp & co: the whole model anyway
        (lambda: nn.Linear(4, 4), {"strict": False}, True, False, ""),  # a tensor may stay unloaded
        (WithMask, {}, True, False, "non-persistent buffers (mask)"),
        (Tied, {}, True, False, "ties parameters"),
        (_refuses_meta, {}, True, False, "refuses the meta device (RuntimeError)"),
    ],
)
def test_build_takes_the_meta_device_only_where_every_tensor_is_loaded(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    factory: Any,
    cfg: dict[str, Any],
    meta_setup: bool,
    on_meta: bool,
    said: str,
) -> None:
    with caplog.at_level(logging.INFO, logger="disttrain"):
        model, meta = init_from.build(_init(tmp_path / "w.pt", **cfg), factory, meta_setup)
    assert meta is on_meta
    assert all(p.is_meta for p in model.parameters()) is on_meta
    assert said in caplog.text
